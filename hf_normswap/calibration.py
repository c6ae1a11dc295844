"""Calibrated swaps: when a norm that wrote the residual stream becomes one that reads it (post -> pre or sandwich),
scale each sublayer's write so that the stream keeps the proportions the source's norms gave it.

Post-LN normalises the stream after every sublayer; pre-LN only normalises what a sublayer reads, so its stream keeps
everything at the scale it was written, and the embeddings or a single layer can drown the rest. Reading is
scale-invariant: if the stream at a point holds c times the sum the source normalised there, the norm that reads it
returns the source's normalised state, and the sublayer's write, scaled by c and carrying the source norm's bias,
keeps that true at the next point. c is fitted point after point on calibration text: the median over tokens of the
least-squares ratio between the stream and what its norm makes of it (less the norm's bias). A sandwich branch norm
(identity at conversion) takes the scale as its gain, times the median spread of the sublayer's output. What one
scale per point cannot carry (tokens whose spread differs from the median, per-feature gains) is left to `heal`.
"""

import torch
from torch import nn

from .configuration_normswap import NormSwapConfig
from .norm_mapping import NormSlot, norm_slots


def calibrated_sublayers(target: NormSwapConfig, norm_sources: dict[str, str | None], source_slots: list[NormSlot]) -> dict[str, str]:
    """The sublayers (e.g. "layers.2.mlp_norms") whose read norm took a norm that wrote the source's stream and whose
    write reaches the stream unnormalised, each with the module its scale goes into (its output projection, or its
    branch norm where it has one); none for a norm type that is not scale-invariant. Read off the configurations."""
    if target.norm_type == "dyt":
        return {}
    writes = {slot.name for slot in source_slots if slot.kind == "write"}
    names = [slot.name for slot in norm_slots(target)]  # in forward order
    slots = set(names)
    sublayers = {}
    for name in names:
        prefix = name.removesuffix(".input_norm")
        if prefix == name or norm_sources[name] not in writes or f"{prefix}.residual_norm" in slots:
            continue
        sublayer = prefix.removeprefix("model.")
        layer = sublayer.rsplit(".", 1)[0]
        if f"{prefix}.output_norm" not in slots:
            sublayers[sublayer] = f"{layer}.self_attn.o_proj" if sublayer.endswith("attention_norms") else f"{layer}.mlp.down_proj"
        elif norm_sources[f"{prefix}.output_norm"] is None:
            sublayers[sublayer] = f"{sublayer}.output_norm"
    return sublayers


def _centred(states: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """States less their mean over features where `norm` removes it (LayerNorm)."""
    return states - states.mean(-1, keepdim=True) if isinstance(norm, nn.LayerNorm) else states


def _median_ratio(stream: torch.Tensor, normalised: torch.Tensor) -> float:
    """The median over rows of the least-squares c in stream ~ c * normalised."""
    return ((stream * normalised).sum(-1) / normalised.pow(2).sum(-1).clamp_min(1e-12)).median().item()


def _bias(norm: nn.Module) -> torch.Tensor | None:
    return getattr(norm, "bias", None)


@torch.no_grad()
def calibrate_writes(model: nn.Module, sublayers: dict[str, str], batch: dict) -> dict[str, float]:
    """Scales the writes of `sublayers` (from `calibrated_sublayers`) in place, fitted on one padded `batch` in a single
    forward pass; returns each sublayer's scale."""
    real = batch["attention_mask"].bool()
    base = model.base_model
    scales, hooks, branch_norm_scales = {}, [], {}

    def scale_write(name: str):
        writer = base.get_submodule(sublayers[name])

        def hook(norm, args):
            stream, bias = args[0][real].float(), _bias(norm)
            normalised = norm.forward(stream) - (0 if bias is None else bias)
            scale = scales[name] = _median_ratio(_centred(stream, norm), _centred(normalised, norm))
            if not isinstance(writer, nn.Linear):  # a branch norm: set when it runs
                branch_norm_scales[writer] = (scale, bias)
                return
            writer.weight.mul_(scale)
            if writer.bias is not None:
                writer.bias.copy_(scale * (writer.bias if bias is None else writer.bias + bias))

        return hook

    def scale_branch_norm(norm, args):
        scale, source_bias = branch_norm_scales.pop(norm)
        spread = _centred(args[0][real].float(), norm).pow(2).mean(-1).sqrt().median().item()
        norm.weight.fill_(scale * spread)
        if _bias(norm) is not None:  # then the read norm, of the same configuration, has one too
            norm.bias.copy_(scale * source_bias)

    for name, written in sublayers.items():
        hooks.append(base.get_submodule(name).input_norm.register_forward_pre_hook(scale_write(name)))
        if written.endswith("output_norm"):
            hooks.append(base.get_submodule(written).register_forward_pre_hook(scale_branch_norm))
    was_training = model.training
    model.eval()
    try:
        base(**batch)
    finally:
        model.train(was_training)
        for hook in hooks:
            hook.remove()
    return scales
