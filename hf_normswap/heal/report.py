"""What a healing records: heal.json (settings, held-out figures before and after, history) and its plot."""

from dataclasses import asdict, dataclass
from pathlib import Path

from ..probes.collapse import POOLINGS


LINEAGE_KEYS = ("teacher", "data", "objective", "steps", "learning_rate", "seconds")  # copied into conversion.json


@dataclass
class HealData:
    """The text healed on: its name, its text columns and the rows trained on and held out."""

    name: str
    text_columns: list[str]
    train_rows: int
    held_out_rows: int


@dataclass
class MaskedLMLoss:
    """The masked-LM loss on the held-out text (every 6th real token masked): the teacher's, the student's before and
    after."""

    teacher: float
    before: float
    after: float


@dataclass
class HealReport:
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
    seconds: float
    resumed: bool
    teacher_collapse: dict
    masked_lm_loss: MaskedLMLoss | None
    before: list[dict]
    after: list[dict]
    history: list[dict]
    log_history: list[dict]

    def lineage(self) -> dict:
        """The healing as conversion.json records it: the settings, and the final output's figures."""
        record = asdict(self)
        return {key: record[key] for key in LINEAGE_KEYS} | {"before": self.before[-1], "after": self.after[-1]}

    def summary(self) -> str:
        """One line: the token cosine to the teacher and the first-token collapse, before -> after."""
        before, after = self.before[-1], self.after[-1]
        return (
            f"healed in {self.seconds:.0f} s: token cosine to the teacher {before['token_cosine']:.4f} -> "
            f"{after['token_cosine']:.4f}, first-token collapse {before['collapse_first_token']:.4f} -> "
            f"{after['collapse_first_token']:.4f} (teacher {self.teacher_collapse['first_token'][-1]:.4f})"
        )


def plot_history(report: HealReport, path: Path) -> None:
    """heal.png: the token cosine and the collapse figures of the final output along the healing, with the
    teacher's collapse."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [entry["step"] for entry in report.history]
    figure, axis = plt.subplots(figsize=(6, 4))
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
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
