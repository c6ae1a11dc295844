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
"""

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from ..probes.next_token import next_token_agreement


def _normalised(states: torch.Tensor, centred: bool, eps: float) -> torch.Tensor:
    """`states` with zero mean (LayerNorm) and unit RMS over features, without parameters."""
    states = states - states.mean(-1, keepdim=True) if centred else states
    return states * torch.rsqrt(states.float().pow(2).mean(-1, keepdim=True) + eps).to(states.dtype)


class StreamMix:
    """Hooks on a converted model's norms and sublayers that mix source and target at each of its 2 * layers stream
    points (two a layer: before attention, before the MLP) by `gates`, all open (the target) until set."""

    def __init__(self, model: nn.Module, stream_rms: list[float]):
        base = getattr(model, "get_base_model", lambda: model)().base_model  # through a PEFT wrapper
        self.layers = len(base.layers)
        if len(stream_rms) != 2 * self.layers + 1:
            raise ValueError("the recorded stream RMS does not fit the model's layers")
        self.gates = torch.ones(2 * self.layers)
        self.hooks = []
        centred = base.config.norm_type == "layernorm"
        sublayers = [
            pair
            for layer in base.layers
            for pair in ((layer.attention_norms, layer.self_attn), (layer.mlp_norms, layer.mlp))
        ]
        writes = [(base.embeddings.norm, 1 / stream_rms[0])] + [
            (norms.residual_norm, stream_rms[s] / (norms.residual_scale * stream_rms[s + 1]))
            for s, (norms, _) in enumerate(sublayers[:-1])
        ]
        for point, (norm, factor) in enumerate(writes):
            self.hooks.append(norm.register_forward_hook(self._mix_write(point, factor, centred)))
            norms, module = sublayers[point]
            if isinstance(norms.input_norm, nn.Identity):
                eps = base.config.norm_eps / stream_rms[point] ** 2  # the source's, on a stream divided by r
                self.hooks.append(module.register_forward_pre_hook(self._mix_input(point, centred, eps)))

    def _mix_write(self, point: int, factor: float, centred: bool):
        def hook(norm, args, output):
            gate = self.gates[point].item()
            if gate == 1.0:
                return output
            states = args[0] - args[0].mean(-1, keepdim=True) if centred else args[0]
            return gate * output + (1 - gate) * factor * states

        return hook

    def _mix_input(self, point: int, centred: bool, eps: float):
        def hook(module, args):
            gate = self.gates[point].item()
            if gate == 1.0:
                return None
            return (gate * args[0] + (1 - gate) * _normalised(args[0], centred, eps), *args[1:])

        return hook

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()


@contextlib.contextmanager
def stream_mix(model: nn.Module, stream_rms: list[float]) -> Iterator[StreamMix]:
    """`model` mixed with its source (`StreamMix`) for the block, its hooks removed after."""
    mix = StreamMix(model, stream_rms)
    try:
        yield mix
    finally:
        mix.remove()


@torch.no_grad()
def kl_by_layer(source: nn.Module, model: nn.Module, stream_rms: list[float], batches: list[dict]) -> list[float]:
    """The next-token KL(source || model) in nats per token with each layer alone in the target placement, every
    other computing the source's function: where a conversion out of pre-LN loses what it loses."""
    kls = []
    with stream_mix(model, stream_rms) as mix:
        for layer in range(mix.layers):
            mix.gates.zero_()
            mix.gates[2 * layer : 2 * layer + 2] = 1
            kls.append(next_token_agreement(source, model, batches)["kl"])
    return kls


def largest_layers(kls: list[float], count: int = 3) -> str:
    """The `count` layers of `kl_by_layer` that lose the most alone, largest first: "layer 3: 0.812, 0: 0.502"."""
    layers = sorted(range(len(kls)), key=kls.__getitem__, reverse=True)[:count]
    return "layer " + ", ".join(f"{layer}: {kls[layer]:.3f}" for layer in layers)
