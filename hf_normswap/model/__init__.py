"""The NormSwap model: its configuration and modeling files (shipped to the Hub as remote code), heads, packing."""

import shutil
from pathlib import Path


REMOTE_CODE_FILES = ("configuration_normswap.py", "modeling_normswap.py")  # what a saved checkpoint carries


def copy_remote_code(destination: Path) -> None:
    """Copies the model's code files next to saved weights, for loading with `trust_remote_code=True`."""
    for name in REMOTE_CODE_FILES:
        shutil.copy(Path(__file__).parent / name, Path(destination) / name)
