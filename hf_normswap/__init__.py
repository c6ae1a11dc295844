"""hf_normswap: pretrained weights under a different layer-norm arrangement."""

__version__ = "0.1.0"

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

from .configuration_normswap import NormSwapConfig, mix_ln_placement
from .convert import convert_checkpoint
from .modeling_normswap import (
    NormSwapForCausalLM,
    NormSwapForMaskedLM,
    NormSwapForQuestionAnswering,
    NormSwapForSequenceClassification,
    NormSwapForTokenClassification,
    NormSwapModel,
    NormSwapPreTrainedModel,
)


AutoConfig.register(NormSwapConfig.model_type, NormSwapConfig)
for _auto_class, _model_class in (
    (AutoModel, NormSwapModel),
    (AutoModelForMaskedLM, NormSwapForMaskedLM),
    (AutoModelForSequenceClassification, NormSwapForSequenceClassification),
    (AutoModelForTokenClassification, NormSwapForTokenClassification),
    (AutoModelForQuestionAnswering, NormSwapForQuestionAnswering),
    (AutoModelForCausalLM, NormSwapForCausalLM),
):
    _auto_class.register(NormSwapConfig, _model_class)

__all__ = [
    "convert_checkpoint",
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
