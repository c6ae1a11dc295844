"""Workarounds that reach into private torch and Transformers internals, each naming the release and the behaviour it
works around. Nothing else in the package touches them."""

import contextlib

import torch
from torch.distributed.tensor import DTensor, _collective_utils, _redistribute, debug
from transformers import PreTrainedModel, TrainingArguments
from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY


# Whether the Trainer leaves alone a model marked by `mark_sharded_at_load` (Transformers 5.19 and later); before, it
# wraps it in DDP, which fails on its DTensor parameters.
TRAINER_KEEPS_SHARDED_MODELS = hasattr(PreTrainedModel, "is_distributed_loading_by_transformers")


def forget_device_meshes() -> None:
    """Empties torch's DTensor caches, whose entries hold device meshes and through them the process group, so that
    the group can end before the interpreter's exit (torch 2.13's caches; where one is missing the rest stay)."""
    with contextlib.suppress(AttributeError):
        debug._clear_sharding_prop_cache()
        DTensor._op_dispatcher.sharding_propagator._propagate_tensor_meta_cached.cache_clear()
        _redistribute.clear_redistribute_planner_cache()
        _redistribute._gen_transform_infos.cache_clear()
        _collective_utils.MeshTopoInfo.build_from_mesh.cache_clear()


def record_outputs(model: torch.nn.Module) -> None:
    """Registers what `model`'s forward may record (hidden states) under its class as it is now: Transformers'
    `_CAN_RECORD_REGISTRY` finds it by the class's name, which FSDP2 changes (to `FSDP<name>`). Transformers 5.5 to
    5.22 key the registry by that name; 5.23 and later key it by the model, naming its class themselves."""
    flags = getattr(model, "_can_record_outputs", None)
    if type(_CAN_RECORD_REGISTRY) is dict:
        _CAN_RECORD_REGISTRY[str(model.__class__)] = flags
    else:
        _CAN_RECORD_REGISTRY[model] = flags


def mark_sharded_at_load(model: torch.nn.Module) -> None:
    """Marks `model`, sharded here, as Transformers marks a model it shards at load time, so that the Trainer neither
    moves it nor wraps it in DDP (Transformers 5.19 and later read `is_distributed_loading_by_transformers`, which
    returns this attribute)."""
    model._is_distributed_loading_by_transformers = True


def one_device_a_process(arguments: TrainingArguments) -> TrainingArguments:
    """`arguments` with the process training on its one device, as the Trainer sets them for a model-parallel model
    (`_n_gpu`, Transformers 5.5 to 5.25): otherwise `_setup_devices` gives a process that sees several GPUs all of
    them, and the Trainer wraps the model in DataParallel and multiplies the batch by their count."""
    if arguments.n_gpu > 1:
        arguments._n_gpu = 1
    return arguments
