"""Healing: train a swapped variant (the student) to compute what its unswapped source (the teacher) computes.

The student learns from the teacher's hidden states on unlabeled text, through the Trainer (a `compute_loss`
override), at every layer boundary. Post-LN writes normalised states into the residual stream and pre-LN does not,
so every boundary but the last is compared after a parameter-free layer norm; the final outputs are compared as they
are. The objectives:

- `hidden`: mean squared error of those states, averaged over boundaries (plain layer-wise distillation);
- `cka`: `hidden`, plus, at every boundary, 1 - linear CKA (Kornblith et al. 2019) of the batch's token states and
  1 - linear CKA of its first-token states (states centred over the batch);
- `similarity` (default): `hidden`, plus, at every boundary, the mean squared error between the batch's matrices of
  cosine similarities of first-token and of mean-pooled states (similarity-preserving distillation, Tung and Mori
  2019): what differs between inputs has to come back, not only their common direction;
- `mlm`: `similarity`, plus the KL divergence of the masked-LM predictions on masked tokens (both need a masked-LM
  head).

The teacher is the source as NormSwap without a swap (the model conversions are verified against), so that it runs
on padding-free batches with the student. The student trains without dropout unless asked (`dropout=True`): it is
matching a deterministic function, and dropout's noise costs more of it than it regularises (measured). Its
embeddings stay frozen unless asked (`freeze_embeddings=False`): a swap moves norms, not the lexicon, and a text
sample reaches only the embeddings of its own tokens. Which objective, learning rate, dropout and freezing are the
defaults was measured on all-MiniLM-L6-v2 (post -> pre); see the README.
"""

import json
import shutil
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from datasets import Dataset, load_dataset
from transformers import (
    AutoConfig,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    DataCollatorWithPadding,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from ..checkpoint import check_output, copy_tokenizer_files, output_folder
from ..convert import ConversionError, load_unswapped
from ..model import copy_remote_code
from ..model.heads import HEAD_CLASSES, head_of_config
from ..model.packing import pack_padded, unpack
from ..probes.collapse import POOLINGS, boundary_states, collapse_of_states, pool
from ..probes.probe_data import mask_every_sixth
from ..tasks import GLUE_TASKS, load_task
from .options import OBJECTIVES, HealError


DEFAULTS = dict(
    data="sst2-sample",
    objective="similarity",
    max_steps=700,
    learning_rate=5e-4,
    batch_size=32,
    max_length=128,
    packing=True,
    dropout=False,
    freeze_embeddings=True,
)
DROPOUT_FIELDS = ("attention_dropout", "hidden_dropout", "classifier_dropout")
EVAL_SIZE = 256


def _normalised(states: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(states.float(), states.shape[-1:])


def _comparable(student: tuple, teacher: tuple) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Pairs of states at each boundary: normalised without parameters, except the final outputs."""
    pairs = [(_normalised(s), _normalised(t)) for s, t in zip(student[:-1], teacher[:-1])]
    return pairs + [(student[-1].float(), teacher[-1].float())]


def _linear_cka(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """Linear CKA between two sets of rows (Kornblith et al. 2019); 0 where either set has no spread."""
    student, teacher = student - student.mean(0), teacher - teacher.mean(0)
    cross = (student.T @ teacher).pow(2).sum()
    return cross / ((student.T @ student).pow(2).sum() * (teacher.T @ teacher).pow(2).sum()).clamp_min(1e-12).sqrt()


def _cosine_matrix(rows: torch.Tensor) -> torch.Tensor:
    unit = F.normalize(rows, dim=-1)
    return unit @ unit.T


def heal_loss(objective: str, student: tuple, teacher: tuple, attention_mask: torch.Tensor) -> torch.Tensor:
    """The objective's loss between the boundary states of student and teacher (tuples of (batch, seq, hidden))."""
    real = attention_mask.bool()
    losses = []
    for s, t in _comparable(student, teacher):
        loss = F.mse_loss(s[real], t[real])
        if objective == "cka":
            loss = loss + 2 - _linear_cka(s[real], t[real]) - _linear_cka(s[:, 0], t[:, 0])
        elif objective in ("similarity", "mlm"):
            pooled_s, pooled_t = pool(s, attention_mask), pool(t, attention_mask)
            loss = loss + sum(F.mse_loss(_cosine_matrix(pooled_s[p]), _cosine_matrix(pooled_t[p])) for p in POOLINGS)
        losses.append(loss)
    return torch.stack(losses).mean()


class HealTrainer(Trainer):
    """A Trainer whose loss is the distance of the model's boundary states to the teacher's (both run on the same
    batch, padding-free with `packing`)."""

    def __init__(self, *args, teacher: torch.nn.Module, objective: str, packing: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.teacher = teacher.to(self.args.device).eval()
        self.objective = objective
        self.packing = packing

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels", None)
        packed, index = pack_padded(inputs) if self.packing else (inputs, None)
        packed = {key: value.to(self.args.device) for key, value in packed.items()}
        with torch.no_grad():
            teacher = _outputs(self.teacher, packed, index, token_logits=labels is not None)
        student = _outputs(model, packed, index, token_logits=labels is not None)
        loss = heal_loss(self.objective, student.hidden_states, teacher.hidden_states, inputs["attention_mask"])
        if labels is not None:  # masked-LM distillation on the masked tokens
            masked = labels != -100
            loss = loss + F.kl_div(
                F.log_softmax(student.logits[masked].float(), -1),
                F.log_softmax(teacher.logits[masked].float(), -1),
                log_target=True,
                reduction="batchmean",
            )
        return (loss, student) if return_outputs else loss


def _outputs(model: torch.nn.Module, batch: dict, index: torch.Tensor | None, token_logits: bool):
    """The model's outputs on `batch`; for a packed batch (`index` from `pack_padded`), its hidden states (and
    per-token logits) laid back out as the padded batch."""
    outputs = model(**batch, output_hidden_states=True)
    if index is not None:
        outputs.hidden_states = tuple(unpack(states, index) for states in outputs.hidden_states)
        if token_logits:
            outputs.logits = unpack(outputs.logits, index)
    return outputs


@torch.no_grad()
def measure(student: torch.nn.Module, batches: list[dict], teacher_states: list[tuple]) -> list[dict]:
    """Per boundary, on the held-out batches: the student's mean token cosine to the teacher's states (as they are),
    the mean squared error of the comparable states, and the student's collapse figures."""
    was_training = student.training
    student.eval()
    cosines, errors, states = [], [], []
    for batch, teacher in zip(batches, teacher_states):
        batch = {k: v.to(student.device) for k, v in batch.items()}
        real = batch["attention_mask"].bool()
        student_states = boundary_states(student, batch)
        teacher = [t.to(student.device) for t in teacher]
        cosines.append(
            torch.stack(
                [
                    F.cosine_similarity(s[real].float(), t[real].float(), dim=-1).sum()
                    for s, t in zip(student_states, teacher)
                ]
            )
        )
        errors.append(
            torch.stack([(s[real] - t[real]).pow(2).mean(-1).sum() for s, t in _comparable(student_states, teacher)])
        )
        states.append(student_states)
    student.train(was_training)
    tokens = sum(batch["attention_mask"].sum().item() for batch in batches)
    collapse = collapse_of_states(states, [batch["attention_mask"].to(student.device) for batch in batches])
    cosine, error = (torch.stack(cosines).sum(0) / tokens).tolist(), (torch.stack(errors).sum(0) / tokens).tolist()
    return [
        {"token_cosine": c, "mse": e, **{f"collapse_{p}": collapse[p][i] for p in POOLINGS}}
        for i, (c, e) in enumerate(zip(cosine, error))
    ]


@torch.no_grad()
def masked_lm_loss(model: torch.nn.Module, batches: list[dict], tokenizer) -> float:
    """The masked-LM loss on the held-out batches, every 6th real token masked (as in conversion.json's swap effect)."""
    was_training = model.training
    model.eval()
    losses = []
    for batch in batches:
        batch = dict(batch)
        labels = mask_every_sixth(batch, tokenizer)
        losses.append(model(**batch, labels=labels).loss.item())
    model.train(was_training)
    return sum(losses) / len(losses)


class HealProbeCallback(TrainerCallback):
    """Measures the student on the held-out batches every `every` steps before the last, for the plot."""

    def __init__(self, batches: list[dict], teacher_states: list[tuple], every: int):
        self.batches, self.teacher_states, self.every, self.history = batches, teacher_states, every, []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step % self.every == 0 and state.global_step < state.max_steps:
            last = measure(model, self.batches, self.teacher_states)[-1]
            self.history.append({"step": state.global_step, **last})


def load_texts(
    data: str, text_column: str | None = None, data_dir: str | None = None
) -> tuple[Dataset, Dataset, list[str]]:
    """Training and held-out text from `data`: `sst2-sample`, a GLUE task name, a local .txt (one text a line), CSV or
    JSON-lines file, or a datasets hub id; returns (train, held_out, text columns)."""
    if data == "sst2-sample" or data in GLUE_TASKS:
        task = load_task(data, data_dir=data_dir)
        return task.data["train"], task.data["validation"], list(task.text_columns)
    path = Path(data)
    if path.is_file() and path.stat().st_size == 0:
        raise HealError(f"data file {data} is empty")
    try:
        if path.suffix == ".txt":
            lines = [line for line in path.read_text().splitlines() if line.strip()]
            if not lines:
                raise HealError(f"data file {data} holds no text")
            splits = {"train": Dataset.from_dict({"text": lines})}
        elif path.is_file():
            splits = load_dataset("csv" if path.suffix == ".csv" else "json", data_files=str(path))
        elif path.exists():
            raise HealError(f"--data {data}: a folder; give a .txt, .csv or .jsonl file, a GLUE task or a hub id")
        else:
            splits = load_dataset(data)
    except HealError:
        raise
    except Exception as error:
        raise HealError(f"--data {data}: cannot be read ({str(error).splitlines()[0]})") from None
    train = splits["train"]
    column = text_column or ("text" if "text" in train.column_names else None)
    if column is None or column not in train.column_names:
        raise HealError(f"--data {data}: no text column {column!r} (use --text-column); columns: {train.column_names}")
    if len(train) == 0:
        raise HealError(f"data file {data} is empty")
    if "validation" in splits:
        return train, splits["validation"], [column]
    parts = train.train_test_split(test_size=min(EVAL_SIZE, max(1, len(train) // 10)), seed=0)
    return parts["train"], parts["test"], [column]


def _tokenize(rows: Dataset, columns: list[str], tokenizer, max_length: int, name: str) -> Dataset:
    """Token ids of the texts, dropping rows that hold no token besides special ones."""
    encoded = rows.map(
        lambda batch: tokenizer(
            *(batch[c] for c in columns), truncation=True, max_length=max_length, return_special_tokens_mask=True
        ),
        batched=True,
        remove_columns=rows.column_names,
    )
    encoded = encoded.filter(lambda row: sum(row["special_tokens_mask"]) < len(row["input_ids"]))
    if len(encoded) == 0:
        raise HealError(f"{name}: the text holds no tokens")
    return encoded.remove_columns("special_tokens_mask")


def resolve_teacher(variant: Path, teacher: str | None) -> str:
    """The teacher: `teacher` if given, else the source named in the variant's conversion.json."""
    if teacher is not None:
        return teacher
    record = variant / "conversion.json"
    if not record.exists():
        raise HealError(f"{variant}: no conversion.json naming its source; pass --teacher")
    return json.loads(record.read_text())["source"]["id"]


def heal_checkpoint(
    variant: str,
    output: str,
    *,
    teacher: str | None = None,
    data: str = DEFAULTS["data"],
    text_column: str | None = None,
    data_dir: str | None = None,
    objective: str = DEFAULTS["objective"],
    max_steps: int = DEFAULTS["max_steps"],
    learning_rate: float = DEFAULTS["learning_rate"],
    batch_size: int = DEFAULTS["batch_size"],
    max_length: int = DEFAULTS["max_length"],
    eval_size: int = EVAL_SIZE,
    checkpoint_dir: str | None = None,
    packing: bool = DEFAULTS["packing"],
    dropout: bool = DEFAULTS["dropout"],
    freeze_embeddings: bool = DEFAULTS["freeze_embeddings"],
    overwrite: bool = False,
    log=print,
) -> dict:
    """Heals the NormSwap checkpoint VARIANT into OUTPUT (same format, plus heal.json and heal.png); returns heal.json.

    With `checkpoint_dir`, the Trainer keeps resumable checkpoints there and a rerun continues from the last one.
    With `packing`, student and teacher run on padding-free batches.
    With `dropout`, the student trains with the dropout of its configuration, else with none (saved unchanged).
    With `freeze_embeddings`, the student's embeddings (and a masked-LM decoder tied to them) are not trained.
    """
    if objective not in OBJECTIVES:
        raise HealError(f"objective={objective!r} is invalid: allowed are {list(OBJECTIVES)}")
    if not isinstance(max_steps, int) or max_steps < 1:
        raise HealError(f"max_steps={max_steps!r} is invalid: at least 1")
    for name, value in (
        ("learning_rate", learning_rate),
        ("batch_size", batch_size),
        ("max_length", max_length),
        ("eval_size", eval_size),
    ):
        if not value > 0:
            raise HealError(f"{name}={value!r} is invalid: must be positive")
    check_output(output, overwrite)
    folder = Path(variant)
    if not (folder / "config.json").exists():
        raise HealError(f"{variant}: not a checkpoint folder (no config.json)")
    teacher_id = resolve_teacher(folder, teacher)
    student, configured_dropout = _load_student(folder, dropout)
    student.base_model.embeddings.requires_grad_(not freeze_embeddings)
    head = head_of_config(student.config)
    mlm = objective == "mlm"
    if mlm and head != "masked-lm":
        raise HealError(f"objective='mlm' needs a masked-LM student; {variant} has the {head!r} head")
    try:
        teacher_config = AutoConfig.from_pretrained(teacher_id)
        teacher_mlm = head == "masked-lm" and head_of_config(teacher_config) == "masked-lm"
        if mlm and not teacher_mlm:
            raise HealError(f"objective='mlm' needs a masked-LM teacher; {teacher_id} has none")
        teacher_model = load_unswapped(teacher_id, "masked-lm" if teacher_mlm else "base")
    except ConversionError as error:
        raise HealError(f"teacher {error}") from None
    except (OSError, ValueError) as error:
        raise HealError(f"teacher {teacher_id}: cannot be loaded ({str(error).splitlines()[0]})") from None
    for field in ("vocab_size", "hidden_size", "num_hidden_layers"):
        ours, theirs = getattr(student.config, field), getattr(teacher_model.config, field, None)
        if ours != theirs:
            raise HealError(f"teacher {teacher_id}: {field} {theirs} differs from the student's {ours}")
    tokenizer = AutoTokenizer.from_pretrained(folder)

    train, held_out, columns = load_texts(data, text_column, data_dir)
    train = _tokenize(train, columns, tokenizer, max_length, data)
    held_out = _tokenize(held_out.select(range(min(eval_size, len(held_out)))), columns, tokenizer, max_length, data)
    pad = DataCollatorWithPadding(tokenizer)
    batches = [
        pad([held_out[i] for i in range(start, min(start + batch_size, len(held_out)))])
        for start in range(0, len(held_out), batch_size)
    ]
    batches = [dict(batch) for batch in batches]
    collator = DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.15) if mlm else pad

    with torch.no_grad():  # the teacher's side of every measurement, computed once
        teacher_states = [boundary_states(teacher_model, batch) for batch in batches]
    teacher_collapse = collapse_of_states(teacher_states, [batch["attention_mask"] for batch in batches])
    before = measure(student, batches, teacher_states)
    masked_lm_before = masked_lm_loss(student, batches, tokenizer) if teacher_mlm else None
    probe = HealProbeCallback(batches, teacher_states, every=max(1, max_steps // 5))
    probe.history.append({"step": 0, **before[-1]})
    with output_folder(output, overwrite) as staging:
        work = Path(checkpoint_dir) if checkpoint_dir else staging / "trainer"
        args = TrainingArguments(
            output_dir=str(work),
            max_steps=max_steps,
            learning_rate=learning_rate,
            per_device_train_batch_size=batch_size,
            warmup_steps=0.1,
            lr_scheduler_type="linear",
            logging_steps=max(1, max_steps // 20),
            save_strategy="steps" if checkpoint_dir else "no",
            save_steps=max(1, max_steps // 5),
            save_total_limit=1,
            seed=0,
            data_seed=0,
            report_to=[],
            remove_unused_columns=False,
            disable_tqdm=log is None,
            use_cpu=not torch.accelerator.is_available(),
        )
        trainer = HealTrainer(
            model=student,
            args=args,
            train_dataset=train,
            data_collator=collator,
            teacher=teacher_model,
            objective=objective,
            packing=packing,
            callbacks=[probe],
        )
        resume = checkpoint_dir is not None and any(work.glob("checkpoint-*"))
        started = time.perf_counter()
        trainer.train(resume_from_checkpoint=True if resume else None)
        seconds = time.perf_counter() - started
        after = measure(student, batches, teacher_states)
        probe.history.append({"step": max_steps, **after[-1]})
        report = {
            "teacher": teacher_id,
            "data": {"name": data, "text_columns": columns, "train_rows": len(train), "held_out_rows": len(held_out)},
            "objective": objective,
            "steps": max_steps,
            "learning_rate": learning_rate,
            "batch_size": batch_size,
            "max_length": max_length,
            "packing": packing,
            "dropout": dropout,
            "freeze_embeddings": freeze_embeddings,
            "seconds": seconds,
            "resumed": resume,
            "teacher_collapse": teacher_collapse,
            "masked_lm_loss": None
            if not teacher_mlm
            else {
                "teacher": masked_lm_loss(teacher_model, batches, tokenizer),
                "before": masked_lm_before,
                "after": masked_lm_loss(student, batches, tokenizer),
            },
            "before": before,
            "after": after,
            "history": probe.history,
            "log_history": trainer.state.log_history,
        }
        student.config.update(configured_dropout)
        _save(student, folder, staging, report)
        (staging / "heal.json").write_text(json.dumps(report, indent=1) + "\n")
        _plot(report, staging / "heal.png")
        shutil.rmtree(staging / "trainer", ignore_errors=True)
    if checkpoint_dir:
        shutil.rmtree(checkpoint_dir, ignore_errors=True)
    if log:
        last_before, last_after = report["before"][-1], report["after"][-1]
        log(
            f"healed in {seconds:.0f} s: token cosine to the teacher {last_before['token_cosine']:.4f} -> "
            f"{last_after['token_cosine']:.4f}, first-token collapse {last_before['collapse_first_token']:.4f} -> "
            f"{last_after['collapse_first_token']:.4f} (teacher {report['teacher_collapse']['first_token'][-1]:.4f})"
        )
        log(f"wrote {output}")
    return report


def _load_student(folder: Path, dropout: bool) -> tuple[torch.nn.Module, dict]:
    """The variant with its own head class in float32 (without dropout unless `dropout`), and its configured dropout;
    refused if it is not a NormSwap checkpoint."""
    from ..model.configuration_normswap import NormSwapConfig

    try:
        config = NormSwapConfig.from_pretrained(folder)
    except (OSError, ValueError) as error:
        raise HealError(f"{folder}: not a NormSwap checkpoint ({str(error).splitlines()[0]})") from None
    configured = {field: getattr(config, field) for field in DROPOUT_FIELDS}
    off = {} if dropout else {field: 0.0 for field, value in configured.items() if value is not None}
    return HEAD_CLASSES[head_of_config(config)].from_pretrained(folder, dtype=torch.float32, **off), configured


def _save(student: torch.nn.Module, source: Path, staging: Path, report: dict) -> None:
    """The healed weights (without what the variant initialises at load), its code, tokenizer, and its
    conversion.json (lineage included) with the healing added."""
    record = source / "conversion.json"
    conversion = json.loads(record.read_text()) if record.exists() else None
    at_load = set(conversion["weights"]["initialized_at_load"]) if conversion else set()
    state = {name: tensor for name, tensor in student.state_dict().items() if name not in at_load}
    student.save_pretrained(staging, state_dict=state)
    copy_remote_code(staging)
    copy_tokenizer_files(source, staging)
    if conversion:
        conversion["heal"] = {
            key: report[key] for key in ("teacher", "data", "objective", "steps", "learning_rate", "seconds")
        }
        conversion["heal"].update(before=report["before"][-1], after=report["after"][-1])
        (staging / "conversion.json").write_text(json.dumps(conversion, indent=2) + "\n")


def _plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [entry["step"] for entry in report["history"]]
    figure, axis = plt.subplots(figsize=(6, 4))
    axis.plot(steps, [e["token_cosine"] for e in report["history"]], marker=".", label="token cosine to the teacher")
    for pooling, style in zip(POOLINGS, ("-", "--")):
        axis.plot(
            steps,
            [e[f"collapse_{pooling}"] for e in report["history"]],
            style,
            marker=".",
            label=f"collapse ({pooling})",
        )
        axis.axhline(
            report["teacher_collapse"][pooling][-1],
            color="gray",
            linestyle=style,
            linewidth=0.8,
            label=f"teacher collapse ({pooling})",
        )
    axis.set(xlabel="healing step", ylabel="final output, held-out text", title=f"Healing ({report['objective']})")
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
