"""The per-layer diagnostics of a comparison's training (`probes.diagnostics`, `probes.collapse`), recorded by a
Trainer callback."""

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from ..devices import compute_device
from ..model.evaluation_mode import evaluation_mode
from ..probes.collapse import collapse_profile
from ..probes.diagnostics import layer_gradient_norms, residual_rms
from ..sharding import gathered


class DiagnosticsCallback(TrainerCallback, ExportableState):
    """Records, at initialisation and every logging step, per-layer gradient norms, residual-stream RMS and the
    collapse figures (`hf_normswap.collapse`) of the probe.

    At initialisation the gradients are those of `probe` (a fixed validation batch, in eval mode, before any update),
    the measurement of Xiong et al. (2020); during training they are the training gradients after clipping.
    """

    def __init__(self, probe: dict[str, list], num_layers: int, records: list | None = None):
        self.probe = probe  # plain lists, so that the state saved with checkpoints stays JSON
        self.num_layers = num_layers
        self.records = records or []

    def state(self) -> dict:
        return {"args": {"probe": self.probe, "num_layers": self.num_layers}, "attributes": {"records": self.records}}

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if self.records:  # resumed: the measurement at initialisation is already there
            return
        with evaluation_mode(model):
            rms = residual_rms(model, self._probe(model), self.num_layers, backward=True)
            self.records.append({"step": 0, **layer_gradient_norms(model, self.num_layers), "residual_rms": rms})
            with gathered(model):  # a sharded model's root, for its base model alone
                self.records[-1]["collapse"] = collapse_profile(model, [self._probe(model)])
            model.zero_grad(set_to_none=True)

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if (state.global_step + 1) % args.logging_steps == 0:
            self.records.append({"step": state.global_step + 1, **layer_gradient_norms(model, self.num_layers)})

    def on_log(self, args, state, control, model=None, logs=None, **kwargs):
        if not self.records or self.records[-1]["step"] != state.global_step or "residual_rms" in self.records[-1]:
            return
        with evaluation_mode(model):
            self.records[-1]["residual_rms"] = residual_rms(model, self._probe(model), self.num_layers)
            with gathered(model):
                self.records[-1]["collapse"] = collapse_profile(model, [self._probe(model)])

    def _probe(self, model) -> dict:
        device = compute_device(model)
        return {name: torch.tensor(values, device=device) for name, values in self.probe.items()}
