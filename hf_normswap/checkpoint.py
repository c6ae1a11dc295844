"""Reading checkpoint weights tensor by tensor, and writing sharded safetensors into a folder that appears whole."""

import contextlib
import json
import os
import pickle
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from huggingface_hub import snapshot_download
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, WEIGHTS_INDEX_NAME, WEIGHTS_NAME


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "sentencepiece.bpe.model",
    "spiece.model",
    "chat_template.jinja",
)
# A sentence-transformers pipeline around the checkpoint: its module list, its settings, and (for old saves) the root
# Transformer's settings under the names sentence-transformers still reads.
SENTENCE_TRANSFORMERS_FILES = (
    "modules.json",
    "config_sentence_transformers.json",
    "sentence_bert_config.json",
    "sentence_roberta_config.json",
    "sentence_distilbert_config.json",
    "sentence_camembert_config.json",
    "sentence_albert_config.json",
    "sentence_xlm-roberta_config.json",
    "sentence_xlnet_config.json",
)


class CheckpointError(ValueError):
    """A problem with a checkpoint's files, said in one line."""


def weight_files(folder: Path, allow_pickle: bool = False) -> list[Path]:
    """The weight files of a checkpoint folder: safetensors (single or sharded), or pickles when allowed."""
    for single, index in ((SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME), (WEIGHTS_NAME, WEIGHTS_INDEX_NAME)):
        pickled = single == WEIGHTS_NAME
        found = (folder / index).exists() or (folder / single).exists()
        if found and pickled and not allow_pickle:
            raise CheckpointError(
                f"{folder}: only pickle weights ({single}), which can run code when loaded; pass --allow-pickle to "
                "read them with weights_only=True"
            )
        if (folder / index).exists():
            try:
                weight_map = json.loads((folder / index).read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as error:
                raise CheckpointError(f"{folder / index}: not a valid weight index ({error})") from None
            files = [folder / name for name in sorted(set(weight_map.values()))]
            for file in files:
                if not file.exists():
                    raise CheckpointError(f"{file}: listed in {index} but missing")
            return files
        if (folder / single).exists():
            return [folder / single]
    raise CheckpointError(f"{folder}: no weights found (expected {SAFE_WEIGHTS_NAME} or {SAFE_WEIGHTS_INDEX_NAME})")


def read_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Each (name, tensor) of a weight file, one at a time (safetensors is memory-mapped)."""
    if path.suffix != ".safetensors":
        try:
            try:
                state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError:  # legacy (non-zip) pickles cannot be memory-mapped
                state = torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as error:
            if "Unsupported global" not in str(error):  # a damaged file, not an object that weights_only refused
                raise CheckpointError(f"{path}: not a readable weights file (a damaged pickle)") from None
            raise CheckpointError(f"{path.name} is not a plain weights file (it would run code when loaded)") from None
        except Exception as error:
            message = str(error).strip().splitlines()[0][:120] if str(error).strip() else ""
            raise CheckpointError(f"{path}: cannot be read as weights ({type(error).__name__}: {message})") from None
        yield from state.items()
        return
    try:
        with safe_open(path, framework="pt") as file:
            for name in file.keys():
                yield name, file.get_tensor(name)
    except SafetensorError as error:
        raise CheckpointError(f"{path}: not a readable safetensors file ({error})") from None


class ShardWriter:
    """Writes tensors into safetensors shards of at most `max_shard_bytes`, named and indexed as Transformers does."""

    def __init__(self, folder: Path, max_shard_bytes: float):
        self.folder = folder
        self.max_shard_bytes = max_shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[list[str]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_shard_bytes:
            self._flush()
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        save_file(self.pending, self.folder / f"shard-{len(self.shards)}.tmp", metadata={"format": "pt"})
        self.shards.append(list(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> list[str]:
        """Writes the last shard and the index; returns the written file names."""
        if self.pending or not self.shards:
            self._flush()
        count = len(self.shards)
        if count == 1:
            os.replace(self.folder / "shard-0.tmp", self.folder / SAFE_WEIGHTS_NAME)
            return [SAFE_WEIGHTS_NAME]
        names, weight_map = [], {}
        for index, tensor_names in enumerate(self.shards):
            name = f"model-{index + 1:05d}-of-{count:05d}.safetensors"
            os.replace(self.folder / f"shard-{index}.tmp", self.folder / name)
            names.append(name)
            weight_map.update(dict.fromkeys(tensor_names, name))
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.folder / SAFE_WEIGHTS_INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        return [*names, SAFE_WEIGHTS_INDEX_NAME]


SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def update_tensors(folder: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Overwrites the named tensors in place in the safetensors shards of `folder`, each in its stored dtype: a
    safetensors file is an 8-byte little-endian header size, a JSON header giving each tensor's dtype, shape and byte
    offsets, then the raw bytes, so a tensor of the same shape and dtype takes exactly its old bytes."""
    remaining = dict(tensors)
    for file in weight_files(folder):
        with open(file, "r+b") as handle:
            header_size = int.from_bytes(handle.read(8), "little")
            header = json.loads(handle.read(header_size))
            for name in sorted(header.keys() & remaining.keys()):
                entry, tensor = header[name], remaining.pop(name)
                if entry["dtype"] not in SAFETENSORS_DTYPES or list(tensor.shape) != entry["shape"]:
                    raise CheckpointError(
                        f"{file}: {name} is stored as {entry['dtype']} {entry['shape']}, cannot take a tensor of "
                        f"shape {list(tensor.shape)} in place (floating-point dtypes only)"
                    )
                stored = tensor.detach().to("cpu", SAFETENSORS_DTYPES[entry["dtype"]]).contiguous().view(-1)
                handle.seek(8 + header_size + entry["data_offsets"][0])
                handle.write(stored.view(torch.uint8).numpy())
    if remaining:
        raise CheckpointError(f"{folder}: no shard holds {', '.join(sorted(remaining))}")


def check_output(output: str | os.PathLike, overwrite: bool) -> Path:
    """OUTPUT as a resolved path, if it may be written: not the working folder or above it, not a non-empty folder
    unless `overwrite`."""
    path = Path(output).resolve()
    if path == Path.cwd() or path in Path.cwd().parents:
        raise CheckpointError(f"{output}: is the working folder or contains it; choose a new folder to write")
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"{output}: exists and is not a folder")
    if blocking := file_above(path.parent):
        raise CheckpointError(f"{output}: {blocking} is a file, not a folder to write in")
    if path.exists() and any(path.iterdir()) and not overwrite:
        raise CheckpointError(f"{output}: exists and is not empty; pass --overwrite to replace it")
    return path


def file_above(path: Path) -> Path | None:
    """The file that stands where `path`, or a folder above it, would be a folder; None if none does."""
    existing = next(folder for folder in (path, *path.parents) if folder.exists())
    return None if existing.is_dir() else existing


@contextlib.contextmanager
def made_folder(path: Path) -> Iterator[None]:
    """`path` made (with its parents) for the block; if the block fails, the folders it made are removed again
    where they are empty."""
    made = [folder for folder in (path, *path.parents) if not folder.exists()]  # the innermost first
    path.mkdir(parents=True, exist_ok=True)
    try:
        yield
    except BaseException:
        for folder in made:
            with contextlib.suppress(OSError):  # one that holds something now stays
                folder.rmdir()
        raise


@contextlib.contextmanager
def output_folder(output: str | os.PathLike, overwrite: bool) -> Iterator[Path]:
    """A temporary folder beside `output` that becomes `output` only if the block succeeds (else the folders made
    for it are removed too)."""
    output = check_output(output, overwrite)
    with made_folder(output.parent):
        staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.", dir=output.parent))
        try:
            yield staging
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(staging, 0o777 & ~umask)  # mkdtemp's folder is private; the result is an ordinary one
            if output.exists():
                shutil.rmtree(output)
            os.replace(staging, output)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise


def resolve_source(source: str, allow_pickle: bool = False) -> tuple[Path, str | None]:
    """A local folder as is, or a Hub id downloaded (config, weights, tokenizer); returns (folder, revision)."""
    if Path(source).is_dir():
        return Path(source), None
    if Path(source).is_file() and Path(source).suffix.lower() == ".gguf":
        raise CheckpointError(f"{source}: a GGUF file, which `convert` reads; convert it first")
    if Path(source).exists():
        raise CheckpointError(f"{source}: a checkpoint must be a folder")
    patterns = ["*.json", "*.safetensors", "*.txt", "*.model", "README.md"] + (["*.bin"] if allow_pickle else [])
    try:
        folder = Path(snapshot_download(source, allow_patterns=patterns))
    except Exception as error:
        raise CheckpointError(f"{source}: not a local folder, and not downloadable from the Hub ({error})") from None
    return folder, folder.name


def companion_files(folder: Path, tokenizer: bool = True) -> list[str]:
    """The files that travel with a checkpoint's weights, as paths relative to `folder`: its tokenizer's (unless
    `tokenizer=False`) and its sentence-transformers pipeline's (`modules.json`, its settings, and every file of the
    module folders it names; the Transformer at the root is the checkpoint itself)."""
    files = [name for name in TOKENIZER_FILES if tokenizer and (folder / name).is_file()]
    if not (folder / "modules.json").is_file():
        return files
    files += [name for name in SENTENCE_TRANSFORMERS_FILES if (folder / name).is_file()]
    for module in _module_folders(folder):
        files += sorted(path.relative_to(folder).as_posix() for path in module.rglob("*") if path.is_file())
    return list(dict.fromkeys(files))  # a folder named twice is copied once


def copy_companion_files(folder: Path, destination: Path, tokenizer: bool = True) -> list[str]:
    """Copies the `companion_files` of `folder` into `destination`; returns their relative paths."""
    files = companion_files(folder, tokenizer=tokenizer)
    for name in files:
        (destination / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(folder / name, destination / name)
    return files


def _module_folders(folder: Path) -> list[Path]:
    """The folders of the sentence-transformers modules that `modules.json` names (those present; sentence-transformers
    itself loads a Normalize module without one)."""
    record = folder / "modules.json"
    try:
        paths = [module.get("path", "") for module in json.loads(record.read_text())]
    except (json.JSONDecodeError, AttributeError, TypeError):
        raise CheckpointError(f"{record}: not a sentence-transformers module list (a JSON list of modules)") from None
    root, folders = folder.resolve(), []
    for path in paths:
        if not isinstance(path, str):
            raise CheckpointError(f"{record}: module path {path!r} is not a string")
        module = (folder / path).resolve()
        if module != root and not module.is_relative_to(root):
            raise CheckpointError(f"{record}: module path {path!r} lies outside the checkpoint folder")
        if module != root and (folder / path).is_dir():
            folders.append(folder / path)
    return folders
