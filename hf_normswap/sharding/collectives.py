"""The collectives by which the processes of a launch agree: a tensor from the main process, a share of a global
count, the largest value."""

import torch
import torch.distributed as dist

from .processes import is_main_process, processes, world_size


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
