"""The model heads by name: NormSwap classes, Transformers' Auto classes, and source architectures."""

import torch
import transformers
from accelerate import init_empty_weights

from .modeling_normswap import HEADS


HEAD_CLASSES = {head: model_class for head, (model_class, _, _) in HEADS.items()}
HEAD_AUTO_CLASSES = {head: auto_class for head, (_, auto_class, _) in HEADS.items()}
NATIVE_AUTO_CLASSES = {head: getattr(transformers, auto_class) for head, auto_class in HEAD_AUTO_CLASSES.items()}
PIPELINE_TAGS = {head: pipeline_tag for head, (_, _, pipeline_tag) in HEADS.items()}
_SOURCE_SUFFIXES = {"ForPreTraining": "masked-lm", "LMHeadModel": "causal-lm"}  # source heads NormSwap names otherwise
_ARCHITECTURE_SUFFIXES = _SOURCE_SUFFIXES | dict(  # the heads' own suffixes, the base model's ("Model") last
    sorted(
        ((model_class.__name__.removeprefix("NormSwap"), head) for head, model_class in HEAD_CLASSES.items()),
        key=lambda item: item[0] == "Model",
    )
)


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
