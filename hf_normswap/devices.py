"""Where a model computes, whether its parameters are plain tensors or DTensor shards."""

import torch


def compute_device(model: torch.nn.Module) -> torch.device:
    """The device `model` computes on: its parameters', the CPU for weights read from disk as they run (parameters on
    the meta device), or for DTensor shards the device their mesh gathers them on (with CPU offload the shards stay on
    the CPU while the units compute on the accelerator)."""
    parameter = next(model.parameters())
    mesh = getattr(parameter, "device_mesh", None)
    if parameter.device.type == "meta":
        return torch.device("cpu")
    if mesh is None or mesh.device_type == "cpu":
        return parameter.device
    return torch.device(mesh.device_type, torch.get_device_module(mesh.device_type).current_device())


def cpu_computes_bfloat16() -> bool:
    """Whether this CPU has bfloat16 arithmetic of its own (AVX512-BF16 or AMX, read from torch's private probes);
    without it, bfloat16 autocast on the CPU computes slower than float32 (docs/experiments/performance.md)."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
