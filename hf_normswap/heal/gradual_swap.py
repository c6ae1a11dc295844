"""A gradual swap out of pre-LN: the student starts computing what its source computes and moves to its own
placement during healing (compare Heimersheim 2024, "You can remove GPT2's LayerNorm by fine-tuning").

A calibrated conversion out of pre-LN (`convert.stream_calibration`) scaled each sublayer's write by alpha / r_s,
with r_s the source's median stream RMS before sublayer s. If each norm that writes the stream divided by those
constants instead of by each token's own RMS, the stream would hold x_s / r_s, and the sublayers' inputs, normalised
without parameters, would be exactly the source's normalised states: the source's function. So at every point p a
gate g_p in [0, 1] mixes the two:

    write norm:       g * norm(z) + (1 - g) * z * r_{p-1} / (alpha * r_p)      (the embedding norm: z / r_0)
    sublayer input:   g * y + (1 - g) * y / rms(y)                            (where the target has no input norm)

g = 0 everywhere is the source, g = 1 the calibrated target; the last write (the source's final norm) is never mixed.
The gates open over the first half of the steps, all at once (`gate`) or one layer after another (`layers`); before
the first step (where the healing measures the student as it starts) they are open.
"""

from pathlib import Path

import torch
from torch import nn
from transformers import TrainerCallback

from ..convert.converter import ConversionRecord
from .options import HealError


def _normalised(states: torch.Tensor, centred: bool, eps: float) -> torch.Tensor:
    """`states` with zero mean (LayerNorm) and unit RMS over features, without parameters."""
    states = states - states.mean(-1, keepdim=True) if centred else states
    return states * torch.rsqrt(states.float().pow(2).mean(-1, keepdim=True) + eps).to(states.dtype)


class GradualSwap(TrainerCallback):
    """Hooks on the student's norms and sublayers that mix source and target at each stream point, and the schedule
    that opens their gates."""

    def __init__(self, model: nn.Module, stream_rms: list[float], schedule: str, max_steps: int):
        base = getattr(model, "get_base_model", lambda: model)().base_model  # through a PEFT wrapper
        self.schedule, self.opening_steps = schedule, max(1, max_steps // 2)
        self.layers = len(base.layers)
        if len(stream_rms) != 2 * self.layers + 1:
            raise HealError(f"swap_schedule={schedule!r}: the recorded stream RMS does not fit the student's layers")
        self.gates = torch.ones(2 * self.layers)  # open, the student's own placement, until training's first step
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

    def set_step(self, step: int) -> None:
        """Opens the gates for training step `step`."""
        progress = min(1.0, step / self.opening_steps)
        if self.schedule == "gate":
            self.gates.fill_(progress)
        else:  # layers: layer l opens while progress * layers goes from l to l + 1
            per_layer = (progress * self.layers - torch.arange(self.layers)).clamp(0, 1)
            self.gates.copy_(per_layer.repeat_interleave(2))

    def on_step_begin(self, args, state, control, **kwargs):
        self.set_step(state.global_step)

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()


def recorded_stream_rms(variant: Path, schedule: str) -> list[float]:
    """The source's stream RMS that a calibrated conversion out of pre-LN recorded in VARIANT's conversion.json."""
    calibration = (ConversionRecord.read(variant) or {}).get("calibration")
    if not calibration or not calibration.get("stream_rms"):
        raise HealError(
            f"swap_schedule={schedule!r} needs a calibrated conversion out of pre-LN (post, pre_post or deepnorm); "
            f"{variant}'s conversion.json records none"
        )
    return calibration["stream_rms"]
