"""The healing objectives: how far the student's boundary states (and masked-LM predictions) are from the teacher's.

Post-LN writes normalised states into the residual stream and pre-LN does not, so every boundary but the last is
compared after a parameter-free layer norm; the final outputs are compared as they are. The objectives:

- `hidden`: mean squared error of those states, averaged over boundaries (plain layer-wise distillation);
- `cka`: `hidden`, plus, at every boundary, 1 - linear CKA (Kornblith et al. 2019) of the batch's token states and
  1 - linear CKA of its first-token states (states centred over the batch);
- `similarity` (an encoder's default): `hidden`, plus, at every boundary, the mean squared error between the batch's
  matrices of cosine similarities of first-token and of mean-pooled states (similarity-preserving distillation, Tung
  and Mori 2019): what differs between inputs has to come back, not only their common direction;
- `mlm`: `similarity`, plus the KL divergence of the masked-LM predictions on masked tokens (both need a masked-LM
  head);
- `kl`: `hidden`, plus the KL divergence of the next-token distributions at every real token (both need a causal-LM
  head; a causal LM's default): a language model's function is its next-token distribution.
"""

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..probes.collapse import POOLINGS, pool
from ..probes.next_token import token_log_probs
from ..sharding import agreed_max, gathered


def comparable(student: tuple, teacher: tuple) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Pairs of states at each boundary: normalised without parameters, except the final outputs."""
    pairs = [(_normalised(s), _normalised(t)) for s, t in zip(student[:-1], teacher[:-1])]
    return pairs + [(student[-1].float(), teacher[-1].float())]


def heal_loss(objective: str, student: tuple, teacher: tuple, attention_mask: torch.Tensor) -> torch.Tensor:
    """The objective's loss between the boundary states of student and teacher (tuples of (batch, seq, hidden))."""
    real = attention_mask.bool()
    losses = []
    for s, t in comparable(student, teacher):
        loss = F.mse_loss(s[real], t[real])
        if objective == "cka":
            loss = loss + 2 - _linear_cka(s[real], t[real]) - _linear_cka(s[:, 0], t[:, 0])
        elif objective in ("similarity", "mlm"):
            pooled_s, pooled_t = pool(s, attention_mask), pool(t, attention_mask)
            loss = loss + sum(F.mse_loss(_cosine_matrix(pooled_s[p]), _cosine_matrix(pooled_t[p])) for p in POOLINGS)
        losses.append(loss)
    return torch.stack(losses).mean()


def masked_lm_distillation(student: torch.Tensor, teacher: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The KL divergence of the student's masked-LM predictions from the teacher's, on the masked tokens (labels
    other than -100)."""
    masked = labels != -100
    return F.kl_div(
        F.log_softmax(student[masked].float(), -1),
        F.log_softmax(teacher[masked].float(), -1),
        log_target=True,
        reduction="batchmean",
    )


TOKENS_PER_CHUNK = 256  # next-token logits held at once: 256 x a 49k vocabulary is 50 MB in float32
KEPT_FOR_BACKWARD_BYTES = 1 << 30  # what a KL's chunks may keep for the backward pass rather than recompute


def teacher_logits_from_forward(rows: int, teacher: torch.nn.Module, device: torch.device) -> bool:
    """Whether the KL takes the teacher's next-token logits from its own forward, held for all `rows` (rows x vocab),
    rather than from its head a chunk at a time (sharded, each chunk gathers the head: vocab x hidden): when they
    take less memory, that is when no process has more rows than the hidden size."""
    return agreed_max(rows, device) <= teacher.config.hidden_size


def next_token_kl(
    student: torch.nn.Module,
    teacher: torch.nn.Module,
    states: torch.Tensor,
    teacher_states: torch.Tensor,
    teacher_log_probs: torch.Tensor | None = None,
):
    """The mean over rows of KL(teacher || student) of the next-token distributions that the two causal LMs' heads
    give the final states (rows, hidden). Computed `TOKENS_PER_CHUNK` rows at a time; where what the backward pass
    needs of all of them (two float32 tensors of rows x vocab) exceeds `KEPT_FOR_BACKWARD_BYTES`, each chunk's
    logits are recomputed there instead, so that memory holds one chunk's logits whatever the vocabulary. The
    teacher's are `teacher_log_probs` (rows, vocab) where given, else its head's on `teacher_states`: under data
    parallelism every process then runs as many chunks (some may be empty), gathering a sharded teacher's head for
    each."""
    total = states.new_zeros((), dtype=torch.float32)
    most = agreed_max(len(states), states.device)
    chunks = max(1, -(-most // TOKENS_PER_CHUNK))
    recomputed = 2 * 4 * most * student.get_output_embeddings().weight.shape[0] > KEPT_FOR_BACKWARD_BYTES
    targets = [None] * chunks if teacher_log_probs is None else teacher_log_probs.tensor_split(chunks)
    for rows, teacher_rows, target in zip(states.tensor_split(chunks), teacher_states.tensor_split(chunks), targets):
        chunk = (student, teacher, rows, teacher_rows, target)
        total = total + (checkpoint(_chunk_kl, *chunk, use_reentrant=False) if recomputed else _chunk_kl(*chunk))
    return total / max(1, len(states))


def _chunk_kl(student, teacher, rows: torch.Tensor, teacher_rows: torch.Tensor, target: torch.Tensor | None):
    if target is None:
        with torch.no_grad(), gathered(teacher):
            target = token_log_probs(teacher, teacher_rows)
    return F.kl_div(token_log_probs(student, rows), target, log_target=True, reduction="sum")


def _normalised(states: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(states.float(), states.shape[-1:])


def _linear_cka(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """Linear CKA between two sets of rows (Kornblith et al. 2019); 0 where either set has no spread."""
    student, teacher = student - student.mean(0), teacher - teacher.mean(0)
    cross = (student.T @ teacher).pow(2).sum()
    return cross / ((student.T @ student).pow(2).sum() * (teacher.T @ teacher).pow(2).sum()).clamp_min(1e-12).sqrt()


def _cosine_matrix(rows: torch.Tensor) -> torch.Tensor:
    unit = F.normalize(rows, dim=-1)
    return unit @ unit.T
