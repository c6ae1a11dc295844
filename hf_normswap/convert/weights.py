"""Streaming a source's tensors into the target's names and shards, and initialising what the source lacks."""

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..checkpoint import ShardWriter, read_tensors
from ..model.configuration_normswap import NormSwapConfig
from ..model.heads import HEAD_CLASSES, local_name
from ..model.norms_normswap import input_scale
from .exact_swaps import apply_exact_swap
from .norm_mapping import norm_slots
from .options import ConversionError
from .plan import ConversionPlan


_INPUT_NORM = re.compile(r"model\.layers\.(\d+)\.(?:attention|mlp)_norms\.input_norm\.(?:weight|bias)")
# Head modules a source may lack: `from_pretrained` initialises them when the written model is loaded.
_HEAD_MODULES = ("classifier.", "pooler.", "head.", "qa_outputs.", "lm_head.")


NO_SLOT = "a norm without a slot under the new placement"


@dataclass
class WeightsRecord:
    """What was written: the files, the source tensors left out, and the target tensors the source had not."""

    files: list[str]
    dropped: list[str]
    initialized: list[str]
    initialized_at_load: list[str]
    dtype: str
    folded: list[str] = field(default_factory=list)  # the source's norms folded into the layers reading the stream

    def mark_folded(self) -> None:
        """Moves the norms left without a slot from `dropped` to `folded`: calibration folded them into the layers
        reading the stream (out of pre-LN into `output` or `none`)."""
        self.folded = [entry.removesuffix(f" ({NO_SLOT})") for entry in self.dropped if entry.endswith(f"({NO_SLOT})")]
        self.dropped = [entry for entry in self.dropped if not entry.endswith(f"({NO_SLOT})")]

    def mark_calibrated(self, names: set[str]) -> None:
        """Lists the tensors of `names` that started at identity as calibrated."""
        self.initialized = [
            entry.replace(" (identity)", " (calibrated)") if entry.split(" ")[0] in names else entry
            for entry in self.initialized
        ]


def write_weights(*, plan: ConversionPlan, folder: Path) -> WeightsRecord:
    """Writes the target's weights into FOLDER: one file from a source of one, else shards no larger than the
    source's largest weight file."""
    head_class = HEAD_CLASSES[plan.head]
    with torch.device("meta"):
        expected = head_class(plan.target).state_dict()
    tied = set(head_class._tied_weights_keys or {}) if plan.target.tie_word_embeddings else set()
    cast = getattr(torch, plan.dtype) if plan.dtype else None
    largest = max(file.stat().st_size for file in plan.files) if len(plan.files) > 1 else math.inf
    writer = ShardWriter(folder=folder, max_shard_bytes=largest)
    dropped, written, dtypes = [], set(), []
    for name, tensor, file, source_name in _target_tensors(plan, dropped):
        name = local_name(name=name, head=plan.head)
        if name in tied:
            continue
        if name not in expected:
            dropped.append(f"{source_name} (no place in a NormSwap {plan.head} model of this configuration)")
            continue
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise ConversionError(
                f"{file}: tensor {source_name!r} has shape {tuple(tensor.shape)}, "
                f"expected {tuple(expected[name].shape)}"
            )
        dtypes.append(tensor.dtype)
        writer.add(name, tensor.to(cast) if cast else tensor)
        written.add(name)
    weights_dtype = cast or dtypes[0]

    new_norms = {local_name(name=goal, head=plan.head) for goal, source in plan.norm_sources.items() if source is None}
    generator = torch.Generator().manual_seed(0)
    initialized, at_load = [], []
    for name, meta in expected.items():
        if name in written or name in tied:
            continue
        initial = _initial_value(name, meta.shape, new_norms, written, plan.target, generator)
        if initial is None and name.startswith(_HEAD_MODULES):
            at_load.append(name)
            continue
        if initial is None:
            raise ConversionError(f"{plan.folder}: no tensor for {name!r} in the {plan.family.name}-family checkpoint")
        value, how = initial
        initialized.append(f"{name} ({how})")
        writer.add(name, value.to(weights_dtype))
    return WeightsRecord(
        files=writer.close(),
        dropped=dropped,
        initialized=initialized,
        initialized_at_load=at_load,
        dtype=plan.dtype or str(weights_dtype).removeprefix("torch."),
    )


def _target_tensors(plan: ConversionPlan, dropped: list[str]) -> Iterator[tuple[str, torch.Tensor, Path, str]]:
    """Each source tensor as (target name, tensor, file, source name), one at a time, its norms moved to the slots
    they fill; norms left without a slot go to `dropped`. An exact swap rewrites the tensors once all are read."""
    moved_norms = {source: goal for goal, source in plan.norm_sources.items() if source is not None}
    plain_norms = {slot.name for slot in norm_slots(plan.plain)}
    collected = {}
    for file in plan.files:
        for source_name, source_tensor in read_tensors(file):
            for name, tensor in _renamed(plan, file, source_name, source_tensor):
                norm, parameter = name.rsplit(".", 1)
                if norm in plain_norms:
                    if norm not in moved_norms:
                        dropped.append(f"{source_name} ({NO_SLOT})")
                        continue
                    name = f"{moved_norms[norm]}.{parameter}"
                scale = _depth_scale(plan, name)
                tensor = tensor if scale == 1.0 else tensor * scale
                if plan.exact_swap:
                    collected[name] = tensor
                else:
                    yield name, tensor, file, source_name
    if plan.exact_swap:
        swapped = apply_exact_swap(
            kind=plan.exact_swap, state=collected, plain=plan.plain, target=plan.target, head=plan.head
        )
        for name, tensor in swapped.items():
            yield name, tensor, plan.folder, f"{name} (after the {plan.exact_swap} swap)"


def _depth_scale(plan: ConversionPlan, name: str) -> float:
    """What a tensor is multiplied by on its way: for an input norm, its source layer's `input_scale` over its target
    layer's (pre -> lns: sqrt(l) at depth l, which LayerNorm Scaling divides by), else 1."""
    match = _INPUT_NORM.fullmatch(name)
    if not match:
        return 1.0
    layer = int(match[1])
    before, after = plan.plain.layer_norm_placements[layer], plan.target.layer_norm_placements[layer]
    return input_scale(before, layer + 1) / input_scale(after, layer + 1)


def _renamed(plan: ConversionPlan, file: Path, source_name: str, tensor: torch.Tensor) -> list:
    """The NormSwap tensors (name, value) of one source tensor, or an error naming a tensor the family lacks."""
    try:
        return plan.family.to_normswap(source_name, tensor, plan.head)
    except KeyError:
        raise ConversionError(
            f"{file}: unexpected tensor {source_name!r} for a {plan.family.name}-family checkpoint"
        ) from None


def _initial_value(
    name: str, shape, new_norms: set[str], written: set[str], target: NormSwapConfig, generator: torch.Generator
) -> tuple[torch.Tensor, str] | None:
    """The value a tensor the source lacks starts at, and how it was chosen; None when there is no rule for it."""
    module, parameter = name.rsplit(".", 1)
    if module in new_norms:
        return (torch.ones(shape) if parameter == "weight" else torch.zeros(shape)), "identity"
    if parameter == "bias" and f"{module}.weight" in written:
        return torch.zeros(shape), "zero: the source has no bias there"
    if parameter == "residual_weight":
        return torch.ones(shape), "Admin's residual weight at 1 (post-LN's function)"
    if parameter == "alpha":
        return torch.full(shape, target.dyt_alpha_init), f"dyt_alpha_init {target.dyt_alpha_init}"
    if name.endswith("embeddings.position_embeddings.weight"):
        std = target.initializer_range
        return torch.randn(shape, generator=generator) * std, f"normal, std {std}"
    return None
