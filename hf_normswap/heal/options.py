"""How `heal` trains: one declaration for the Python keywords, the CLI, the experiment's `heal:` section and the
checks."""

from dataclasses import dataclass, field


OBJECTIVES = ("hidden", "cka", "similarity", "mlm")


class HealError(ValueError):
    """A healing that cannot be done, said in one line."""


@dataclass
class HealOptions:
    """The teacher, the text and the training of a healing."""

    teacher: str | None = field(
        default=None,
        metadata={
            "help": "folder or Hub id of a BERT-, LLaMA-family or NormSwap checkpoint; default: the source named in "
            "VARIANT's conversion.json"
        },
    )
    data: str = field(
        default="sst2-sample",
        metadata={"help": "sst2-sample, a GLUE task name, a .txt / .csv / .jsonl file, or a datasets hub id"},
    )
    text_column: str | None = field(
        default=None, metadata={"help": "the text column of a CSV / JSON-lines file or hub dataset (default: text)"}
    )
    data_dir: str | None = field(
        default=None, metadata={"help": "folder holding GLUE TASK/train.jsonl and TASK/validation.jsonl"}
    )
    objective: str = field(default="similarity", metadata={"choices": OBJECTIVES, "help": "what the student matches"})
    max_steps: int = field(default=700, metadata={"help": "training steps"})
    learning_rate: float = field(default=5e-4, metadata={"help": "peak learning rate (10% warm-up, linear decay)"})
    batch_size: int = field(default=32, metadata={"help": "texts per step"})
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

    def __post_init__(self):
        if self.objective not in OBJECTIVES:
            raise HealError(f"objective={self.objective!r} is invalid: allowed are {list(OBJECTIVES)}")
        if not isinstance(self.max_steps, int) or self.max_steps < 1:
            raise HealError(f"max_steps={self.max_steps!r} is invalid: at least 1")
        for name in ("learning_rate", "batch_size", "max_length", "eval_size"):
            if not getattr(self, name) > 0:
                raise HealError(f"{name}={getattr(self, name)!r} is invalid: must be positive")
