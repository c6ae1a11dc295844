"""A gradual swap out of pre-LN: the student starts computing what its source computes and moves to its own
placement during healing, its stream points' gates (`probes.stream_mix`) opening over the first half of the steps,
all at once (`gate`) or one layer after another (`layers`); with `taper`, one layer after another too, from the exact
post-LN rewrite that divides each write by the token's own stream RMS to the median's (`per_token_stream`). Before
the first step (where the healing measures the student as it starts) the gates are open.
"""

from pathlib import Path

import torch
from torch import nn
from transformers import TrainerCallback

from ..convert.calibration import CalibrationRecord
from ..convert.converter import ConversionRecord
from ..probes.stream_mix import StreamMix
from .options import HealError


class GradualSwap(StreamMix, TrainerCallback):
    """The student mixed with its source (`StreamMix`), and the schedule that opens the gates."""

    def __init__(self, model: nn.Module, stream_rms: list[float], schedule: str, max_steps: int):
        if schedule == "stages":
            raise HealError("swap_schedule='stages' is for norm-free students (norm_placement 'none')")
        try:
            super().__init__(model, stream_rms, per_token_stream=schedule == "taper")
        except ValueError as error:
            raise HealError(f"swap_schedule={schedule!r}: {error}") from None
        self.schedule, self.opening_steps = schedule, max(1, max_steps // 2)
        self.settled_step = self.opening_steps  # from here the student computes its own function

    def set_step(self, step: int) -> None:
        """Opens the gates for training step `step`."""
        progress = min(1.0, step / self.opening_steps)
        if self.schedule == "gate":
            self.gates.fill_(progress)
            return
        # layers and taper: layer l opens while progress * layers goes from l to l + 1
        per_layer = (progress * self.layers - torch.arange(self.layers)).clamp(0, 1).repeat_interleave(2)
        self.gates.copy_(per_layer)
        self.per_token.copy_(1 - per_layer)  # taper: its writes from the token's own RMS to the median's

    def on_step_begin(self, args, state, control, **kwargs):
        self.set_step(state.global_step)


def _conversion_calibration(variant: Path) -> CalibrationRecord | None:
    record = ConversionRecord.read(variant)
    return record.calibration if record else None


def conversion_stream_rms(variant: Path) -> list[float] | None:
    """The source's stream RMS that a calibrated conversion out of pre-LN into a normalised stream recorded in
    VARIANT's conversion.json, or None."""
    calibration = _conversion_calibration(variant)
    return (calibration.stream_rms if calibration else None) or None


def calibrated_out_of_pre_ln(variant: Path) -> bool:
    """Whether VARIANT's conversion.json records a calibrated conversion out of pre-LN (where the block-wise fit
    starts)."""
    calibration = _conversion_calibration(variant)
    return calibration is not None and bool(calibration.out_of_pre_ln or calibration.stream_rms)


def recorded_stream_rms(variant: Path, needed_by: str) -> list[float]:
    """`conversion_stream_rms`, which `needed_by` (an option, as the user set it) needs."""
    stream_rms = conversion_stream_rms(variant)
    if stream_rms is None:
        raise HealError(
            f"{needed_by} needs a calibrated conversion out of pre-LN into post, pre_post or deepnorm; "
            f"{variant}'s conversion.json records none"
        )
    return stream_rms
