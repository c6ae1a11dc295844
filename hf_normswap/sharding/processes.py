"""The processes of a distributed launch (torchrun or accelerate launch): their group, its size and main process, and
its end."""

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


def process_share(texts: int, error: type[ValueError] = ValueError) -> int:
    """Each process's share of a step's `texts` (`batch_size`), so that a launch of any size takes the texts a step
    that one process takes; `error` in one line where the processes cannot share them equally."""
    count = world_size()
    if texts % count:
        raise error(f"batch_size={texts}: each of the {count} processes takes an equal share: a multiple of {count}")
    return texts // count


def is_main_process() -> bool:
    return processes().is_main_process
