"""What a comparison runs: the experiment's fields (command-line options, experiment-file keys) and variant names."""

import dataclasses
import itertools
import math
from pathlib import Path

import yaml
from transformers.integrations import is_tensorboard_available, is_trackio_available, is_wandb_available

from ..convert.norm_mapping import NORM_MAPPINGS
from ..model.configuration_normswap import NORM_PLACEMENTS, POSITION_EMBEDDING_TYPES
from ..tasks import DATA_DIR


PLACEMENTS = (*NORM_PLACEMENTS, "mix_ln")
EXPERIMENTS_DIR = DATA_DIR
DEFAULT_EXPERIMENT = EXPERIMENTS_DIR / "default_experiment.yaml"
TASK_TYPES = ("sequence-classification", "causal-lm")
TRACKERS = {"tensorboard": is_tensorboard_available, "wandb": is_wandb_available, "trackio": is_trackio_available}
VARIANT_SETTINGS = ("learning_rate", "warmup_ratio")  # what `VARIANT@field=value` may pin
HEAL_SUFFIX = "+heal"  # `pre+heal`: the converted variant is healed before fine-tuning
HEAL_SETTINGS = (
    "data",
    "text_column",
    "data_dir",
    "objective",
    "max_steps",
    "learning_rate",
    "batch_size",
    "max_length",
    "eval_size",
    "packing",
    "dropout",
    "freeze_embeddings",
)
_PATH_FIELDS = ("model", "tokenizer", "task", "data_dir")  # relative to the experiment file when found there


@dataclasses.dataclass
class Experiment:
    """What to compare and how to train; every field is also a `--` option and a key of an experiment file."""

    model: str | None = None  # checkpoint folder or Hub id, or a NormSwap config JSON (random init); None: MiniLM
    variants: list[str] = dataclasses.field(default_factory=lambda: ["post", "pre", "sandwich"])
    reference: str | None = None  # the variant the others are compared with, seed by seed; default: the first
    task: str = "sst2-sample"
    task_type: str = "sequence-classification"  # or causal-lm: next-token loss and perplexity on the text columns
    text_columns: list[str] | None = None
    label_column: str = "label"
    data_dir: str | None = None
    tokenizer: str | None = None  # default: the model's (for a config JSON: MiniLM's)
    seeds: int = 3
    output: str = "normswap-comparison"
    learning_rate: float = 2e-5
    learning_rates: list[float] | None = None  # a grid (replaces learning_rate): each variant takes its best point
    warmup_ratio: float = 0.0
    warmup_ratios: list[float] | None = None  # a grid (replaces warmup_ratio)
    dev_fraction: float = 0.1  # of the training data, held out (seed 0) to score the grid; validation is never used
    search_seeds: int = 1  # runs per grid point on the development split
    batch_size: int = 32
    max_length: int = 128
    epochs: float = 3.0
    weight_decay: float = 0.0
    max_steps: int = -1
    max_train_samples: int | None = None
    logging_steps: int = 10
    norm_mapping: str = "shift"
    calibrate: bool = True  # convert with calibrated writes where a swap needs them (`hf_normswap.calibration`)
    allow_pickle: bool = False  # accept pytorch_model.bin (read with weights_only=True)
    report_to: list[str] = dataclasses.field(default_factory=lambda: ["none"])  # tensorboard, wandb, trackio, none
    packing: bool = False  # padding-free batches for the NormSwap variants; `native` ones keep padding
    heal: dict | None = None  # settings of the `+heal` variants' healing (`hf_normswap.heal_checkpoint` keywords)

    @classmethod
    def from_file(cls, path: str, **overrides) -> "Experiment":
        """An experiment from a YAML or JSON file, or the name of one shipped with the package (`stability`);
        `overrides` (not None) take precedence."""
        path = Path(path)
        if not path.is_file() and (EXPERIMENTS_DIR / f"{path}.yaml").is_file():
            path = EXPERIMENTS_DIR / f"{path}.yaml"
        try:
            fields = yaml.safe_load(path.read_text()) or {}
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
                fields[name] = value = value.split(",")
            if name in _PATH_FIELDS and isinstance(value, str) and (path.parent / value).exists():
                fields[name] = str(path.parent / value)
        return cls(**{**fields, **{k: v for k, v in overrides.items() if v is not None}})

    def validate(self) -> None:
        """Checks every field, so that a bad value stops the comparison before any work, with a one-line error.
        Numbers given as text (`1e-5` in YAML, grid values on the command line) are read as numbers."""
        for field in dataclasses.fields(self):
            value, kinds = getattr(self, field.name), _KINDS.get(field.name)
            if field.name in _FLOAT_FIELDS:
                value = _number(field.name, value)
            elif field.name in _GRID_FIELDS and isinstance(value, list):
                value = [_number(field.name, item) for item in value]
                for item in value:
                    if not _is_number(item):
                        raise ValueError(f"{field.name}: {item!r} is not a number")
            setattr(self, field.name, value)
            if value is None or not kinds:
                continue
            if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
                raise ValueError(
                    f"{field.name}={value!r} is invalid: expected {' or '.join(k.__name__ for k in kinds)}"
                )
        for name, value in self._numbers():
            if not _RULES[name][0](value):
                raise ValueError(f"{name}={value!r} is invalid: {_RULES[name][1]}")
        if not self.variants:
            raise ValueError("variants is empty: name at least one variant")
        for name in ("variants", "learning_rates", "warmup_ratios", "report_to"):
            values = getattr(self, name) or []
            if not values and name != "variants" and getattr(self, name) is not None:
                raise ValueError(f"{name} is empty: give at least one value, or leave it out")
            if len(set(values)) < len(values):
                raise ValueError(f"{name}={values!r} is invalid: a value is repeated")
        for variant in self.variants:
            name = split_variant(variant)[0]
            if name.endswith(HEAL_SUFFIX) and (name == "native" + HEAL_SUFFIX or (self.model or "").endswith(".json")):
                raise ValueError(f"variant {variant!r}: healing needs a converted variant of a pretrained checkpoint")
        unknown = sorted(set(self.heal or {}) - set(HEAL_SETTINGS))
        if unknown:
            raise ValueError(f"heal: unknown settings {unknown}; allowed: {' '.join(HEAL_SETTINGS)}")
        if self.reference is not None and self.reference not in self.variants:
            raise ValueError(
                f"reference={self.reference!r} is invalid: it must be one of the variants {self.variants}"
            )
        _choice("task_type", self.task_type, TASK_TYPES)
        _choice("norm_mapping", self.norm_mapping, NORM_MAPPINGS)
        for tracker in self.report_to:
            _choice("report_to", tracker, ("none", *TRACKERS))
            if tracker in TRACKERS and not TRACKERS[tracker]():
                raise ValueError(
                    f"report_to={tracker!r} is invalid: {tracker} is not installed (pip install {tracker})"
                )
        if self.model is not None and self.model.endswith(".json") and "native" in self.variants:
            raise ValueError("variant 'native' needs a pretrained checkpoint, not a NormSwap configuration")

    def _numbers(self):
        """(field, value) for every number to check: scalar fields, grid values and the values variants pin."""
        for name in _RULES:
            if name in _GRID_FIELDS:
                yield from ((name, value) for value in getattr(self, name) or [])
            elif getattr(self, name) is not None:
                yield name, getattr(self, name)
        for variant in self.variants:
            yield from split_variant(variant)[1].items()

    @property
    def reference_variant(self) -> str:
        return self.reference or self.variants[0]

    def grid(self, variant: str) -> list[dict[str, float]]:
        """The (learning rate, warm-up ratio) points a variant may train at; settings the variant pins stay fixed."""
        pinned = split_variant(variant)[1]
        learning_rates = (
            [pinned["learning_rate"]] if "learning_rate" in pinned else self.learning_rates or [self.learning_rate]
        )
        warmup_ratios = (
            [pinned["warmup_ratio"]] if "warmup_ratio" in pinned else self.warmup_ratios or [self.warmup_ratio]
        )
        return [
            {"learning_rate": lr, "warmup_ratio": wr} for lr, wr in itertools.product(learning_rates, warmup_ratios)
        ]


def _number(name: str, value):
    """`value`, read as a float when it is text."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            raise ValueError(f"{name}: {value!r} is not a number") from None
    return value


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _choice(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is invalid: allowed are {', '.join(allowed)}")


_KINDS = {
    field: (int,)
    for field in (
        "seeds",
        "search_seeds",
        "batch_size",
        "max_length",
        "max_steps",
        "max_train_samples",
        "logging_steps",
    )
}
_KINDS.update(
    {field: (int, float) for field in ("learning_rate", "epochs", "warmup_ratio", "weight_decay", "dev_fraction")}
)
_KINDS.update(
    {field: (list,) for field in ("variants", "text_columns", "learning_rates", "warmup_ratios", "report_to")}
)
_KINDS.update({field: (str,) for field in ("task", "task_type", "label_column", "output", "norm_mapping")})
_KINDS.update({field: (str,) for field in ("model", "reference", "data_dir", "tokenizer")})
_KINDS["allow_pickle"] = _KINDS["packing"] = _KINDS["calibrate"] = (bool,)
_KINDS["heal"] = (dict,)
_FLOAT_FIELDS = ("learning_rate", "epochs", "warmup_ratio", "weight_decay", "dev_fraction")
_GRID_FIELDS = ("learning_rates", "warmup_ratios")
_RULES = {  # field: (test, what is allowed)
    "seeds": (lambda v: v >= 1, "at least 1"),
    "search_seeds": (lambda v: v >= 1, "at least 1"),
    "batch_size": (lambda v: v >= 1, "at least 1"),
    "max_length": (lambda v: v >= 1, "at least 1 token"),
    "logging_steps": (lambda v: v >= 1, "at least 1"),
    "max_steps": (lambda v: v == -1 or v >= 1, "-1 (train for epochs) or at least 1"),
    "max_train_samples": (lambda v: v >= 1, "at least 1"),
    "epochs": (lambda v: math.isfinite(v) and v > 0, "must be positive"),
    "learning_rate": (lambda v: math.isfinite(v) and v > 0, "must be positive"),
    "learning_rates": (lambda v: math.isfinite(v) and v > 0, "every learning rate must be positive"),
    "warmup_ratio": (lambda v: 0 <= v < 1, "a fraction of the steps, in [0, 1)"),
    "warmup_ratios": (lambda v: 0 <= v < 1, "every warm-up ratio is a fraction of the steps, in [0, 1)"),
    "weight_decay": (lambda v: math.isfinite(v) and v >= 0, "must be 0 or more"),
    "dev_fraction": (lambda v: 0 < v < 1, "a fraction of the training data, in (0, 1)"),
}


def split_variant(variant: str) -> tuple[str, dict[str, float]]:
    """`NAME` or `NAME@field=value@...` -> (NAME, the training settings it pins: learning_rate, warmup_ratio);
    NAME may end in `+heal`."""
    if not isinstance(variant, str):
        raise ValueError(f"variants: {variant!r} is not a variant name")
    name, *settings = variant.split("@")
    parse_variant(name.removesuffix(HEAL_SUFFIX))
    pinned = {}
    for setting in settings:
        field, _, value = setting.partition("=")
        if field not in VARIANT_SETTINGS or not value:
            raise ValueError(
                f"variant {variant!r}: after '@' comes field=value, with field one of {', '.join(VARIANT_SETTINGS)}"
            )
        pinned[field] = _number(f"variant {variant!r}: {field}", value)
    return name, pinned


def parse_variant(variant: str) -> tuple[str | None, str | None]:
    """`native`, `PLACEMENT`, `PLACEMENT:POSITION` or `:POSITION` -> (placement, position); native is (None, None)."""
    if variant == "native":
        return None, None
    placement, _, position = variant.partition(":")
    if (
        (placement and placement not in PLACEMENTS)
        or (position and position not in POSITION_EMBEDDING_TYPES)
        or not (placement or position)
    ):
        raise ValueError(
            f"unknown variant {variant!r}: use native, a placement ({', '.join(PLACEMENTS)}) and/or "
            f":POSITION ({', '.join(POSITION_EMBEDDING_TYPES)})"
        )
    return placement or None, position or None
