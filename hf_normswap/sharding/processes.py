"""The processes of a distributed launch (torchrun or accelerate launch): their group, its end, and the collectives
by which they agree."""

import gc

import torch
import torch.distributed as dist
from accelerate import PartialState

from .private_internals import forget_device_meshes


def processes() -> PartialState:
    """The processes of the launch, their group started if it was not (gloo on CPU), as the Trainer starts it."""
    return PartialState(cpu=not torch.accelerator.is_available())


def end_processes() -> None:
    """Ends the launch's process group, if one was started, once the models sharded across it are freed: its gloo
    workers are joined here, not left to the interpreter's exit, where one still freeing a finished collective's
    tensors aborts the process ("terminate called without an active exception"). The CLI calls it after a command;
    a script of your own calls it last, once its models are out of scope."""
    if not dist.is_initialized():
        return
    forget_device_meshes()
    gc.collect()
    dist.destroy_process_group()


def world_size() -> int:
    """The number of processes of the distributed launch (1 without one)."""
    return processes().num_processes


def is_main_process() -> bool:
    return processes().is_main_process


def from_main_process(tensor: torch.Tensor | None, shape: tuple, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """The main process's `tensor` (of `shape` and `dtype`) on every process, on the CPU; elsewhere `tensor` is None.
    Every process must call it."""
    device = processes().device
    shared = tensor.to(device) if is_main_process() else torch.empty(shape, dtype=dtype, device=device)
    dist.broadcast(shared, src=0)
    return shared.cpu()


def token_share(count: int | torch.Tensor, device: torch.device) -> torch.Tensor:
    """This process's share of the global batch's `count` (e.g. of its real tokens), times the number of processes:
    the weight that turns a mean over this process's items into its part of the mean over every process's items
    (the Trainer averages the processes' gradients and logged losses)."""
    count = torch.as_tensor(count, dtype=torch.float32, device=device)
    if world_size() == 1:
        return torch.ones((), device=device)
    total = count.clone()
    dist.all_reduce(total)
    return count * world_size() / total.clamp_min(1)


def agreed_max(value: int, device: torch.device) -> int:
    """The largest `value` of all the processes (`value` itself without a launch), so that every process takes the
    same decision where they must run the same collectives."""
    if world_size() == 1:
        return value
    largest = torch.tensor(value, device=device)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    return int(largest)
