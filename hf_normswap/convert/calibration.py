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

from ..checkpoint import update_tensors
from ..model.configuration_normswap import NormSwapConfig
from ..model.evaluation_mode import evaluation_mode
from ..model.heads import HEAD_CLASSES
from ..probes.probe_data import probe_batches, probe_tokenizer, sampled_batches
from ..probes.stream_mix import LayerGates, gated_at_branch_norms
from .branch_calibration import calibrate_branches, calibrates_branches, removes_norms
from .layer_stream import LayerStream
from .lazy_layers import folder_loaders, lazy_of, load_layer
from .norm_mapping import NormSlot, norm_slots
from .refit import RIDGE, MedianSample, WriteFit, augmented, centred, least_squares_ratios, set_write
from .stream_calibration import calibrate_stream, calibrates_stream


CALIBRATION_SIZE = 704  # the shipped SST-2 training sample, all of it
CALIBRATION_BATCH_SIZE = 64  # sentences per forward pass: memory holds one batch's activations


@dataclass
class CalibrationRecord:
    """What calibration did: on which data, each sublayer's write scale, each refitted write's relative error before
    and after, and the modules it changed."""

    data: str
    write_scales: dict[str, float]
    refit_errors: dict[str, list[float]]
    ridge: float | None
    modules: list[str]
    stream_rms: list[float] | None = None  # into a normalised stream: the source's median stream RMS at its norms
    out_of_pre_ln: bool = False  # the source pre-LN: the block-wise fit of `heal` can start from it
    removed_norm_rms: list[float] | None = None  # norm-free: what each removed norm divided by (the config's too)

    def layer_gates(self, target: NormSwapConfig) -> LayerGates | None:
        """How the calibrated `target` computes its source layer by layer (`probes.stream_mix`): into a stream its
        norms write, or into sandwich; else None."""
        if self.stream_rms:
            return LayerGates(self.stream_rms)
        return LayerGates() if self.out_of_pre_ln and gated_at_branch_norms(target) else None


def calibrate_checkpoint(
    *,
    folder: Path,
    head: str,
    source_model: nn.Module,
    target: NormSwapConfig,
    norm_sources: dict[str, str | None],
    sublayers: dict[str, str],
    log,
    size: int = CALIBRATION_SIZE,
    batch_size: int = CALIBRATION_BATCH_SIZE,
    model: nn.Module | None = None,
) -> tuple[CalibrationRecord, set[str]]:
    """Calibrates the model written in FOLDER against the unswapped source (`source_model`): out of pre-LN into a
    stream its norms write (`stream_calibration`) or into norms on the branch (`branch_calibration`), or by scaling
    the writes of `sublayers` and refitting its linear writes. Calibrates on `size` sentences (the training sample,
    repeated beyond its length), `batch_size` at a time. `model` is the written model, loaded whole or with lazy
    layers (`lazy_layers`; its changes are written back as its layers are dropped); loaded whole by default. Returns
    what was done and the names of the tensors it changed."""
    if model is None:
        model = HEAD_CLASSES[head].from_pretrained(folder, dtype=torch.float32)
    batches, data = _calibration_data(model, source_model, probe_tokenizer(folder), size, batch_size)
    scales, errors, stream_rms, into = _calibrate_model(model, source_model, target, norm_sources, sublayers, batches)
    modules = list(sublayers.values())
    changed = write_back(model, folder)
    if into is not None:
        prefix = "" if model.base_model is model else f"{model.base_model_prefix}."
        ordered = [name for name in model.state_dict() if name in changed]  # forward order
        modules = list(dict.fromkeys(name.removeprefix(prefix).rsplit(".", 1)[0] for name in ordered))
    done = f"calibrated the writes of {len(scales)} sublayers" if scales else "calibrated"
    log(
        f"{done} on {data}"
        + (f" (scales {min(scales.values()):.3g} to {max(scales.values()):.3g})" if scales else "")
        + (f", refitted {len(errors)} of them" if errors else "")
        + (f", {into}" if into else "")
    )
    record = CalibrationRecord(
        data=data,
        write_scales=scales,
        refit_errors=errors,
        ridge=RIDGE if errors else None,
        modules=modules,
        stream_rms=stream_rms,
        out_of_pre_ln=into is not None,
        removed_norm_rms=target.removed_norm_rms,
    )
    return record, changed


@torch.no_grad()
def _finite_on(model: nn.Module, batch: dict) -> bool:
    """Whether `model`'s outputs on `batch` are finite (a lazy model is not run: True)."""
    if lazy_of(model) is not None:
        return True
    with evaluation_mode(model):
        outputs = model(**batch)
    return bool(torch.isfinite(outputs.logits if hasattr(outputs, "logits") else outputs.last_hidden_state).all())


def _calibration_data(model: nn.Module, source_model: nn.Module, tokenizer, size: int, batch_size: int):
    """The batches to calibrate on, and what they are: `size` sentences of the training sample (random tokens without
    a tokenizer) or, for a norm-free causal LM, texts sampled from the source, whose stream RMS at each point is that
    of long texts, not of the first tokens of short sentences."""
    if removes_norms(model.config) and model.config.is_causal and hasattr(model, "lm_head") and not lazy_of(model):
        batches = sampled_batches(source_model, tokenizer)
        texts, length = batches[0]["input_ids"].shape
        return batches, f"{texts} texts of {length} tokens sampled from the source"
    batches = probe_batches(
        tokenizer=tokenizer, vocab_size=model.config.vocab_size, size=size, batch_size=batch_size, split="train"
    )
    if tokenizer is None:
        return batches, f"{size} random token sequences"
    repeated = f" (its {CALIBRATION_SIZE}, repeated)" if size > CALIBRATION_SIZE else ""
    return batches, f"the {size} sentences of the shipped SST-2 training sample{repeated}"


def _calibrate_model(
    model: nn.Module, source_model: nn.Module, target: NormSwapConfig, norm_sources, sublayers, batches
) -> tuple[dict[str, float], dict[str, list[float]], list[float] | None, str | None]:
    """Calibrates `model` in the way its swap needs; returns the scales, the refit errors, the source's stream RMS
    (into a normalised stream) and, out of pre-LN, what was done. Norm-free, `target` records what its removed norms
    divided by (`removed_norm_rms`)."""
    if calibrates_stream(source_model.config, target):
        calibration = calibrate_stream(model, source_model, batches)
        into = "folded the pre-LN gains into the layers reading them"
        return calibration.write_scales, {}, calibration.stream_rms, into
    if calibrates_branches(source_model.config, target):
        calibration = calibrate_branches(model, source_model, batches)
        into = "fitted the branch norms' gains" + (
            ", folded the pre-LN norms into the layers reading the stream" if calibration.stream_rms else ""
        )
        if removes_norms(target):
            target.removed_norm_rms = model.config.removed_norm_rms = calibration.stream_rms
            target.first_position_scales = model.config.first_position_scales
            into = "folded the pre-LN norms into the layers reading the stream, the final norm into a fixed scale"
            if not _finite_on(model, batches[0]):
                into += (
                    "; WARNING: its outputs overflow on the calibration texts (fixed divisors let the streams the "
                    "source's norms kept in check grow unchecked: docs/interpretability.md)"
                )
        return calibration.branch_gains, {}, None, into
    sources = fitted_sources(target, norm_sources, norm_slots(source_model.config), sublayers)
    scales, errors = calibrate_writes(model, sublayers, batches, source_model, sources)
    return scales, errors, None, None


def write_back(model: nn.Module, folder: Path) -> set[str]:
    """Writes the tensors of `model` that differ from FOLDER's into its shards; returns their names."""
    lazy = lazy_of(model)
    if lazy is not None:
        return lazy.close()
    loaders = folder_loaders(folder)
    changed = {
        name: tensor
        for name, tensor in model.state_dict().items()
        if name in loaders and not torch.equal(tensor, loaders[name]().float())
    }
    update_tensors(folder=folder, tensors=changed)
    return set(changed)


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


def _bias(norm: nn.Module) -> torch.Tensor | None:
    return getattr(norm, "bias", None)


@torch.no_grad()
def calibrate_writes(
    model: nn.Module,
    sublayers: dict[str, str],
    batches: list[dict],
    source: nn.Module | None = None,
    targets: dict[str, str] | None = None,
) -> tuple[dict[str, float], dict[str, list[float]]]:
    """Scales the writes of `sublayers` (from `calibrated_sublayers`) in place, point after point in forward order,
    each fitted on all `batches` (run layer by layer: `layer_stream`), and refits the linear writes that have
    `targets` (from `fitted_sources`) towards what the `source` feeds those norms. Returns each sublayer's scale and
    each refitted write's relative error before and after."""
    base, targets = model.base_model, targets or {}
    written = LayerStream(base, batches)
    reference = LayerStream(source.base_model, batches) if targets else None
    scales, errors = {}, {}
    try:
        with evaluation_mode(model):
            for index in range(len(base.layers)):
                load_layer(base, index)
                for name in [name for name in sublayers if name.startswith(f"layers.{index}.")]:
                    target = targets.get(name)
                    if target is not None:
                        reference.advance(int(target.split(".")[2]))  # "model.layers.{j}...."
                    scales[name], error = _fit_point(written, name, sublayers[name], reference, target)
                    if error is not None:
                        errors[name] = error
                written.advance()
    finally:
        written.close()
        if reference is not None:
            reference.close()
    return scales, errors


def _fit_point(
    written: LayerStream, name: str, writer_name: str, reference: LayerStream | None, target: str | None
) -> tuple[float, list[float] | None]:
    """Fits the scale of the write of sublayer `name` (and refits it towards the input of the source's norm
    `target`) on one pass of its layer over every batch; returns the scale and the refit's errors."""
    base = written.base
    norm, writer = base.get_submodule(name).input_norm, base.get_submodule(writer_name)
    bias, ratios, spreads = _bias(norm), MedianSample(), MedianSample()
    fit = WriteFit(augmented(writer, bias), norm) if target is not None else None
    current = {}

    def real(states: torch.Tensor, stream: LayerStream = written) -> torch.Tensor:
        return states[stream.batch["attention_mask"].bool()].float()

    def read(norm, args):
        stream = current["stream"] = real(args[0])
        normalised = norm.forward(stream) - (0 if bias is None else bias)
        ratios.add(least_squares_ratios(centred(stream, norm), centred(normalised, norm)))

    def write(writer, args, output):
        fit.add(real(args[0]), current["stream"], current["target"])

    hooks = [norm.register_forward_pre_hook(read)]
    if fit is not None:
        aim = reference.base.get_submodule(target.removeprefix("model."))
        hooks.append(aim.register_forward_pre_hook(lambda _, args: current.update(target=real(args[0], reference))))
        hooks.append(writer.register_forward_hook(write))
    elif not isinstance(writer, nn.Linear):  # a branch norm
        hooks.append(
            writer.register_forward_pre_hook(
                lambda module, args: spreads.add(centred(real(args[0]), module).pow(2).mean(-1).sqrt())
            )
        )
    try:
        for index in range(len(written.batches)):
            if fit is not None:
                reference.output(index)
            written.output(index)
    finally:
        for hook in hooks:
            hook.remove()
    scale = ratios.median()
    if fit is not None:
        refitted, before, after = fit.solve(scale)
        set_write(writer, refitted)
        return scale, [before, after]
    if isinstance(writer, nn.Linear):
        set_write(writer, scale * augmented(writer, bias))
    else:  # the sandwich branch norm takes the scale as its gain, times the median spread of what it normalises
        writer.weight.fill_(scale * spreads.median())
        if _bias(writer) is not None:  # then the read norm, of the same configuration, has one too
            writer.bias.copy_(scale * bias)
    return scale, None
