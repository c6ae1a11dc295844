"""Write a NormSwap checkpoint back as Transformers' own classes (BERT, LLaMA, GPT-2, Gemma 2/3, OLMo 2,
ELECTRA, DistilBERT, ModernBERT), when its configuration allows.

Whether it allows is read off a round trip: each target's native configuration is built from the NormSwap one and
mapped back the way `convert` maps sources (`families.normswap_config`); a field that comes back different is one
the native architecture cannot represent."""

import copy
from pathlib import Path

from huggingface_hub.errors import StrictDataclassError
from transformers import (
    AutoConfig,
    BertConfig,
    BertModel,
    DistilBertConfig,
    ElectraConfig,
    Gemma2Config,
    Gemma3TextConfig,
    GPT2Config,
    LlamaConfig,
    ModernBertConfig,
    Olmo2Config,
)

from ..checkpoint import copy_companion_files, output_folder, resolve_source
from ..model.configuration_normswap import LAYER_TYPES, NormSwapConfig, rope_parameters_by_layer_type
from ..model.heads import HEAD_CLASSES, NATIVE_AUTO_CLASSES, head_of_config, local_name
from .families import BERT, DISTILBERT, ELECTRA, GEMMA, GPT2, LLAMA, MODERNBERT, OLMO2, Family, normswap_config
from .options import ConversionError


def _common(config: NormSwapConfig) -> dict:
    return dict(
        vocab_size=config.vocab_size,
        initializer_range=config.initializer_range,
        pad_token_id=config.pad_token_id,
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        tie_word_embeddings=config.tie_word_embeddings,
        id2label=config.id2label,
        label2id=config.label2id,
        problem_type=config.problem_type,
    )


def _encoder_common(config: NormSwapConfig) -> dict:
    """The shared fields that BERT-style configurations take: no bos / eos token ids."""
    common = _common(config)
    del common["bos_token_id"], common["eos_token_id"]
    return common


def _decoder(config: NormSwapConfig) -> dict:
    """The fields LLaMA-style configurations share."""
    return dict(
        _common(config),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.norm_eps,
        rope_parameters=copy.deepcopy(config.rope_parameters),
        attention_bias=config.attention_bias,
        attention_dropout=config.attention_dropout,
    )


def _bert_config(config: NormSwapConfig, config_class=BertConfig, **extra):
    common = _encoder_common(config)
    return config_class(
        **common,
        **extra,
        hidden_size=config.hidden_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        intermediate_size=config.intermediate_size,
        hidden_act=config.hidden_act,
        hidden_dropout_prob=config.hidden_dropout,
        attention_probs_dropout_prob=config.attention_dropout,
        max_position_embeddings=config.max_position_embeddings,
        type_vocab_size=config.type_vocab_size,
        layer_norm_eps=config.norm_eps,
        classifier_dropout=config.classifier_dropout,
    )


def _electra_config(config: NormSwapConfig):
    return _bert_config(config, ElectraConfig, embedding_size=config.embedding_size)


def _distilbert_config(config: NormSwapConfig):
    common = _encoder_common(config)
    return DistilBertConfig(
        **common,
        dim=config.hidden_size,
        hidden_dim=config.intermediate_size,
        n_layers=config.num_hidden_layers,
        n_heads=config.num_attention_heads,
        activation=config.hidden_act,
        max_position_embeddings=config.max_position_embeddings,
        dropout=config.hidden_dropout,
        attention_dropout=config.attention_dropout,
        seq_classif_dropout=config.hidden_dropout if config.classifier_dropout is None else config.classifier_dropout,
    )


def _modernbert_config(config: NormSwapConfig):
    rope = config.layer_rope_parameters
    window = config.sliding_window
    return ModernBertConfig(
        **_common(config),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        hidden_activation=config.hidden_act,
        max_position_embeddings=config.max_position_embeddings,
        norm_eps=config.norm_eps,
        norm_bias=config.norm_bias,
        attention_bias=config.attention_bias,
        attention_dropout=config.attention_dropout,
        layer_types=list(config.layer_types),
        rope_parameters={kind: dict(rope.get(kind) or next(iter(rope.values()))) for kind in LAYER_TYPES},
        **({"local_attention": 2 * window} if window else {}),  # ModernBERT's window counts both sides
        embedding_dropout=config.hidden_dropout,
        mlp_dropout=config.hidden_dropout,
        mlp_bias=config.mlp_bias,
        decoder_bias=config.decoder_bias,
        classifier_pooling=config.classifier_pooling,
        classifier_dropout=config.hidden_dropout if config.classifier_dropout is None else config.classifier_dropout,
        classifier_bias=config.head_dense_bias,
        classifier_activation=config.classifier_activation,
    )


def _llama_config(config: NormSwapConfig):
    return LlamaConfig(
        **_decoder(config), head_dim=config.head_dim, hidden_act=config.hidden_act, mlp_bias=config.mlp_bias
    )


def _gpt2_config(config: NormSwapConfig):
    return GPT2Config(
        **_common(config),
        n_embd=config.hidden_size,
        n_inner=config.intermediate_size,
        n_layer=config.num_hidden_layers,
        n_head=config.num_attention_heads,
        n_positions=config.max_position_embeddings,
        activation_function=config.hidden_act,
        layer_norm_epsilon=config.norm_eps,
        resid_pdrop=config.hidden_dropout,
        embd_pdrop=config.hidden_dropout,
        attn_pdrop=config.attention_dropout,
        scale_attn_weights=config.query_pre_attn_scalar is None,
    )


def _gemma_config(config_class):
    def build(config: NormSwapConfig):
        rope = config.rope_parameters
        if config_class is Gemma3TextConfig and not rope_parameters_by_layer_type(rope):
            rope = dict.fromkeys(("full_attention", "sliding_attention"), rope)
        return config_class(
            **dict(_decoder(config), rope_parameters=copy.deepcopy(rope)),
            head_dim=config.head_dim,
            hidden_activation=config.hidden_act,
            query_pre_attn_scalar=int(config.query_pre_attn_scalar or config.head_dim),
            layer_types=list(config.layer_types),
            sliding_window=config.sliding_window,
            attn_logit_softcapping=config.attn_logit_softcapping,
            final_logit_softcapping=config.final_logit_softcapping,
        )

    return build


def _olmo2_config(config: NormSwapConfig):
    return Olmo2Config(**_decoder(config), hidden_act=config.hidden_act)


# The native architectures a NormSwap configuration can be written as: family (names) and configuration builder.
TARGETS = (
    (BERT, _bert_config),
    (LLAMA, _llama_config),
    (GPT2, _gpt2_config),
    (GEMMA, _gemma_config(Gemma2Config)),
    (GEMMA, _gemma_config(Gemma3TextConfig)),
    (OLMO2, _olmo2_config),
    (ELECTRA, _electra_config),
    (DISTILBERT, _distilbert_config),
    (MODERNBERT, _modernbert_config),
)

# Fields that do not change what a model computes (initialisation, dropout, labels, token ids, file metadata): left
# out of the round trip's comparison.
_IGNORED_FIELDS = {
    "architectures",
    "auto_map",
    "id2label",
    "label2id",
    "initializer_range",
    "dyt_alpha_init",
    "hidden_dropout",
    "attention_dropout",
    "classifier_dropout",
    "bos_token_id",
    "eos_token_id",
    "dtype",
    "transformers_version",
    "_name_or_path",
}


def _blockers(config: NormSwapConfig, build) -> list[str]:
    """The fields of `config` that the native configuration built from it reads back differently (FIELD=VALUE
    (needs WANTED)), or the builder's own refusal."""
    try:
        round_trip = normswap_config(build(config)).to_dict()
    except (ValueError, TypeError, StrictDataclassError) as error:
        return [" ".join(str(error).split())]
    ignored = set(_IGNORED_FIELDS)
    if round_trip["position_embedding_type"] != config.position_embedding_type:
        ignored.add("rope_parameters")  # follows from the position scheme, which is named already
    return [
        f"{field}={value!r} (needs {round_trip.get(field)})"
        for field, value in config.to_dict().items()
        if field not in ignored and round_trip.get(field) != value
    ]


def native_config(config: NormSwapConfig, head: str) -> tuple[Family, object]:
    """The family and Transformers configuration that compute what `config` computes, or a ConversionError naming why
    not (the blocking fields of the closest native architecture)."""
    candidates = []
    for family, build in TARGETS:
        blockers = _blockers(config, build)
        if not blockers and head not in family.heads:
            blockers = [f"head {head!r} (the {family.name} export has {', '.join(family.heads)})"]
        candidates.append((len(blockers), family, blockers, build))
    _, family, blockers, build = min(candidates, key=lambda candidate: candidate[0])
    if blockers:
        raise ConversionError(f"cannot be written as a native {family.name} model: {'; '.join(blockers)}")
    return family, build(config)


def export_native(source: str, output: str, *, overwrite: bool = False, log=print) -> dict:
    """Writes the NormSwap checkpoint SOURCE as a native checkpoint (see `TARGETS`) in OUTPUT."""
    folder, _ = resolve_source(source)
    try:
        config = AutoConfig.from_pretrained(folder)
    except (OSError, ValueError) as error:
        raise ConversionError(f"{folder}: {error}".splitlines()[0]) from None
    if not isinstance(config, NormSwapConfig):
        raise ConversionError(f"{folder}: not a NormSwap checkpoint (model_type {config.model_type!r})")
    head = head_of_config(config)
    family, target_config = native_config(config, head)

    model = HEAD_CLASSES[head].from_pretrained(folder)
    ours = model.state_dict()
    extra = {"add_pooling_layer": False} if family is BERT and head == "base" else {}
    native = BertModel(target_config, **extra) if extra else NATIVE_AUTO_CLASSES[head].from_config(target_config)
    native = native.to(next(model.parameters()).dtype)
    state = {}
    for name in native.state_dict():
        tensor = family.from_normswap(name, lambda ours_name: ours[local_name(name=ours_name, head=head)], head)
        if tensor is not None:
            state[name] = tensor
    missing = native.load_state_dict(state, strict=False).missing_keys
    tied = set(type(native)._tied_weights_keys or {})
    if set(missing) - tied:
        raise ConversionError(f"{folder}: no NormSwap tensor for {sorted(set(missing) - tied)}")
    native.tie_weights()

    with output_folder(output=output, overwrite=overwrite) as staging:
        native.save_pretrained(staging)
        copy_companion_files(folder=Path(folder), destination=staging)
    log(f"wrote {type(native).__name__} to {output}")
    return {"family": family.name, "architecture": type(native).__name__}


__all__ = ["export_native", "native_config"]
