"""Source model families: how a checkpoint of a Transformers architecture reads as a NormSwap configuration and
weights. Each family is one declarative entry: names, tensor layouts, and its configuration fields (a `FieldTable`
from `config_fields`, read both ways)."""

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import PreTrainedConfig

from ..model.configuration_normswap import NormSwapConfig
from ..model.heads import HEAD_CLASSES, head_of_architecture
from .config_fields import (
    BERT_FIELDS,
    DISTILBERT_FIELDS,
    ELECTRA_FIELDS,
    GEMMA_FIELDS,
    GPT2_FIELDS,
    LLAMA_FIELDS,
    MODERNBERT_FIELDS,
    OLMO2_FIELDS,
)
from .field_table import FieldTable


@dataclass(frozen=True)
class Family:
    """A group of Transformers architectures that map onto NormSwap the same way."""

    name: str
    model_types: tuple[str, ...]
    heads: tuple[str, ...]  # the NormSwap heads whose weights this family's checkpoints can carry
    base_prefixes: tuple[str, ...]
    renames: tuple[tuple[str, str], ...]
    dropped: tuple[str, ...]
    fields: FieldTable | None  # its configuration fields, both ways (None: NormSwap's own)
    causal: bool = False  # causal LMs: verified in causal mode, tokenizers get a pad token, swaps scored by perplexity
    transposed: tuple[str, ...] = ()  # source tensors stored (in, out), as GPT-2's Conv1D: transposed on the way
    fused: tuple[tuple[str, tuple[str, ...]], ...] = ()  # a fused NormSwap name part -> its equal parts (dim 0)
    norm_weight_offset: float = 0.0  # source norms scale by (offset + w), as Gemma's (1 + w): folded into w
    head_renames: tuple[tuple[str, str, str], ...] = ()  # (head, pattern, replacement), tried first for that head
    architecture_heads: tuple[tuple[str, str], ...] = ()  # architectures whose head is not the one their name says

    def rename(self, key: str, head: str | None = None) -> str | None:
        """The NormSwap name (as in a `NormSwapFor...` head, body under `model.`) of a source tensor, or None to
        drop."""
        for prefix in self.base_prefixes:
            if key.startswith(prefix):
                key = key[len(prefix) :]
                break
        for pattern in self.dropped:
            if re.fullmatch(pattern, key):
                return None
        renames = [(pattern, new) for name, pattern, new in self.head_renames if name == head] + list(self.renames)
        for pattern, replacement in renames:
            new_key, found = re.subn(pattern, replacement, key)
            if found:
                return new_key
        raise KeyError(key)

    def head_of(self, architecture: str) -> str:
        """The NormSwap head of one of this family's architectures, such as `BertForMaskedLM`."""
        return dict(self.architecture_heads).get(architecture) or head_of_architecture(architecture)

    def to_normswap(self, key: str, tensor: torch.Tensor, head: str | None = None) -> list[tuple[str, torch.Tensor]]:
        """The NormSwap tensors (name, value) that a source tensor becomes: none when dropped, several when fused."""
        name = self.rename(key, head)
        if name is None:
            return []
        if any(re.search(pattern, key) for pattern in self.transposed):
            tensor = tensor.t().contiguous()
        if self.norm_weight_offset and name.endswith("norm.weight"):
            tensor = (tensor.float() + self.norm_weight_offset).to(tensor.dtype)
        for part, parts in self.fused:
            if part in name:
                return [(name.replace(part, new), chunk) for new, chunk in zip(parts, tensor.chunk(len(parts)))]
        return [(name, tensor)]

    def from_normswap(
        self, key: str, tensors: Callable[[str], torch.Tensor], head: str | None = None
    ) -> torch.Tensor | None:
        """The source tensor `key` rebuilt from NormSwap tensors (looked up by name), or None if it is dropped."""
        name = self.rename(key, head)
        if name is None:
            return None
        fused = next(((part, parts) for part, parts in self.fused if part in name), None)
        tensor = torch.cat([tensors(name.replace(fused[0], new)) for new in fused[1]]) if fused else tensors(name)
        if self.norm_weight_offset and name.endswith("norm.weight"):
            tensor = (tensor.float() - self.norm_weight_offset).to(tensor.dtype)
        if any(re.search(pattern, key) for pattern in self.transposed):
            tensor = tensor.t().contiguous()
        return tensor


_ENCODER_HEADS = tuple(head for head in HEAD_CLASSES if head != "causal-lm")  # an encoder family's heads
_BERT_LAYER = r"^encoder\.layer\.(\d+)\."
BERT = Family(
    name="bert",
    model_types=("bert", "roberta", "xlm-roberta"),
    heads=_ENCODER_HEADS,
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
    fields=BERT_FIELDS,
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
    fields=LLAMA_FIELDS,
    causal=True,
)

_GPT2_LAYER = r"^h\.(\d+)\."
GPT2 = Family(
    name="gpt2",
    model_types=("gpt2",),
    heads=("base", "causal-lm", "sequence-classification"),
    base_prefixes=("transformer.",),
    renames=(
        (r"^wte\.", "model.embeddings.word_embeddings."),
        (r"^wpe\.", "model.embeddings.position_embeddings."),
        (_GPT2_LAYER + r"ln_1\.", r"model.layers.\1.attention_norms.input_norm."),
        (_GPT2_LAYER + r"attn\.c_attn\.", r"model.layers.\1.self_attn.qkv_proj."),
        (_GPT2_LAYER + r"attn\.c_proj\.", r"model.layers.\1.self_attn.o_proj."),
        (_GPT2_LAYER + r"ln_2\.", r"model.layers.\1.mlp_norms.input_norm."),
        (_GPT2_LAYER + r"mlp\.c_fc\.", r"model.layers.\1.mlp.up_proj."),
        (_GPT2_LAYER + r"mlp\.c_proj\.", r"model.layers.\1.mlp.down_proj."),
        (r"^ln_f\.", "model.norm."),
        (r"^lm_head\.", "lm_head."),
        (r"^score\.", "classifier."),
    ),
    dropped=(r"h\.\d+\.attn\.(bias|masked_bias)",),
    fields=GPT2_FIELDS,
    causal=True,
    transposed=(r"(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.weight$",),
    fused=((".qkv_proj.", (".q_proj.", ".k_proj.", ".v_proj.")),),
)

# Gemma 2 and Gemma 3 (text): sandwich norms, their RMSNorm's (1 + w) folded into w.
GEMMA = Family(
    name="gemma",
    model_types=("gemma2", "gemma3_text"),
    heads=("base", "causal-lm"),
    base_prefixes=("model.",),
    renames=(
        (r"^embed_tokens\.", "model.embeddings.word_embeddings."),
        (_LLAMA_LAYER + r"input_layernorm\.", r"model.layers.\1.attention_norms.input_norm."),
        (_LLAMA_LAYER + r"post_attention_layernorm\.", r"model.layers.\1.attention_norms.output_norm."),
        (_LLAMA_LAYER + r"pre_feedforward_layernorm\.", r"model.layers.\1.mlp_norms.input_norm."),
        (_LLAMA_LAYER + r"post_feedforward_layernorm\.", r"model.layers.\1.mlp_norms.output_norm."),
        (_LLAMA_LAYER + r"(self_attn|mlp)\.", r"model.layers.\1.\2."),
        (r"^norm\.", "model.norm."),
        (r"^lm_head\.", "lm_head."),
    ),
    dropped=(r"rotary_emb\..*",),
    fields=GEMMA_FIELDS,  # Gemma 3 (text) is written back with GEMMA3_TEXT_FIELDS
    causal=True,
    norm_weight_offset=1.0,
)

# OLMo 2: output norms x + N(F(x)), q/k norms over the whole projection.
OLMO2 = Family(
    name="olmo2",
    model_types=("olmo2",),
    heads=("base", "causal-lm"),
    base_prefixes=("model.",),
    renames=(
        (r"^embed_tokens\.", "model.embeddings.word_embeddings."),
        (_LLAMA_LAYER + r"post_attention_layernorm\.", r"model.layers.\1.attention_norms.output_norm."),
        (_LLAMA_LAYER + r"post_feedforward_layernorm\.", r"model.layers.\1.mlp_norms.output_norm."),
        (_LLAMA_LAYER + r"(self_attn|mlp)\.", r"model.layers.\1.\2."),
        (r"^norm\.", "model.norm."),
        (r"^lm_head\.", "lm_head."),
    ),
    dropped=(r"rotary_emb\..*",),
    fields=OLMO2_FIELDS,
    causal=True,
)

_DISTILBERT_LAYER = r"^transformer\.layer\.(\d+)\."
DISTILBERT = Family(
    name="distilbert",
    model_types=("distilbert",),
    heads=_ENCODER_HEADS,
    base_prefixes=("distilbert.",),
    renames=(
        (r"^embeddings\.LayerNorm\.", "model.embeddings.norm."),
        (r"^embeddings\.", "model.embeddings."),
        (_DISTILBERT_LAYER + r"attention\.q_lin\.", r"model.layers.\1.self_attn.q_proj."),
        (_DISTILBERT_LAYER + r"attention\.k_lin\.", r"model.layers.\1.self_attn.k_proj."),
        (_DISTILBERT_LAYER + r"attention\.v_lin\.", r"model.layers.\1.self_attn.v_proj."),
        (_DISTILBERT_LAYER + r"attention\.out_lin\.", r"model.layers.\1.self_attn.o_proj."),
        (_DISTILBERT_LAYER + r"sa_layer_norm\.", r"model.layers.\1.attention_norms.residual_norm."),
        (_DISTILBERT_LAYER + r"ffn\.lin1\.", r"model.layers.\1.mlp.up_proj."),
        (_DISTILBERT_LAYER + r"ffn\.lin2\.", r"model.layers.\1.mlp.down_proj."),
        (_DISTILBERT_LAYER + r"output_layer_norm\.", r"model.layers.\1.mlp_norms.residual_norm."),
        (r"^vocab_transform\.", "lm_head.dense."),
        (r"^vocab_layer_norm\.", "lm_head.norm."),
        (r"^vocab_projector\.", "lm_head.decoder."),
        (r"^pre_classifier\.", "pooler.dense."),
        (r"^classifier\.", "classifier."),
        (r"^qa_outputs\.", "qa_outputs."),
    ),
    dropped=(r"embeddings\.position_ids",),
    fields=DISTILBERT_FIELDS,
)

ELECTRA = Family(
    name="electra",
    model_types=("electra",),
    heads=_ENCODER_HEADS,
    base_prefixes=("electra.",),
    renames=(
        (r"^embeddings_project\.", "model.embeddings.projection."),
        *(rule for rule in BERT.renames if not rule[0].startswith((r"^pooler", r"^cls", r"^lm_head"))),
        (r"^generator_predictions\.dense\.", "lm_head.dense."),
        (r"^generator_predictions\.LayerNorm\.", "lm_head.norm."),
        (r"^generator_lm_head\.", "lm_head.decoder."),
    ),
    dropped=(r"embeddings\.(position|token_type)_ids", r"discriminator_predictions\..*"),
    fields=ELECTRA_FIELDS,
    architecture_heads=(("ElectraForPreTraining", "base"),),  # the discriminator: its replaced-token head is dropped
)

# ModernBERT: fused Wqkv and Wi (input, gate: act(input) * gate) split; its `head` serves every task.
MODERNBERT = Family(
    name="modernbert",
    model_types=("modernbert",),
    heads=_ENCODER_HEADS,
    base_prefixes=("model.",),
    renames=(
        (r"^embeddings\.tok_embeddings\.", "model.embeddings.word_embeddings."),
        (r"^embeddings\.norm\.", "model.embeddings.norm."),
        (_LLAMA_LAYER + r"attn_norm\.", r"model.layers.\1.attention_norms.input_norm."),
        (_LLAMA_LAYER + r"attn\.Wqkv\.", r"model.layers.\1.self_attn.qkv_proj."),
        (_LLAMA_LAYER + r"attn\.Wo\.", r"model.layers.\1.self_attn.o_proj."),
        (_LLAMA_LAYER + r"mlp_norm\.", r"model.layers.\1.mlp_norms.input_norm."),
        (_LLAMA_LAYER + r"mlp\.Wi\.", r"model.layers.\1.mlp.gate_up_proj."),
        (_LLAMA_LAYER + r"mlp\.Wo\.", r"model.layers.\1.mlp.down_proj."),
        (r"^final_norm\.", "model.norm."),
        (r"^head\.", "head."),
        (r"^decoder\.", "lm_head.decoder."),
        (r"^classifier\.", "classifier."),
    ),
    dropped=(),
    fields=MODERNBERT_FIELDS,
    fused=((".qkv_proj.", (".q_proj.", ".k_proj.", ".v_proj.")), (".gate_up_proj.", (".gate_proj.", ".up_proj."))),
    head_renames=(
        ("masked-lm", r"^head\.", "lm_head."),
        ("sequence-classification", r"^head\.", "pooler."),
        ("question-answering", r"^classifier\.", "qa_outputs."),
    ),
)

NORMSWAP = Family(
    name="normswap",
    model_types=("normswap",),
    heads=tuple(HEAD_CLASSES),
    base_prefixes=(),
    renames=((r"^(model|pooler|head|classifier|qa_outputs|lm_head)\.", r"\1."), (r"^", "model.")),
    dropped=(),
    fields=None,
)

FAMILIES = (BERT, LLAMA, GPT2, GEMMA, OLMO2, DISTILBERT, ELECTRA, MODERNBERT, NORMSWAP)
SUPPORTED_MODEL_TYPES = tuple(model_type for family in FAMILIES for model_type in family.model_types)


def family_of(config: PreTrainedConfig) -> Family:
    """The family of a source configuration, or a ValueError listing what is supported."""
    for family in FAMILIES:
        if config.model_type in family.model_types:
            return family
    supported = ", ".join(SUPPORTED_MODEL_TYPES)
    raise ValueError(f"model_type {config.model_type!r} is not supported; supported model types: {supported}.")


def normswap_config(source: PreTrainedConfig, **overrides) -> NormSwapConfig:
    """The NormSwap configuration that computes what `source` computes (causal families: in causal mode)."""
    family = family_of(source)
    if family is NORMSWAP:
        return NormSwapConfig.from_dict({**source.to_dict(), **overrides})
    return NormSwapConfig(**{**family.fields.normswap_fields(source), **overrides})
