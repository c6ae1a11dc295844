"""How `heal` trains: one declaration for the Python keywords, the CLI, the experiment's `heal:` section and the
checks."""

from dataclasses import dataclass, field, replace

from ..option_rules import Rule, at_least, check_options, positive, whole
from ..sharding import ShardingOptions, resumable, sharding_section


OBJECTIVES = ("hidden", "cka", "similarity", "mlm", "kl")
SWAP_SCHEDULES = ("direct", "gate", "layers", "taper", "stages")
DTYPES = ("float32", "bfloat16")
RECONSTRUCTION_BATCH_SIZE = 16  # texts a step of the block-wise reconstruction sees
DEVELOPMENT_TEXTS = 64  # the most development texts: one sampled group on a CPU
COUNTED_TEXTS = 1024  # the training texts whose mean length turns a budget in tokens into steps


# What a healing takes where an option is left open, by the student's head (a causal LM, or any other); chosen by
# measurement: docs/experiments/healing.md. A causal LM converted calibrated out of pre-LN (its writes or its branch
# norms) and swapped directly has its layers fitted first (`FITTED_DEFAULTS`); any other student takes no fit. A
# causal LM's learning rate and training tokens scale with the student (`CAUSAL_SCALING`).
HEAD_DEFAULTS = {
    "causal-lm": {"objective": "kl", "data": "teacher", "batch_size": 8},
    "other": {
        "objective": "similarity",
        "data": "sst2-sample",
        "max_steps": 700,
        "learning_rate": 5e-4,
        "batch_size": 32,
    },
}


FITTED_DEFAULTS = {"reconstruct_steps": 60}


@dataclass(frozen=True)
class CausalScaling:
    """A causal-LM student's learning rate (`width_rate` / hidden size squared, at most `most_rate`; after fitted
    layers, times its steps / `fitted_steps` up to 1: in a short healing a larger rate undid the fit, in a long one it
    healed furthest) and training tokens (`tokens_by_parameters` / its parameters outside embeddings and head, at most
    `most_tokens`); at SmolLM2-135M's width 576 and 106M such parameters the rates measured there, 1e-4 (1e-5
    fitted), and 100 steps of 8 texts of 64 tokens. Chosen on SmolLM2 and three LLaMAs pretrained from scratch
    (docs/experiments/healing.md, 2026-12-02, 2026-12-06 and 2026-12-07)."""

    width_rate: float = 33.1776  # 1e-4 x 576**2
    most_rate: float = 2e-3  # three models of width 64: within 1.075x of their best; the better trained, the lower
    fitted_steps: int = 1000
    tokens_by_parameters: float = 5.44e12
    most_tokens: int = 2**21

    def learning_rate(self, width: int, fitted: bool, steps: int) -> float:
        rate = min(self.width_rate / width**2, self.most_rate)
        return rate * (min(1.0, steps / self.fitted_steps) if fitted else 1.0)

    def tokens(self, parameters: int) -> int:
        return int(min(self.most_tokens, self.tokens_by_parameters / parameters))


CAUSAL_SCALING = CausalScaling()


def _by_head(field: str) -> str:
    """The help text's default of a field that `HEAD_DEFAULTS` sets."""
    causal, other = HEAD_DEFAULTS["causal-lm"].get(field), HEAD_DEFAULTS["other"][field]
    return f"default: {other}" + (f" ({causal} for a causal-LM student)" if causal is not None else "")


class HealError(ValueError):
    """A healing that cannot be done, said in one line."""


@dataclass
class HealOptions:
    """The teacher, the text and the training of a healing, and its `sharding` section (`ShardingOptions`, whose
    settings are named flat where they are given: `with_sharding_section`)."""

    teacher: str | None = field(
        default=None,
        metadata={
            "help": "folder, Hub id or GGUF file of a supported or NormSwap checkpoint, or smollm2; default: the "
            "source named in VARIANT's conversion.json"
        },
    )
    data: str | None = field(
        default=None,
        metadata={
            "help": "sst2-sample, a GLUE task name, a .txt / .csv / .jsonl file, a datasets hub id, or teacher (text "
            "sampled from a causal-LM teacher; held-out text: the SST-2 sample); " + _by_head("data")
        },
    )
    text_column: str | None = field(
        default=None, metadata={"help": "the text column of a CSV / JSON-lines file or hub dataset (default: text)"}
    )
    data_dir: str | None = field(
        default=None, metadata={"help": "folder holding GLUE TASK/train.jsonl and TASK/validation.jsonl"}
    )
    objective: str | None = field(
        default=None,
        metadata={
            "choices": OBJECTIVES,
            "help": f"what the student matches; {_by_head('objective')}",
        },
    )
    swap_schedule: str = field(
        default="direct",
        metadata={
            "rules": (
                Rule(
                    lambda value, options: value != "taper" or not options.sharding.activation_checkpointing,
                    "not with activation_checkpointing=True, whose recomputing one layer alone would not see the "
                    "per-token stream carried from layer to layer",
                ),
            ),
            "choices": SWAP_SCHEDULES,
            "help": "out of pre-LN: start from the source's function and move to the target placement over the first "
            "half of the steps, all layers at once (gate), one layer after another (layers), or one layer after "
            "another from writes divided by each token's own stream RMS to the median's (taper; not into sandwich, "
            "whose gates are at its branch norms); norm-free: the "
            "removed norms leave all at once (gate), a layer at a time (layers), or the MLPs', attention's, then the "
            "final norm (stages); direct: at once",
        },
    )
    sample_temperature: float = field(
        default=1.0, metadata={"rules": (positive(),), "help": "with --data teacher: the sampling temperature"}
    )
    sample_length: int = field(
        default=64, metadata={"rules": (at_least(1),), "help": "with --data teacher: tokens per sampled text"}
    )
    sample_count: int | None = field(
        default=None,
        metadata={
            "rules": (at_least(1, "at least 1, or none for a stream"),),
            "help": "with --data teacher: sample this many texts once and repeat them; default: a new text every time",
        },
    )
    sample_reads: int = field(
        default=1,
        metadata={
            "rules": (
                at_least(1),
                Rule(
                    lambda value, options: value == 1 or options.sample_count is None,
                    "more than 1 needs a stream: texts sampled once (sample_count) are read again every epoch",
                ),
            ),
            "help": "with --data teacher and no --sample-count: read each sampled text this many times, each reading "
            "after the next group's first, in a seeded order (in one process on a CPU a second reading runs no "
            "teacher)",
        },
    )
    reconstruct_steps: int | None = field(
        default=None,
        metadata={
            "rules": (
                at_least(0, "0 (no fit) or more"),
                Rule(
                    lambda value, options: not (value and options.lora),
                    "not with lora=True: the fit trains the layers' own weights",
                ),
                Rule(
                    lambda value, options: not value or options.swap_schedule == "direct",
                    "the fit needs swap_schedule='direct': a gradual swap starts from the source's function, which "
                    "fitted layers no longer compute",
                ),
                Rule(
                    lambda value, options: not value or options.sharding.reads_trained_once(),
                    "the main process alone fits the layers, and fsdp_config turns cpu_ram_efficient_loading off, so "
                    "the others would read the unfitted student: turn it on, or give 0",
                ),
            ),
            "help": "out of pre-LN, before healing: fit each layer in turn to the teacher's stream after it, on the "
            "layer's own inputs, this many Adam steps a layer (0: no fit); default: "
            f"{FITTED_DEFAULTS['reconstruct_steps']} for a causal-LM student of a calibrated conversion out of pre-LN "
            "with the direct swap, without lora, else 0",
        },
    )
    reconstruct_learning_rate: float = field(
        default=3e-5,
        metadata={
            "rules": (positive(),),
            "help": "with --reconstruct-steps: the fit's Adam learning rate (at 1e-4 SmolLM2 overfitted 128 texts)",
        },
    )
    reconstruct_sequences: int = field(
        default=128,
        metadata={
            "rules": (
                Rule(
                    lambda value, options: not options.reconstruct_steps or whole(value, RECONSTRUCTION_BATCH_SIZE),
                    f"too few for the fit: at least {RECONSTRUCTION_BATCH_SIZE}, one batch of its steps",
                ),
            ),
            "help": "with --reconstruct-steps: the texts the fit uses, the first of the training text (at least "
            f"{RECONSTRUCTION_BATCH_SIZE}, one batch), and a batch of their tokens alone as texts of one token",
        },
    )
    max_steps: int | None = field(
        default=None,
        metadata={
            "rules": (at_least(1, "a whole number, at least 1"),),
            "help": f"training steps; {_by_head('max_steps')}; for a causal-LM student, or with --max-tokens, those "
            "the tokens take",
        },
    )
    max_tokens: int | None = field(
        default=None,
        metadata={
            "rules": (
                at_least(1, "a whole number, at least 1"),
                Rule(
                    lambda value, options: value is None or options.max_seconds is None,
                    "give one budget, in tokens or in seconds, not max_seconds too",
                ),
            ),
            "help": "training tokens, as whole steps (sampled texts are --sample-length long, others counted on the "
            f"first {COUNTED_TEXTS:,}); default for a causal-LM student: "
            f"{CAUSAL_SCALING.tokens_by_parameters:.3g} / its parameters outside embeddings and head, at most "
            f"{CAUSAL_SCALING.most_tokens:,}; --max-steps overrides it",
        },
    )
    max_seconds: float | None = field(
        default=None,
        metadata={
            "rules": (positive("a positive number of seconds"),),
            "help": "stop training after this many seconds (the schedule stays that of the steps)",
        },
    )
    stop_patience: int = field(
        default=2,
        metadata={
            "rules": (at_least(0, "0 (never stop early) or more"),),
            "help": "with --data teacher: stop once the next-token KL on --dev-size development texts (sampled with a "
            "seed of their own) has not fallen 1% below its best for this many measurements, every tenth of the "
            "steps once a gradual --swap-schedule has ended; without one, in place of the held-out curve (0: never)",
        },
    )
    dev_size: int = field(
        default=64,
        metadata={
            "rules": (
                Rule(
                    lambda value, options: whole(value, 1, DEVELOPMENT_TEXTS),
                    f"1 to {DEVELOPMENT_TEXTS}",
                ),
            ),
            "help": "with --data teacher: the development texts the stop (--stop-patience) and a norm-free "
            f"student's stages (--swap-schedule) are measured on (at most {DEVELOPMENT_TEXTS})",
        },
    )
    learning_rate: float | None = field(
        default=None,
        metadata={
            "rules": (positive(),),
            "help": f"peak learning rate (10% warm-up, linear decay); {_by_head('learning_rate')}; for a causal-LM "
            f"student, {CAUSAL_SCALING.width_rate:.4g} / its hidden size squared, at most "
            f"{CAUSAL_SCALING.most_rate:g}, after fitted layers times the "
            f"steps / {CAUSAL_SCALING.fitted_steps:,} (at most 1)",
        },
    )
    batch_size: int | None = field(
        default=None,
        metadata={
            "rules": (at_least(1),),
            "help": f"texts a step, shared equally by the processes of a launch; {_by_head('batch_size')}",
        },
    )
    max_length: int = field(
        default=128,
        metadata={
            "rules": (at_least(1),),
            "help": "tokens per text at most (at most the absolute positions of student or teacher)",
        },
    )
    eval_size: int = field(
        default=256,
        metadata={
            "rules": (at_least(1),),
            "help": "held-out texts measured before and after, and every fifth of the steps unless --stop-patience "
            "measures from the first step (with --data teacher and no gradual --swap-schedule)",
        },
    )
    checkpoint_dir: str | None = field(
        default=None,
        metadata={
            "rules": (
                Rule(
                    lambda value, options: value is None or resumable(options.sharding),
                    "not with fsdp=True on CPU: the Trainer cannot resume a model sharded there",
                ),
            ),
            "help": "keep resumable Trainer checkpoints here; a rerun of the same variant and options (but "
            "--max-seconds and --activation-checkpointing) continues from the last, another's is refused; removed, "
            "and the figures kept beside them, once the healing has written OUTPUT",
        },
    )
    packing: bool = field(default=True, metadata={"help": "run student and teacher on padding-free batches"})
    dropout: bool = field(
        default=False, metadata={"help": "train the student with its configured dropout (the saved config keeps it)"}
    )
    freeze_embeddings: bool = field(default=True, metadata={"help": "keep the student's embeddings as converted"})
    lora: bool = field(
        default=False,
        metadata={
            "rules": (
                Rule(
                    lambda value, options: not (value and options.sharding.fsdp),
                    "adapters are not sharded (fsdp=True), with or without a distributed launch; give one of them",
                ),
            ),
            "help": "train low-rank adapters (PEFT) on the student's linear layers, and its norms, and merge them "
            "into the saved checkpoint",
        },
    )
    lora_rank: int = field(
        default=16, metadata={"rules": (at_least(1),), "help": "with --lora: the adapters' rank (their scale is 1)"}
    )
    dtype: str = field(
        default="float32",
        metadata={
            "rules": (
                Rule(
                    lambda value, options: value != "bfloat16" or options.lora,
                    "bfloat16 needs --lora: a bfloat16 weight's update at a healing learning rate mostly rounds "
                    "away; with --lora the adapters and norms train in float32",
                ),
            ),
            "choices": DTYPES,
            "help": "the dtype student and teacher are loaded in, and the student saves in; bfloat16 needs --lora",
        },
    )
    sharding: ShardingOptions = sharding_section()

    def __post_init__(self):
        check_options(self, HealError)

    @property
    def fit_texts(self) -> int:
        """The texts the layers' fit reads: the training text's first `reconstruct_sequences`, none without a fit."""
        return self.reconstruct_sequences if self.reconstruct_steps else 0

    def for_head(self, head: str, out_of_pre_ln: bool = False) -> "HealOptions":
        """These options with those left open set by `HEAD_DEFAULTS` for a student with `head`, and by
        `FITTED_DEFAULTS` where a causal LM's conversion was calibrated out of pre-LN (`out_of_pre_ln`); a causal LM's
        learning rate and steps are left to `scaled`."""
        defaults = dict(HEAD_DEFAULTS["causal-lm" if head == "causal-lm" else "other"])
        if self.max_tokens is not None:  # the steps follow from the tokens (`budgeted`)
            defaults.pop("max_steps", None)
        if self.reconstruct_steps is None:
            fits = head == "causal-lm" and out_of_pre_ln and self.swap_schedule == "direct" and not self.lora
            defaults["reconstruct_steps"] = FITTED_DEFAULTS["reconstruct_steps"] if fits else 0
        return replace(self, **{name: value for name, value in defaults.items() if getattr(self, name) is None})

    def budgeted(self, tokens_per_text: float, default_tokens: int | None = None) -> "HealOptions":
        """These options (`for_head`'s) with steps left open set by the training tokens, `max_tokens` or else
        `default_tokens`, at `tokens_per_text` (whole steps, at least 1)."""
        if self.max_steps is not None:
            return self
        tokens = self.max_tokens or default_tokens
        return replace(self, max_steps=max(1, round(tokens / (self.batch_size * tokens_per_text))))

    def scaled(self, width: int, parameters: int, tokens_per_text: float) -> "HealOptions":
        """These options (`for_head`'s) with a causal LM's learning rate and steps left open set by `CAUSAL_SCALING`
        for a student of hidden size `width` and `parameters` outside embeddings and head, its steps those its tokens
        take at `tokens_per_text`."""
        options = self.budgeted(tokens_per_text, CAUSAL_SCALING.tokens(parameters))
        fitted = bool(options.reconstruct_steps)
        learning_rate = options.learning_rate or CAUSAL_SCALING.learning_rate(width, fitted, options.max_steps)
        return replace(options, learning_rate=learning_rate)
