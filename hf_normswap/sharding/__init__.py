"""Training sharded across processes with FSDP2, what other packages use of it: the options a healing and a
comparison share (`options`), the launch's processes (`processes`) and their collectives (`collectives`), the
sharding of models (`fsdp`), the Trainer's side (`trainer_bridge`), gathering and saving (`gathering`), and the memory
a sharded run needs (`memory_plan`). Inside, `private_internals` works around the private internals it needs."""

from .collectives import agreed_max, from_main_process, token_share
from .fsdp import loads_weights, prepare_frozen, prepare_trained, resumable, sharded, take_main_dtypes
from .gathering import gathered, unsharded
from .memory_plan import MemoryPlan, describe_plan, plan_memory
from .options import ShardingError, ShardingOptions, flat_settings, sharding_section, with_sharding_section
from .processes import end_processes, is_main_process, process_share, processes, world_size
from .trainer_bridge import RecordShardedOutputs, launch_training_arguments


__all__ = [
    "MemoryPlan",
    "RecordShardedOutputs",
    "ShardingError",
    "ShardingOptions",
    "agreed_max",
    "describe_plan",
    "end_processes",
    "flat_settings",
    "from_main_process",
    "gathered",
    "is_main_process",
    "launch_training_arguments",
    "loads_weights",
    "plan_memory",
    "prepare_frozen",
    "prepare_trained",
    "process_share",
    "processes",
    "resumable",
    "sharded",
    "sharding_section",
    "take_main_dtypes",
    "token_share",
    "unsharded",
    "with_sharding_section",
    "world_size",
]
