"""The NormSwap fields that compute what a source configuration computes, one function per family."""

from transformers import PreTrainedConfig

from ..model.configuration_normswap import rope_parameters_by_layer_type


def _same_names(source: PreTrainedConfig) -> dict:
    """The fields that most Transformers configurations name as NormSwap does."""
    return dict(
        vocab_size=source.vocab_size,
        hidden_size=source.hidden_size,
        intermediate_size=source.intermediate_size,
        num_hidden_layers=source.num_hidden_layers,
        num_attention_heads=source.num_attention_heads,
        max_position_embeddings=source.max_position_embeddings,
        initializer_range=source.initializer_range,
        pad_token_id=source.pad_token_id,
    )


def bert_fields(source: PreTrainedConfig) -> dict:
    roberta = source.model_type in ("roberta", "xlm-roberta")
    return dict(
        **_same_names(source),
        hidden_act=source.hidden_act,
        type_vocab_size=source.type_vocab_size,
        norm_placement="post",
        norm_type="layernorm",
        norm_eps=source.layer_norm_eps,
        position_embedding_type="absolute",
        position_offset=source.pad_token_id + 1 if roberta else 0,
        attention_bias=True,
        mlp_type="standard",
        mlp_bias=True,
        hidden_dropout=source.hidden_dropout_prob,
        attention_dropout=source.attention_probs_dropout_prob,
        classifier_dropout=source.classifier_dropout,
        classifier_pooling="cls",
        tie_word_embeddings=getattr(source, "tie_word_embeddings", True),
    )


def _attention_types(source: PreTrainedConfig) -> dict:
    """The source's per-layer attention types and window (Mistral: all layers slide when it has a window)."""
    window = getattr(source, "sliding_window", None)
    layer_types = getattr(source, "layer_types", None)
    if layer_types is None:
        layer_types = ["full_attention" if window is None else "sliding_attention"] * source.num_hidden_layers
    layer_types = list(layer_types)
    return dict(layer_types=layer_types, sliding_window=window if "sliding_attention" in layer_types else None)


def llama_fields(source: PreTrainedConfig) -> dict:
    qwen2 = source.model_type == "qwen2"
    return dict(
        **_same_names(source),
        num_key_value_heads=source.num_key_value_heads,
        head_dim=getattr(source, "head_dim", None) or source.hidden_size // source.num_attention_heads,
        hidden_act=source.hidden_act,
        type_vocab_size=0,
        norm_placement="pre",
        norm_type="rmsnorm",
        norm_eps=source.rms_norm_eps,
        embedding_norm=False,
        final_norm=True,
        position_embedding_type="rope",
        rope_parameters=dict(source.rope_parameters),
        is_causal=True,
        **_attention_types(source),
        attention_bias=True if qwen2 else getattr(source, "attention_bias", False),
        attention_output_bias=False if qwen2 else getattr(source, "attention_bias", False),
        qk_norm=source.model_type == "qwen3",
        mlp_type="glu",
        mlp_bias=getattr(source, "mlp_bias", False),
        hidden_dropout=0.0,
        attention_dropout=source.attention_dropout,
        classifier_pooling="last",
        classifier_bias=False,
        tie_word_embeddings=source.tie_word_embeddings,
    )


def _refuse(source: PreTrainedConfig, field: str, value, why: str) -> None:
    if getattr(source, field, None) == value:
        raise ValueError(f"{source.model_type} with {field}={value!r} is not supported: {why}")


def gpt2_fields(source: PreTrainedConfig) -> dict:
    _refuse(source, "scale_attn_by_inverse_layer_idx", True, "NormSwap scales attention the same in every layer")
    _refuse(source, "add_cross_attention", True, "NormSwap has no cross-attention")
    return dict(
        vocab_size=source.vocab_size,
        hidden_size=source.n_embd,
        intermediate_size=source.n_inner or 4 * source.n_embd,
        num_hidden_layers=source.n_layer,
        num_attention_heads=source.n_head,
        hidden_act=source.activation_function,
        max_position_embeddings=source.n_positions,
        type_vocab_size=0,
        initializer_range=source.initializer_range,
        norm_placement="pre",
        norm_type="layernorm",
        norm_eps=source.layer_norm_epsilon,
        embedding_norm=False,
        final_norm=True,
        position_embedding_type="absolute",
        is_causal=True,
        query_pre_attn_scalar=None if source.scale_attn_weights else 1.0,
        attention_bias=True,
        mlp_type="standard",
        mlp_bias=True,
        hidden_dropout=source.resid_pdrop,
        attention_dropout=source.attn_pdrop,
        classifier_pooling="last",
        classifier_bias=False,
        pad_token_id=source.pad_token_id,
        tie_word_embeddings=source.tie_word_embeddings,
    )


def _rope_of_layer_types(source: PreTrainedConfig, layer_types: list[str]) -> dict:
    """The source's rope parameters; a per-layer-type dict keeps the types in use."""
    rope = dict(source.rope_parameters)
    if rope_parameters_by_layer_type(rope):
        return {layer_type: dict(rope[layer_type]) for layer_type in sorted(set(layer_types))}
    return rope


def gemma_fields(source: PreTrainedConfig) -> dict:
    _refuse(source, "use_bidirectional_attention", True, "convert the causal model and pass --attention bidirectional")
    types = _attention_types(source)
    return dict(
        **_same_names(source),
        num_key_value_heads=source.num_key_value_heads,
        head_dim=source.head_dim,
        hidden_act=source.hidden_activation,
        type_vocab_size=0,
        norm_placement="sandwich",
        norm_type="rmsnorm",
        norm_eps=source.rms_norm_eps,
        embedding_norm=False,
        final_norm=True,
        embedding_multiplier=source.hidden_size**0.5,
        position_embedding_type="rope",
        rope_parameters=_rope_of_layer_types(source, types["layer_types"]),
        is_causal=True,
        **types,
        attention_bias=source.attention_bias,
        qk_norm=source.model_type == "gemma3_text",
        query_pre_attn_scalar=source.query_pre_attn_scalar,
        attn_logit_softcapping=source.attn_logit_softcapping,
        final_logit_softcapping=source.final_logit_softcapping,
        mlp_type="glu",
        mlp_bias=False,
        hidden_dropout=0.0,
        attention_dropout=source.attention_dropout,
        classifier_pooling="last",
        classifier_bias=False,
        tie_word_embeddings=source.tie_word_embeddings,
    )


def olmo2_fields(source: PreTrainedConfig) -> dict:
    return dict(
        llama_fields(source),
        norm_placement="output",
        qk_norm=True,
        qk_norm_scope="projection",
        attention_bias=source.attention_bias,
        attention_output_bias=source.attention_bias,
        mlp_bias=False,
    )


def distilbert_fields(source: PreTrainedConfig) -> dict:
    return dict(
        vocab_size=source.vocab_size,
        hidden_size=source.dim,
        intermediate_size=source.hidden_dim,
        num_hidden_layers=source.n_layers,
        num_attention_heads=source.n_heads,
        hidden_act=source.activation,
        max_position_embeddings=source.max_position_embeddings,
        type_vocab_size=0,
        initializer_range=source.initializer_range,
        norm_placement="post",
        norm_type="layernorm",
        norm_eps=1e-12,  # fixed in DistilBERT
        position_embedding_type="absolute",  # a sinusoidal table (sinusoidal_pos_embds) is stored like a learned one
        attention_bias=True,
        mlp_type="standard",
        mlp_bias=True,
        hidden_dropout=source.dropout,
        attention_dropout=source.attention_dropout,
        classifier_dropout=source.seq_classif_dropout,
        classifier_pooling="cls",
        classifier_activation="relu",
        pad_token_id=source.pad_token_id,
        tie_word_embeddings=source.tie_word_embeddings,
    )


def electra_fields(source: PreTrainedConfig) -> dict:
    return {**bert_fields(source), "embedding_size": source.embedding_size, "classifier_activation": "gelu"}


def modernbert_fields(source: PreTrainedConfig) -> dict:
    types = _attention_types(source)
    return dict(
        **_same_names(source),
        hidden_act=source.hidden_activation,
        type_vocab_size=0,
        norm_placement="pre",
        norm_type="layernorm",
        norm_eps=source.norm_eps,
        norm_bias=source.norm_bias,
        embedding_norm=True,
        final_norm=True,
        first_attention_input_norm=False,
        position_embedding_type="rope",
        rope_parameters=_rope_of_layer_types(source, types["layer_types"]),
        **types,
        attention_bias=source.attention_bias,
        mlp_type="glu",
        mlp_bias=source.mlp_bias,
        hidden_dropout=source.mlp_dropout,
        attention_dropout=source.attention_dropout,
        classifier_pooling=source.classifier_pooling,
        classifier_activation=source.classifier_activation,
        classifier_norm=True,
        token_classifier_head=True,
        classifier_bias=True,
        classifier_dropout=source.classifier_dropout,
        head_dense_bias=source.classifier_bias,
        decoder_bias=source.decoder_bias,
        tie_word_embeddings=source.tie_word_embeddings,
    )
