"""Position schemes of NormSwap: sinusoidal embeddings, ALiBi biases and rotary embeddings."""

import math

import torch
from torch import nn
from transformers import initialization as init
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update

from .configuration_normswap import NormSwapConfig, rope_parameters_by_layer_type


def sinusoidal_position_embeddings(position_ids: torch.Tensor, dim: int) -> torch.Tensor:
    """Fixed sin/cos embeddings (Vaswani et al. 2017), sines in the first half of the features."""
    inv_freq = 1.0 / (10_000 ** (torch.arange(0, dim, 2, dtype=torch.float, device=position_ids.device) / dim))
    angles = position_ids[..., None].float() * inv_freq
    return torch.cat((angles.sin(), angles.cos()), dim=-1)[..., :dim]


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """ALiBi head slopes (Press et al. 2022): a geometric sequence from 2^(-8/n), interleaved when n is no power
    of 2."""
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


def rotary_by_layer_type(rotary: NormSwapRotaryEmbedding | None, hidden_states, position_ids, layer_types) -> dict:
    """The rotary cos/sin of each of `layer_types` (None without rope)."""
    layer_types = set(layer_types)
    if rotary is None:
        return dict.fromkeys(layer_types)
    if rotary.by_layer_type:
        return {
            layer_type: rotary(hidden_states, position_ids=position_ids, layer_type=layer_type)
            for layer_type in layer_types
        }
    return dict.fromkeys(layer_types, rotary(hidden_states, position_ids=position_ids))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    """Rotates queries and keys (batch, heads, seq, head_dim) by cos/sin (batch, seq, head_dim)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
