"""The two models of a healing: the student (the swapped variant) and the teacher (its unswapped source).

The teacher is the source as NormSwap without a swap (the model conversions are verified against), so that it runs
on padding-free batches with the student. The student trains without dropout unless asked: it is matching a
deterministic function, and dropout's noise costs more of it than it regularises (measured). Its embeddings stay
frozen unless asked: a swap moves norms, not the lexicon, and a text sample reaches only the embeddings of its own
tokens.
"""

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig

from ..convert import ConversionError, load_unswapped
from ..model.configuration_normswap import NormSwapConfig
from ..model.heads import HEAD_CLASSES, head_of_config
from .options import HealError, HealOptions


DROPOUT_FIELDS = ("attention_dropout", "hidden_dropout", "classifier_dropout")
SHARED_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers")  # where student and teacher must agree


@dataclass
class HealModels:
    """Student and teacher in float32; `masked_lm` when both have a masked-LM head (its loss is measured then)."""

    student: torch.nn.Module
    configured_dropout: dict  # the student's configuration's dropout, saved with it whatever it trained with
    teacher: torch.nn.Module
    teacher_id: str
    masked_lm: bool


def load_models(variant: str, options: HealOptions) -> HealModels:
    """The student VARIANT (embeddings frozen with `freeze_embeddings`) and its teacher, checked to fit each other
    and the objective."""
    folder = Path(variant)
    if not (folder / "config.json").exists():
        raise HealError(f"{variant}: not a checkpoint folder (no config.json)")
    teacher_id = resolve_teacher(folder, options.teacher)
    student, configured_dropout = _load_student(folder, dropout=options.dropout)
    student.base_model.embeddings.requires_grad_(not options.freeze_embeddings)
    head = head_of_config(student.config)
    if options.objective == "mlm" and head != "masked-lm":
        raise HealError(f"objective='mlm' needs a masked-LM student; {variant} has the {head!r} head")
    teacher, masked_lm = _load_teacher(teacher_id, student_head=head, objective=options.objective)
    for field in SHARED_FIELDS:
        ours, theirs = getattr(student.config, field), getattr(teacher.config, field, None)
        if ours != theirs:
            raise HealError(f"teacher {teacher_id}: {field} {theirs} differs from the student's {ours}")
    return HealModels(
        student=student,
        configured_dropout=configured_dropout,
        teacher=teacher,
        teacher_id=teacher_id,
        masked_lm=masked_lm,
    )


def resolve_teacher(variant: Path, teacher: str | None) -> str:
    """The teacher: `teacher` if given, else the source named in the variant's conversion.json."""
    if teacher is not None:
        return teacher
    record = variant / "conversion.json"
    if not record.exists():
        raise HealError(f"{variant}: no conversion.json naming its source; pass --teacher")
    return json.loads(record.read_text())["source"]["id"]


def _load_student(folder: Path, dropout: bool) -> tuple[torch.nn.Module, dict]:
    """The variant with its own head class in float32 (without dropout unless `dropout`), and its configured dropout;
    refused if it is not a NormSwap checkpoint."""
    try:
        config = NormSwapConfig.from_pretrained(folder)
    except (OSError, ValueError) as error:
        raise HealError(f"{folder}: not a NormSwap checkpoint ({str(error).splitlines()[0]})") from None
    configured = {field: getattr(config, field) for field in DROPOUT_FIELDS}
    off = {} if dropout else {field: 0.0 for field, value in configured.items() if value is not None}
    return HEAD_CLASSES[head_of_config(config)].from_pretrained(folder, dtype=torch.float32, **off), configured


def _load_teacher(teacher_id: str, student_head: str, objective: str) -> tuple[torch.nn.Module, bool]:
    """The unswapped source, with the masked-LM head where student and source both have one (and whether they do)."""
    try:
        masked_lm = (
            student_head == "masked-lm" and head_of_config(AutoConfig.from_pretrained(teacher_id)) == "masked-lm"
        )
        if objective == "mlm" and not masked_lm:
            raise HealError(f"objective='mlm' needs a masked-LM teacher; {teacher_id} has none")
        return load_unswapped(teacher_id, head="masked-lm" if masked_lm else "base"), masked_lm
    except ConversionError as error:
        raise HealError(f"teacher {error}") from None
    except (OSError, ValueError) as error:
        raise HealError(f"teacher {teacher_id}: cannot be loaded ({str(error).splitlines()[0]})") from None
