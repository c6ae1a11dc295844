"""hf_normswap: pretrained weights under a different layer-norm arrangement."""

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
from .modeling_normswap import (
    NormSwapForCausalLM,
    NormSwapForMaskedLM,
    NormSwapForQuestionAnswering,
    NormSwapForSequenceClassification,
    NormSwapForTokenClassification,
    NormSwapModel,
    NormSwapPreTrainedModel,
)


__version__ = "0.1.0"

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
