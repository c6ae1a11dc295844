"""Write a NormSwap checkpoint back as Transformers' own BERT or LLaMA classes, when its configuration allows."""

from pathlib import Path

from transformers import AutoConfig, BertConfig, BertModel, LlamaConfig

from .checkpoint import output_folder
from .configuration_normswap import NormSwapConfig
from .convert import ConversionError, copy_tokenizer_files, resolve_source
from .families import BERT, LLAMA, Family
from .heads import HEAD_CLASSES, NATIVE_AUTO_CLASSES, head_of_config, local_name


def _placements(config):
    return set(config.layer_norm_placements)


def _all_full(config):
    return "all full_attention" if set(config.layer_types) == {"full_attention"} else config.layer_types


# (field, required value, how to read it off the config); the first one that fails blocks the export.
_BERT_NEEDS = (
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
    ("num_key_value_heads", "num_attention_heads", lambda c: "num_attention_heads" if c.num_key_value_heads == c.num_attention_heads else c.num_key_value_heads),
    ("head_dim", "hidden_size // num_attention_heads", lambda c: "hidden_size // num_attention_heads" if c.head_dim * c.num_attention_heads == c.hidden_size else c.head_dim),
    ("type_vocab_size", "at least 1", lambda c: "at least 1" if c.type_vocab_size >= 1 else c.type_vocab_size),
    ("classifier_pooling", "cls", None),
    ("classifier_bias", True, None),
)
_LLAMA_NEEDS = (
    ("norm_placement", {"pre"}, _placements),
    ("norm_type", "rmsnorm", None),
    ("position_embedding_type", "rope", None),
    ("embedding_norm", False, None),
    ("final_norm", True, None),
    ("is_causal", True, None),
    ("layer_types", "all full_attention", _all_full),
    ("qk_norm", False, None),
    ("mlp_type", "glu", None),
    ("attention_output_bias", "attention_bias", lambda c: "attention_bias" if c.attention_output_bias == c.attention_bias else c.attention_output_bias),
    ("type_vocab_size", 0, None),
    ("classifier_pooling", "last", None),
    ("classifier_bias", False, None),
)


def _blockers(config: NormSwapConfig, needs) -> list[str]:
    blocked = []
    for field, required, read in needs:
        value = read(config) if read else getattr(config, field)
        if value != required:
            needed = " or ".join(sorted(required)) if isinstance(required, set) else repr(required)
            blocked.append(f"{field}={getattr(config, field)!r} (needs {needed})")
    return blocked


def native_config(config: NormSwapConfig, head: str) -> tuple[Family, object]:
    """The family and Transformers configuration that compute what `config` computes, or a ValueError naming why not."""
    blockers = {BERT: _blockers(config, _BERT_NEEDS), LLAMA: _blockers(config, _LLAMA_NEEDS)}
    for family in (BERT, LLAMA):
        if not blockers[family] and head not in family.heads:
            blockers[family] = [f"head {head!r} (the {family.name} export has {', '.join(family.heads)})"]
    family = min((BERT, LLAMA), key=lambda f: len(blockers[f]))
    if blockers[family]:
        raise ConversionError(
            f"cannot be written as a native {family.name} model: {'; '.join(blockers[family])}"
        )
    labels = {"id2label": config.id2label, "label2id": config.label2id, "problem_type": config.problem_type}
    if family is BERT:
        return family, BertConfig(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            num_hidden_layers=config.num_hidden_layers,
            num_attention_heads=config.num_attention_heads,
            intermediate_size=config.intermediate_size,
            hidden_act=config.hidden_act,
            hidden_dropout_prob=config.hidden_dropout,
            attention_probs_dropout_prob=config.attention_dropout,
            max_position_embeddings=config.max_position_embeddings,
            type_vocab_size=config.type_vocab_size,
            initializer_range=config.initializer_range,
            layer_norm_eps=config.norm_eps,
            pad_token_id=config.pad_token_id,
            classifier_dropout=config.classifier_dropout,
            tie_word_embeddings=config.tie_word_embeddings,
            **labels,
        )
    return family, LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        hidden_act=config.hidden_act,
        max_position_embeddings=config.max_position_embeddings,
        initializer_range=config.initializer_range,
        rms_norm_eps=config.norm_eps,
        rope_parameters=dict(config.rope_parameters),
        attention_bias=config.attention_bias,
        attention_dropout=config.attention_dropout,
        mlp_bias=config.mlp_bias,
        pad_token_id=config.pad_token_id,
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        tie_word_embeddings=config.tie_word_embeddings,
        **labels,
    )


def export_native(source: str, output: str, *, overwrite: bool = False, log=print) -> dict:
    """Writes the NormSwap checkpoint SOURCE as a native BERT or LLaMA checkpoint in OUTPUT."""
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
    native = (BertModel(target_config, **extra) if extra else NATIVE_AUTO_CLASSES[head].from_config(target_config))
    native = native.to(next(model.parameters()).dtype)
    state = {}
    for name in native.state_dict():
        tensor = family.from_normswap(name, lambda ours_name: ours[local_name(ours_name, head)])
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
