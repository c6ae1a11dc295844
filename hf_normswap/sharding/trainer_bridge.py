"""The Trainer's side of sharding: the TrainingArguments a sharded training needs, and the callback that readies a
model the Trainer's FSDP2 sharded for the measurements run beside it."""

import torch
from torch.distributed.fsdp import FSDPModule
from transformers import TrainerCallback, TrainingArguments

from .fsdp import accelerate_shards, block_class_names, resumable, run_whole_once, sharded
from .options import ShardingOptions
from .private_internals import one_device_a_process, record_outputs


class RecordShardedOutputs(TrainerCallback):
    """For the trained model once the Trainer has prepared it (sharded by accelerate's FSDP2): `record_outputs`, and
    `run_whole_once`, so that the callbacks after it (measurements) may run its submodules alone."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        record_outputs(model)
        if isinstance(model, FSDPModule):
            run_whole_once(model)


# TrainingArguments' field for activation checkpointing: `activation_checkpointing` from Transformers 5.23 (where
# `gradient_checkpointing` is its deprecated alias), `gradient_checkpointing` before.
CHECKPOINTING_ARGUMENT = next(
    name
    for name in ("activation_checkpointing", "gradient_checkpointing")
    if name in TrainingArguments.__dataclass_fields__
)


def trainer_arguments(options: ShardingOptions, model: torch.nn.Module) -> dict:
    """The TrainingArguments `options` set: mixed precision, activation checkpointing, and on accelerators the
    Trainer's FSDP2 (the `fsdp_config` file, or each of the model's blocks a unit). On CPU, a model sharded here (see
    `shard`) cannot be resumed by the Trainer, so it saves no checkpoints (`resumable`)."""
    arguments = {"bf16": options.bf16, CHECKPOINTING_ARGUMENT: options.activation_checkpointing}
    if sharded(options) and accelerate_shards():
        config = options.fsdp_config_fields() or {
            "version": 2,
            "transformer_layer_cls_to_wrap": block_class_names(model),
        }
        arguments.update(fsdp=True, fsdp_config={"cpu_ram_efficient_loading": True, **config})
    elif not resumable(options):
        arguments.update(save_strategy="no")
    return arguments


def launch_training_arguments(options: ShardingOptions, model: torch.nn.Module, **arguments) -> TrainingArguments:
    """The Trainer's `arguments` with those `options` set (`trainer_arguments`), each process on one device: a
    launch's processes share a step's batch, and a process that sees several GPUs trains on the first alone."""
    return one_device_a_process(TrainingArguments(**{**arguments, **trainer_arguments(options, model)}))
