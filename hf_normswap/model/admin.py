"""Admin's profiled initialisation (Liu et al. 2020, "Understanding the Difficulty of Training Transformers").

Sublayer i of an Admin model computes x_i = N(w_i * x_{i-1} + f_i(x_{i-1})). From scratch, w_i starts at
sqrt(Var[x_0] + sum over j < i of Var[f_j(x_{j-1})]), so that each sublayer's branch weighs as little against the
stream as the sublayers before it let it. The authors' profiling reaches it in one forward pass, sublayer after
sublayer: w_1 = 1, and w_{i+1} = sqrt(Var[w_i * x_{i-1}] + Var[f_i(x_{i-1})]), each variance over every feature of
every real token of the batch.
"""

import torch
from torch import nn

from .evaluation_mode import evaluation_mode
from .norms_normswap import ResidualNorms


@torch.no_grad()
def profile_admin(model: nn.Module, batch: dict[str, torch.Tensor]) -> list[float]:
    """Sets the residual weight of every Admin sublayer of `model` (a NormSwap model or head model) from one forward
    pass on `batch` (the model's own inputs: `input_ids`, `attention_mask`, or a padding-free batch), without dropout,
    and returns the values set, in forward order. Sublayers of other placements are left as they are."""
    admin = [module for module in model.modules() if isinstance(module, ResidualNorms)]
    admin = [norms for norms in admin if norms.residual_weight is not None]
    mask = batch.get("attention_mask")
    mask = mask.bool() if mask is not None and mask.dim() == 2 else None
    if mask is None and "seq_idx" in batch:  # a padding-free batch: the end of a row is padding
        mask = batch["seq_idx"] >= 0
    stream, ratio, weights = {}, [1.0], []

    def variance(tensor: torch.Tensor) -> float:
        real = tensor[mask] if mask is not None and tensor.shape[:2] == mask.shape else tensor
        return real.float().var(unbiased=False).item()

    def read_stream(module, args):
        stream["x"] = args[0]

    def weigh_branch(norms):
        def hook(module, args, branch):
            norms.residual_weight.fill_(ratio[0])
            weights.append(ratio[0])
            ratio[0] = (variance(stream["x"] * norms.residual_weight) + variance(branch)) ** 0.5

        return hook

    handles = []
    for norms in admin:
        handles.append(norms.input_norm.register_forward_pre_hook(read_stream))
        handles.append(norms.dropout.register_forward_hook(weigh_branch(norms)))
    try:
        with evaluation_mode(model):
            model(**batch)
    finally:
        for handle in handles:
            handle.remove()
    return weights
