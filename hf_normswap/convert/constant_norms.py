"""A norm-free model (`none` placement) as a pre-LN model of the same function, for native classes that always have
norms: each norm gets epsilon E = 2^40, against which its input's mean square vanishes, and a gain of sqrt(E) = 2^20
(times the fixed final scale before the head), so that g * x / sqrt(ms(x) + E) = x. Both are powers of two, so the
scaling is exact; in float32 a mean square below 2^15 vanishes against E entirely, and above it the relative error is
ms / (2E), 1e-5 at a token RMS of about 4,700. Query/key norms, which stay norms, take E too: the queries and keys are
scaled by the power of two s nearest sqrt(E / eps), so that they normalise with an epsilon of E / s^2, within a
factor of 2 of their own eps (`query_key_scale`)."""

import math

import torch
from torch import nn

from ..model.configuration_normswap import NormSwapConfig
from .branch_calibration import removes_norms
from .options import ConversionError


CONSTANT_NORM_EPS = 2.0**40
CONSTANT_NORM_GAIN = 2.0**20  # sqrt(CONSTANT_NORM_EPS)


def constant_norm_config(config: NormSwapConfig) -> NormSwapConfig:
    """The pre-LN configuration whose norms divide by a constant, computing what the norm-free `config` computes."""
    if config.norm_type == "dyt":
        raise ConversionError("norm_type='dyt': a tanh cannot divide by a constant; export needs layernorm or rmsnorm")
    if config.embedding_norm:
        raise ConversionError(
            "embedding_norm=True: the native classes have one norm epsilon, and the embedding norm would take the "
            f"norm-free export's {CONSTANT_NORM_EPS:.0f}"
        )
    if config.first_position_scales:
        raise ConversionError(
            "first_position_scales: the native classes have no scale for a sequence's first position; a norm-free "
            "model exports once healing has removed them"
        )
    fields = config.to_dict()
    fields.update(norm_placement="pre", final_norm=True, final_scale=False, norm_eps=CONSTANT_NORM_EPS)
    fields.pop("removed_norm_rms", None)
    return NormSwapConfig.from_dict(fields)


def query_key_scale(eps: float) -> float:
    """The power of two by which queries and keys are scaled, so that their norms' epsilon of CONSTANT_NORM_EPS acts
    as one of CONSTANT_NORM_EPS / scale^2, the nearest such to `eps`."""
    return 2.0 ** round(math.log2(CONSTANT_NORM_EPS / eps) / 2)


@torch.no_grad()
def with_constant_norms(model: nn.Module) -> nn.Module:
    """The norm-free `model` (float32 or bfloat16) as a model of `constant_norm_config`, weights scaled to match."""
    if not removes_norms(model.config):
        raise ConversionError(f"norm_placement={model.config.norm_placement!r}: not a norm-free model")
    dtype = next(model.parameters()).dtype
    if dtype == torch.float16:
        raise ConversionError(
            f"dtype float16: a norm-free export's norm gains are {CONSTANT_NORM_GAIN:.0f}, beyond float16's range; "
            "use float32 or bfloat16"
        )
    stand_in = type(model)(constant_norm_config(model.config)).to(dtype)
    ours, state = model.state_dict(), stand_in.state_dict()
    queries_and_keys = ("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias") if model.config.qk_norm else ()
    scale = query_key_scale(model.config.norm_eps)
    for name, tensor in state.items():
        if name in ours:
            tensor.copy_(ours[name])
        if name.endswith(queries_and_keys):
            tensor.mul_(scale)
        elif name.endswith("input_norm.bias"):
            tensor.zero_()
        elif name.endswith(("input_norm.weight", "model.norm.weight")) or name == "norm.weight":
            tensor.copy_(tensor * CONSTANT_NORM_GAIN if name in ours else torch.full_like(tensor, CONSTANT_NORM_GAIN))
    stand_in.load_state_dict(state)
    return stand_in.eval()
