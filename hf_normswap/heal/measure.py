"""What the healing is judged by, on held-out batches: per boundary, the student's closeness to the teacher and its
collapse figures; and the masked-LM loss."""

import torch
import torch.nn.functional as F

from ..devices import compute_device
from ..model.evaluation_mode import evaluation_mode
from ..probes.collapse import POOLINGS, boundary_states, collapse_of_states
from ..probes.probe_data import mask_every_sixth, on_device
from .losses import comparable


@torch.no_grad()
def teacher_states(teacher: torch.nn.Module, batches: list[dict]) -> list[tuple]:
    """The teacher's boundary states on every held-out batch: its side of every measurement, computed once."""
    return [boundary_states(teacher, on_device(batch, teacher)) for batch in batches]


@torch.no_grad()
def student_states(student: torch.nn.Module, batches: list[dict]) -> list[tuple]:
    """The student's boundary states on every held-out batch, on its device."""
    with evaluation_mode(student):
        return [boundary_states(student, on_device(batch, student)) for batch in batches]


def measure(student: torch.nn.Module, batches: list[dict], teacher_states: list[tuple]) -> list[dict]:
    """`measure_states` of the student's states on the held-out batches."""
    return measure_states(student_states(student, batches), batches, teacher_states)


@torch.no_grad()
def measure_states(states: list[tuple], batches: list[dict], teacher_states: list[tuple]) -> list[dict]:
    """Per boundary, from the student's `states` on the held-out batches: its mean token cosine to the teacher's
    states (as they are), the mean squared error of the comparable states, and its collapse figures."""
    cosines, errors = [], []
    for batch, student, teacher in zip(batches, states, teacher_states, strict=True):
        device = student[0].device
        real = batch["attention_mask"].bool().to(device)
        teacher = [t.to(device) for t in teacher]
        cosines.append(
            torch.stack(
                [F.cosine_similarity(s[real].float(), t[real].float(), dim=-1).sum() for s, t in zip(student, teacher)]
            )
        )
        errors.append(
            torch.stack([(s[real] - t[real]).pow(2).mean(-1).sum() for s, t in comparable(student, teacher)])
        )
    tokens = sum(batch["attention_mask"].sum().item() for batch in batches)
    collapse = collapse_of_states(states, [batch["attention_mask"] for batch in batches])
    cosine, error = (torch.stack(cosines).sum(0) / tokens).tolist(), (torch.stack(errors).sum(0) / tokens).tolist()
    return [
        {"token_cosine": c, "mse": e, **{f"collapse_{p}": collapse[p][i] for p in POOLINGS}}
        for i, (c, e) in enumerate(zip(cosine, error))
    ]


@torch.no_grad()
def masked_lm_loss(model: torch.nn.Module, batches: list[dict], tokenizer) -> float:
    """The masked-LM loss on the held-out batches, every 6th real token masked (as in conversion.json's swap
    effect)."""
    losses = []
    with evaluation_mode(model):
        for batch in batches:
            batch = dict(batch)
            labels = mask_every_sixth(batch, tokenizer).to(compute_device(model))
            batch = on_device(batch, model)
            losses.append(model(**batch, labels=labels).loss.item())
    return sum(losses) / len(losses)
