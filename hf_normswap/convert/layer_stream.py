"""A NormSwap base model run layer by layer over many batches: every batch goes through one layer before any goes
through the next, and the stream between layers waits in files of a temporary folder, so memory holds one batch's
activations however much data there is. Calibration uses it to finish a point over all the data before the next
point is fitted on what it wrote."""

import tempfile
from pathlib import Path

import torch
from torch import nn


class _Recorder(nn.Module):
    """Stands in for a layer: keeps the keywords the layer is called with and passes the stream through."""

    def __init__(self, attention_type: str):
        super().__init__()
        self.attention_type = attention_type
        self.hidden_states, self.kwargs = None, None

    def forward(self, hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:
        self.hidden_states, self.kwargs = hidden_states, kwargs
        return hidden_states


@torch.no_grad()
def layer_inputs(base: nn.Module, batch: dict) -> tuple[torch.Tensor, dict[str, dict]]:
    """The stream entering the first layer, and the keywords (masks, rotary tables, packing) each layer type is
    called with, from the model's own forward with its layers stood in for."""
    layers = base.layers
    recorders = {layer_type: _Recorder(layer_type) for layer_type in set(base.config.layer_types)}
    base.layers = nn.ModuleList(recorders[layer.attention_type] for layer in layers)
    try:
        base(**batch)
    finally:
        base.layers = layers
    stream = recorders[layers[0].attention_type].hidden_states  # every stand-in passes the embeddings' output on
    return stream, {layer_type: recorder.kwargs for layer_type, recorder in recorders.items()}


class LayerStream:
    """`base` run over `batches` one layer at a time; `layer` is the index of the next layer to run."""

    def __init__(self, base: nn.Module, batches: list[dict]):
        self.base, self.batches, self.layer, self.batch = base, batches, 0, None
        self._folder = tempfile.TemporaryDirectory(prefix="hf_normswap-stream-")
        for index, batch in enumerate(batches):
            self._save(index, layer_inputs(base, batch)[0])

    def _path(self, index: int) -> Path:
        return Path(self._folder.name) / f"{index}.pt"

    def _save(self, index: int, hidden_states: torch.Tensor) -> None:
        torch.save(hidden_states.contiguous(), self._path(index))

    @torch.no_grad()
    def output(self, index: int) -> torch.Tensor:
        """Runs the next layer on the stream of batch `index` (then `self.batch`) and returns its output."""
        layer, self.batch = self.base.layers[self.layer], self.batches[index]
        kwargs = layer_inputs(self.base, self.batch)[1][layer.attention_type]
        return layer(torch.load(self._path(index), weights_only=True), **kwargs)

    def advance(self, layer: int | None = None) -> None:
        """Runs layers until `layer` (default: the next one) is the next to run, keeping their outputs."""
        stop = self.layer + 1 if layer is None else layer
        while self.layer < stop:
            for index in range(len(self.batches)):
                self._save(index, self.output(index))
            self.layer += 1

    def close(self) -> None:
        self._folder.cleanup()
