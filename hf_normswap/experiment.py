"""What a comparison runs: the experiment's fields (command-line options, experiment-file keys) and variant names."""

import dataclasses
from pathlib import Path

import yaml

from .configuration_normswap import NORM_PLACEMENTS, POSITION_EMBEDDING_TYPES


PLACEMENTS = (*NORM_PLACEMENTS, "mix_ln")
DEFAULT_EXPERIMENT = Path(__file__).parent / "data" / "default_experiment.yaml"


@dataclasses.dataclass
class Experiment:
    """What to compare and how to train; every field is also a `--` option and a key of an experiment file."""

    model: str | None = None  # checkpoint folder or Hub id, or a NormSwap config JSON (random init); None: MiniLM
    variants: list[str] = dataclasses.field(default_factory=lambda: ["post", "pre", "sandwich"])
    task: str = "sst2-sample"
    text_columns: list[str] | None = None
    label_column: str = "label"
    data_dir: str | None = None
    tokenizer: str | None = None  # default: the model's (for a config JSON: MiniLM's)
    seeds: int = 3
    output: str = "normswap-comparison"
    learning_rate: float = 2e-5
    batch_size: int = 32
    max_length: int = 128
    epochs: float = 3.0
    warmup_ratio: float = 0.0
    weight_decay: float = 0.0
    max_steps: int = -1
    max_train_samples: int | None = None
    logging_steps: int = 10
    norm_mapping: str = "shift"

    @classmethod
    def from_file(cls, path: str, **overrides) -> "Experiment":
        """An experiment from a YAML or JSON file; `overrides` (not None) take precedence."""
        try:
            fields = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as error:
            raise ValueError(f"experiment file {path}: {str(error).splitlines()[0]}") from None
        if not isinstance(fields, dict):
            raise ValueError(f"experiment file {path}: expected a mapping of field names to values")
        known = {field.name: field for field in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - set(known))
        if unknown:
            raise ValueError(f"experiment file {path}: unknown keys {unknown}; allowed: {sorted(known)}")
        for name, value in fields.items():
            if "list" in str(known[name].type) and isinstance(value, str):
                fields[name] = value.split(",")
        return cls(**{**fields, **{k: v for k, v in overrides.items() if v is not None}})

    def validate(self) -> None:
        for field in dataclasses.fields(self):
            value, kinds = getattr(self, field.name), _KINDS.get(field.name)
            if value is not None and kinds and not isinstance(value, kinds):
                raise ValueError(f"{field.name}={value!r} is invalid: expected {' or '.join(k.__name__ for k in kinds)}")
        for variant in self.variants:
            parse_variant(variant)
        if self.seeds < 1:
            raise ValueError(f"seeds={self.seeds} is invalid: at least 1")
        if not 0 <= self.warmup_ratio < 1:
            raise ValueError(f"warmup_ratio={self.warmup_ratio} is invalid: a fraction of the steps, in [0, 1)")
        if self.model is not None and self.model.endswith(".json") and "native" in self.variants:
            raise ValueError("variant 'native' needs a pretrained checkpoint, not a NormSwap configuration")


_KINDS = {field: (int,) for field in ("seeds", "batch_size", "max_length", "max_steps", "max_train_samples", "logging_steps")}
_KINDS.update({field: (int, float) for field in ("learning_rate", "epochs", "warmup_ratio", "weight_decay")})
_KINDS.update({field: (list,) for field in ("variants", "text_columns")})


def parse_variant(variant: str) -> tuple[str | None, str | None]:
    """`native`, `PLACEMENT`, `PLACEMENT:POSITION` or `:POSITION` -> (placement, position); native is (None, None)."""
    if variant == "native":
        return None, None
    placement, _, position = variant.partition(":")
    if (placement and placement not in PLACEMENTS) or (position and position not in POSITION_EMBEDDING_TYPES) or not (placement or position):
        raise ValueError(
            f"unknown variant {variant!r}: use 'native', a placement ({', '.join(PLACEMENTS)}), optionally "
            f"':' and a position scheme ({', '.join(POSITION_EMBEDDING_TYPES)})"
        )
    return placement or None, position or None
