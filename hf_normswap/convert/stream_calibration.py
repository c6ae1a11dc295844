"""Calibrated swaps out of pre-LN: when the target's norms write the residual stream (post, pre_post, DeepNorm) and
the source's only read it.

Pre-LN computes x_{s+1} = x_s + F_s(g_s * x_s / rms(x_s)); its stream keeps every write at the scale it was made.
A stream normalised after each sublayer holds y_s = x_s / rms(x_s) instead. So, with r_s the source's stream RMS at
point s (what its norm there divides by):

- each input norm's gain g_s (and bias) is folded into the linear layers that read it, where the target has no input
  norm (pre_post keeps its input norms with the source's gains);
- each sublayer's write is multiplied by alpha / r_s (alpha: DeepNorm's residual scale, else 1);
- the norms that write the stream get unit gains, except the last, which takes the source's final norm.

Then y_s + write / r_s = x_{s+1} / r_s, which the next norm maps onto x_{s+1} / rms(x_{s+1}): exact (up to the
norms' epsilon) when every token's stream RMS at every point equals r_s. Post-LN has no place for the per-token scale
rms(x) itself; r_s is the median over calibration tokens, and what the median cannot carry is left to `heal`.
"""

from dataclasses import dataclass

import torch
from torch import nn

from ..model.configuration_normswap import NORM_PLACEMENTS, NormSwapConfig
from ..model.evaluation_mode import evaluation_mode
from .lazy_layers import load_layer
from .refit import MedianSample


NORMALISED_STREAM_PLACEMENTS = tuple(name for name, norms in NORM_PLACEMENTS.items() if "residual_norm" in norms)


@dataclass
class StreamCalibration:
    """The source's median stream RMS at each point read by a norm (after the embeddings, before each sublayer, before
    the final norm), and the scale each sublayer's write was multiplied by."""

    stream_rms: list[float]
    write_scales: dict[str, float]


def pre_ln_source(plain: NormSwapConfig) -> bool:
    """Whether `plain` is pre-LN throughout: a norm before each sublayer, a final norm, none after the embeddings."""
    return (
        set(plain.layer_norm_placements) == {"pre"}
        and plain.final_norm
        and plain.first_attention_input_norm
        and not plain.embedding_norm
    )


def calibrates_stream(plain: NormSwapConfig, target: NormSwapConfig) -> bool:
    """Whether the swap from `plain` to `target` is one out of pre-LN into a stream its norms write."""
    return (
        pre_ln_source(plain)
        and set(target.layer_norm_placements) <= set(NORMALISED_STREAM_PLACEMENTS)
        and plain.norm_type == target.norm_type != "dyt"
        and target.embedding_norm
        and not target.final_norm
        and target.embedding_size == target.hidden_size
        and _foldable(plain, target)
    )


def _foldable(plain: NormSwapConfig, target: NormSwapConfig) -> bool:
    """Whether the source's norm biases, where the target reads without a norm, fold into linear layers with biases."""
    reads_bare = any(placement != "pre_post" for placement in target.layer_norm_placements)
    norm_bias = plain.norm_type == "layernorm" and plain.norm_bias
    return not (reads_bare and norm_bias) or (plain.attention_bias and plain.mlp_bias)


def sublayers(model: nn.Module) -> list[tuple[nn.Module, list[nn.Linear], nn.Linear]]:
    """Per sublayer in forward order: its norms, the linear layers reading its input, and its write."""
    found = []
    for layer in model.base_model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        readers = [getattr(mlp, name) for name in ("gate_proj", "up_proj") if hasattr(mlp, name)]
        found.append((layer.attention_norms, [attention.q_proj, attention.k_proj, attention.v_proj], attention.o_proj))
        found.append((layer.mlp_norms, readers, mlp.down_proj))
    return found


@torch.no_grad()
def stream_rms(source: nn.Module, batches: list[dict], first_only: bool = False) -> list[float]:
    """The median over the real tokens of `batches` (`first_only`: each text's first) of what each of the pre-LN
    source's reading norms divides by (its input's RMS for RMSNorm, its standard deviation for LayerNorm), in forward
    order, the final norm last."""
    norms = [norms.input_norm for norms, _, _ in sublayers(source)] + [source.base_model.norm]
    samples, real = {norm: MedianSample() for norm in norms}, {}

    def record(norm, args):
        states = args[0][real["mask"]].float()
        if isinstance(norm, nn.LayerNorm):
            states = states - states.mean(-1, keepdim=True)
        eps = norm.eps if isinstance(norm, nn.LayerNorm) else norm.variance_epsilon
        samples[norm].add((states.pow(2).mean(-1) + eps).sqrt())

    hooks = [norm.register_forward_pre_hook(record) for norm in norms]
    try:
        with evaluation_mode(source):
            for batch in batches:
                real["mask"] = batch["attention_mask"].bool()
                if first_only:
                    real["mask"] = real["mask"] & (real["mask"].cumsum(-1) == 1)
                source.base_model(**batch)
    finally:
        for hook in hooks:
            hook.remove()
    return [samples[norm].median() for norm in norms]


def fold_norm(norm: nn.Module, readers: list[nn.Linear]) -> None:
    """Folds `norm`'s gain and bias into the linear layers that read its output."""
    bias = getattr(norm, "bias", None)
    for reader in readers:
        if bias is not None:  # `_foldable`: the reader has one
            reader.bias.add_(reader.weight @ bias)
        reader.weight.mul_(norm.weight)


def set_norm(norm: nn.Module, like: nn.Module | None) -> None:
    """`norm` takes the weights of `like`, or unit gain and no shift."""
    norm.weight.copy_(like.weight if like is not None else torch.ones_like(norm.weight))
    if getattr(norm, "bias", None) is not None:
        norm.bias.copy_(like.bias if like is not None and like.bias is not None else torch.zeros_like(norm.bias))


@torch.no_grad()
def calibrate_stream(model: nn.Module, source: nn.Module, batches: list[dict]) -> StreamCalibration:
    """Sets the norms and writes of the written `model` (converted from the pre-LN `source` with its norms mapped in
    any way) as the module docstring says, with scales from the source's stream on `batches`."""
    rms = stream_rms(source, batches)
    base, scales = model.base_model, {}
    set_norm(base.embeddings.norm, None)
    targets, sources = sublayers(model), sublayers(source)
    for index, ((norms, readers, write), (source_norms, _, _)) in enumerate(zip(targets, sources)):
        load_layer(base, index // 2)
        load_layer(source.base_model, index // 2)
        if isinstance(norms.input_norm, nn.Identity):
            fold_norm(source_norms.input_norm, readers)
        else:
            set_norm(norms.input_norm, source_norms.input_norm)
        scale = scales[f"layers.{index // 2}.{('attention_norms', 'mlp_norms')[index % 2]}"] = (
            norms.residual_scale / rms[index]
        )
        write.weight.mul_(scale)
        if write.bias is not None:
            write.bias.mul_(scale)
        last = index == len(targets) - 1
        set_norm(norms.residual_norm, source.base_model.norm if last else None)
    return StreamCalibration(stream_rms=rms, write_scales=scales)
