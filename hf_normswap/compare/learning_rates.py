"""Learning rates relative to the source: each weight matrix's scaled by its size over the source's same matrix.

Adam moves every weight by about the learning rate, whatever the weight's size, so a conversion that rescales weights
changes what one learning rate means. Calibrated writes out of pre-LN multiply a layer's writes by 1 / (the source's
stream RMS there): SmolLM2-135M's last writes shrink 30-fold and its first grow 8.6-fold, and Adam then moves the last
ones 30 times as much, relative to their size, as it moves the source's. Scaled by their RMS over the source's, a
variant's matrices move as much relative to their size as the source's would; the unswapped variant's scales are 1.
Measured: docs/experiments/main-job.md.
"""

import torch
from transformers import Trainer


def weight_sizes(model: torch.nn.Module) -> dict[str, float]:
    """The RMS of each weight matrix of `model`'s base model, by its name there."""
    return {name: _rms(weight) for name, weight in model.base_model.named_parameters() if weight.dim() >= 2}


def learning_rate_scales(model: torch.nn.Module, source_sizes: dict[str, float]) -> dict[str, float]:
    """Each trained parameter's learning-rate scale, by its name in `model`: a base-model matrix's RMS over the
    source's matrix of that name (`source_sizes`: `weight_sizes` of the source), else 1."""
    by_id = {}
    for name, weight in model.base_model.named_parameters():
        if weight.dim() >= 2 and source_sizes.get(name):
            by_id[id(weight)] = _rms(weight) / source_sizes[name]
    return {name: by_id.get(id(weight), 1.0) for name, weight in model.named_parameters() if weight.requires_grad}


class RelativeLearningRateTrainer(Trainer):
    """A Trainer whose optimizer gives each trained parameter the learning rate times its scale in
    `learning_rate_scales` (by parameter name; weight decay and the schedule as the Trainer sets them)."""

    def __init__(self, *args, learning_rate_scales: dict[str, float], **kwargs):
        super().__init__(*args, **kwargs)
        self.learning_rate_scales = learning_rate_scales

    def create_optimizer(self, model=None) -> torch.optim.Optimizer:
        if self.optimizer is None:
            model = self.model if model is None else model
            decayed = set(self.get_decay_parameter_names(model))
            optimizer_class, settings = self.get_optimizer_cls_and_kwargs(self.args, model)
            groups = [
                {
                    "params": [weight],
                    "lr": self.args.learning_rate * self.learning_rate_scales[name],
                    "weight_decay": self.args.weight_decay if name in decayed else 0.0,
                }
                for name, weight in model.named_parameters()
                if weight.requires_grad
            ]
            self.optimizer = optimizer_class(groups, **settings)
        return self.optimizer


def _rms(weight: torch.Tensor) -> float:
    return weight.detach().float().pow(2).mean().sqrt().item()
