"""NormSwap models whose layers stay on disk: built with their parameters on the meta device, each layer loaded when it
runs and dropped when another layer of the same model is loaded, the input and output embeddings loaded when they run
and dropped after, and the rest (norms, pooler, head transforms) loaded whole, so that memory holds one layer of each
model. A model loaded from a folder it is written back to writes the tensors that changed back into the folder's
shards, in place, as it drops them."""

import weakref
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from ..checkpoint import update_tensors, weight_files
from ..model.configuration_normswap import NormSwapConfig
from ..model.heads import empty_model, local_name
from .families import Family
from .options import ConversionError


Loaders = dict[str, Callable[[], torch.Tensor]]  # each tensor's name in the model, and how to read it
_LAZY: "weakref.WeakKeyDictionary[nn.Module, LazyLayers]" = weakref.WeakKeyDictionary()


def _safetensors(files: list[Path]) -> list[Path]:
    for file in files:
        if file.suffix != ".safetensors":
            raise ConversionError(f"{file}: low_memory needs safetensors weights (pickles are read whole)")
    return files


def _read(file: Path, key: str) -> torch.Tensor:
    with safe_open(file, framework="pt") as opened:
        return opened.get_tensor(key)


def folder_loaders(folder: Path) -> Loaders:
    """The tensors of a NormSwap checkpoint written in FOLDER, by their names in its model."""
    loaders = {}
    for file in _safetensors(weight_files(folder)):
        with safe_open(file, framework="pt") as opened:
            for key in opened.keys():
                loaders[key] = lambda file=file, key=key: _read(file, key)
    return loaders


def source_loaders(files: list[Path], family: Family, head: str) -> Loaders:
    """The NormSwap tensors that the source's weight FILES become (`Family.to_normswap`), by their names in the
    model of `head`; which tensor a source tensor becomes is found on the meta device, without reading it."""
    loaders = {}
    for file in _safetensors(files):
        with safe_open(file, framework="pt") as opened:
            for key in opened.keys():
                shape = opened.get_slice(key).get_shape()
                renamed = family.to_normswap(key, torch.empty(shape, device="meta"), head)
                for part, (name, _) in enumerate(renamed):
                    loaders[local_name(name=name, head=head)] = lambda file=file, key=key, part=part: (
                        family.to_normswap(key, _read(file, key).float(), head)[part][1]
                    )
    return loaders


def reader(loaders: Loaders) -> Callable[[str], torch.Tensor | None]:
    """Reads a tensor by its name in the model (None: no loader has it)."""
    return lambda name: loaders[name]() if name in loaders else None


def assign_weights(
    model: nn.Module, module: nn.Module, prefix: str, read: Callable[[str], torch.Tensor | None], recurse: bool = True
) -> None:
    """Loads the meta parameters of `module` (its own only, without `recurse`; named under `prefix` in `model`) from
    `read` (a tensor by its name in `model`, or None), in each parameter's dtype; those `read` lacks are initialised
    as `from_pretrained` initialises the weights a checkpoint lacks."""
    state, empty = {}, set()
    tensors = module.state_dict(keep_vars=True) if recurse else {**module._parameters, **module._buffers}
    for name, tensor in tensors.items():
        if tensor is None or tensor.device.type != "meta":  # buffers are built on the CPU
            continue
        value = read(prefix + name)
        if value is None:
            value = torch.empty_like(tensor, device="cpu")
            empty.add(name)
        state[name] = value.to(tensor.dtype)
    module.load_state_dict(state, strict=False, assign=True)
    owners = set()
    for name in state:
        owner, _, attribute = name.rpartition(".")
        getattr(module.get_submodule(owner), attribute)._is_hf_initialized = name not in empty
        if name in empty:
            owners.add(owner)
    for owner in owners:
        model._init_weights(module.get_submodule(owner))


class LazyLayers:
    """The layers of `model` (parameters on the meta device) read from `loaders` one at a time; with a `folder`, the
    tensors that changed are written back there, in place, when their layer is dropped (and at `close`)."""

    def __init__(self, model: nn.Module, loaders: Loaders, folder: Path | None = None):
        self.model, self.loaders, self.folder = model, loaders, folder
        self.prefix = "" if model.base_model is model else f"{model.base_model_prefix}."
        self.current, self.changed = None, set()
        for index, layer in enumerate(model.base_model.layers):
            layer.register_forward_pre_hook(lambda module, args, index=index: self.load(index) and None)
        _LAZY[model.base_model] = self

    def _layer_prefix(self, index: int) -> str:
        return f"{self.prefix}layers.{index}."

    def load(self, index: int) -> nn.Module:
        """Layer `index`, loaded (dropping the one loaded before)."""
        layer = self.model.base_model.layers[index]
        if self.current != index:
            self.release()
            assign_weights(self.model, layer, self._layer_prefix(index), reader(self.loaders))
            self.current = index
        return layer

    def _write_changes(self, tensors: dict[str, torch.Tensor]) -> None:
        """Writes those of `tensors` (by their names in the model) that differ from the folder's back into it."""
        if self.folder is None:
            return
        changed = {
            name: tensor
            for name, tensor in tensors.items()
            if name in self.loaders
            and tensor.device.type != "meta"
            and not torch.equal(tensor, self.loaders[name]().to(tensor.dtype))
        }
        update_tensors(folder=self.folder, tensors=changed)
        self.changed |= changed.keys()

    def stream(self, module: nn.Module, prefix: str) -> None:
        """Reads `module`'s own weights (named under `prefix`) when it runs and drops them after, writing changes
        back."""

        def drop(module, args, output):
            self._write_changes({prefix + name: tensor for name, tensor in module._parameters.items()})
            module.to("meta")

        module.register_forward_pre_hook(
            lambda module, args: assign_weights(self.model, module, prefix, reader(self.loaders), recurse=False)
        )
        module.register_forward_hook(drop)

    def release(self) -> None:
        """Drops the loaded layer, writing its changed tensors back."""
        if self.current is not None:
            layer = self.model.base_model.layers[self.current]
            prefix = self._layer_prefix(self.current)
            self._write_changes({prefix + name: tensor for name, tensor in layer.state_dict().items()})
            layer.to("meta")
            self.current = None

    def close(self) -> set[str]:
        """Drops the loaded layer, writes the changed tensors back; returns the names of those that changed."""
        self.release()
        layers = f"{self.prefix}layers."
        self._write_changes({name: t for name, t in self.model.state_dict().items() if not name.startswith(layers)})
        return set(self.changed)


def load_layer(base: nn.Module, index: int) -> nn.Module:
    """Layer `index` of a base model, loaded first if its layers are lazy."""
    lazy = _LAZY.get(base)
    return lazy.load(index) if lazy is not None else base.layers[index]


def lazy_model(config: NormSwapConfig, head: str, loaders: Loaders, folder: Path | None = None) -> nn.Module:
    """The NormSwap model of `head` and `config` with lazy layers (`LazyLayers`, reachable with `lazy_of`), lazy
    input and output embeddings (`LazyLayers.stream`; a tied head reads its own copy), the rest loaded, in float32 and
    evaluation mode."""
    model = empty_model(config, head)
    tied = model.all_tied_weights_keys.items()
    loaders = {**{target: loaders[source] for target, source in tied if source in loaders}, **loaders}
    lazy = LazyLayers(model, loaders, folder)
    names = {module: name for name, module in model.named_modules()}
    embeddings = [model.get_input_embeddings(), model.get_output_embeddings()]
    streamed = [
        module
        for module in embeddings
        if module is not None and all(f"{names[module]}.{name}" in loaders for name in module._parameters)
    ]
    layers = f"{lazy.prefix}layers"
    for name, module in model.named_modules():
        if module in streamed or name == layers or name.startswith(f"{layers}."):
            continue
        if next(module.parameters(recurse=False), None) is not None:
            assign_weights(model, module, f"{name}." if name else "", reader(loaders), recurse=False)
    for module in streamed:
        lazy.stream(module, f"{names[module]}.")
    return model.eval()


def lazy_of(model: nn.Module) -> LazyLayers | None:
    """The `LazyLayers` of a model from `lazy_model` (None for a model loaded whole)."""
    return _LAZY.get(model.base_model)
