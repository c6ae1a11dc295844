"""hf_normswap: pretrained weights under a different layer-norm arrangement."""

from importlib.metadata import version

from .model.configuration_normswap import NormSwapConfig, mix_ln_placement  # first: it checks the Transformers release


# isort: split
from transformers import AutoConfig

from .convert import convert_checkpoint
from .convert.gguf import smollm2_gguf
from .heal import heal_checkpoint
from .model import modeling_normswap
from .model.admin import profile_admin
from .model.heads import HEAD_CLASSES, NATIVE_AUTO_CLASSES
from .model.modeling_normswap import *  # noqa: F403 (its __all__: the model classes of the head table)
from .model.packing import DataCollatorWithPacking
from .sharding.accelerate_configs import accelerate_config


__version__ = version("hf-normswap")

AutoConfig.register(NormSwapConfig.model_type, NormSwapConfig)
for _head, _model_class in HEAD_CLASSES.items():
    NATIVE_AUTO_CLASSES[_head].register(NormSwapConfig, _model_class)

__all__ = [
    "accelerate_config",
    "convert_checkpoint",
    "DataCollatorWithPacking",
    "heal_checkpoint",
    "NormSwapConfig",
    "mix_ln_placement",
    "profile_admin",
    "smollm2_gguf",
    *modeling_normswap.__all__,
]
