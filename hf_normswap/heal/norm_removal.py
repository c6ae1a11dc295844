"""A norm-free student (`none`) that starts as its pre-LN source and loses its norms during healing (compare Baroni et
al. 2025, who remove GPT-2's LayerNorms in stages). The conversion folded each removed norm into its readers over the
source's median stream RMS r there (`removed_norm_rms`); multiplying the readers' input x by r / rms(x) (LayerNorm:
the RMS of the centred x, epsilon as the source's) gives back the source's per-token division exactly. Each point
mixes the two divisors by the share k of its norm kept:

    x -> x * r / (k * rms(x) + (1 - k) * r)

Mixing the outputs instead, x * (k * r / rms(x) + 1 - k), lets a small norm-free share multiply a sink's stream:
SmolLM2 overflows at k = 0.75 that way, where the divisors' mix stays within KL 0.10 of the source.

k = 1 everywhere is the source, k = 0 the norm-free student. Over the first half of the steps k goes from 1 to 0 at
every point at once (`gate`), one layer after another, the final norm last (`layers`), or a group at a time: the MLPs'
norms, then attention's, then the final norm (`stages`, Baroni's order). Before the first step (where the healing
measures the student as it starts) every k is 0. A first position's own divisors (`first_position_scales`, factors
c on its input) are removed last, over the second half of the steps (c to 1), and the saved student has none.
"""

from dataclasses import asdict

import torch
from torch import nn

from .report import NormRemovalStage
from .trainer import CheckpointedFigures, DevelopmentTexts


NORM_FREE_SCHEDULES = ("gate", "layers", "stages")


class NormRemoval(CheckpointedFigures):
    """Hooks on a norm-free model's stream readers that give back a share `kept` of each removed norm, in forward
    order (per layer: attention, MLP; the final norm last), and the schedule that takes it away; the figures of each
    stage kept beside the checkpoints."""

    FILE = "norm_removal.json"

    def __init__(
        self,
        model: nn.Module,
        removed_rms: list[float],
        schedule: str,
        max_steps: int,
        development: DevelopmentTexts | None = None,
    ):
        base = getattr(model, "get_base_model", lambda: model)().base_model  # through a PEFT wrapper
        points = [norms.input_norm for layer in base.layers for norms in (layer.attention_norms, layer.mlp_norms)]
        self.layers, self.opening_steps = len(base.layers), max(1, max_steps // 2)
        self.removed_rms, self.kept = removed_rms, torch.zeros(len(points) + 1)
        self.centred, self.eps = base.config.norm_type == "layernorm", base.config.norm_eps
        self.hooks = [
            point.register_forward_hook(lambda _, args, output, index=index: self._mixed(output, index))
            for index, point in enumerate(points)
        ]
        final = len(points)
        self.hooks.append(base.norm.register_forward_pre_hook(lambda _, args: (self._mixed(args[0], final),)))
        self.model, self.first_scales = base, base.config.first_position_scales
        self.settled_step = self.opening_steps * (2 if self.first_scales else 1)  # every norm and divisor removed
        if schedule == "gate":
            self.groups, self.group_names = torch.zeros(len(points) + 1, dtype=torch.long), ["every norm"]
        elif schedule == "layers":  # group l: layer l's two points; the final norm its own last group
            self.groups = torch.cat([torch.arange(self.layers).repeat_interleave(2), torch.tensor([self.layers])])
            self.group_names = [f"layer {layer}" for layer in range(self.layers)] + ["final norm"]
        else:  # stages: the MLPs' norms, then attention's, then the final norm
            self.groups = torch.cat([torch.tensor([1, 0]).repeat(self.layers), torch.tensor([2])])
            self.group_names = ["MLP norms", "attention norms", "final norm"]
        self.development = development
        self.stages: list[NormRemovalStage] = []  # heal.json's norm_removal

    def _mixed(self, states: torch.Tensor, point: int) -> torch.Tensor:
        kept = self.kept[point].item()
        if kept == 0:
            return states
        spread = states - states.mean(-1, keepdim=True) if self.centred else states
        rms = (spread.float().pow(2).mean(-1, keepdim=True) + self.eps).sqrt()
        removed = self.removed_rms[point]
        return states * (removed / (kept * rms + (1 - kept) * removed)).to(states.dtype)

    def _shares(self, step: int) -> tuple[torch.Tensor, float]:
        """Each point's kept share at training step `step`, and the part of the first position's factors left."""
        progress = min(1.0, step / self.opening_steps)
        count = len(self.group_names)
        left = 1 - min(1.0, max(0.0, step / self.opening_steps - 1))  # over the second half
        return 1 - (progress * count - self.groups).clamp(0, 1), left

    def set_step(self, step: int) -> None:
        """Sets each point's kept share for training step `step`, and the first position's factors (c to 1)."""
        kept, left = self._shares(step)
        self.kept.copy_(kept)
        if self.first_scales:
            self.model.config.first_position_scales = [1 + (scale - 1) * left for scale in self.first_scales]

    def removed(self, step: int) -> list[str]:
        """The groups of norms gone at training step `step` (and the first position's divisors, where it had some)."""
        kept, left = self._shares(step)
        gone = [name for group, name in enumerate(self.group_names) if not kept[self.groups == group].any()]
        return gone + (["first position's divisors"] if self.first_scales and left == 0 else [])

    def figures(self) -> dict:
        return {"stages": [asdict(stage) for stage in self.stages]}

    def restore(self, figures: dict) -> None:
        self.stages = [NormRemovalStage(**stage) for stage in figures["stages"]]

    def on_step_begin(self, args, state, control, **kwargs):
        self.set_step(state.global_step)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        """With development texts, the student's figures there at the step where a group of norms is gone."""
        step = state.global_step
        self.set_step(step)  # as the next step begins, where the measurements after this one see it
        newly = [name for name in self.removed(step) if name not in self.removed(step - 1)]
        if self.development is None or not newly:
            return
        with self.measuring():
            self.stages.append(NormRemovalStage(step=step, removed=newly, **self.development.figures(model, step)))

    def remove(self) -> None:
        """Takes the hooks away, and the first position's divisors: the student is norm-free."""
        for hook in self.hooks:
            hook.remove()
        if self.first_scales:
            self.model.config.first_position_scales = None
