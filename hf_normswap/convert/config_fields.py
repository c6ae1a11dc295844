"""Each family's configuration fields, one `FieldTable` a family: the fields copied as they are (native name, NormSwap
name), the NormSwap values the architecture fixes, and the fields computed on the way in, the way out, or both."""

import copy
from collections.abc import Callable
from dataclasses import replace

from transformers import (
    BertConfig,
    DistilBertConfig,
    ElectraConfig,
    Gemma2Config,
    Gemma3TextConfig,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    ModernBertConfig,
    Olmo2Config,
    PreTrainedConfig,
    Qwen2Config,
    Qwen3Config,
)

from ..model.configuration_normswap import LAYER_TYPES, NormSwapConfig, rope_parameters_by_layer_type
from .field_table import Computed, FieldTable, same_names


# The fields that most Transformers configurations name as NormSwap does.
_SHARED_NAMES = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "max_position_embeddings",
    "initializer_range",
    "pad_token_id",
)
# NormSwap values that a whole group of architectures fixes.
_POST_LN_ENCODER = dict(
    norm_placement="post",
    norm_type="layernorm",
    position_embedding_type="absolute",
    attention_bias=True,
    mlp_type="standard",
    mlp_bias=True,
    classifier_pooling="cls",
)
_CAUSAL_DECODER = dict(
    type_vocab_size=0,
    embedding_norm=False,
    final_norm=True,
    is_causal=True,
    classifier_pooling="last",
    classifier_bias=False,
)
_ROPE_DECODER = dict(
    _CAUSAL_DECODER, norm_type="rmsnorm", position_embedding_type="rope", mlp_type="glu", hidden_dropout=0.0
)


def _layer_types(source: PreTrainedConfig) -> list[str]:
    """The source's attention type per layer (Mistral: every layer slides when it has a window)."""
    layer_types = getattr(source, "layer_types", None)
    if layer_types is None:
        window = getattr(source, "sliding_window", None)
        return ["full_attention" if window is None else "sliding_attention"] * source.num_hidden_layers
    return list(layer_types)


def _sliding_window(source: PreTrainedConfig) -> int | None:
    """The source's window, where some layer slides."""
    return getattr(source, "sliding_window", None) if "sliding_attention" in _layer_types(source) else None


def _rope_parameters(source: PreTrainedConfig) -> dict:
    """The source's rope parameters; a per-layer-type dict keeps the types in use."""
    rope = dict(source.rope_parameters)
    if rope_parameters_by_layer_type(rope):
        return {layer_type: dict(rope[layer_type]) for layer_type in sorted(set(_layer_types(source)))}
    return rope


def _head_dim(source: PreTrainedConfig) -> int:
    return getattr(source, "head_dim", None) or source.hidden_size // source.num_attention_heads


def _roberta_position_offset(source: PreTrainedConfig) -> int:
    """RoBERTa counts positions from pad_token_id + 1; BERT from 0."""
    return source.pad_token_id + 1 if source.model_type in ("roberta", "xlm-roberta") else 0


def _qkv_bias(source: PreTrainedConfig) -> bool:
    """Whether q, k and v have biases: always in Qwen2."""
    return True if source.model_type == "qwen2" else getattr(source, "attention_bias", False)


def _output_bias(source: PreTrainedConfig) -> bool:
    """Whether the attention output has a bias: never in Qwen2."""
    return False if source.model_type == "qwen2" else getattr(source, "attention_bias", False)


def _written_back(name: str, native: str | None = None) -> Callable[[NormSwapConfig], dict]:
    """A `Computed.write` that gives NormSwap's `name` back as it is (a copy), named `native` (default: the same)."""
    return lambda config: {native or name: copy.deepcopy(getattr(config, name))}


def _hidden_dropout(native: str, *also: str) -> Computed:
    """NormSwap's one hidden dropout: read from `native`, written to it and to the native dropouts `also`."""
    return Computed(
        "hidden_dropout",
        lambda source: getattr(source, native),
        lambda config: dict.fromkeys((native, *also), config.hidden_dropout),
    )


def _classifier_dropout(native: str) -> Computed:
    """NormSwap's classifier dropout, written back as the hidden dropout where it is None (NormSwap falls back so)."""

    def write(config: NormSwapConfig) -> dict:
        return {native: config.hidden_dropout if config.classifier_dropout is None else config.classifier_dropout}

    return Computed("classifier_dropout", lambda source: getattr(source, native), write)


def _rope_of_every_layer_type(config: NormSwapConfig) -> dict:
    """ModernBERT takes rope parameters for both layer types: a type not in use gets those of one that is."""
    rope = config.layer_rope_parameters
    return {"rope_parameters": {kind: dict(rope.get(kind) or next(iter(rope.values()))) for kind in LAYER_TYPES}}


def _rope_by_layer_type(config: NormSwapConfig) -> dict:
    """Gemma 3 (text) takes rope parameters per layer type: flat ones serve both."""
    rope = config.rope_parameters
    if not rope_parameters_by_layer_type(rope):
        rope = dict.fromkeys(LAYER_TYPES, rope)
    return {"rope_parameters": copy.deepcopy(rope)}


def _local_attention(config: NormSwapConfig) -> dict:
    """ModernBERT's window, which counts both sides."""
    return {"local_attention": 2 * config.sliding_window} if config.sliding_window else {}


_LAYER_TYPES_WRITTEN = Computed("layer_types", _layer_types, lambda config: {"layer_types": list(config.layer_types)})


BERT_FIELDS = FieldTable(
    BertConfig,
    copied=(
        *same_names(*_SHARED_NAMES, "hidden_act", "type_vocab_size", "classifier_dropout", "tie_word_embeddings"),
        ("layer_norm_eps", "norm_eps"),
        ("hidden_dropout_prob", "hidden_dropout"),
        ("attention_probs_dropout_prob", "attention_dropout"),
    ),
    fixed=_POST_LN_ENCODER,
    computed=(Computed("position_offset", _roberta_position_offset),),  # BertConfig has none
    writes_token_ids=False,
)

ELECTRA_FIELDS = replace(
    BERT_FIELDS,
    native_class=ElectraConfig,
    copied=BERT_FIELDS.copied + same_names("embedding_size"),
    fixed=dict(BERT_FIELDS.fixed, classifier_activation="gelu"),
)

DISTILBERT_FIELDS = FieldTable(
    DistilBertConfig,
    copied=(
        *same_names(
            "vocab_size",
            "max_position_embeddings",
            "initializer_range",
            "pad_token_id",
            "attention_dropout",
            "tie_word_embeddings",
        ),
        ("dim", "hidden_size"),
        ("hidden_dim", "intermediate_size"),
        ("n_layers", "num_hidden_layers"),
        ("n_heads", "num_attention_heads"),
        ("activation", "hidden_act"),
        ("dropout", "hidden_dropout"),
    ),
    # eps is fixed in DistilBERT; a sinusoidal table (sinusoidal_pos_embds) is stored like a learned one
    fixed=dict(_POST_LN_ENCODER, type_vocab_size=0, norm_eps=1e-12, classifier_activation="relu"),
    computed=(_classifier_dropout("seq_classif_dropout"),),
    writes_token_ids=False,
)

MODERNBERT_FIELDS = FieldTable(
    ModernBertConfig,
    copied=(
        *same_names(
            *_SHARED_NAMES,
            "norm_eps",
            "norm_bias",
            "attention_bias",
            "attention_dropout",
            "mlp_bias",
            "classifier_pooling",
            "classifier_activation",
            "decoder_bias",
            "tie_word_embeddings",
        ),
        ("hidden_activation", "hidden_act"),
        ("classifier_bias", "head_dense_bias"),
    ),
    fixed=dict(
        type_vocab_size=0,
        norm_placement="pre",
        norm_type="layernorm",
        embedding_norm=True,
        final_norm=True,
        first_attention_input_norm=False,
        position_embedding_type="rope",
        mlp_type="glu",
        classifier_norm=True,
        token_classifier_head=True,
        classifier_bias=True,
    ),
    computed=(
        Computed("rope_parameters", _rope_parameters, _rope_of_every_layer_type),
        _LAYER_TYPES_WRITTEN,
        Computed("sliding_window", _sliding_window, _local_attention),
        _hidden_dropout("mlp_dropout", "embedding_dropout"),
        _classifier_dropout("classifier_dropout"),
    ),
)


def _qwen_layer_types(config: NormSwapConfig) -> dict:
    """Qwen's layer types, with the window switched on where some layer slides, and `max_window_layers` (the layers
    before the first that slides) for readers that derive the types from it."""
    types = list(config.layer_types)
    first_sliding = types.index("sliding_attention") if "sliding_attention" in types else len(types)
    return {
        "layer_types": types,
        "use_sliding_window": config.sliding_window is not None,
        "max_window_layers": first_sliding,
    }


# How the LLaMA family's computed fields read from any of its classes.
_LLAMA_READS = {
    "head_dim": _head_dim,
    "layer_types": _layer_types,
    "sliding_window": _sliding_window,
    "attention_bias": _qkv_bias,
    "attention_output_bias": _output_bias,
    "qk_norm": lambda source: source.model_type == "qwen3",
    "mlp_bias": lambda source: getattr(source, "mlp_bias", False),
}


def _llama_fields(native_class: type[PreTrainedConfig], *written: str, **writes: Callable) -> FieldTable:
    """The LLaMA family's fields (LLaMA, Mistral, Qwen2, Qwen3: read the same way), written back as `native_class`
    takes them: the fields in `written` as they are, the ones in `writes` by their functions, the rest not at all
    (fixed by the class, so the round trip reads them back as the class has them)."""
    if unknown := {*written, *writes} - set(_LLAMA_READS):
        raise ValueError(f"{native_class.__name__}: no LLaMA-family field {sorted(unknown)} to write")
    return FieldTable(
        native_class,
        copied=(
            *same_names(
                *_SHARED_NAMES,
                "num_key_value_heads",
                "hidden_act",
                "rope_parameters",
                "attention_dropout",
                "tie_word_embeddings",
            ),
            ("rms_norm_eps", "norm_eps"),
        ),
        fixed=dict(_ROPE_DECODER, norm_placement="pre"),
        computed=tuple(
            Computed(name, read, writes.get(name) or (_written_back(name) if name in written else None))
            for name, read in _LLAMA_READS.items()
        ),
    )


LLAMA_FIELDS = _llama_fields(LlamaConfig, "head_dim", "attention_bias", "mlp_bias")
# The family's other classes, for the export: Mistral slides in every layer when it has a window; Qwen2 always has q,
# k and v biases (head_dim is read where set); Qwen3 has q/k norms.
MISTRAL_FIELDS = _llama_fields(MistralConfig, "head_dim", "sliding_window")
QWEN2_FIELDS = _llama_fields(Qwen2Config, "head_dim", "sliding_window", layer_types=_qwen_layer_types)
QWEN3_FIELDS = _llama_fields(
    Qwen3Config, "head_dim", "sliding_window", "attention_bias", layer_types=_qwen_layer_types
)

OLMO2_FIELDS = FieldTable(
    Olmo2Config,
    copied=(
        *same_names(
            *_SHARED_NAMES,
            "num_key_value_heads",
            "hidden_act",
            "rope_parameters",
            "attention_bias",
            "attention_dropout",
            "tie_word_embeddings",
        ),
        ("rms_norm_eps", "norm_eps"),
    ),
    fixed=dict(_ROPE_DECODER, norm_placement="output", qk_norm=True, qk_norm_scope="projection", mlp_bias=False),
    computed=(
        Computed("head_dim", _head_dim),
        Computed("layer_types", _layer_types),
        Computed("sliding_window", _sliding_window),
        Computed("attention_output_bias", lambda source: source.attention_bias),
    ),
)

GPT2_FIELDS = FieldTable(
    GPT2Config,
    copied=(
        *same_names("vocab_size", "initializer_range", "pad_token_id", "tie_word_embeddings"),
        ("n_embd", "hidden_size"),
        ("n_layer", "num_hidden_layers"),
        ("n_head", "num_attention_heads"),
        ("n_positions", "max_position_embeddings"),
        ("activation_function", "hidden_act"),
        ("layer_norm_epsilon", "norm_eps"),
        ("attn_pdrop", "attention_dropout"),
    ),
    fixed=dict(
        _CAUSAL_DECODER,
        norm_placement="pre",
        norm_type="layernorm",
        position_embedding_type="absolute",
        attention_bias=True,
        mlp_type="standard",
        mlp_bias=True,
    ),
    computed=(
        Computed(
            "intermediate_size",
            lambda source: source.n_inner or 4 * source.n_embd,
            _written_back("intermediate_size", "n_inner"),
        ),
        # without scale_attn_weights GPT-2 does not divide the scores: a query scale of 1
        Computed(
            "query_pre_attn_scalar",
            lambda source: None if source.scale_attn_weights else 1.0,
            lambda config: {"scale_attn_weights": config.query_pre_attn_scalar is None},
        ),
        _hidden_dropout("resid_pdrop", "embd_pdrop"),
    ),
    refused=(
        ("scale_attn_by_inverse_layer_idx", True, "NormSwap scales attention the same in every layer"),
        ("add_cross_attention", True, "NormSwap has no cross-attention"),
    ),
)


def _gemma_fields(native_class: type[PreTrainedConfig], write_rope: Callable[[NormSwapConfig], dict]) -> FieldTable:
    """Gemma 2 and Gemma 3 (text) read alike; they write rope parameters each its own way."""
    return FieldTable(
        native_class,
        copied=(
            *same_names(
                *_SHARED_NAMES,
                "num_key_value_heads",
                "head_dim",
                "attention_bias",
                "attn_logit_softcapping",
                "final_logit_softcapping",
                "attention_dropout",
                "tie_word_embeddings",
            ),
            ("hidden_activation", "hidden_act"),
            ("rms_norm_eps", "norm_eps"),
        ),
        fixed=dict(_ROPE_DECODER, norm_placement="sandwich", mlp_bias=False),
        computed=(
            Computed("embedding_multiplier", lambda source: source.hidden_size**0.5),
            Computed("rope_parameters", _rope_parameters, write_rope),
            _LAYER_TYPES_WRITTEN,
            Computed("sliding_window", _sliding_window, _written_back("sliding_window")),
            Computed("qk_norm", lambda source: source.model_type == "gemma3_text"),
            Computed(
                "query_pre_attn_scalar",
                lambda source: source.query_pre_attn_scalar,
                lambda config: {"query_pre_attn_scalar": int(config.query_pre_attn_scalar or config.head_dim)},
            ),
        ),
        refused=(
            ("use_bidirectional_attention", True, "convert the causal model and pass --attention bidirectional"),
        ),
    )


GEMMA_FIELDS = _gemma_fields(Gemma2Config, _written_back("rope_parameters"))
GEMMA3_TEXT_FIELDS = _gemma_fields(Gemma3TextConfig, _rope_by_layer_type)
