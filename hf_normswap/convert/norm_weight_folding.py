"""Norm gains folded into the linear layers that read them (FlashNorm, Graef et al.): each norm keeps normalising,
with unit gain and no shift, and its gain (and bias) moves into the weights (and biases) of the layers reading its
output, which computes the same up to float rounding. A norm whose output anything else reads keeps its gain: the
final norm before a head tied to the embeddings (or a head that is not a causal LM's), named in the result."""

import torch
from torch import nn

from ..model.configuration_normswap import NormSwapConfig
from ..model.evaluation_mode import evaluation_mode
from ..model.heads import HEAD_CLASSES
from .options import ConversionError
from .stream_calibration import fold_norm, set_norm, sublayers


def _refuse(name: str, reason: str) -> None:
    raise ConversionError(f"fold_norm_weights: {name} cannot fold, {reason}")


def _check_foldable(model: nn.Module) -> None:
    """Refuses, naming the first, a norm that writes the residual stream or whose gain no linear map reads alone."""
    config, prefix = model.config, "model."
    if config.qk_norm:
        _refuse(f"{prefix}layers.0.self_attn.q_norm", "its gain scales queries and keys before rope and the product")
    if config.embedding_norm:
        _refuse(f"{prefix}embeddings.norm", "it writes the residual stream")
    for index, (norms, readers, _) in enumerate(sublayers(model)):
        name = f"{prefix}layers.{index // 2}.{('attention_norms', 'mlp_norms')[index % 2]}"
        for slot in ("output_norm", "residual_norm"):
            if not isinstance(getattr(norms, slot), nn.Identity):
                _refuse(f"{name}.{slot}", "it writes the residual stream")
        bias = getattr(norms.input_norm, "bias", None)
        if bias is not None and any(reader.bias is None for reader in readers):
            _refuse(f"{name}.input_norm", "its bias has no bias of the layers reading it to go to")


def check_foldable(config: NormSwapConfig, head: str) -> None:
    """Refuses, before anything is written, a conversion to `config` with `head` whose norms cannot fold: on its
    model without weights."""
    with torch.device("meta"):
        _check_foldable(HEAD_CLASSES[head](config))


@torch.no_grad()
def fold_norm_weights(model: nn.Module) -> list[str]:
    """Folds the gains of `model`'s norms (`check_foldable` passed its configuration) into the layers reading them, in
    place; returns the norms keeping theirs."""
    with evaluation_mode(model):
        for norms, readers, _ in sublayers(model):
            if not isinstance(norms.input_norm, nn.Identity):
                fold_norm(norms.input_norm, readers)
                set_norm(norms.input_norm, None)
        final = model.base_model.norm
        if isinstance(final, nn.Identity):
            return []
        head = model.get_output_embeddings() if hasattr(model, "lm_head") and model.config.is_causal else None
        tied = head is not None and head.weight is model.get_input_embeddings().weight
        if head is None or tied or (getattr(final, "bias", None) is not None and head.bias is None):
            return ["model.norm"]
        fold_norm(final, [head])
        set_norm(final, None)
    return []
