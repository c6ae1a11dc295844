"""The norms of NormSwap: LayerNorm, RMSNorm or Dynamic Tanh, and the norms around a residual sublayer."""

import torch
from torch import nn

from .configuration_normswap import NORM_PLACEMENTS, NormSwapConfig


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


def scale_first_positions(hidden_states: torch.Tensor, first_positions: torch.Tensor, scale: float) -> torch.Tensor:
    """`hidden_states` with each sequence's first position (`first_positions`, True there) times `scale`."""
    factor = torch.where(first_positions[..., None], scale, 1.0)
    return hidden_states * factor.to(hidden_states.dtype)


def input_scale(placement: str, depth: int) -> float:
    """What the input norm's output is multiplied by in a layer of `placement` at depth 1, 2, ...: 1/sqrt(depth) for
    LayerNorm Scaling (`lns`), else 1."""
    return depth**-0.5 if placement == "lns" else 1.0


class NormSwapFixedScale(nn.Module):
    """A removed norm's fixed stand-in: weight * x (+ bias), x centred first where the model's norms are LayerNorms."""

    def __init__(self, config: NormSwapConfig, size: int):
        super().__init__()
        self.centred = config.norm_type == "layernorm"
        self.weight = nn.Parameter(torch.ones(size))
        self.bias = nn.Parameter(torch.zeros(size)) if self.centred and config.norm_bias else None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.centred:
            hidden_states = hidden_states - hidden_states.mean(-1, keepdim=True)
        hidden_states = self.weight * hidden_states
        return hidden_states if self.bias is None else hidden_states + self.bias


class ResidualNorms(nn.Module):
    """The norms around one residual sublayer F, in the slots its placement fills:

        x -> residual_norm(omega * x + dropout(output_norm(F(input_norm(x) * input_scale))))

    An empty slot is the identity. omega is 1, DeepNorm's alpha (`residual_scale`) or Admin's learned per-feature
    `residual_weight`; `input_scale` is 1, or 1/sqrt(depth) for LayerNorm Scaling.
    """

    def __init__(self, config: NormSwapConfig, placement: str, depth: int, point: int, input_norm: bool = True):
        super().__init__()
        self.config, self.point = config, point  # norm-free: config.first_position_scales[point] scales position 0
        slots = NORM_PLACEMENTS[placement] - (set() if input_norm else {"input_norm"})
        self.input_norm = build_norm(config, size=config.hidden_size) if "input_norm" in slots else nn.Identity()
        self.output_norm = build_norm(config, size=config.hidden_size) if "output_norm" in slots else nn.Identity()
        self.residual_norm = build_norm(config, size=config.hidden_size) if "residual_norm" in slots else nn.Identity()
        self.input_scale = input_scale(placement, depth)
        self.residual_scale = config.deepnorm_alpha if placement == "deepnorm" else 1.0
        self.residual_weight = nn.Parameter(torch.ones(config.hidden_size)) if placement == "admin" else None
        self.dropout = nn.Dropout(config.hidden_dropout)

    def normalize_input(self, hidden_states: torch.Tensor, first_positions: torch.Tensor | None = None):
        if first_positions is not None and self.config.first_position_scales:
            scale = self.config.first_position_scales[self.point]
            hidden_states = scale_first_positions(hidden_states, first_positions, scale)
        hidden_states = self.input_norm(hidden_states)
        return hidden_states if self.input_scale == 1.0 else hidden_states * self.input_scale

    def add_residual(self, residual: torch.Tensor, sublayer_output: torch.Tensor) -> torch.Tensor:
        branch = self.dropout(self.output_norm(sublayer_output))
        if self.residual_weight is not None:
            residual = residual * self.residual_weight
        return self.residual_norm(torch.add(branch, residual, alpha=self.residual_scale))
