"""`compare --plan`: the memory each process of a comparison's fine-tuning will hold, from the configuration alone."""

from ..heal.models import source_config
from ..model.configuration_normswap import NormSwapConfig
from ..model.heads import HEAD_CLASSES
from ..sharding import MemoryPlan, plan_memory
from .comparison import source_model
from .experiment import Experiment


def comparison_plan(experiment: Experiment, processes: int) -> MemoryPlan:
    """The per-process memory of fine-tuning the experiment's model (every parameter trained) on `processes`
    processes; a `+heal` variant's healing needs about as much again for its teacher (`heal --plan`)."""
    model = source_model(experiment.model)
    config = NormSwapConfig.from_json_file(model) if model.endswith(".json") else source_config(model)
    head = "causal-lm" if experiment.task_type == "causal-lm" else "sequence-classification"
    config.architectures = [HEAD_CLASSES[head].__name__]
    return plan_memory(
        config, processes=processes, sharded=experiment.sharding.fsdp and processes > 1, bf16=experiment.sharding.bf16
    )
