"""The NormSwap model: its Hub code files (shipped as remote code), heads, packing."""

import shutil
from pathlib import Path


REMOTE_CODE_FILES = (  # what a saved checkpoint carries: the Hub code, importing only torch, transformers and itself
    "configuration_normswap.py",
    "norms_normswap.py",
    "positions_normswap.py",
    "packed_sequences_normswap.py",
    "layers_normswap.py",
    "modeling_normswap.py",
)


def copy_remote_code(destination: Path) -> None:
    """Copies the model's code files next to saved weights, for loading with `trust_remote_code=True`."""
    for name in REMOTE_CODE_FILES:
        shutil.copy(Path(__file__).parent / name, Path(destination) / name)
