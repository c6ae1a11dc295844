"""Packed (padding-free) batches as NormSwap reads them: sequence ids, positions, and per-sequence outputs."""

import torch
from torch import nn
from transformers.masking_utils import find_packed_sequence_indices


def packed_sequence_ids(
    attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None, seq_idx: torch.Tensor | None
) -> torch.Tensor | None:
    """For a packed (padding-free) batch, the sequence of every token, numbered across the batch; None otherwise.

    The boundaries come from the collator: its `seq_idx` (`DataCollatorWithPacking`, or `DataCollatorWithFlattening`
    with `return_seq_idx=True`; -1 marks padding at the end of a row) or else, for a batch without attention mask,
    where its `position_ids` restart (`DataCollatorWithFlattening`'s default).
    """
    if seq_idx is not None:
        return seq_idx
    if attention_mask is not None or position_ids is None:
        return None
    in_row = find_packed_sequence_indices(position_ids)
    if in_row is None:
        return None
    per_row = in_row[:, -1] + 1
    return in_row + (per_row.cumsum(0) - per_row)[:, None]


def positions_in_sequence(sequence_ids: torch.Tensor) -> torch.Tensor:
    """The index of every token within its sequence of a packed batch (0 at each sequence start)."""
    index = torch.arange(sequence_ids.shape[-1], device=sequence_ids.device).expand_as(sequence_ids)
    starts = torch.ones_like(sequence_ids, dtype=torch.bool)
    starts[:, 1:] = sequence_ids[:, 1:] != sequence_ids[:, :-1]
    return index - torch.where(starts, index, 0).cummax(-1).values


def unpack_sequences(packed: torch.Tensor, sequence_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, row length, ...) packed values -> (sequences, longest, ...) in sequence order, zero past each end,
    and the (sequences, longest) mask of real tokens: the padded layout of the same sequences."""
    real = sequence_ids >= 0
    sequence, position = sequence_ids[real], positions_in_sequence(sequence_ids)[real]
    shape = (int(sequence.max()) + 1, int(position.max()) + 1)
    unpacked = packed.new_zeros(*shape, *packed.shape[2:])
    unpacked[sequence, position] = packed[real]
    mask = torch.zeros(shape, dtype=torch.bool, device=packed.device)
    mask[sequence, position] = True
    return unpacked, mask


def mask_padding(logits: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """(batch, length, ...) logits with the dtype's minimum where a 2D `attention_mask` marks padding."""
    if attention_mask is None or attention_mask.dim() != 2:
        return logits
    return logits.masked_fill(attention_mask[..., None] == 0, torch.finfo(logits.dtype).min)


def next_token_labels(labels: torch.Tensor, sequence_ids: torch.Tensor) -> torch.Tensor:
    """The causal-LM targets of a packed batch: each token's next label within its own sequence, -100 at its end."""
    same_sequence = sequence_ids[:, 1:] == sequence_ids[:, :-1]
    return nn.functional.pad(labels[:, 1:].masked_fill(~same_sequence, -100), (0, 1), value=-100)


def flash_varlen_kwargs(sequence_ids: torch.Tensor) -> dict:
    """The cumulative sequence lengths flash-attention's varlen kernels take, over the flattened packed batch."""
    flat = sequence_ids.reshape(-1)
    starts = torch.nonzero(flat[1:] != flat[:-1]).flatten() + 1
    ends = torch.tensor([0, flat.numel()], device=flat.device)
    cu_seq_lens = torch.cat([ends[:1], starts, ends[1:]]).to(torch.int32)
    max_length = int(cu_seq_lens.diff().max())
    return {
        "cu_seq_lens_q": cu_seq_lens,
        "cu_seq_lens_k": cu_seq_lens,
        "max_length_q": max_length,
        "max_length_k": max_length,
    }
