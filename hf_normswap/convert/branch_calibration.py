"""Calibrated swaps out of pre-LN into norms on the branch (sandwich, output): the target's stream, like the source's,
keeps every write at the scale it was made, but each write passes a norm first.

Pre-LN computes x_{s+1} = x_s + F_s(N_s(x_s)); sandwich computes x_s + B_s(F_s(N_s(x_s))), where the branch norm B_s
returns g * F / rms(F) (+ b) and so drops each token's write size, which one gain per feature gives back only on
average. B_s's gain (and bias) is fitted feature by feature by least squares, so that the target's stream after the
sublayer, x_s + B_s(F_s), lies nearest the source's x_{s+1}, each token weighted by 1 / rms(x_{s+1})^2 (its error as
the next reading norm sees it). The target runs on its own stream, so each fit repairs what the earlier ones left.

The output placement has no input norm: its sublayers read the stream itself. The source's input norm at point s is
folded into the linear layers reading it, divided by the source's median stream RMS r_s there (LayerNorm's centring
too, as the readers' weights less their means over the inputs): exact for the tokens whose stream RMS is r_s.

Norm-free (`none`) folds every input norm so, and the final norm becomes a fixed per-feature scale: its gain over the
source's median RMS before it (and its bias), the head left as it is, tied or not, so that the student's final output
stays comparable with the source's (healing compares them). Each text's first position (an attention sink, its
stream many times the median) keeps its own divisors: the source's median there at position 0, as factors r_s / r0_s
on the first position's input at each point (`first_position_scales`).
"""

from dataclasses import dataclass

import torch
from torch import nn

from ..model.configuration_normswap import NORM_PLACEMENTS, NormSwapConfig
from ..model.evaluation_mode import evaluation_mode
from .layer_stream import LayerStream
from .lazy_layers import load_layer
from .stream_calibration import fold_norm, pre_ln_source, set_norm, stream_rms, sublayers


@dataclass
class BranchCalibration:
    """The median gain each fitted branch norm took, and the source's median stream RMS that the folded readers and a
    fixed final scale divide by (None where no sublayer reads the stream unnormalised and a final norm reads it)."""

    branch_gains: dict[str, float]
    stream_rms: list[float] | None


def removes_norms(config: NormSwapConfig) -> bool:
    """Whether `config` places no norm on the stream (`none` in every layer, no final norm)."""
    return set(config.layer_norm_placements) == {"none"} and not config.final_norm


def calibrates_branches(plain: NormSwapConfig, target: NormSwapConfig) -> bool:
    """Whether the swap from `plain` to `target` is one out of pre-LN into norms on the branch of its sublayers, or
    into none."""
    placements = set(target.layer_norm_placements)
    return bool(placements & {"sandwich", "output", "none"}) and not branch_calibration_blockers(plain, target)


def folds_input_norms(plain: NormSwapConfig, target: NormSwapConfig) -> bool:
    """Whether the calibrated swap from `plain` to `target` folds the source's input norms into the layers reading a
    stream that no norm reads (`output`, `none`)."""
    bare = any("input_norm" not in NORM_PLACEMENTS[placement] for placement in target.layer_norm_placements)
    return bare and calibrates_branches(plain, target)


def branch_calibration_blockers(plain: NormSwapConfig, target: NormSwapConfig) -> list[str]:
    """What keeps the swap from `plain` to `target` from being calibrated at the branch norms, said for an error."""
    placements = set(target.layer_norm_placements)
    reads_bare = bool(placements & {"output", "none"})
    norm_bias = plain.norm_type == "layernorm" and plain.norm_bias
    blockers = {
        f"a pre-LN source (this one's placement is {plain.norm_placement!r})": pre_ln_source(plain),
        "no placement with a norm after the sum in the same model": all(
            "residual_norm" not in NORM_PLACEMENTS[placement] for placement in placements
        ),
        "no LayerNorm Scaling ('lns') in the same model": "lns" not in placements,
        f"the source's norm_type {plain.norm_type!r} kept (asked: {target.norm_type!r})": (
            plain.norm_type == target.norm_type
        ),
        "norms that divide, not dyt": plain.norm_type != "dyt",
        "a final norm or a fixed final scale": bool(target.final_norm or target.final_scale),
        "no embedding norm": not target.embedding_norm,
        "linear biases to take the source's LayerNorm biases (attention_bias and mlp_bias)": not (
            reads_bare and norm_bias and not (plain.attention_bias and plain.mlp_bias)
        ),
    }
    return [f"needs {needed}" for needed, met in blockers.items() if not met]


def _fold_scaled(norm: nn.Module, readers: list[nn.Linear], rms: float) -> None:
    """Folds the pre-LN `norm` into the `readers` of a stream that no norm reads, for tokens of stream RMS `rms`."""
    fold_norm(norm, readers)
    for reader in readers:
        if isinstance(norm, nn.LayerNorm):
            reader.weight.sub_(reader.weight.mean(1, keepdim=True))
        reader.weight.div_(rms)


BIAS_RIDGE = 1e-6  # relative, on a LayerNorm branch norm's bias: where a feature's write never varies, the gain's


class _GainFit:
    """Per-feature weighted sums for the least-squares gain (and bias) of a branch norm: the normalised write u,
    the aim a = (the source's x_{s+1}) - x_s, and the weights w."""

    def __init__(self, width: int, bias: bool):
        self.bias = bias
        self.sums = torch.zeros(5, width, dtype=torch.float64)  # w u u, w u, w, w u a, w a

    def add(self, normalised: torch.Tensor, aim: torch.Tensor, weights: torch.Tensor) -> None:
        u, a, w = normalised.double(), aim.double(), weights.double()[:, None]
        for row, terms in enumerate((w * u * u, w * u, w.expand_as(u), w * u * a, w * a)):
            self.sums[row] += terms.sum(0)

    def solve(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        uu, u, one, ua, a = self.sums
        if not self.bias:
            return ua / uu.clamp_min(1e-30), None
        one = one * (1 + BIAS_RIDGE)
        determinant = uu * one - u * u
        return (one * ua - u * a) / determinant, (uu * a - u * ua) / determinant


def _fit_branch(written: LayerStream, reference: LayerStream, sublayer: int) -> torch.Tensor:
    """Fits the branch norm of `sublayer` (0: attention, 1: MLP) of the layer both streams run next, on every batch;
    returns its gain."""
    layer, source_layer = written.base.layers[written.layer], reference.base.layers[reference.layer]
    norms = (layer.attention_norms, layer.mlp_norms)[sublayer]
    norm = norms.output_norm
    fit, current = _GainFit(norm.weight.numel(), getattr(norm, "bias", None) is not None), {}

    def real(states: torch.Tensor) -> torch.Tensor:
        return states[current["real"]].float()

    hooks = [
        norms.input_norm.register_forward_pre_hook(lambda _, args: current.update(stream=real(args[0]))),
        norm.register_forward_hook(lambda _, args, output: current.update(normalised=real(output))),
    ]
    if sublayer == 0:
        hooks.append(
            source_layer.mlp_norms.input_norm.register_forward_pre_hook(
                lambda _, args: current.update(aim=real(args[0]))
            )
        )
    centred = isinstance(norm, nn.LayerNorm)
    try:
        for index, batch in enumerate(written.batches):
            current["real"] = batch["attention_mask"].bool()
            aim = reference.output(index)
            if sublayer == 1:
                current["aim"] = real(aim)
            written.output(index)
            target = current["aim"]
            spread = target - target.mean(-1, keepdim=True) if centred else target
            fit.add(current["normalised"], target - current["stream"], 1 / spread.pow(2).mean(-1).clamp_min(1e-12))
    finally:
        for hook in hooks:
            hook.remove()
    gain, bias = fit.solve()
    norm.weight.copy_(gain)
    if bias is not None:
        norm.bias.copy_(bias)
    return gain


@torch.no_grad()
def calibrate_branches(model: nn.Module, source: nn.Module, batches: list[dict]) -> BranchCalibration:
    """Sets the norms of the written `model` (converted from the pre-LN `source`) and, where a sublayer reads the
    stream unnormalised, its readers, as the module docstring says, point after point on `batches`."""
    base = model.base_model
    bare = any(isinstance(norms.input_norm, nn.Identity) for norms, _, _ in sublayers(model))
    rms = stream_rms(source, batches) if bare or model.config.final_scale else None
    written, reference, gains = LayerStream(base, batches), LayerStream(source.base_model, batches), {}
    targets, sources = sublayers(model), sublayers(source)
    try:
        with evaluation_mode(model), evaluation_mode(source):
            for index, ((norms, readers, _), (source_norms, _, _)) in enumerate(zip(targets, sources)):
                layer, sublayer = divmod(index, 2)
                load_layer(base, layer)
                load_layer(source.base_model, layer)
                if isinstance(norms.input_norm, nn.Identity):
                    _fold_scaled(source_norms.input_norm, readers, rms[index])
                else:
                    set_norm(norms.input_norm, source_norms.input_norm)
                if not isinstance(norms.output_norm, nn.Identity):
                    name = f"layers.{layer}.{('attention_norms', 'mlp_norms')[sublayer]}"
                    gains[name] = _fit_branch(written, reference, sublayer).median().item()
                if sublayer == 1:
                    written.advance()
                    reference.advance()
    finally:
        written.close()
        reference.close()
    set_norm(base.norm, source.base_model.norm)
    if model.config.final_scale:
        base.norm.weight.div_(rms[-1])
    if removes_norms(model.config):
        first = stream_rms(source, batches, first_only=True)
        model.config.first_position_scales = [median / at_first for median, at_first in zip(rms, first)]
    return BranchCalibration(branch_gains=gains, stream_rms=rms)
