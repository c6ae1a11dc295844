"""A gradual swap out of pre-LN: the student starts computing what its source computes and moves to its own
placement during healing, its gates (`probes.stream_mix`) opening over the first half of the steps, all at once
(`gate`) or one layer after another (`layers`); with `taper`, one layer after another too, from the exact post-LN
rewrite that divides each write by the token's own stream RMS to the median's (`per_token_stream`). A stream its
norms write (post, pre_post, deepnorm) is gated at its stream points, sandwich at its branch norms. Before the first
step (where the healing measures the student as it starts) the gates are open.
"""

import torch
from torch import nn
from transformers import TrainerCallback

from ..convert.branch_calibration import removes_norms
from ..convert.calibration import CalibrationRecord
from ..convert.converter import ConversionRecord
from ..model.configuration_normswap import NormSwapConfig
from ..probes.stream_mix import LayerGates
from .norm_removal import NORM_FREE_SCHEDULES
from .options import HealError


class GradualSwap(TrainerCallback):
    """The student mixed with its source through its `gates` (`probes.stream_mix`), and the schedule that opens
    them."""

    def __init__(self, model: nn.Module, gates: LayerGates, schedule: str, max_steps: int):
        self.mix = gates.mix(model, per_token_stream=schedule == "taper")
        self.schedule, self.opening_steps = schedule, max(1, max_steps // 2)
        self.settled_step = self.opening_steps  # from here the student computes its own function

    def set_step(self, step: int) -> None:
        """Opens the gates for training step `step`."""
        progress = min(1.0, step / self.opening_steps)
        if self.schedule == "gate":
            self.mix.gates.fill_(progress)
            return
        # layers and taper: layer l opens while progress * layers goes from l to l + 1
        per_layer = (progress * self.mix.layers - torch.arange(self.mix.layers)).clamp(0, 1).repeat_interleave(2)
        self.mix.gates.copy_(per_layer)
        if self.schedule == "taper":
            self.mix.per_token.copy_(1 - per_layer)  # its writes from the token's own RMS to the median's

    def remove(self) -> None:
        self.mix.remove()

    def on_step_begin(self, args, state, control, **kwargs):
        self.set_step(state.global_step)

    def on_step_end(self, args, state, control, **kwargs):
        self.set_step(state.global_step)  # as the next step begins, where the measurements after this one see it


def _calibration(conversion: ConversionRecord | None) -> CalibrationRecord | None:
    return conversion.calibration if conversion else None


def conversion_layer_gates(conversion: ConversionRecord | None, config: NormSwapConfig) -> LayerGates | None:
    """How a variant (of `config`) calibrated out of pre-LN computes its source layer by layer, from its
    `conversion` record, or None."""
    calibration = _calibration(conversion)
    return calibration.layer_gates(config) if calibration else None


def calibrated_out_of_pre_ln(conversion: ConversionRecord | None) -> bool:
    """Whether a variant's `conversion` record holds a calibrated conversion out of pre-LN (where the block-wise fit
    starts)."""
    calibration = _calibration(conversion)
    return calibration is not None and bool(calibration.out_of_pre_ln or calibration.stream_rms)


def check_swap_schedule(
    variant: str, conversion: ConversionRecord | None, config: NormSwapConfig, schedule: str
) -> None:
    """Refuses in one line a gradual `schedule` that VARIANT (of `config`, converted as its `conversion` record
    says) cannot start from its source's function: checked on its files, before any model loads."""
    if schedule == "direct":
        return
    points = 2 * config.num_hidden_layers + 1  # per layer attention's and the MLP's, and the final norm
    if removes_norms(config):
        if schedule not in NORM_FREE_SCHEDULES:
            allowed = ", ".join(["direct", *NORM_FREE_SCHEDULES])
            raise HealError(f"swap_schedule={schedule!r} is invalid for a norm-free student: allowed are {allowed}")
        if config.removed_norm_rms is None or len(config.removed_norm_rms) != points:
            raise HealError(f"swap_schedule={schedule!r} needs the removed_norm_rms a conversion records, one a norm")
        return
    if schedule == "stages":
        raise HealError("swap_schedule='stages' is for norm-free students (norm_placement 'none')")
    gates = conversion_layer_gates(conversion, config)
    if gates is None:
        raise HealError(
            f"swap_schedule={schedule!r} needs a calibrated conversion out of pre-LN into post, pre_post, deepnorm or "
            f"sandwich; {variant}'s conversion.json records none"
        )
    if schedule == "taper" and gates.stream_rms is None:
        raise HealError("swap_schedule='taper' is for a stream its norms write: sandwich's keeps each write's size")
    if gates.stream_rms is not None and len(gates.stream_rms) != points:
        raise HealError(f"swap_schedule={schedule!r}: the recorded stream RMS does not fit the model's layers")
