"""A conversion out of pre-LN mixed with its source, stream point by stream point (compare Heimersheim 2024, "You
can remove GPT2's LayerNorm by fine-tuning").

A calibrated conversion out of pre-LN (`convert.stream_calibration`) scaled each sublayer's write by alpha / r_s,
with r_s the source's median stream RMS before sublayer s. If each norm that writes the stream divided by those
constants instead of by each token's own RMS, the stream would hold x_s / r_s, and the sublayers' inputs, normalised
without parameters, would be exactly the source's normalised states: the source's function. So at every point p a
gate g_p in [0, 1] mixes the two:

    write norm:       g * norm(z) + (1 - g) * z * r_{p-1} / (alpha * r_p)      (the embedding norm: z / r_0)
    sublayer input:   g * y + (1 - g) * y / rms(y)                            (where the target has no input norm)

g = 0 everywhere is the source, g = 1 the calibrated target; the last write (the source's final norm) is never mixed.

What post-LN cannot carry is each token's own stream RMS rho_s. With `per_token_stream`, the source's side holds each
token's normalised stream u_p = x_p / rho_p instead (what a post-LN norm gives), and carries rho_p beside it: each
write point rescales the carried stream by (rho_s / r_s)^t before normalising the sum, so that with t = 1 (`per_token`)
and g = 0 the stream is the source's exactly for every token (up to the norms' epsilon): the post-LN rewrite that
divides each write by the token's own RMS. t = 0 divides by the median, as the calibrated target does.

Into sandwich the stream and the input norms stay the source's, so the gates are at the branch norms B alone
(`BranchMix`): g * B(F) + (1 - g) * F. `LayerGates` says which of the two a calibrated conversion takes.
"""

from dataclasses import dataclass

import torch
from torch import nn

from ..model.configuration_normswap import NORM_PLACEMENTS
from .next_token import agreement_with, next_token_log_probs


def normalised(states: torch.Tensor, centred: bool, eps: float | torch.Tensor) -> torch.Tensor:
    """`states` with zero mean (LayerNorm) and unit RMS over features, without parameters."""
    states = states - states.mean(-1, keepdim=True) if centred else states
    return states * torch.rsqrt(states.float().pow(2).mean(-1, keepdim=True) + eps).to(states.dtype)


class _Gates:
    """A converted model's `gates`, two a layer (before attention, before the MLP), all open (the target) until set,
    and the hooks that read them."""

    def __init__(self, model: nn.Module):
        self.base = getattr(model, "get_base_model", lambda: model)().base_model  # through a PEFT wrapper
        self.layers = len(self.base.layers)
        self.gates, self.hooks = torch.ones(2 * self.layers), []

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()


class StreamMix(_Gates):
    """Hooks on a converted model's norms and sublayers that mix source and target at each of its 2 * layers stream
    points by `gates`; with `per_token_stream`, the source's side carries each token's own stream RMS, rescaled by
    `per_token` (t, all 1)."""

    def __init__(self, model: nn.Module, stream_rms: list[float], per_token_stream: bool = False):
        super().__init__(model)
        base = self.base
        if len(stream_rms) != 2 * self.layers + 1:
            raise ValueError("the recorded stream RMS does not fit the model's layers")
        self.per_token = torch.ones(2 * self.layers)
        self.stream_rms, self.per_token_stream = stream_rms, per_token_stream
        self.centred, self.eps = base.config.norm_type == "layernorm", base.config.norm_eps
        self._stream = self._rms = None  # per-token stream: the last write point's stream, and x's RMS it carries
        sublayers = [
            pair
            for layer in base.layers
            for pair in ((layer.attention_norms, layer.self_attn), (layer.mlp_norms, layer.mlp))
        ]
        # per write point: its norm, and the norms of the sublayer whose sum it normalises (None: the embeddings)
        writes = [(base.embeddings.norm, None)] + [(norms.residual_norm, norms) for norms, _ in sublayers[:-1]]
        for point, (norm, summed) in enumerate(writes):
            self.hooks.append(norm.register_forward_hook(self._mix_write(point, summed)))
            norms, module = sublayers[point]
            if isinstance(norms.input_norm, nn.Identity):
                self.hooks.append(module.register_forward_pre_hook(self._mix_input(point)))
        if per_token_stream:  # the last sum reaches the source's final norm, never mixed: rescaled only
            last = sublayers[-1][0]
            final = base.norm if isinstance(last.residual_norm, nn.Identity) else last.residual_norm
            self.hooks.append(final.register_forward_pre_hook(self._rescale_last(last)))

    def _rescaled_sum(self, point: int, summed, states: torch.Tensor) -> torch.Tensor:
        """The sum `states` of the sublayer before `point` (of norms `summed`), its carried per-token stream u_s
        rescaled by (rho_s / r_s)^t: alpha * (x_s + F_s) / r_s with t = 1."""
        if self._rms is None:
            return states
        carried = self._stream * (summed.residual_weight if summed.residual_weight is not None else 1.0)
        rescale = (self._rms / self.stream_rms[point - 1]) ** self.per_token[point - 1].item()
        return states + summed.residual_scale * carried * (rescale - 1)

    def _rescale_last(self, summed):
        def hook(module, args):
            return (self._rescaled_sum(2 * self.layers, summed, args[0]), *args[1:])

        return hook

    def _source_side(self, point: int, summed, states: torch.Tensor) -> torch.Tensor:
        """The stream the source's side gives at `point` from the sum `states` the norm reads: x_p / r_p, or with
        `per_token_stream` x_p / rho_p (and rho_p kept for the next point)."""
        to_source = 1.0  # the embeddings' output is x_0; a sum is alpha * x_{s+1} / r_s
        if summed is not None:
            states = self._rescaled_sum(point, summed, states) if self.per_token_stream else states
            to_source = self.stream_rms[point - 1] / summed.residual_scale
        states = states - states.mean(-1, keepdim=True) if self.centred else states
        if not self.per_token_stream:
            return states * (to_source / self.stream_rms[point])
        rms = states.float().pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-30).to(states.dtype)
        self._rms = rms * to_source
        return states / rms

    def _mix_write(self, point: int, summed):
        def hook(norm, args, output):
            gate = self.gates[point].item()
            if gate == 1.0:
                self._stream = self._rms = None
                return output
            mixed = gate * output + (1 - gate) * self._source_side(point, summed, args[0])
            if self.per_token_stream:
                self._stream = mixed
            return mixed

        return hook

    def _mix_input(self, point: int):
        def hook(module, args):
            gate = self.gates[point].item()
            if gate == 1.0:
                return None
            scale = self.stream_rms[point] if self._rms is None else self._rms  # what x was divided by
            eps = self.eps / scale**2  # the source's, on the stream
            return (gate * args[0] + (1 - gate) * normalised(args[0], self.centred, eps), *args[1:])

        return hook


class BranchMix(_Gates):
    """Hooks on a conversion out of pre-LN into sandwich that mix each branch norm B with its input by `gates`, one a
    sublayer: g * B(F) + (1 - g) * F. The input norms and the stream are the source's, so with every gate shut the
    student computes its source exactly, and with every gate open its own function."""

    def __init__(self, model: nn.Module):
        super().__init__(model)
        if not gated_at_branch_norms(self.base.config):
            raise ValueError(
                "the branch mix needs an input and a branch norm at every sublayer, and none on the stream"
            )
        sublayers = [norms for layer in self.base.layers for norms in (layer.attention_norms, layer.mlp_norms)]
        self.hooks = [
            norms.output_norm.register_forward_hook(self._mix(point)) for point, norms in enumerate(sublayers)
        ]

    def _mix(self, point: int):
        def hook(norm, args, output):
            gate = self.gates[point].item()
            return None if gate == 1.0 else gate * output + (1 - gate) * args[0]

        return hook


def gated_at_branch_norms(config) -> bool:
    """Whether every sublayer of `config` has an input and a branch norm and none on the stream (sandwich): what
    `BranchMix` gates."""
    slots = {"input_norm", "output_norm"}
    return config.first_attention_input_norm and all(
        NORM_PLACEMENTS[placement] == slots for placement in config.layer_norm_placements
    )


@dataclass(frozen=True)
class LayerGates:
    """Where a calibrated conversion out of pre-LN is gated to compute its source, layer by layer: at its stream
    points through the source's `stream_rms` (into post, pre_post, deepnorm), or at its branch norms (into sandwich:
    None)."""

    stream_rms: list[float] | None = None

    def mix(self, model: nn.Module, per_token_stream: bool = False) -> StreamMix | BranchMix:
        """The hooks that gate `model`, every gate open."""
        if self.stream_rms is None:
            return BranchMix(model)
        return StreamMix(model, self.stream_rms, per_token_stream)


@torch.no_grad()
def kl_by_layer(source: nn.Module, model: nn.Module, gates: LayerGates, batches: list[dict]) -> list[float]:
    """The next-token KL(source || model) in nats per token with each layer alone in the target placement, every
    other computing the source's function through its `gates`: where a conversion out of pre-LN loses what it loses."""
    kls, expected = [], list(next_token_log_probs(source, batches))  # the source's, once
    mix = gates.mix(model)
    try:
        for layer in range(mix.layers):
            mix.gates.zero_()
            mix.gates[2 * layer : 2 * layer + 2] = 1
            kls.append(agreement_with(expected, model, batches)["kl"])
    finally:
        mix.remove()
    return kls


def largest_layers(kls: list[float], count: int = 3) -> str:
    """The `count` layers of `kl_by_layer` that lose the most alone, largest first: "layer 3: 0.812, 0: 0.502"."""
    layers = sorted(range(len(kls)), key=kls.__getitem__, reverse=True)[:count]
    return "layer " + ", ".join(f"{layer}: {kls[layer]:.3f}" for layer in layers)
