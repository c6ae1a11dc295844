"""Write a NormSwap checkpoint back as Transformers' own classes (BERT, LLaMA, GPT-2, Gemma 2/3, OLMo 2,
ELECTRA, DistilBERT, ModernBERT), when its configuration allows."""

import copy
from pathlib import Path

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

from ..checkpoint import copy_tokenizer_files, output_folder, resolve_source
from ..model.configuration_normswap import LAYER_TYPES, NormSwapConfig, rope_parameters_by_layer_type
from ..model.heads import HEAD_CLASSES, NATIVE_AUTO_CLASSES, head_of_config, local_name
from .converter import ConversionError
from .families import BERT, DISTILBERT, ELECTRA, GEMMA, GPT2, LLAMA, MODERNBERT, OLMO2, Family


def _placements(config):
    return set(config.layer_norm_placements)


def _all_full(config):
    return "all full_attention" if set(config.layer_types) == {"full_attention"} else config.layer_types


def _same(field: str, other: str):
    """Reads `field` as the name `other` when the two are equal."""
    return lambda c: other if getattr(c, field) == getattr(c, other) else getattr(c, field)


_MHA = ("num_key_value_heads", "num_attention_heads", _same("num_key_value_heads", "num_attention_heads"))
_HEAD_DIM = (
    "head_dim",
    "hidden_size // num_attention_heads",
    lambda c: (
        "hidden_size // num_attention_heads" if c.head_dim * c.num_attention_heads == c.hidden_size else c.head_dim
    ),
)
_PLAIN_ATTENTION = (  # what BERT, LLaMA, GPT-2 and OLMo 2 cannot represent
    ("query_pre_attn_scalar", None, None),
    ("attn_logit_softcapping", None, None),
    ("final_logit_softcapping", None, None),
    ("embedding_multiplier", 1.0, None),
)
_FLAT_ROPE = (
    "rope_parameters",
    "one dict for all layers",
    lambda c: "one dict for all layers" if not rope_parameters_by_layer_type(c.rope_parameters) else c.rope_parameters,
)
_SAME_EMBEDDING_SIZE = ("embedding_size", "hidden_size", _same("embedding_size", "hidden_size"))
_DEFAULT_HEADS = (  # what only ModernBERT's head layout uses
    ("first_attention_input_norm", True, None),
    ("classifier_norm", False, None),
    ("token_classifier_head", False, None),
    ("head_dense_bias", True, None),
    ("decoder_bias", True, None),
)


def _changed(needs: tuple, *rows: tuple) -> tuple:
    """`needs` with each of `rows` in place of the row of its field, or added at the end when the field is new."""
    replacing = {row[0]: row for row in rows}
    fields = {need[0] for need in needs}
    return (*(replacing.get(need[0], need) for need in needs), *(row for row in rows if row[0] not in fields))


# (field, required value, how to read it off the config); every one that fails blocks the export.
_POST_LN_ENCODER = (  # BERT, ELECTRA, DistilBERT
    ("norm_placement", {"post"}, _placements),
    ("norm_type", "layernorm", None),
    ("norm_bias", True, None),
    ("position_embedding_type", "absolute", None),
    ("position_offset", 0, None),
    ("embedding_norm", True, None),
    ("final_norm", False, None),
    ("is_causal", False, None),
    ("layer_types", "all full_attention", _all_full),
    ("qk_norm", False, None),
    ("mlp_type", "standard", None),
    ("mlp_bias", True, None),
    ("attention_bias", True, None),
    ("attention_output_bias", True, None),
    _MHA,
    _HEAD_DIM,
    ("type_vocab_size", "at least 1", lambda c: "at least 1" if c.type_vocab_size >= 1 else c.type_vocab_size),
    ("classifier_pooling", "cls", None),
    ("classifier_bias", True, None),
    *_PLAIN_ATTENTION,
    *_DEFAULT_HEADS,
)
_BERT_NEEDS = (*_POST_LN_ENCODER, _SAME_EMBEDDING_SIZE, ("classifier_activation", "tanh", None))
_ELECTRA_NEEDS = (*_POST_LN_ENCODER, ("classifier_activation", "gelu", None))
_DISTILBERT_NEEDS = _changed(
    _POST_LN_ENCODER,
    ("type_vocab_size", 0, None),
    _SAME_EMBEDDING_SIZE,
    ("norm_eps", 1e-12, None),
    ("classifier_activation", "relu", None),
)
_MODERNBERT_NEEDS = (
    ("norm_placement", {"pre"}, _placements),
    ("norm_type", "layernorm", None),
    ("embedding_norm", True, None),
    ("final_norm", True, None),
    ("first_attention_input_norm", False, None),
    ("position_embedding_type", "rope", None),
    ("is_causal", False, None),
    ("qk_norm", False, None),
    ("mlp_type", "glu", None),
    ("attention_output_bias", "attention_bias", _same("attention_output_bias", "attention_bias")),
    _MHA,
    _HEAD_DIM,
    _SAME_EMBEDDING_SIZE,
    ("type_vocab_size", 0, None),
    (
        "classifier_pooling",
        "cls or mean",
        lambda c: "cls or mean" if c.classifier_pooling in ("cls", "mean") else c.classifier_pooling,
    ),
    # its masked-LM head uses classifier_activation
    ("classifier_activation", "hidden_act", _same("classifier_activation", "hidden_act")),
    ("classifier_norm", True, None),
    ("token_classifier_head", True, None),
    ("classifier_bias", True, None),
    *_PLAIN_ATTENTION,
)
_LLAMA_NEEDS = (
    ("norm_placement", {"pre"}, _placements),
    ("norm_type", "rmsnorm", None),
    ("position_embedding_type", "rope", None),
    _FLAT_ROPE,
    ("embedding_norm", False, None),
    ("final_norm", True, None),
    ("is_causal", True, None),
    ("layer_types", "all full_attention", _all_full),
    ("qk_norm", False, None),
    ("mlp_type", "glu", None),
    ("attention_output_bias", "attention_bias", _same("attention_output_bias", "attention_bias")),
    ("type_vocab_size", 0, None),
    ("classifier_pooling", "last", None),
    ("classifier_bias", False, None),
    *_PLAIN_ATTENTION,
    _SAME_EMBEDDING_SIZE,
    *_DEFAULT_HEADS,
)
_GPT2_NEEDS = _changed(
    _POST_LN_ENCODER,
    ("norm_placement", {"pre"}, _placements),
    ("embedding_norm", False, None),
    ("final_norm", True, None),
    ("is_causal", True, None),
    ("type_vocab_size", 0, None),
    ("classifier_pooling", "last", None),
    ("classifier_bias", False, None),
    (
        "query_pre_attn_scalar",
        "None or 1",
        lambda c: "None or 1" if c.query_pre_attn_scalar in (None, 1) else c.query_pre_attn_scalar,
    ),
    _SAME_EMBEDDING_SIZE,
)
_GEMMA_NEEDS = (
    ("norm_placement", {"sandwich"}, _placements),
    ("norm_type", "rmsnorm", None),
    ("position_embedding_type", "rope", None),
    ("embedding_norm", False, None),
    ("final_norm", True, None),
    ("is_causal", True, None),
    ("mlp_type", "glu", None),
    ("mlp_bias", False, None),
    ("attention_output_bias", "attention_bias", _same("attention_output_bias", "attention_bias")),
    ("type_vocab_size", 0, None),
    (
        "embedding_multiplier",
        "sqrt(hidden_size)",
        lambda c: "sqrt(hidden_size)" if c.embedding_multiplier == c.hidden_size**0.5 else c.embedding_multiplier,
    ),
    (
        "query_pre_attn_scalar",
        "None or a whole number",
        lambda c: (
            "None or a whole number"
            if c.query_pre_attn_scalar is None or float(c.query_pre_attn_scalar).is_integer()
            else c.query_pre_attn_scalar
        ),
    ),
    _SAME_EMBEDDING_SIZE,
    *_DEFAULT_HEADS,
)
_GEMMA2_NEEDS = (*_GEMMA_NEEDS, ("qk_norm", False, None), _FLAT_ROPE)
_GEMMA3_NEEDS = (*_GEMMA_NEEDS, ("qk_norm", True, None), ("qk_norm_scope", "head", None))
_OLMO2_NEEDS = (
    ("norm_placement", {"output"}, _placements),
    ("norm_type", "rmsnorm", None),
    ("position_embedding_type", "rope", None),
    _FLAT_ROPE,
    ("embedding_norm", False, None),
    ("final_norm", True, None),
    ("is_causal", True, None),
    ("layer_types", "all full_attention", _all_full),
    ("qk_norm", True, None),
    ("qk_norm_scope", "projection", None),
    ("mlp_type", "glu", None),
    ("mlp_bias", False, None),
    ("attention_output_bias", "attention_bias", _same("attention_output_bias", "attention_bias")),
    _HEAD_DIM,
    ("type_vocab_size", 0, None),
    *_PLAIN_ATTENTION,
    _SAME_EMBEDDING_SIZE,
    *_DEFAULT_HEADS,
)


def _blockers(config: NormSwapConfig, needs) -> list[str]:
    blocked = []
    for field, required, read in needs:
        value = read(config) if read else getattr(config, field)
        if value != required:
            needed = " or ".join(sorted(required)) if isinstance(required, set) else repr(required)
            blocked.append(f"{field}={getattr(config, field)!r} (needs {needed})")
    return blocked


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
    common = _common(config)
    common.pop("bos_token_id"), common.pop("eos_token_id")
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
    common = _common(config)
    common.pop("bos_token_id"), common.pop("eos_token_id")
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


# The native architectures a NormSwap configuration can be written as: family (names), requirements, configuration.
TARGETS = (
    (BERT, _BERT_NEEDS, _bert_config),
    (LLAMA, _LLAMA_NEEDS, _llama_config),
    (GPT2, _GPT2_NEEDS, _gpt2_config),
    (GEMMA, _GEMMA2_NEEDS, _gemma_config(Gemma2Config)),
    (GEMMA, _GEMMA3_NEEDS, _gemma_config(Gemma3TextConfig)),
    (OLMO2, _OLMO2_NEEDS, _olmo2_config),
    (ELECTRA, _ELECTRA_NEEDS, _electra_config),
    (DISTILBERT, _DISTILBERT_NEEDS, _distilbert_config),
    (MODERNBERT, _MODERNBERT_NEEDS, _modernbert_config),
)


def native_config(config: NormSwapConfig, head: str) -> tuple[Family, object]:
    """The family and Transformers configuration that compute what `config` computes, or a ValueError naming why not
    (the blocking fields of the closest native architecture)."""
    candidates = []
    for family, needs, build in TARGETS:
        blockers = _blockers(config, needs)
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
        tensor = family.from_normswap(name, lambda ours_name: ours[local_name(ours_name, head)], head)
        if tensor is not None:
            state[name] = tensor
    missing = native.load_state_dict(state, strict=False).missing_keys
    tied = set(type(native)._tied_weights_keys or {})
    if set(missing) - tied:
        raise ConversionError(f"{folder}: no NormSwap tensor for {sorted(set(missing) - tied)}")
    native.tie_weights()

    with output_folder(output, overwrite) as staging:
        native.save_pretrained(staging)
        copy_tokenizer_files(Path(folder), staging)
    log(f"wrote {type(native).__name__} to {output}")
    return {"family": family.name, "architecture": type(native).__name__}


__all__ = ["export_native", "native_config"]
