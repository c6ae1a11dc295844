"""Per-layer training diagnostics: gradient norms of attention and feed-forward, residual-stream RMS, collapse."""

import re

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from ..model.evaluation_mode import evaluation_mode
from ..sharding.fsdp import compute_device, gathered
from .collapse import collapse_profile


# NormSwap, BERT and LLaMA parameter names: the layer index, then what the parameter belongs to.
_LAYER_PARAMETER = re.compile(
    r"layers?\.(\d+)\.(self_attn|attention_norms|attention|input_layernorm|mlp_norms|mlp|intermediate|output|post_attention_layernorm)\."
)
_ATTENTION = {"self_attn", "attention_norms", "attention", "input_layernorm"}


def layer_gradient_norms(model: torch.nn.Module, num_layers: int) -> dict[str, list[float]]:
    """The gradient norm of each layer's attention block and feed-forward block (each with its norms)."""
    squares = {"attention": [0.0] * num_layers, "ffn": [0.0] * num_layers}
    for name, parameter in model.named_parameters():
        found = _LAYER_PARAMETER.search(name)
        if found and parameter.grad is not None:
            part = "attention" if found.group(2) in _ATTENTION else "ffn"
            squares[part][int(found.group(1))] += parameter.grad.detach().float().pow(2).sum().item()
    return {part: [value**0.5 for value in values] for part, values in squares.items()}


def _layers(model: torch.nn.Module, num_layers: int) -> torch.nn.ModuleList:
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == num_layers:
            return module
    raise ValueError(f"{type(model).__name__}: no list of {num_layers} layers found")


def residual_rms(model: torch.nn.Module, batch: dict, num_layers: int, backward: bool = False) -> list[float]:
    """RMS of the residual stream over real tokens: entering layer 0, then after each layer.

    With `backward`, the batch's loss is also backpropagated (gradients are left in place for the caller).
    """
    captured = []

    def record(tensor):
        captured.append(tensor[0] if isinstance(tensor, tuple) else tensor)

    layers = _layers(model, num_layers)
    hooks = [
        layers[0].register_forward_pre_hook(
            lambda module, args, kwargs: record(args[0] if args else kwargs["hidden_states"]), with_kwargs=True
        )
    ]
    hooks += [layer.register_forward_hook(lambda module, args, output: record(output)) for layer in layers]
    try:
        with torch.set_grad_enabled(backward):
            output = model(**batch)
            if backward:
                output.loss.backward()
    finally:
        for hook in hooks:
            hook.remove()
    mask = batch["attention_mask"].bool()
    return [tensor.detach()[mask].float().pow(2).mean().sqrt().item() for tensor in captured]


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
