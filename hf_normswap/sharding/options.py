"""How a training is spread over the processes of a distributed launch: one declaration for heal's and compare's
options, the experiment's keys and the checks; the `sharding` section of `HealOptions` and `Experiment`."""

import json
import warnings
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
from accelerate.utils import str_to_bool

from ..devices import cpu_computes_bfloat16
from ..option_rules import Rule, check_options


class ShardingError(ValueError):
    """Sharding that cannot be done, said in one line."""


@dataclass
class ShardingOptions:
    """FSDP2 sharding, mixed precision and activation checkpointing of a training."""

    fsdp: bool = field(
        default=False,
        metadata={
            "help": "shard the trained model (and a healing's teacher) across the processes of a distributed launch "
            "with FSDP2 (torchrun, or accelerate launch on GPUs); without a distributed launch one process trains "
            "unsharded"
        },
    )
    fsdp_config: str | None = field(
        default=None,
        metadata={
            "help": "with --fsdp on GPUs: a JSON file of the Trainer's fsdp_config; default: FSDP2 with each decoder "
            "layer its own unit",
            "rules": (Rule(lambda value, options: value is None or options.fsdp, "it needs fsdp (pass --fsdp too)"),),
        },
    )
    bf16: bool = field(
        default=False,
        metadata={"help": "bfloat16 mixed precision (float32 weights, gradients reduced in float32)"},
    )
    activation_checkpointing: bool = field(
        default=False, metadata={"help": "recompute the layers' activations in the backward pass to save memory"}
    )

    def __post_init__(self):
        check_options(self, ShardingError)
        self.fsdp_config_fields()
        if self.bf16 and not torch.accelerator.is_available() and not cpu_computes_bfloat16():
            warnings.warn(
                "bf16=True on a CPU without bfloat16 arithmetic of its own (AVX512-BF16 or AMX): it trains slower "
                "than float32 there",
                stacklevel=3,  # past the dataclass's generated __init__, to whoever built the options
            )

    def fsdp_config_fields(self) -> dict:
        """The Trainer's `fsdp_config` as the `fsdp_config` JSON file gives it ({} without one), its keys as the
        Trainer reads them (an `fsdp_` prefix dropped), `cpu_ram_efficient_loading` as a bool."""
        if self.fsdp_config is None:
            return {}
        try:
            fields = json.loads(Path(self.fsdp_config).read_text())
        except (OSError, ValueError) as error:
            raise ShardingError(f"fsdp_config={self.fsdp_config!r}: not a readable JSON file ({error})") from None
        if not isinstance(fields, dict):
            raise ShardingError(f"fsdp_config={self.fsdp_config!r}: holds {type(fields).__name__}, not an object")
        fields = {key.removeprefix("fsdp_"): value for key, value in fields.items()}
        if "cpu_ram_efficient_loading" in fields:
            value = fields["cpu_ram_efficient_loading"]
            try:
                fields["cpu_ram_efficient_loading"] = bool(str_to_bool(str(value).lower()))
            except ValueError:
                raise ShardingError(
                    f"fsdp_config={self.fsdp_config!r}: cpu_ram_efficient_loading={value!r} is invalid: true or false"
                ) from None
        return fields

    def reads_trained_once(self) -> bool:
        """Whether accelerate's FSDP2 hands the trained model's weights from the main process to the others
        (`cpu_ram_efficient_loading`: on unless the `fsdp_config` file turns it off)."""
        return self.fsdp_config_fields().get("cpu_ram_efficient_loading", True)


SHARDING_SETTINGS = tuple(item.name for item in fields(ShardingOptions))
SECTION_TITLE = "sharding (FSDP2), mixed precision and activation checkpointing"


def sharding_section() -> ShardingOptions:  # typed as the value it declares, as `dataclasses.field` is
    """The `sharding` field of an options dataclass: its settings are named flat where the options are given (the
    command line, `heal_checkpoint`'s keywords, an experiment file), grouped in `--help` under `SECTION_TITLE`."""
    return field(default_factory=ShardingOptions, metadata={"section": SECTION_TITLE})


def with_sharding_section(settings: dict) -> dict:
    """Flat `settings` with the sharding ones (`SHARDING_SETTINGS`) moved into their `sharding` section (which may
    also be given, as `ShardingOptions` or a mapping, as `dataclasses.asdict` writes it)."""
    section = settings.get("sharding") or {}
    section = asdict(section) if isinstance(section, ShardingOptions) else section
    if not isinstance(section, dict):
        raise ShardingError(f"sharding={section!r} is invalid: a mapping of {', '.join(SHARDING_SETTINGS)}")
    unknown = sorted(set(section) - set(SHARDING_SETTINGS), key=str)
    if unknown:
        raise ShardingError(f"sharding: unknown settings {unknown} (allowed: {', '.join(SHARDING_SETTINGS)})")
    section = {**section, **{name: settings[name] for name in SHARDING_SETTINGS if name in settings}}
    rest = {name: value for name, value in settings.items() if name not in (*SHARDING_SETTINGS, "sharding")}
    return {**rest, "sharding": ShardingOptions(**section)}


def flat_settings(options) -> dict:
    """The settings of an options dataclass as they are named where given: its `sharding` section's fields flat."""
    settings = {item.name: getattr(options, item.name) for item in fields(options) if item.name != "sharding"}
    return {**settings, **asdict(options.sharding)}
