"""Sharded models gathered: their root units for a block of code, or whole on the main process to be saved."""

import contextlib
from collections.abc import Iterator

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule

from .processes import is_main_process


@contextlib.contextmanager
def gathered(*models: torch.nn.Module) -> Iterator[None]:
    """The root units of the sharded `models` gathered for the block (their embeddings, final norm and head), so that
    their submodules (`base_model`, a head) run outside the models' own forward; after it every unit of theirs is
    resharded, those that stay gathered after a forward too (accelerate's tail of final norm and head): a gathered
    unit's parameters are its unsharded ones, which `zero_grad` would clear instead of the sharded gradients. Every
    process must enter it."""
    roots = [model for model in models if isinstance(model, FSDPModule)]
    for root in roots:
        root.unshard()
    try:
        yield
    finally:
        for unit in (module for root in roots for module in root.modules() if isinstance(module, FSDPModule)):
            unit.reshard()


def unsharded(model: torch.nn.Module) -> torch.nn.Module | None:
    """`model` itself when it is not sharded; else, gathered from its shards (every process joining), a plain model
    of its class holding its full weights on CPU, on the main process (None elsewhere): what gets saved. The plain
    model is built on the meta device and takes the gathered tensors as its own, so the weights are held once; its
    buffers outside the state dict (e.g. rotary frequencies) stay unbuilt, for it is only to be saved."""
    if not isinstance(model, FSDPModule):
        return model
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not is_main_process():
        return None
    plain_class = next(kind for kind in type(model).__mro__ if not issubclass(kind, FSDPModule))
    with torch.device("meta"):
        plain = plain_class._from_config(model.config, dtype=model.dtype)
    plain.load_state_dict(state, assign=True, strict=False)  # a tied head is not in `state`: tied again below
    plain.tie_weights()
    missing = [name for name, tensor in plain.state_dict().items() if tensor.is_meta]
    if missing:
        raise RuntimeError(f"gathered state of {plain_class.__name__} lacks {missing[:3]}")
    return plain
