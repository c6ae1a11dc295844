"""How `heal` trains: one declaration for the Python keywords, the CLI, the experiment's `heal:` section and the
checks."""

from dataclasses import dataclass, field, replace

from ..sharding import ShardingOptions, sharding_section


OBJECTIVES = ("hidden", "cka", "similarity", "mlm", "kl")
SWAP_SCHEDULES = ("direct", "gate", "layers", "taper", "stages")
DTYPES = ("float32", "bfloat16")
RECONSTRUCTION_BATCH_SIZE = 16  # texts a step of the block-wise reconstruction sees
DEVELOPMENT_TEXTS = 64  # the most development texts: one sampled group on a CPU


# What a healing takes where an option is left open, by the student's head (a causal LM, or any other); chosen by
# measurement: docs/experiments/healing.md. A causal LM converted out of pre-LN with calibrated writes (a recorded
# stream) and swapped directly has its layers fitted first (`FITTED_DEFAULTS`); any other student takes no fit. A
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
    """A causal-LM student's learning rate (`width_rate` / hidden size squared, a tenth of it after fitted layers:
    from a close start, a larger one undid the fit) and training tokens (`tokens_by_parameters` / its parameters
    outside embeddings and head, at most `most_tokens`); at SmolLM2-135M's width 576 and 106M such parameters the
    rates measured there, 1e-4 (1e-5 fitted), and 100 steps of 8 texts of 64 tokens. Chosen on SmolLM2 and LLaMAs
    pretrained from scratch (docs/experiments/healing.md, 2026-12-02)."""

    width_rate: float = 33.1776  # 1e-4 x 576**2
    fitted_share: float = 0.1
    tokens_by_parameters: float = 5.44e12
    most_tokens: int = 2**21

    def learning_rate(self, width: int, fitted: bool) -> float:
        return self.width_rate / width**2 * (self.fitted_share if fitted else 1.0)

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
            "sampled from a causal-LM teacher; held-out text: the SST-2 sample); default: teacher for a causal-LM "
            "student, else sst2-sample"
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
            "help": "what the student matches; default: kl for a causal-LM student, else similarity",
        },
    )
    swap_schedule: str = field(
        default="direct",
        metadata={
            "choices": SWAP_SCHEDULES,
            "help": "out of pre-LN: start from the source's function and move to the target placement over the first "
            "half of the steps, all layers at once (gate), one layer after another (layers), or one layer after "
            "another from writes divided by each token's own stream RMS to the median's (taper); norm-free: the "
            "removed norms leave all at once (gate), a layer at a time (layers), or the MLPs', attention's, then the "
            "final norm (stages); direct: at once",
        },
    )
    sample_temperature: float = field(default=1.0, metadata={"help": "with --data teacher: the sampling temperature"})
    sample_length: int = field(default=64, metadata={"help": "with --data teacher: tokens per sampled text"})
    sample_count: int | None = field(
        default=None,
        metadata={
            "help": "with --data teacher: sample this many texts once and repeat them; default: a new text every time"
        },
    )
    sample_reads: int = field(
        default=1,
        metadata={
            "help": "with --data teacher and no --sample-count: read each sampled text this many times, each reading "
            "after the next group's first, in a seeded order (on a CPU a second reading runs no teacher)"
        },
    )
    reconstruct_steps: int | None = field(
        default=None,
        metadata={
            "help": "out of pre-LN, before healing: fit each layer in turn to the teacher's stream after it, on the "
            "layer's own inputs, this many Adam steps a layer (0: no fit); default: "
            f"{FITTED_DEFAULTS['reconstruct_steps']} for a causal-LM student of a calibrated conversion out of pre-LN "
            "with the direct swap, without lora, else 0"
        },
    )
    reconstruct_sequences: int = field(
        default=128,
        metadata={
            "help": "with --reconstruct-steps: the texts the fit uses, the first of the training text (at least "
            f"{RECONSTRUCTION_BATCH_SIZE}, one batch), and a batch of their tokens alone as texts of one token"
        },
    )
    max_steps: int | None = field(
        default=None,
        metadata={
            "help": f"training steps; {_by_head('max_steps')}; for a causal-LM student, those --max-tokens take"
        },
    )
    max_tokens: int | None = field(
        default=None,
        metadata={
            "help": "a causal-LM student's training tokens, as whole steps (sampled texts are --sample-length "
            f"long); default: {CAUSAL_SCALING.tokens_by_parameters:.3g} / its parameters outside embeddings and "
            f"head, at most {CAUSAL_SCALING.most_tokens:,}; --max-steps overrides it"
        },
    )
    max_seconds: float | None = field(
        default=None,
        metadata={"help": "stop training after this many seconds (the schedule stays that of the steps)"},
    )
    stop_patience: int = field(
        default=2,
        metadata={
            "help": "with --data teacher: stop once the next-token KL on --dev-size development texts (sampled with a "
            "seed of their own) has not fallen 1% below its best for this many measurements, every tenth of the "
            "steps (0: never)"
        },
    )
    dev_size: int = field(default=64, metadata={"help": "with --stop-patience: the development texts (at most 64)"})
    learning_rate: float | None = field(
        default=None,
        metadata={
            "help": f"peak learning rate (10% warm-up, linear decay); {_by_head('learning_rate')}; for a causal-LM "
            f"student, {CAUSAL_SCALING.width_rate:.4g} / its hidden size squared, a tenth of it after fitted layers"
        },
    )
    batch_size: int | None = field(default=None, metadata={"help": f"texts per step; {_by_head('batch_size')}"})
    max_length: int = field(default=128, metadata={"help": "tokens per text at most"})
    eval_size: int = field(default=256, metadata={"help": "held-out texts measured before, during and after"})
    checkpoint_dir: str | None = field(
        default=None, metadata={"help": "keep resumable Trainer checkpoints here; a rerun continues from the last"}
    )
    packing: bool = field(default=True, metadata={"help": "run student and teacher on padding-free batches"})
    dropout: bool = field(
        default=False, metadata={"help": "train the student with its configured dropout (the saved config keeps it)"}
    )
    freeze_embeddings: bool = field(default=True, metadata={"help": "keep the student's embeddings as converted"})
    lora: bool = field(
        default=False,
        metadata={
            "help": "train low-rank adapters (PEFT) on the student's linear layers, and its norms, and merge them "
            "into the saved checkpoint"
        },
    )
    lora_rank: int = field(default=16, metadata={"help": "with --lora: the adapters' rank (their scale is 1)"})
    dtype: str = field(
        default="float32",
        metadata={
            "choices": DTYPES,
            "help": "the dtype student and teacher are loaded in, and the student saves in; bfloat16 needs --lora",
        },
    )
    sharding: ShardingOptions = sharding_section()

    def __post_init__(self):
        if self.sharding.fsdp and self.lora:
            raise HealError("lora=True is invalid with fsdp=True: adapters are not sharded; heal with one of them")
        if self.objective not in (None, *OBJECTIVES):
            raise HealError(f"objective={self.objective!r} is invalid: allowed are {list(OBJECTIVES)}")
        for name in ("max_steps", "max_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise HealError(f"{name}={value!r} is invalid: a whole number, at least 1")
        if self.max_seconds is not None and not (isinstance(self.max_seconds, int | float) and self.max_seconds > 0):
            raise HealError(f"max_seconds={self.max_seconds!r} is invalid: a positive number of seconds")
        if self.max_tokens is not None and self.max_seconds is not None:
            raise HealError("max_tokens is invalid with max_seconds: give one budget, in tokens or in seconds")
        if self.swap_schedule not in SWAP_SCHEDULES:
            raise HealError(f"swap_schedule={self.swap_schedule!r} is invalid: allowed are {list(SWAP_SCHEDULES)}")
        if self.swap_schedule == "taper" and self.sharding.activation_checkpointing:
            raise HealError(
                "swap_schedule='taper' is invalid with activation_checkpointing=True: its per-token stream is carried "
                "from layer to layer, which recomputing one layer alone would not see"
            )
        self._check_reconstruction()
        if self.sample_count is not None and self.sample_count < 1:
            raise HealError(f"sample_count={self.sample_count!r} is invalid: at least 1, or none for a stream")
        if not isinstance(self.sample_reads, int) or self.sample_reads < 1:
            raise HealError(f"sample_reads={self.sample_reads!r} is invalid: at least 1")
        if self.sample_reads > 1 and self.sample_count is not None:
            raise HealError(
                f"sample_reads={self.sample_reads} is invalid with sample_count: texts sampled once are read again "
                "every epoch"
            )
        if not isinstance(self.stop_patience, int) or self.stop_patience < 0:
            raise HealError(f"stop_patience={self.stop_patience!r} is invalid: 0 (never stop early) or more")
        if not isinstance(self.dev_size, int) or not 1 <= self.dev_size <= DEVELOPMENT_TEXTS:
            raise HealError(f"dev_size={self.dev_size!r} is invalid: 1 to {DEVELOPMENT_TEXTS}")
        for name in ("learning_rate", "batch_size", "max_length", "eval_size", "sample_temperature", "sample_length"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise HealError(f"{name}={getattr(self, name)!r} is invalid: must be positive")
        if not isinstance(self.lora_rank, int) or self.lora_rank < 1:
            raise HealError(f"lora_rank={self.lora_rank!r} is invalid: at least 1")
        if self.dtype not in DTYPES:
            raise HealError(f"dtype={self.dtype!r} is invalid: allowed are {list(DTYPES)}")
        if self.dtype == "bfloat16" and not self.lora:
            raise HealError(
                "dtype='bfloat16' needs --lora: a bfloat16 weight's update at a healing learning rate mostly rounds "
                "away; with --lora the adapters and norms train in float32"
            )

    def _check_reconstruction(self) -> None:
        if self.reconstruct_steps is None:
            return
        if not isinstance(self.reconstruct_steps, int) or self.reconstruct_steps < 0:
            raise HealError(f"reconstruct_steps={self.reconstruct_steps!r} is invalid: 0 (no fit) or more")
        if not self.reconstruct_steps:
            return
        if not isinstance(self.reconstruct_sequences, int) or self.reconstruct_sequences < RECONSTRUCTION_BATCH_SIZE:
            raise HealError(
                f"reconstruct_sequences={self.reconstruct_sequences!r} is too few for the fit: at least "
                f"{RECONSTRUCTION_BATCH_SIZE}, one batch of its steps"
            )
        refused = {
            "lora": (self.lora, "it fits the layers' own weights"),
            "swap_schedule": (
                self.swap_schedule,
                "a gradual swap starts from the source's function, which the fitted layers no longer compute; use "
                "swap_schedule='direct'",
            ),
        }
        for name, (value, reason) in refused.items():
            if value not in (False, "direct"):
                raise HealError(f"reconstruct_steps is invalid with {name}={value!r}: {reason}")

    def for_head(self, head: str, out_of_pre_ln: bool = False) -> "HealOptions":
        """These options with those left open set by `HEAD_DEFAULTS` for a student with `head`, and by
        `FITTED_DEFAULTS` where a causal LM's conversion was calibrated out of pre-LN (`out_of_pre_ln`); a causal LM's
        learning rate and steps are left to `scaled`."""
        defaults = dict(HEAD_DEFAULTS["causal-lm" if head == "causal-lm" else "other"])
        if self.reconstruct_steps is None:
            fits = head == "causal-lm" and out_of_pre_ln and self.swap_schedule == "direct" and not self.lora
            defaults["reconstruct_steps"] = FITTED_DEFAULTS["reconstruct_steps"] if fits else 0
        return replace(self, **{name: value for name, value in defaults.items() if getattr(self, name) is None})

    def scaled(self, width: int, parameters: int, tokens_per_text: float) -> "HealOptions":
        """These options (`for_head`'s) with a causal LM's learning rate and steps left open set by `CAUSAL_SCALING`
        for a student of hidden size `width` and `parameters` outside embeddings and head, its steps those its tokens
        take at `tokens_per_text`."""
        learning_rate = self.learning_rate or CAUSAL_SCALING.learning_rate(width, fitted=bool(self.reconstruct_steps))
        steps = self.max_steps
        if steps is None:
            tokens = self.max_tokens or CAUSAL_SCALING.tokens(parameters)
            steps = max(1, round(tokens / (self.batch_size * tokens_per_text)))
        return replace(self, learning_rate=learning_rate, max_steps=steps)
