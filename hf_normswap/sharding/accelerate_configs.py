"""The Accelerate configuration files shipped for one node of N GPUs: FSDP2 with bfloat16 mixed precision, with
activation checkpointing, with CPU offload."""

from pathlib import Path


FOLDER = Path(__file__).resolve().parents[1] / "data" / "accelerate"


def accelerate_config_names() -> list[str]:
    return sorted(path.stem for path in FOLDER.glob("*.yaml"))


def accelerate_config(name: str = "fsdp2_bf16") -> Path:
    """The path of the shipped configuration `name`, for `accelerate launch --config_file`."""
    path = FOLDER / f"{name}.yaml"
    if not path.is_file():
        raise ValueError(f"accelerate config {name!r}: not shipped; shipped are {accelerate_config_names()}")
    return path
