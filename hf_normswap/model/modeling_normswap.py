"""NormSwap: a Transformer encoder whose norm placement, norm type and position scheme come from its config."""

import math
from collections.abc import Callable

import torch
from torch import nn
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.masking_utils import (
    create_bidirectional_mask,
    create_bidirectional_sliding_window_mask,
    create_causal_mask,
    create_sliding_window_causal_mask,
    find_packed_sequence_indices,
    packed_sequence_mask_function,
)
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import (
    BaseModelOutputWithPast,
    CausalLMOutputWithPast,
    MaskedLMOutput,
    QuestionAnsweringModelOutput,
    SequenceClassifierOutput,
    TokenClassifierOutput,
)
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from .configuration_normswap import NORM_PLACEMENTS, NormSwapConfig, rope_parameters_by_layer_type


AUTO_MAP = {
    "AutoConfig": "configuration_normswap.NormSwapConfig",
    "AutoModel": "modeling_normswap.NormSwapModel",
    "AutoModelForMaskedLM": "modeling_normswap.NormSwapForMaskedLM",
    "AutoModelForSequenceClassification": "modeling_normswap.NormSwapForSequenceClassification",
    "AutoModelForTokenClassification": "modeling_normswap.NormSwapForTokenClassification",
    "AutoModelForQuestionAnswering": "modeling_normswap.NormSwapForQuestionAnswering",
    "AutoModelForCausalLM": "modeling_normswap.NormSwapForCausalLM",
}


class NormSwapRMSNorm(nn.Module):
    """RMSNorm computed in float32, as LLaMA's."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class NormSwapDyT(nn.Module):
    """Dynamic Tanh (Zhu et al. 2025): weight * tanh(alpha * x) + bias, with a learned scalar alpha."""

    def __init__(self, hidden_size: int, alpha_init: float, bias: bool):
        super().__init__()
        self.alpha = nn.Parameter(torch.full((1,), alpha_init))
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.bias = nn.Parameter(torch.zeros(hidden_size)) if bias else None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = self.weight * torch.tanh(self.alpha * hidden_states)
        return hidden_states if self.bias is None else hidden_states + self.bias


def build_norm(config: NormSwapConfig, size: int) -> nn.Module:
    """A norm of `config.norm_type` over the last `size` features."""
    if config.norm_type == "rmsnorm":
        return NormSwapRMSNorm(size, eps=config.norm_eps)
    if config.norm_type == "dyt":
        return NormSwapDyT(size, alpha_init=config.dyt_alpha_init, bias=config.norm_bias)
    return nn.LayerNorm(size, eps=config.norm_eps, bias=config.norm_bias)


class ResidualNorms(nn.Module):
    """The norms around one residual sublayer F, in the slots its placement fills:

        x -> residual_norm(alpha * x + dropout(output_norm(F(input_norm(x)))))

    An empty slot is the identity; alpha is 1 except for DeepNorm.
    """

    def __init__(self, config: NormSwapConfig, placement: str, input_norm: bool = True):
        super().__init__()
        slots = NORM_PLACEMENTS[placement] - (set() if input_norm else {"input_norm"})
        self.input_norm = build_norm(config, config.hidden_size) if "input_norm" in slots else nn.Identity()
        self.output_norm = build_norm(config, config.hidden_size) if "output_norm" in slots else nn.Identity()
        self.residual_norm = build_norm(config, config.hidden_size) if "residual_norm" in slots else nn.Identity()
        self.residual_scale = config.deepnorm_alpha if placement == "deepnorm" else 1.0
        self.dropout = nn.Dropout(config.hidden_dropout)

    def normalize_input(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.input_norm(hidden_states)

    def add_residual(self, residual: torch.Tensor, sublayer_output: torch.Tensor) -> torch.Tensor:
        branch = self.dropout(self.output_norm(sublayer_output))
        return self.residual_norm(torch.add(branch, residual, alpha=self.residual_scale))


def sinusoidal_position_embeddings(position_ids: torch.Tensor, dim: int) -> torch.Tensor:
    """Fixed sin/cos embeddings (Vaswani et al. 2017), sines in the first half of the features."""
    inv_freq = 1.0 / (10_000 ** (torch.arange(0, dim, 2, dtype=torch.float, device=position_ids.device) / dim))
    angles = position_ids[..., None].float() * inv_freq
    return torch.cat((angles.sin(), angles.cos()), dim=-1)[..., :dim]


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """ALiBi head slopes (Press et al. 2022): a geometric sequence from 2^(-8/n), interleaved when n is no power of 2."""
    closest_power = 2 ** math.floor(math.log2(num_heads))
    slopes = [2 ** (-8 * (i + 1) / closest_power) for i in range(closest_power)]
    extra = [2 ** (-4 * (2 * i + 1) / closest_power) for i in range(num_heads - closest_power)]
    return torch.tensor(slopes + extra)


def alibi_attention_mask(
    attention_mask: torch.Tensor | None,
    num_heads: int,
    query_length: int,
    key_length: int,
    is_causal: bool,
    dtype,
    device,
) -> torch.Tensor:
    """The additive mask with ALiBi's bias -slope * |i - j| folded in, shaped (batch or 1, heads, query, key).

    The queries are the last `query_length` of the `key_length` keys (a cache holds the keys before them).
    """
    key_positions = torch.arange(key_length, device=device)
    query_positions = key_positions[key_length - query_length :]
    distance = (query_positions[:, None] - key_positions[None, :]).abs()
    bias = (-alibi_slopes(num_heads).to(device)[None, :, None, None] * distance).to(dtype)
    if attention_mask is None and is_causal:
        attention_mask = key_positions[None, :] <= query_positions[:, None]
    if attention_mask is None:
        return bias
    if attention_mask.dtype == torch.bool:
        return bias.masked_fill(~attention_mask, torch.finfo(dtype).min)
    return (bias + attention_mask).clamp(min=torch.finfo(dtype).min)


def packed_sequence_ids(
    attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None, seq_idx: torch.Tensor | None
) -> torch.Tensor | None:
    """For a packed (padding-free) batch, the sequence of every token, numbered across the batch; None otherwise.

    The boundaries come from the collator: its `seq_idx` (`DataCollatorWithPacking`, or `DataCollatorWithFlattening`
    with `return_seq_idx=True`; -1 marks padding at the end of a row) or else, for a batch without attention mask,
    where its `position_ids` restart (`DataCollatorWithFlattening`'s default).
    """
    if seq_idx is not None:
        return seq_idx
    if attention_mask is not None or position_ids is None:
        return None
    in_row = find_packed_sequence_indices(position_ids)
    if in_row is None:
        return None
    per_row = in_row[:, -1] + 1
    return in_row + (per_row.cumsum(0) - per_row)[:, None]


def positions_in_sequence(sequence_ids: torch.Tensor) -> torch.Tensor:
    """The index of every token within its sequence of a packed batch (0 at each sequence start)."""
    index = torch.arange(sequence_ids.shape[-1], device=sequence_ids.device).expand_as(sequence_ids)
    starts = torch.ones_like(sequence_ids, dtype=torch.bool)
    starts[:, 1:] = sequence_ids[:, 1:] != sequence_ids[:, :-1]
    return index - torch.where(starts, index, 0).cummax(-1).values


def unpack_sequences(packed: torch.Tensor, sequence_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, row length, ...) packed values -> (sequences, longest, ...) in sequence order, zero past each end,
    and the (sequences, longest) mask of real tokens: the padded layout of the same sequences."""
    real = sequence_ids >= 0
    sequence, position = sequence_ids[real], positions_in_sequence(sequence_ids)[real]
    shape = (int(sequence.max()) + 1, int(position.max()) + 1)
    unpacked = packed.new_zeros(*shape, *packed.shape[2:])
    unpacked[sequence, position] = packed[real]
    mask = torch.zeros(shape, dtype=torch.bool, device=packed.device)
    mask[sequence, position] = True
    return unpacked, mask


def mask_padding(logits: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """(batch, length, ...) logits with the dtype's minimum where a 2D `attention_mask` marks padding."""
    if attention_mask is None or attention_mask.dim() != 2:
        return logits
    return logits.masked_fill(attention_mask[..., None] == 0, torch.finfo(logits.dtype).min)


def next_token_labels(labels: torch.Tensor, sequence_ids: torch.Tensor) -> torch.Tensor:
    """The causal-LM targets of a packed batch: each token's next label within its own sequence, -100 at its end."""
    same_sequence = sequence_ids[:, 1:] == sequence_ids[:, :-1]
    return nn.functional.pad(labels[:, 1:].masked_fill(~same_sequence, -100), (0, 1), value=-100)


def flash_varlen_kwargs(sequence_ids: torch.Tensor) -> dict:
    """The cumulative sequence lengths flash-attention's varlen kernels take, over the flattened packed batch."""
    flat = sequence_ids.reshape(-1)
    starts = torch.nonzero(flat[1:] != flat[:-1]).flatten() + 1
    ends = torch.tensor([0, flat.numel()], device=flat.device)
    cu_seq_lens = torch.cat([ends[:1], starts, ends[1:]]).to(torch.int32)
    max_length = int(cu_seq_lens.diff().max())
    return {
        "cu_seq_lens_q": cu_seq_lens,
        "cu_seq_lens_k": cu_seq_lens,
        "max_length_q": max_length,
        "max_length_k": max_length,
    }


class NormSwapEmbeddings(nn.Module):
    """Token embeddings, plus token-type and absolute or sinusoidal position embeddings where configured, projected
    to `hidden_size` after the norm when `embedding_size` differs (ELECTRA)."""

    def __init__(self, config: NormSwapConfig):
        super().__init__()
        self.position_embedding_type = config.position_embedding_type
        self.position_offset = config.position_offset
        size = config.embedding_size
        self.word_embeddings = nn.Embedding(config.vocab_size, size, padding_idx=config.pad_token_id)
        self.embedding_multiplier = config.embedding_multiplier
        if config.type_vocab_size > 0:
            self.token_type_embeddings = nn.Embedding(config.type_vocab_size, size)
        if config.position_embedding_type == "absolute":
            self.position_embeddings = nn.Embedding(config.max_position_embeddings, size)
        self.norm = build_norm(config, size) if config.embedding_norm else nn.Identity()
        self.dropout = nn.Dropout(config.hidden_dropout)
        if size != config.hidden_size:
            self.projection = nn.Linear(size, config.hidden_size)

    def forward(
        self,
        input_ids: torch.LongTensor | None,
        inputs_embeds: torch.Tensor | None,
        token_type_ids: torch.LongTensor | None,
        position_ids: torch.LongTensor,
    ) -> torch.Tensor:
        embeddings = inputs_embeds
        if inputs_embeds is None:
            embeddings = self.word_embeddings(input_ids)
            if self.embedding_multiplier != 1.0:
                embeddings = embeddings * torch.tensor(self.embedding_multiplier, dtype=embeddings.dtype)
        if hasattr(self, "token_type_embeddings"):
            if token_type_ids is None:
                token_type_ids = torch.zeros(embeddings.shape[:-1], dtype=torch.long, device=embeddings.device)
            embeddings = embeddings + self.token_type_embeddings(token_type_ids)
        if self.position_embedding_type == "absolute":
            embeddings = embeddings + self.position_embeddings(position_ids + self.position_offset)
        elif self.position_embedding_type == "sinusoidal":
            table = sinusoidal_position_embeddings(position_ids + self.position_offset, embeddings.shape[-1])
            embeddings = embeddings + table.to(embeddings.dtype)
        embeddings = self.dropout(self.norm(embeddings))
        return self.projection(embeddings) if hasattr(self, "projection") else embeddings


class NormSwapRotaryEmbedding(nn.Module):
    """Rotary position embeddings from Transformers' `rope_parameters` (every rope type it supports): one set of
    frequencies for all layers, or one per layer type (buffers prefixed with the type, as Gemma 3's)."""

    def __init__(self, config: NormSwapConfig):
        super().__init__()
        self.config = config
        self.max_seq_len_cached = config.max_position_embeddings
        self.original_max_seq_len = config.max_position_embeddings
        self.by_layer_type = rope_parameters_by_layer_type(config.rope_parameters)
        self.rope_type = {}
        for layer_type in sorted(config.rope_parameters) if self.by_layer_type else [None]:
            parameters = config.rope_parameters[layer_type] if layer_type else config.rope_parameters
            self.rope_type[layer_type] = parameters["rope_type"]
            inv_freq, attention_scaling = self.frequencies(layer_type)
            setattr(self, f"{self.prefix(layer_type)}inv_freq", nn.Buffer(inv_freq, persistent=False))
            setattr(self, f"{self.prefix(layer_type)}original_inv_freq", nn.Buffer(inv_freq.clone(), persistent=False))
            setattr(self, f"{self.prefix(layer_type)}attention_scaling", attention_scaling)
        if not self.by_layer_type:
            self.rope_type = self.rope_type[None]

    @staticmethod
    def prefix(layer_type: str | None) -> str:
        return f"{layer_type}_" if layer_type else ""

    def frequencies(self, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
        """The inverse frequencies and attention scaling of one layer type (None: the only set)."""
        rope_type = self.rope_type[layer_type] if isinstance(self.rope_type, dict) else self.rope_type
        rope_init_fn = ROPE_INIT_FUNCTIONS.get(rope_type, self.compute_default_rope_parameters)
        return rope_init_fn(self.config, None, **({"layer_type": layer_type} if layer_type else {}))

    def reset_frequencies(self) -> None:
        """Recomputes the (non-persistent) frequency buffers, as `_init_weights` must after loading on meta."""
        for layer_type in sorted(self.config.rope_parameters) if self.by_layer_type else [None]:
            inv_freq = self.frequencies(layer_type)[0]
            init.copy_(getattr(self, f"{self.prefix(layer_type)}inv_freq"), inv_freq)
            init.copy_(getattr(self, f"{self.prefix(layer_type)}original_inv_freq"), inv_freq)

    @staticmethod
    def compute_default_rope_parameters(
        config: NormSwapConfig, device=None, layer_type: str | None = None, **kwargs
    ) -> tuple[torch.Tensor, float]:
        parameters = config.rope_parameters[layer_type] if layer_type else config.rope_parameters
        base, dim = parameters["rope_theta"], config.head_dim
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0

    @torch.no_grad()
    @dynamic_rope_update
    def forward(
        self, x: torch.Tensor, position_ids: torch.LongTensor, layer_type: str | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        prefix = self.prefix(layer_type)
        inv_freq, attention_scaling = getattr(self, f"{prefix}inv_freq"), getattr(self, f"{prefix}attention_scaling")
        freqs = position_ids[..., None].float() * inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * attention_scaling).to(x.dtype), (emb.sin() * attention_scaling).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    """Rotates queries and keys (batch, heads, seq, head_dim) by cos/sin (batch, seq, head_dim)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(batch, kv_heads, seq, dim) -> (batch, kv_heads * n_rep, seq, dim)."""
    if n_rep == 1:
        return hidden_states
    return hidden_states.repeat_interleave(n_rep, dim=1)


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    softcap: float | None = None,
    **kwargs: Unpack[TransformersKwargs],
):
    key = repeat_kv(key, module.num_key_value_groups)
    value = repeat_kv(value, module.num_key_value_groups)
    attn_weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if softcap is not None:
        attn_weights = torch.tanh(attn_weights / softcap) * softcap
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask
    attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_weights = nn.functional.dropout(attn_weights, p=dropout, training=module.training)
    attn_output = torch.matmul(attn_weights, value).transpose(1, 2).contiguous()
    return attn_output, attn_weights


class NormSwapAttention(nn.Module):
    """Multi-head attention with GQA, optional q/k norms (per head or over the projection), rotary embeddings or ALiBi,
    a sliding window where the layer type says so, and a KV cache."""

    def __init__(self, config: NormSwapConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.attention_type = config.layer_types[layer_idx]
        # the window in flash attention's terms (the masks carry it for the other implementations)
        self.sliding_window = None
        if self.attention_type == "sliding_attention":
            self.sliding_window = config.sliding_window + (0 if config.is_causal else 1)
        self.alibi = config.position_embedding_type == "alibi"
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = (config.query_pre_attn_scalar or self.head_dim) ** -0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = config.is_causal
        q_size, kv_size = config.num_attention_heads * self.head_dim, config.num_key_value_heads * self.head_dim
        self.q_proj = nn.Linear(config.hidden_size, q_size, bias=config.attention_bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_size, bias=config.attention_bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=config.attention_output_bias)
        self.qk_norm_per_head = config.qk_norm_scope == "head"
        q_norm_size, k_norm_size = (self.head_dim, self.head_dim) if self.qk_norm_per_head else (q_size, kv_size)
        self.q_norm = build_norm(config, q_norm_size) if config.qk_norm else nn.Identity()
        self.k_norm = build_norm(config, k_norm_size) if config.qk_norm else nn.Identity()

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        past_key_values: Cache | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states, key_states = self.q_proj(hidden_states), self.k_proj(hidden_states)
        if self.qk_norm_per_head:
            query_states, key_states = query_states.view(hidden_shape), key_states.view(hidden_shape)
        query_states = self.q_norm(query_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_norm(key_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        if position_embeddings is not None:
            query_states, key_states = apply_rotary_pos_emb(query_states, key_states, *position_embeddings)
        if past_key_values is not None:
            key_states, value_states = past_key_values.update(key_states, value_states, self.layer_idx)
        if self.alibi:
            attention_mask = alibi_attention_mask(
                attention_mask,
                self.config.num_attention_heads,
                query_states.shape[-2],
                key_states.shape[-2],
                self.is_causal,
                query_states.dtype,
                query_states.device,
            )

        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        attn_output, attn_weights = attention_interface(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask,
            dropout=self.attention_dropout if self.training else 0.0,
            scaling=self.scaling,
            sliding_window=self.sliding_window,
            softcap=self.config.attn_logit_softcapping,
            **kwargs,
        )
        attn_output = self.o_proj(attn_output.reshape(*input_shape, -1).contiguous())
        return attn_output, attn_weights


class NormSwapMLP(nn.Module):
    """up -> activation -> down (BERT's feed-forward)."""

    def __init__(self, config: NormSwapConfig):
        super().__init__()
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.up_proj(hidden_states)))


class NormSwapGatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU with silu, GeGLU with gelu."""

    def __init__(self, config: NormSwapConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(hidden_states)) * self.up_proj(hidden_states))


MLP_CLASSES = {"standard": NormSwapMLP, "glu": NormSwapGatedMLP}


class NormSwapLayer(GradientCheckpointingLayer):
    """Attention then feed-forward, each wrapped in the norms of this layer's placement."""

    def __init__(self, config: NormSwapConfig, layer_idx: int):
        super().__init__()
        placement = config.layer_norm_placements[layer_idx]
        self.attention_type = config.layer_types[layer_idx]
        self.self_attn = NormSwapAttention(config, layer_idx)
        attention_input_norm = layer_idx > 0 or config.first_attention_input_norm
        self.attention_norms = ResidualNorms(config, placement, input_norm=attention_input_norm)
        self.mlp = MLP_CLASSES[config.mlp_type](config)
        self.mlp_norms = ResidualNorms(config, placement)
        if placement == "deepnorm":
            mlp_linears = [module for module in self.mlp.children() if isinstance(module, nn.Linear)]
            for linear in (self.self_attn.v_proj, self.self_attn.o_proj, *mlp_linears):
                linear.init_std_scale = config.deepnorm_beta

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        past_key_values: Cache | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> torch.Tensor:
        attn_input = self.attention_norms.normalize_input(hidden_states)
        attn_output, _ = self.self_attn(attn_input, attention_mask, position_embeddings, past_key_values, **kwargs)
        hidden_states = self.attention_norms.add_residual(hidden_states, attn_output)
        mlp_output = self.mlp(self.mlp_norms.normalize_input(hidden_states))
        return self.mlp_norms.add_residual(hidden_states, mlp_output)


class NormSwapPreTrainedModel(PreTrainedModel):
    config: NormSwapConfig
    config_class = NormSwapConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["NormSwapEmbeddings", "NormSwapLayer"]
    _skip_keys_device_placement = ["past_key_values"]
    _supports_flash_attn = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _can_record_outputs = {"hidden_states": NormSwapLayer, "attentions": NormSwapAttention}

    @property
    def _supports_sdpa(self) -> bool:
        """sdpa cannot soft-cap attention scores."""
        return self.config.attn_logit_softcapping is None

    @torch.no_grad()
    def _init_weights(self, module: nn.Module):
        super()._init_weights(module)
        if isinstance(module, nn.Linear) and hasattr(module, "init_std_scale"):
            init.normal_(module.weight, std=self.config.initializer_range * module.init_std_scale)
        elif isinstance(module, NormSwapRotaryEmbedding):
            module.reset_frequencies()
        elif isinstance(module, NormSwapDyT):
            init.constant_(module.alpha, self.config.dyt_alpha_init)
            init.ones_(module.weight)
            if module.bias is not None:
                init.zeros_(module.bias)

    def save_pretrained(self, save_directory, *args, **kwargs):
        """Saves as Transformers does, with an `auto_map` naming every Auto class for remote-code loading."""
        self.config.auto_map = dict(AUTO_MAP)
        super().save_pretrained(save_directory, *args, **kwargs)


class NormSwapModel(NormSwapPreTrainedModel):
    def __init__(self, config: NormSwapConfig):
        super().__init__(config)
        self.embeddings = NormSwapEmbeddings(config)
        self.layers = nn.ModuleList([NormSwapLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = build_norm(config, config.hidden_size) if config.final_norm else nn.Identity()
        self.rotary_emb = NormSwapRotaryEmbedding(config) if config.position_embedding_type == "rope" else None
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self):
        return self.embeddings.word_embeddings

    def set_input_embeddings(self, value):
        self.embeddings.word_embeddings = value

    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        use_cache: bool | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> BaseModelOutputWithPast:
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if past_key_values is not None and not self.config.is_causal:
            raise ValueError("past_key_values needs NormSwapConfig.is_causal=True, got False.")
        if use_cache and past_key_values is None and self.config.is_causal:
            past_key_values = DynamicCache(config=self.config)
        inputs = input_ids if inputs_embeds is None else inputs_embeds
        if position_ids is not None:
            position_ids = position_ids.expand(inputs.shape[0], -1)
        sequence_ids = packed_sequence_ids(attention_mask, position_ids, kwargs.get("seq_idx"))
        if position_ids is None:  # restarting at every sequence of a packed batch; after the cached tokens
            if sequence_ids is not None:
                position_ids = positions_in_sequence(sequence_ids)
            else:
                past_seen = past_key_values.get_seq_length() if past_key_values is not None else 0
                position_ids = torch.arange(past_seen, past_seen + inputs.shape[1], device=inputs.device).unsqueeze(0)
        if sequence_ids is not None and "flash" in self.config._attn_implementation and "cu_seq_lens_q" not in kwargs:
            kwargs.update(flash_varlen_kwargs(sequence_ids))

        hidden_states = self.embeddings(input_ids, inputs_embeds, token_type_ids, position_ids)
        masks = self._attention_masks(hidden_states, attention_mask, past_key_values, sequence_ids)
        position_embeddings = self._position_embeddings(hidden_states, position_ids)

        for layer in self.layers:
            hidden_states = layer(
                hidden_states,
                masks[layer.attention_type],
                position_embeddings[layer.attention_type],
                past_key_values,
                **kwargs,
            )
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden_states), past_key_values=past_key_values)

    def _attention_masks(self, inputs_embeds, attention_mask, past_key_values, sequence_ids) -> dict:
        """The attention-implementation-specific mask of each layer type, as Transformers' masking utilities build
        it: causal or bidirectional, full or sliding-window, sized to the cache, and block-diagonal over the sequences
        of a packed batch (a document mask for flex attention). A dict passes through as is."""
        if isinstance(attention_mask, dict):
            return attention_mask
        if self.config.position_embedding_type == "alibi" and self.config._attn_implementation not in (
            "eager",
            "sdpa",
        ):
            raise ValueError(
                "position_embedding_type='alibi' needs attn_implementation 'eager' or 'sdpa', "
                f"got {self.config._attn_implementation!r}."
            )
        mask_kwargs = {"config": self.config, "inputs_embeds": inputs_embeds, "attention_mask": attention_mask}
        if sequence_ids is not None:
            mask_kwargs["and_mask_function"] = packed_sequence_mask_function(sequence_ids)
        if self.config.is_causal:
            mask_kwargs["past_key_values"] = past_key_values
            builders = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
        else:
            builders = {
                "full_attention": create_bidirectional_mask,
                "sliding_attention": create_bidirectional_sliding_window_mask,
            }
        return {layer_type: builders[layer_type](**mask_kwargs) for layer_type in set(self.config.layer_types)}

    def _position_embeddings(self, hidden_states, position_ids) -> dict:
        """The rotary cos/sin of each layer type (None without rope)."""
        layer_types = set(self.config.layer_types)
        if self.rotary_emb is None:
            return dict.fromkeys(layer_types)
        if self.rotary_emb.by_layer_type:
            return {layer_type: self.rotary_emb(hidden_states, position_ids, layer_type) for layer_type in layer_types}
        return dict.fromkeys(layer_types, self.rotary_emb(hidden_states, position_ids))


class NormSwapMaskedLMHead(nn.Module):
    """BERT's masked-LM head: dense (to `embedding_size`), activation, norm, then a decoder tied to the word
    embeddings."""

    def __init__(self, config: NormSwapConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.embedding_size, bias=config.head_dense_bias)
        self.act_fn = ACT2FN[config.hidden_act]
        self.norm = build_norm(config, config.embedding_size)
        self.decoder = nn.Linear(config.embedding_size, config.vocab_size, bias=config.decoder_bias)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.norm(self.act_fn(self.dense(hidden_states))))


class NormSwapForMaskedLM(NormSwapPreTrainedModel):
    _tied_weights_keys = {"lm_head.decoder.weight": "model.embeddings.word_embeddings.weight"}

    def __init__(self, config: NormSwapConfig):
        super().__init__(config)
        self.model = NormSwapModel(config)
        self.lm_head = NormSwapMaskedLMHead(config)
        self.post_init()

    def get_output_embeddings(self):
        return self.lm_head.decoder

    def set_output_embeddings(self, new_embeddings):
        self.lm_head.decoder = new_embeddings

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> MaskedLMOutput:
        outputs = self.model(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, **kwargs)
        logits = self.lm_head(outputs.last_hidden_state)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, vocab_size=self.config.vocab_size, **kwargs)
        return MaskedLMOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )


class NormSwapClassifierHead(nn.Module):
    """Dense -> `classifier_activation` -> norm (when `classifier_norm`): BERT's pooler is dense + tanh, ModernBERT's
    head dense, gelu and norm; the identity without `classifier_activation`."""

    def __init__(self, config: NormSwapConfig):
        super().__init__()
        if config.classifier_activation is not None:
            self.dense = nn.Linear(config.hidden_size, config.hidden_size, bias=config.head_dense_bias)
            self.act_fn = ACT2FN[config.classifier_activation]
            self.norm = build_norm(config, config.hidden_size) if config.classifier_norm else nn.Identity()

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "dense"):
            return hidden_states
        return self.norm(self.act_fn(self.dense(hidden_states)))


class NormSwapPooler(NormSwapClassifierHead):
    """Pools a sequence to one vector (`cls`: first token, `mean`, `last`: last non-padding token), then applies the
    classifier head."""

    def __init__(self, config: NormSwapConfig):
        super().__init__(config)
        self.pooling = config.classifier_pooling

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        return super().forward(self.pool(hidden_states, attention_mask))

    def pool(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        if self.pooling == "cls":
            return hidden_states[:, 0]
        if attention_mask is None:
            attention_mask = torch.ones(hidden_states.shape[:2], device=hidden_states.device)
        mask = attention_mask.to(hidden_states.dtype)
        if self.pooling == "mean":
            return (hidden_states * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        positions = torch.arange(mask.shape[1], device=mask.device)
        last = (positions * attention_mask.to(torch.long)).argmax(-1)
        return hidden_states[torch.arange(hidden_states.shape[0], device=last.device), last]


class NormSwapForSequenceClassification(NormSwapPreTrainedModel):
    def __init__(self, config: NormSwapConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.model = NormSwapModel(config)
        self.pooler = NormSwapPooler(config)
        dropout = config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels, bias=config.classifier_bias)
        self.post_init()

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> SequenceClassifierOutput:
        outputs = self.model(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, **kwargs)
        hidden_states = outputs.last_hidden_state
        sequence_ids = packed_sequence_ids(attention_mask, position_ids, kwargs.get("seq_idx"))
        if sequence_ids is not None:  # pool each sequence of a packed batch, in sequence order
            hidden_states, attention_mask = unpack_sequences(hidden_states, sequence_ids)
        pooled = self.pooler(hidden_states, attention_mask)
        logits = self.classifier(self.dropout(pooled))
        loss = None
        if labels is not None:
            loss = self.loss_function(labels=labels, pooled_logits=logits, config=self.config)
        return SequenceClassifierOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )


class NormSwapForTokenClassification(NormSwapPreTrainedModel):
    def __init__(self, config: NormSwapConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.model = NormSwapModel(config)
        self.head = NormSwapClassifierHead(config) if config.token_classifier_head else nn.Identity()
        dropout = config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels, bias=config.classifier_bias)
        self.post_init()

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> TokenClassifierOutput:
        outputs = self.model(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, **kwargs)
        logits = self.classifier(self.dropout(self.head(outputs.last_hidden_state)))
        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, self.config)
        return TokenClassifierOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )


class NormSwapForQuestionAnswering(NormSwapPreTrainedModel):
    def __init__(self, config: NormSwapConfig):
        super().__init__(config)
        self.model = NormSwapModel(config)
        self.head = NormSwapClassifierHead(config) if config.token_classifier_head else nn.Identity()
        self.qa_outputs = nn.Linear(config.hidden_size, 2)
        self.post_init()

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        start_positions: torch.LongTensor | None = None,
        end_positions: torch.LongTensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> QuestionAnsweringModelOutput:
        outputs = self.model(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, **kwargs)
        logits = self.qa_outputs(self.head(outputs.last_hidden_state))
        sequence_ids = packed_sequence_ids(attention_mask, position_ids, kwargs.get("seq_idx"))
        if sequence_ids is not None:  # one row of logits per sequence of a packed batch, nothing past its end
            logits, attention_mask = unpack_sequences(logits, sequence_ids)
            logits = mask_padding(logits, attention_mask)
        start_logits, end_logits = (x.squeeze(-1).contiguous() for x in logits.split(1, dim=-1))
        loss = None
        if start_positions is not None and end_positions is not None:  # padding is never an answer
            starts, ends = (x.squeeze(-1) for x in mask_padding(logits, attention_mask).split(1, dim=-1))
            loss = self.loss_function(starts, ends, start_positions, end_positions, **kwargs)
        return QuestionAnsweringModelOutput(
            loss=loss,
            start_logits=start_logits,
            end_logits=end_logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )


class NormSwapForCausalLM(NormSwapPreTrainedModel, GenerationMixin):
    """A causal LM head (no bias): scores text and generates with Transformers' caches."""

    _tied_weights_keys = {"lm_head.weight": "model.embeddings.word_embeddings.weight"}

    def __init__(self, config: NormSwapConfig):
        if not config.is_causal:
            raise ValueError("NormSwapForCausalLM needs NormSwapConfig.is_causal=True, got False.")
        super().__init__(config)
        self.model = NormSwapModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, new_embeddings):
        self.lm_head = new_embeddings

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        use_cache: bool | None = None,
        labels: torch.LongTensor | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Unpack[TransformersKwargs],
    ) -> CausalLMOutputWithPast:
        outputs = self.model(
            input_ids,
            attention_mask,
            token_type_ids,
            position_ids,
            inputs_embeds,
            past_key_values=past_key_values,
            use_cache=use_cache,
            **kwargs,
        )
        hidden_states = outputs.last_hidden_state
        kept = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden_states[:, kept, :])
        if self.config.final_logit_softcapping is not None:
            cap = self.config.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        loss = None
        if labels is not None:
            sequence_ids = packed_sequence_ids(attention_mask, position_ids, kwargs.get("seq_idx"))
            if sequence_ids is not None and kwargs.get("shift_labels") is None:
                kwargs["shift_labels"] = next_token_labels(labels, sequence_ids)
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            past_key_values=outputs.past_key_values,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )


for _model_class, _auto_class in (
    (NormSwapModel, "AutoModel"),
    (NormSwapForMaskedLM, "AutoModelForMaskedLM"),
    (NormSwapForSequenceClassification, "AutoModelForSequenceClassification"),
    (NormSwapForTokenClassification, "AutoModelForTokenClassification"),
    (NormSwapForQuestionAnswering, "AutoModelForQuestionAnswering"),
    (NormSwapForCausalLM, "AutoModelForCausalLM"),
):
    _model_class.register_for_auto_class(_auto_class)

__all__ = [
    "NormSwapPreTrainedModel",
    "NormSwapModel",
    "NormSwapForMaskedLM",
    "NormSwapForSequenceClassification",
    "NormSwapForTokenClassification",
    "NormSwapForQuestionAnswering",
    "NormSwapForCausalLM",
]
