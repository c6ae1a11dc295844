"""Source model families: how a BERT- or LLaMA-family checkpoint reads as a NormSwap configuration and weights."""

import re
from dataclasses import dataclass

from transformers import PreTrainedConfig

from .configuration_normswap import NormSwapConfig


@dataclass(frozen=True)
class Family:
    """A group of Transformers architectures that map onto NormSwap the same way."""

    name: str
    model_types: tuple[str, ...]
    heads: tuple[str, ...]  # the NormSwap heads whose weights this family's checkpoints can carry
    base_prefixes: tuple[str, ...]
    renames: tuple[tuple[str, str], ...]
    dropped: tuple[str, ...]

    def rename(self, key: str) -> str | None:
        """The NormSwap name (as in a `NormSwapFor...` head, body under `model.`) of a source tensor, or None to drop."""
        for prefix in self.base_prefixes:
            if key.startswith(prefix):
                key = key[len(prefix) :]
                break
        for pattern in self.dropped:
            if re.fullmatch(pattern, key):
                return None
        for pattern, replacement in self.renames:
            new_key, found = re.subn(pattern, replacement, key)
            if found:
                return new_key
        raise KeyError(key)


_BERT_LAYER = r"^encoder\.layer\.(\d+)\."
BERT = Family(
    name="bert",
    model_types=("bert", "roberta", "xlm-roberta"),
    heads=("base", "masked-lm", "sequence-classification", "token-classification", "question-answering"),
    base_prefixes=("bert.", "roberta."),
    renames=(
        (r"^embeddings\.LayerNorm\.", "model.embeddings.norm."),
        (r"^embeddings\.", "model.embeddings."),
        (_BERT_LAYER + r"attention\.self\.query\.", r"model.layers.\1.self_attn.q_proj."),
        (_BERT_LAYER + r"attention\.self\.key\.", r"model.layers.\1.self_attn.k_proj."),
        (_BERT_LAYER + r"attention\.self\.value\.", r"model.layers.\1.self_attn.v_proj."),
        (_BERT_LAYER + r"attention\.output\.dense\.", r"model.layers.\1.self_attn.o_proj."),
        (_BERT_LAYER + r"attention\.output\.LayerNorm\.", r"model.layers.\1.attention_norms.residual_norm."),
        (_BERT_LAYER + r"intermediate\.dense\.", r"model.layers.\1.mlp.up_proj."),
        (_BERT_LAYER + r"output\.dense\.", r"model.layers.\1.mlp.down_proj."),
        (_BERT_LAYER + r"output\.LayerNorm\.", r"model.layers.\1.mlp_norms.residual_norm."),
        (r"^pooler\.dense\.", "pooler.dense."),
        (r"^cls\.predictions\.transform\.dense\.", "lm_head.dense."),
        (r"^cls\.predictions\.transform\.LayerNorm\.", "lm_head.norm."),
        (r"^cls\.predictions\.decoder\.weight$", "lm_head.decoder.weight"),
        (r"^cls\.predictions\.bias$", "lm_head.decoder.bias"),
        (r"^lm_head\.layer_norm\.", "lm_head.norm."),
        (r"^lm_head\.bias$", "lm_head.decoder.bias"),
        (r"^lm_head\.(dense|decoder)\.weight$", r"lm_head.\1.weight"),
        (r"^lm_head\.dense\.bias$", "lm_head.dense.bias"),
        (r"^classifier\.dense\.", "pooler.dense."),
        (r"^classifier\.out_proj\.", "classifier."),
        (r"^classifier\.", "classifier."),
        (r"^qa_outputs\.", "qa_outputs."),
    ),
    dropped=(
        r"embeddings\.position_ids",
        r"cls\.predictions\.decoder\.bias",
        r"lm_head\.decoder\.bias",
        r"cls\.seq_relationship\..*",
    ),
)

_LLAMA_LAYER = r"^layers\.(\d+)\."
LLAMA = Family(
    name="llama",
    model_types=("llama", "mistral", "qwen2", "qwen3"),
    heads=("base", "causal-lm", "sequence-classification"),
    base_prefixes=("model.",),
    renames=(
        (r"^embed_tokens\.", "model.embeddings.word_embeddings."),
        (_LLAMA_LAYER + r"input_layernorm\.", r"model.layers.\1.attention_norms.input_norm."),
        (_LLAMA_LAYER + r"post_attention_layernorm\.", r"model.layers.\1.mlp_norms.input_norm."),
        (_LLAMA_LAYER + r"(self_attn|mlp)\.", r"model.layers.\1.\2."),
        (r"^norm\.", "model.norm."),
        (r"^lm_head\.", "lm_head."),
        (r"^score\.", "classifier."),
    ),
    dropped=(r"layers\.\d+\.self_attn\.rotary_emb\.inv_freq", r"rotary_emb\.inv_freq"),
)

NORMSWAP = Family(
    name="normswap",
    model_types=("normswap",),
    heads=("base", "masked-lm", "sequence-classification", "token-classification", "question-answering", "causal-lm"),
    base_prefixes=(),
    renames=((r"^(model|pooler|classifier|qa_outputs|lm_head)\.", r"\1."), (r"^", "model.")),
    dropped=(),
)

FAMILIES = (BERT, LLAMA, NORMSWAP)
SUPPORTED_MODEL_TYPES = tuple(model_type for family in FAMILIES for model_type in family.model_types)


def family_of(config: PreTrainedConfig) -> Family:
    """The family of a source configuration, or a ValueError listing what is supported."""
    for family in FAMILIES:
        if config.model_type in family.model_types:
            return family
    raise ValueError(
        f"model_type {config.model_type!r} is not supported; supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}."
    )


def normswap_config(source: PreTrainedConfig, **overrides) -> NormSwapConfig:
    """The NormSwap configuration that computes what `source` computes (LLaMA family: in causal mode)."""
    family = family_of(source)
    if family is NORMSWAP:
        return NormSwapConfig.from_dict({**source.to_dict(), **overrides})
    fields = _bert_fields(source) if family is BERT else _llama_fields(source)
    for name in ("id2label", "label2id", "problem_type", "bos_token_id", "eos_token_id"):
        if getattr(source, name, None) is not None:
            fields[name] = getattr(source, name)
    fields.update(overrides)
    return NormSwapConfig(**fields)


def _bert_fields(source: PreTrainedConfig) -> dict:
    roberta = source.model_type in ("roberta", "xlm-roberta")
    return dict(
        vocab_size=source.vocab_size,
        hidden_size=source.hidden_size,
        intermediate_size=source.intermediate_size,
        num_hidden_layers=source.num_hidden_layers,
        num_attention_heads=source.num_attention_heads,
        hidden_act=source.hidden_act,
        max_position_embeddings=source.max_position_embeddings,
        type_vocab_size=source.type_vocab_size,
        initializer_range=source.initializer_range,
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
        pad_token_id=source.pad_token_id,
        tie_word_embeddings=getattr(source, "tie_word_embeddings", True),
    )


def attention_types(source: PreTrainedConfig) -> dict:
    """The source's per-layer attention types and window (Mistral: all layers slide when it has a window)."""
    window = getattr(source, "sliding_window", None)
    layer_types = getattr(source, "layer_types", None)
    if layer_types is None:
        layer_types = ["full_attention" if window is None else "sliding_attention"] * source.num_hidden_layers
    layer_types = list(layer_types)
    return dict(layer_types=layer_types, sliding_window=window if "sliding_attention" in layer_types else None)


def _llama_fields(source: PreTrainedConfig) -> dict:
    qwen2 = source.model_type == "qwen2"
    return dict(
        vocab_size=source.vocab_size,
        hidden_size=source.hidden_size,
        intermediate_size=source.intermediate_size,
        num_hidden_layers=source.num_hidden_layers,
        num_attention_heads=source.num_attention_heads,
        num_key_value_heads=source.num_key_value_heads,
        head_dim=getattr(source, "head_dim", None) or source.hidden_size // source.num_attention_heads,
        hidden_act=source.hidden_act,
        max_position_embeddings=source.max_position_embeddings,
        type_vocab_size=0,
        initializer_range=source.initializer_range,
        norm_placement="pre",
        norm_type="rmsnorm",
        norm_eps=source.rms_norm_eps,
        embedding_norm=False,
        final_norm=True,
        position_embedding_type="rope",
        rope_parameters=dict(source.rope_parameters),
        is_causal=True,
        **attention_types(source),
        attention_bias=True if qwen2 else getattr(source, "attention_bias", False),
        attention_output_bias=False if qwen2 else getattr(source, "attention_bias", False),
        qk_norm=source.model_type == "qwen3",
        mlp_type="glu",
        mlp_bias=getattr(source, "mlp_bias", False),
        hidden_dropout=0.0,
        attention_dropout=source.attention_dropout,
        classifier_pooling="last",
        classifier_bias=False,
        pad_token_id=source.pad_token_id,
        tie_word_embeddings=source.tie_word_embeddings,
    )
