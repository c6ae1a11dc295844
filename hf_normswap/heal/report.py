"""What a healing records: heal.json (settings, held-out figures before and after, history) and its plot."""

from dataclasses import dataclass, fields
from pathlib import Path

from ..probes.collapse import POOLINGS
from ..records import JsonRecord


@dataclass
class TeacherSampling:
    """How the teacher's texts were sampled: at which temperature, tokens a text, how many once (None: a new text
    every time) and how many times each was read."""

    temperature: float
    length: int
    count: int | None
    reads: int


@dataclass
class HealData:
    """The text healed on: its name, its text columns, the rows trained on and held out, and with text sampled from
    the teacher, how (`TeacherSampling`)."""

    name: str
    text_columns: list[str]
    train_rows: int | None  # None: a stream sampled from the teacher
    held_out_rows: int
    sampling: TeacherSampling | None = None


@dataclass
class MaskedLMLoss:
    """The masked-LM loss on the held-out text (every 6th real token masked): the teacher's, the student's before and
    after."""

    teacher: float
    before: float
    after: float


@dataclass
class NextTokenAgreement:
    """A causal LM's distance to the teacher on the held-out text, before and after: KL of next-token distributions
    (nats per token), by position, top-1 agreement, the cross-entropy gap, and greedy agreement (32 tokens from the
    first 8 tokens of 32 texts; not on the development texts)."""

    before: dict
    after: dict


@dataclass
class Reconstruction:
    """The block-wise reconstruction before healing: on how many texts, Adam steps a layer at which learning rate,
    in how many seconds; each layer's mean squared error per feature to its target before and after its fit; the
    conversion's figures through a causal-LM head before it (`NextTokenAgreement`'s, or None)."""

    sequences: int
    steps: int
    learning_rate: float
    seconds: float
    layer_errors: list[list[float]]
    conversion: dict | None


@dataclass
class Budget:
    """How long a healing trained: the steps its schedule took (from its tokens, where given or the default), the
    tokens or seconds asked for, and its stop on the development texts (`DevelopmentStop`: their count, the patience,
    the KL at each measurement, the step it stopped at, or None)."""

    steps: int
    tokens: int | None
    seconds: float | None
    development_texts: int
    patience: int | None
    development_kl: list[dict] | None
    stopped_at: int | None


@dataclass
class NormRemovalStage:
    """A norm-free student healed in stages, on the development texts at the step where its schedule took a group of
    norms (or the first position's divisors) away: the next-token KL to the teacher (nats per token), by position,
    top-1 agreement, and the cross-entropy gap (the student's minus the teacher's, nats per token)."""

    step: int
    removed: list[str]
    kl: float
    kl_by_position: dict
    top1_agreement: float
    cross_entropy_gap: float | None


@dataclass
class HealLineage:
    """A healing as conversion.json records it (its `heal`): the settings, and the final output's figures before and
    after; a causal LM's next-token figures on the held-out text, and on the development texts where it had some."""

    teacher: str
    data: HealData
    objective: str
    steps: int
    learning_rate: float
    seconds: float
    tokens: int
    next_token: NextTokenAgreement | None
    before: dict
    after: dict
    sampled_next_token: NextTokenAgreement | None = None


@dataclass
class HealReport(JsonRecord):
    """heal.json: the settings, the teacher's collapse figures, the student's figures per boundary before and after
    (`measure`), the masked-LM losses where both have the head, the probe's history and the Trainer's log."""

    teacher: str
    data: HealData
    objective: str
    steps: int
    learning_rate: float
    batch_size: int
    max_length: int
    packing: bool
    dropout: bool
    freeze_embeddings: bool
    swap_schedule: str
    seconds: float  # this run's training, its measurements included (the first one, unless it resumed)
    measuring_seconds: float  # of `seconds`, those the measurements took
    tokens: int  # the real (not padding) tokens trained on, by every process together (before a resume too)
    resumed: bool
    teacher_collapse: dict
    masked_lm_loss: MaskedLMLoss | None
    next_token: NextTokenAgreement | None
    before: list[dict]
    after: list[dict]
    history: list[dict]
    log_history: list[dict]
    lora: bool = False
    lora_rank: int | None = None  # with lora
    dtype: str = "float32"
    reconstruction: Reconstruction | None = None
    budget: Budget | None = None
    norm_removal: list[NormRemovalStage] | None = None  # a norm-free student's gradual schedule
    sampled_next_token: NextTokenAgreement | None = None  # on the development texts, sampled from the teacher

    FILE = "heal.json"
    INDENT = 1

    def lineage(self) -> HealLineage:
        """The healing as conversion.json records it."""
        settings = {field.name: getattr(self, field.name) for field in fields(HealLineage)}
        return HealLineage(**settings | {"before": self.before[-1], "after": self.after[-1]})

    def summary(self) -> str:
        """One line: the tokens and seconds trained, the token cosine to the teacher and the first-token collapse,
        before -> after."""
        before, after = self.before[-1], self.after[-1]
        line = (
            f"healed on {self.tokens:,} tokens in {self.seconds:.0f} s{' (this run, resumed)' * self.resumed}: token "
            "cosine to the teacher "
            f"{before['token_cosine']:.4f} -> {after['token_cosine']:.4f}, first-token collapse "
            f"{before['collapse_first_token']:.4f} -> {after['collapse_first_token']:.4f} "
            f"(teacher {self.teacher_collapse['first_token'][-1]:.4f})"
        )
        if self.next_token:
            before, after = self.next_token.before, self.next_token.after
            line += (
                f"; next-token KL {before['kl']:.3f} -> {after['kl']:.3f} nats/token, top-1 agreement "
                f"{before['top1_agreement']:.3f} -> {after['top1_agreement']:.3f}, greedy agreement "
                f"{before['greedy_agreement']:.3f} -> {after['greedy_agreement']:.3f}"
            )
        if self.reconstruction and self.reconstruction.conversion:
            line += (
                f" (the conversion's KL {self.reconstruction.conversion['kl']:.3f}, before the layers were fitted in "
                f"{self.reconstruction.seconds:.0f} s)"
            )
        return line


HEAL_PLOT = "heal.png"


def plot_history(report: HealReport, path: Path) -> None:
    """`HEAL_PLOT`: the token cosine and the collapse figures of the final output along the healing, with the
    teacher's collapse; beside them, where the development texts were measured along the way, their KL."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    development = report.budget.development_kl if report.budget else None
    figure, axes = plt.subplots(1, 2 if development else 1, figsize=(11 if development else 6, 4), squeeze=False)
    axis = axes[0][0]
    steps = [entry["step"] for entry in report.history]
    axis.plot(steps, [e["token_cosine"] for e in report.history], marker=".", label="token cosine to the teacher")
    for pooling, style in zip(POOLINGS, ("-", "--")):
        axis.plot(
            steps,
            [e[f"collapse_{pooling}"] for e in report.history],
            style,
            marker=".",
            label=f"collapse ({pooling})",
        )
        axis.axhline(
            report.teacher_collapse[pooling][-1],
            color="gray",
            linestyle=style,
            linewidth=0.8,
            label=f"teacher collapse ({pooling})",
        )
    axis.set(xlabel="healing step", ylabel="final output, held-out text", title=f"Healing ({report.objective})")
    axis.legend(fontsize=7)
    if development:
        kl = axes[0][1]
        kl.plot([e["step"] for e in development], [e["kl"] for e in development], marker=".")
        kl.set(xlabel="healing step", ylabel="KL from the teacher, nats per token", title="Development texts")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
