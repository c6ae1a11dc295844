"""Calibrated swaps: when a norm that wrote the residual stream becomes one that reads it (post -> pre or sandwich),
scale each sublayer's write so that the stream keeps the proportions the source's norms gave it.

Post-LN normalises the stream after every sublayer; pre-LN only normalises what a sublayer reads, so its stream keeps
everything at the scale it was written, and the embeddings or a single layer can drown the rest. Reading is
scale-invariant: if the stream at a point holds c times the sum the source normalised there, the norm that reads it
returns the source's normalised state, and the sublayer's write, scaled by c and carrying the source norm's bias,
keeps that true at the next point. c is fitted point after point on calibration text: the median over tokens of the
least-squares ratio between the stream and what its norm makes of it (less the norm's bias). A sandwich branch norm
(identity at conversion) takes the scale as its gain, times the median spread of the sublayer's output.

One scale per point cannot carry the source norms' per-feature gains, which post-LN applies to the whole stream at
every point. So a write that is a linear layer is then refitted: by ridge regression (towards the scaled write) on
the same text, so that the stream after it lies, token by token, along the sum the source normalised at the point the
next reading norm comes from. What the refit cannot carry is left to `heal`.
"""

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from ..checkpoint import update_tensors
from ..model.configuration_normswap import NormSwapConfig
from ..model.evaluation_mode import evaluation_mode
from ..model.heads import HEAD_CLASSES
from ..probes.probe_data import probe_batches, probe_tokenizer
from .norm_mapping import NormSlot, norm_slots
from .stream_calibration import calibrate_stream, calibrates_stream


CALIBRATION_SIZE = 704  # the shipped SST-2 training sample, all of it
# times the mean diagonal of the write inputs' Gram matrix; chosen on held-out text (docs/experiments/calibration.md)
RIDGE = 1.0


@dataclass
class CalibrationRecord:
    """What calibration did: on which data, each sublayer's write scale, each refitted write's relative error before
    and after, and the modules it changed."""

    data: str
    write_scales: dict[str, float]
    refit_errors: dict[str, list[float]]
    ridge: float | None
    modules: list[str]
    stream_rms: list[float] | None = None  # out of pre-LN: the source's median stream RMS at each norm it reads


def calibrate_checkpoint(
    *,
    folder: Path,
    head: str,
    source_model: nn.Module,
    target: NormSwapConfig,
    norm_sources: dict[str, str | None],
    sublayers: dict[str, str],
    log,
) -> tuple[CalibrationRecord, set[str]]:
    """Calibrates the model written in FOLDER against the unswapped source (`source_model`): out of pre-LN into a
    stream its norms write (`stream_calibration`), or by scaling the writes of `sublayers` and refitting its linear
    writes. Returns what was done and the names of the tensors it changed."""
    model = HEAD_CLASSES[head].from_pretrained(folder, dtype=torch.float32)
    tokenizer = probe_tokenizer(folder)
    batch = probe_batches(
        tokenizer=tokenizer,
        vocab_size=model.config.vocab_size,
        size=CALIBRATION_SIZE,
        batch_size=CALIBRATION_SIZE,
        split="train",
    )[0]
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    stream_rms, modules = None, list(sublayers.values())
    if calibrates_stream(source_model.config, target):
        calibration = calibrate_stream(model, source_model, batch)
        scales, errors, stream_rms = calibration.write_scales, {}, calibration.stream_rms
    else:
        sources = fitted_sources(target, norm_sources, norm_slots(source_model.config), sublayers)
        scales, errors = calibrate_writes(model, sublayers, batch, source_sums(source_model, sources, batch))
    changed = {name: tensor for name, tensor in model.state_dict().items() if not torch.equal(tensor, before[name])}
    if stream_rms is not None:
        prefix = "" if model.base_model is model else f"{model.base_model_prefix}."
        modules = list(dict.fromkeys(name.removeprefix(prefix).rsplit(".", 1)[0] for name in changed))
    update_tensors(folder=folder, tensors=changed)
    data = (
        f"the {CALIBRATION_SIZE} sentences of the shipped SST-2 training sample"
        if tokenizer
        else f"{CALIBRATION_SIZE} random token sequences"
    )
    log(
        f"calibrated the writes of {len(scales)} sublayers on {data} "
        f"(scales {min(scales.values()):.3g} to {max(scales.values()):.3g})"
        + (f", refitted {len(errors)} of them" if errors else "")
        + (", folded the pre-LN gains into the layers reading them" if stream_rms is not None else "")
    )
    record = CalibrationRecord(
        data=data,
        write_scales=scales,
        refit_errors=errors,
        ridge=RIDGE if errors else None,
        modules=modules,
        stream_rms=stream_rms,
    )
    return record, set(changed)


def calibrated_sublayers(
    target: NormSwapConfig, norm_sources: dict[str, str | None], source_slots: list[NormSlot]
) -> dict[str, str]:
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
            sublayers[sublayer] = (
                f"{layer}.self_attn.o_proj" if sublayer.endswith("attention_norms") else f"{layer}.mlp.down_proj"
            )
        elif norm_sources[f"{prefix}.output_norm"] is None:
            sublayers[sublayer] = f"{sublayer}.output_norm"
    return sublayers


def fitted_sources(
    target: NormSwapConfig,
    norm_sources: dict[str, str | None],
    source_slots: list[NormSlot],
    sublayers: dict[str, str],
) -> dict[str, str]:
    """For each sublayer of `sublayers` whose write is a linear layer: the source norm (a norm that wrote the source's
    stream) that the next norm reading the stream took; its input is what the refitted write aims at."""
    writes = {slot.name for slot in source_slots if slot.kind == "write"}
    slots = [slot for slot in norm_slots(target) if slot.kind != "branch"]
    sources = {}
    for slot, following in zip(slots, slots[1:]):
        sublayer = slot.name.removeprefix("model.").removesuffix(".input_norm")
        if (
            sublayers.get(sublayer, "").endswith("_proj")
            and following.kind == "read"
            and norm_sources[following.name] in writes
        ):
            sources[sublayer] = norm_sources[following.name]
    return sources


@torch.no_grad()
def source_sums(source: nn.Module, norms: dict[str, str], batch: dict) -> dict[str, torch.Tensor]:
    """The input of each of the source's `norms` (sublayer -> norm name) over the batch's real tokens, in float32."""
    real = batch["attention_mask"].bool()
    base, sums = source.base_model, {}
    hooks = [
        base.get_submodule(norm.removeprefix("model.")).register_forward_pre_hook(
            lambda module, args, sublayer=sublayer: sums.__setitem__(sublayer, args[0][real].float())
        )
        for sublayer, norm in norms.items()
    ]
    try:
        base(**batch)
    finally:
        for hook in hooks:
            hook.remove()
    return sums


def _centred(states: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """States less their mean over features where `norm` removes it (LayerNorm)."""
    return states - states.mean(-1, keepdim=True) if isinstance(norm, nn.LayerNorm) else states


def _median_ratio(stream: torch.Tensor, normalised: torch.Tensor) -> float:
    """The median over rows of the least-squares c in stream ~ c * normalised."""
    return ((stream * normalised).sum(-1) / normalised.pow(2).sum(-1).clamp_min(1e-12)).median().item()


def _bias(norm: nn.Module) -> torch.Tensor | None:
    return getattr(norm, "bias", None)


def _refit(
    writer: nn.Linear, inputs: torch.Tensor, stream: torch.Tensor, target: torch.Tensor, norm: nn.Module
) -> tuple[float, float]:
    """Refits `writer` in place so that stream + writer(inputs), as `norm` sees it, lies along `target` token by token
    (each token keeping the length the current write gives it); rows are real tokens. Returns the relative error
    before and after."""
    inputs, stream, target = inputs.double(), _centred(stream.double(), norm), _centred(target.double(), norm)
    if writer.bias is not None:
        inputs = torch.cat([inputs, inputs.new_ones(len(inputs), 1)], dim=1)
    current = (
        writer.weight.double().T
        if writer.bias is None
        else torch.cat([writer.weight.double().T, writer.bias.double()[None]])
    )
    reached = _centred(stream + inputs @ current, norm)
    wanted = (
        target * (reached * target).sum(-1, keepdim=True) / target.pow(2).sum(-1, keepdim=True).clamp_min(1e-12)
        - stream
    )
    gram = inputs.T @ inputs
    ridge = RIDGE * gram.diagonal().mean()
    prior = _centred(current, norm)  # the part of the write that the norm sees
    fitted = torch.linalg.solve(
        gram + ridge * torch.eye(len(gram), dtype=gram.dtype), inputs.T @ wanted + ridge * prior
    )
    fitted = fitted + current - prior

    def error(weights: torch.Tensor) -> float:
        return ((_centred(inputs @ weights, norm) - wanted).pow(2).sum() / wanted.pow(2).sum().clamp_min(1e-12)).item()

    writer.weight.copy_(fitted[: writer.in_features].T)
    if writer.bias is not None:
        writer.bias.copy_(fitted[-1])
    return error(current), error(fitted)


@torch.no_grad()
def calibrate_writes(
    model: nn.Module, sublayers: dict[str, str], batch: dict, targets: dict[str, torch.Tensor] | None = None
) -> tuple[dict[str, float], dict[str, list[float]]]:
    """Scales the writes of `sublayers` (from `calibrated_sublayers`) in place, fitted on one padded `batch` in a
    single forward pass, and refits the linear writes that have `targets` (from `source_sums`). Returns each
    sublayer's scale and each refitted write's relative error before and after."""
    real = batch["attention_mask"].bool()
    base, targets = model.base_model, targets or {}
    scales, hooks, branch_norm_scales, streams, errors = {}, [], {}, {}, {}

    def scale_write(name: str):
        writer = base.get_submodule(sublayers[name])

        def hook(norm, args):
            stream, bias = args[0][real].float(), _bias(norm)
            normalised = norm.forward(stream) - (0 if bias is None else bias)
            scale = scales[name] = _median_ratio(_centred(stream, norm), _centred(normalised, norm))
            if name in targets:
                streams[name] = (stream, norm)
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

    def refit_write(name: str):
        def hook(writer, args, output):
            stream, norm = streams.pop(name)
            errors[name] = list(_refit(writer, args[0][real], stream, targets[name], norm))
            return F.linear(args[0], writer.weight, writer.bias)

        return hook

    for name, written in sublayers.items():
        hooks.append(base.get_submodule(name).input_norm.register_forward_pre_hook(scale_write(name)))
        if written.endswith("output_norm"):
            hooks.append(base.get_submodule(written).register_forward_pre_hook(scale_branch_norm))
        elif name in targets:
            hooks.append(base.get_submodule(written).register_forward_hook(refit_write(name)))
    try:
        with evaluation_mode(model):
            base(**batch)
    finally:
        for hook in hooks:
            hook.remove()
    return scales, errors
