"""The model heads by name: NormSwap classes, Transformers' Auto classes, and source architectures."""

import torch
import transformers
from accelerate import init_empty_weights

from .modeling_normswap import AUTO_CLASSES


HEAD_AUTO_CLASSES = {  # each head's name and Auto class
    "base": "AutoModel",
    "masked-lm": "AutoModelForMaskedLM",
    "sequence-classification": "AutoModelForSequenceClassification",
    "token-classification": "AutoModelForTokenClassification",
    "question-answering": "AutoModelForQuestionAnswering",
    "causal-lm": "AutoModelForCausalLM",
}
HEAD_CLASSES = {head: AUTO_CLASSES[auto_class] for head, auto_class in HEAD_AUTO_CLASSES.items()}
NATIVE_AUTO_CLASSES = {head: getattr(transformers, auto_class) for head, auto_class in HEAD_AUTO_CLASSES.items()}
_ARCHITECTURE_SUFFIXES = {
    "ForMaskedLM": "masked-lm",
    "ForPreTraining": "masked-lm",
    "ForSequenceClassification": "sequence-classification",
    "ForTokenClassification": "token-classification",
    "ForQuestionAnswering": "question-answering",
    "ForCausalLM": "causal-lm",
    "LMHeadModel": "causal-lm",
    "Model": "base",
}


def empty_model(config, head: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The NormSwap model of `head` and `config` in `dtype`, its parameters on the meta device (nothing allocated,
    nothing initialised) and its buffers built, for weights assigned after; a head to be tied is not tied yet."""
    with init_empty_weights(include_buffers=False):
        return HEAD_CLASSES[head]._from_config(config, dtype=dtype)


def local_name(name: str, head: str) -> str:
    """A tensor name as a `NormSwapFor...` model has it, as the model of `head` has it (the base has no `model.`)."""
    return name.removeprefix("model.") if head == "base" else name


def head_of_config(config) -> str:
    """The head of a saved model, from its config's `architectures` (the base model when there are none)."""
    return head_of_architecture((config.architectures or ["NormSwapModel"])[0])


def head_of_architecture(architecture: str) -> str:
    """The head name of a Transformers architecture such as `BertForMaskedLM`."""
    for suffix, head in _ARCHITECTURE_SUFFIXES.items():
        if architecture.endswith(suffix):
            return head
    raise ValueError(
        f"architecture {architecture!r} has no NormSwap head; heads: {', '.join(HEAD_CLASSES)} "
        f"(architectures ending in {', '.join(_ARCHITECTURE_SUFFIXES)})"
    )
