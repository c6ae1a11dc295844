"""Per-layer training diagnostics: gradient norms of attention and feed-forward, residual-stream RMS."""

import re

import torch


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
