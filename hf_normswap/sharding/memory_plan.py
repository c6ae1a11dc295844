"""A per-process memory estimate of a healing or fine-tuning, made from configurations before anything loads.

The models are built on the meta device, so parameters are counted exactly and nothing is allocated. What is counted,
per process, at the peak of a training step (the student's backward):
- the student's weights: trainable parameters in float32 (heal keeps them there in a bfloat16 model, FSDP2's mixed
  precision keeps float32 sharded parameters), frozen ones in `dtype`;
- gradients (float32) and AdamW's two float32 states, for the trainable parameters only;
- compute copies, the weights held besides the stored ones while computing: sharded, the unsharded (all-gathered)
  copies FSDP2 holds, the root's (embeddings and heads, kept gathered from forward to backward) and two layers' (the
  one computing and the one prefetched), in bfloat16 with `bf16`; replicated with `bf16`, autocast's bfloat16 copies of
  the student's float32 weights, which the backward keeps (an upper bound: norms and embedding lookups make none);
- the teacher's weights in `dtype` (frozen, sharded like the student).
Sharding divides every parameter over the processes along its first dimension, padded as FSDP2 pads it.
Not counted: activations, the teacher's transient gathered layers and unsharded gradient buffers, LoRA adapters,
communication buffers, the CUDA context and allocator fragmentation.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..model.configuration_normswap import NormSwapConfig
from ..model.heads import HEAD_CLASSES, NATIVE_AUTO_CLASSES, head_of_config
from ..model.layers_normswap import NormSwapLayer
from ..option_rules import not_allowed


DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
GIB = 1024**3


@dataclass
class MemoryPlan:
    """Bytes per process, but for the parameter counts."""

    processes: int
    sharded: bool
    bf16: bool
    parameters: int  # the student's, counted once where tied
    trainable_parameters: int
    student: int
    gradients: int
    optimizer_states: int
    compute_weights: int
    teacher: int
    total: int


def plan_memory(
    student_config,
    *,
    processes: int,
    sharded: bool,
    dtype: str = "float32",
    bf16: bool = False,
    teacher_config=None,
    trainable: Callable[[str], bool] | None = None,
) -> MemoryPlan:
    """The memory one of `processes` processes needs to train the student of `student_config` (a NormSwapConfig)
    against the teacher of `teacher_config` (any Transformers config, or none), its parameters `trainable` by name
    (default: all), weights loaded in `dtype`, with bfloat16 mixed precision when `bf16`."""
    if not isinstance(processes, int) or processes < 1:
        raise ValueError(f"processes={processes!r} is invalid: a positive integer")
    if dtype not in DTYPE_BYTES:
        raise ValueError(not_allowed("dtype", dtype, DTYPE_BYTES))
    shards = processes if sharded else 1
    student = _meta_model(student_config)
    named = dict(student.named_parameters())
    learns = {name: trainable is None or trainable(name) for name in named}
    stored = {name: 4 if learns[name] else DTYPE_BYTES[dtype] for name in named}
    learning = [parameter for name, parameter in named.items() if learns[name]]
    weights = sum(_shard_numel(parameter, shards) * stored[name] for name, parameter in named.items())
    gradients = 4 * sum(_shard_numel(parameter, shards) for parameter in learning)
    teacher = 0
    if teacher_config is not None:
        teacher_parameters = _meta_model(teacher_config).parameters()
        teacher = DTYPE_BYTES[dtype] * sum(_shard_numel(parameter, shards) for parameter in teacher_parameters)
    compute = _compute_weights(student, stored, sharded=sharded, bf16=bf16)
    return MemoryPlan(
        processes=processes,
        sharded=sharded,
        bf16=bf16,
        parameters=sum(parameter.numel() for parameter in named.values()),
        trainable_parameters=sum(parameter.numel() for parameter in learning),
        student=weights,
        gradients=gradients,
        optimizer_states=2 * gradients,
        compute_weights=compute,
        teacher=teacher,
        total=weights + 3 * gradients + compute + teacher,
    )


def _meta_model(config) -> torch.nn.Module:
    """The model of `config` with its head, on the meta device: NormSwap's class, or Transformers' Auto class."""
    head = head_of_config(config)
    with torch.device("meta"):
        if isinstance(config, NormSwapConfig):
            return HEAD_CLASSES[head]._from_config(config)
        return NATIVE_AUTO_CLASSES[head].from_config(config)


def _shard_numel(parameter: torch.Tensor, shards: int) -> int:
    """The elements of one process's shard: the first dimension padded to a multiple of `shards`, then divided."""
    if parameter.dim() == 0:
        return parameter.numel()
    return math.ceil(parameter.shape[0] / shards) * (parameter.numel() // parameter.shape[0])


def _compute_weights(student: torch.nn.Module, stored: dict[str, int], sharded: bool, bf16: bool) -> int:
    """Bytes of the weights held besides the stored ones while computing (see the module's docstring)."""
    if not sharded:
        return 2 * sum(
            parameter.numel() for name, parameter in student.named_parameters() if bf16 and stored[name] == 4
        )

    def gathered(module: torch.nn.Module, prefix: str) -> int:
        return sum(
            parameter.numel() * (2 if bf16 else stored[prefix + name]) for name, parameter in module.named_parameters()
        )

    layers = {name: module for name, module in student.named_modules() if isinstance(module, NormSwapLayer)}
    in_layers = sum(gathered(layer, f"{name}.") for name, layer in layers.items())
    largest = max((gathered(layer, f"{name}.") for name, layer in layers.items()), default=0)
    return gathered(student, "") - in_layers + min(2, len(layers)) * largest


def describe_plan(plan: MemoryPlan) -> str:
    """The plan as a short table for the terminal, in GiB."""
    processes = f"{plan.processes} process" + ("es" if plan.processes > 1 else "")
    layout = f"{processes} sharded (FSDP2)" if plan.sharded else f"{processes} replicated"
    precision = "bfloat16 mixed precision" if plan.bf16 else "no mixed precision"
    rows = [
        ("student weights", plan.student),
        ("gradients", plan.gradients),
        ("AdamW states", plan.optimizer_states),
        ("compute copies", plan.compute_weights),
        ("teacher weights", plan.teacher),
        ("total", plan.total),
    ]
    lines = [
        f"memory per process, {layout}, {precision}; activations not estimated",
        f"student: {plan.parameters:,} parameters, {plan.trainable_parameters:,} trainable",
    ]
    lines += [f"  {name:18} {value / GIB:9.2f} GiB" for name, value in rows]
    return "\n".join(lines)
