"""hf_normswap: pretrained weights under a different layer-norm arrangement."""

__version__ = "0.1.0"

from transformers import AutoConfig

from .configuration_normswap import NormSwapConfig, mix_ln_placement
from .convert import convert_checkpoint
from .heal import heal_checkpoint
from .heads import HEAD_CLASSES, NATIVE_AUTO_CLASSES
from .modeling_normswap import (
    NormSwapForCausalLM,
    NormSwapForMaskedLM,
    NormSwapForQuestionAnswering,
    NormSwapForSequenceClassification,
    NormSwapForTokenClassification,
    NormSwapModel,
    NormSwapPreTrainedModel,
)
from .packing import DataCollatorWithPacking


AutoConfig.register(NormSwapConfig.model_type, NormSwapConfig)
for _head, _model_class in HEAD_CLASSES.items():
    NATIVE_AUTO_CLASSES[_head].register(NormSwapConfig, _model_class)

__all__ = [
    "convert_checkpoint",
    "DataCollatorWithPacking",
    "heal_checkpoint",
    "NormSwapConfig",
    "mix_ln_placement",
    "NormSwapPreTrainedModel",
    "NormSwapModel",
    "NormSwapForMaskedLM",
    "NormSwapForSequenceClassification",
    "NormSwapForTokenClassification",
    "NormSwapForQuestionAnswering",
    "NormSwapForCausalLM",
]
