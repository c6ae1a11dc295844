"""Padding-free batches: tokenized examples packed into rows, with the sequence boundaries NormSwap reads."""

from dataclasses import dataclass

import torch


@dataclass
class DataCollatorWithPacking:
    """The padding-free counterpart of `DataCollatorWithPadding`, for NormSwap models.

    Packs tokenized examples end to end into rows as long as the longest example (first-fit decreasing; an example is
    never split) and returns `input_ids`, `position_ids` restarting at 0 for every example, `seq_idx` (the example
    each token belongs to; -1 for the padding left at the end of a row) and the examples' other fields: per-token
    lists (`token_type_ids`, token `labels`) packed the same way (`labels` -100 at the row ends), per-example values
    (`label` as `labels`, `start_positions`, ...) in the examples' order, which is also the order in which NormSwap
    answers per-example heads (sequence classification, question answering).
    """

    pad_token_id: int = 0

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        features = [{("labels" if key == "label" else key): value for key, value in f.items()} for f in features]
        lengths = [len(feature["input_ids"]) for feature in features]
        for index, feature in enumerate(features):
            if 0 in feature.get("attention_mask", ()):
                raise ValueError(
                    f"DataCollatorWithPacking: example {index} is padded; pack examples tokenized without padding"
                )
        rows = first_fit_decreasing(lengths, max(lengths))
        shape = (len(rows), max(lengths))
        batch = {"seq_idx": torch.full(shape, -1), "position_ids": torch.zeros(shape, dtype=torch.long)}
        per_token = [
            key
            for key in features[0]
            if key != "attention_mask" and all(_length(f[key]) == n for f, n in zip(features, lengths))
        ]
        fill = {"input_ids": self.pad_token_id, "labels": -100}
        for key in per_token:
            batch[key] = torch.full(shape, fill.get(key, 0), dtype=torch.as_tensor(features[0][key]).dtype)
        for row, examples in enumerate(rows):
            start = 0
            for index in examples:
                end = start + lengths[index]
                batch["seq_idx"][row, start:end] = index
                batch["position_ids"][row, start:end] = torch.arange(lengths[index])
                for key in per_token:
                    batch[key][row, start:end] = torch.as_tensor(features[index][key])
                start = end
        for key in features[0].keys() - set(per_token) - {"attention_mask"}:
            batch[key] = torch.tensor([feature[key] for feature in features])
        return batch


def _length(value) -> int | None:
    return len(value) if isinstance(value, (list, tuple, torch.Tensor)) else None


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices of `lengths` grouped into rows of at most `capacity` tokens, longest first, each into the first row
    with room."""
    rows, room = [], []
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        row = next((r for r, free in enumerate(room) if free >= lengths[index]), None)
        if row is None:
            rows.append([])
            room.append(capacity)
            row = len(rows) - 1
        rows[row].append(index)
        room[row] -= lengths[index]
    return rows


def pack_padded(batch: dict[str, torch.Tensor], pad_token_id: int = 0) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A padded batch (with `attention_mask`) packed as `DataCollatorWithPacking` packs it, and for every padded
    position its index in the flattened packed rows (-1 for padding), for `unpack`."""
    real = batch["attention_mask"].bool()
    per_token = [key for key, value in batch.items() if key != "attention_mask" and value.shape == real.shape]
    features = [{key: batch[key][row][real[row]].tolist() for key in per_token} for row in range(len(real))]
    packed = DataCollatorWithPacking(pad_token_id)(features)
    flat = packed["seq_idx"].flatten()
    order = torch.argsort(torch.where(flat < 0, len(real), flat), stable=True)  # each example's tokens, in order
    index = torch.full(real.shape, -1)
    index[real] = order[: int(real.sum())]
    return packed, index


def unpack(states: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Per-token `states` (rows, length, ...) of a packed batch laid back out as the padded batch (zeros at
    padding)."""
    flat = states.flatten(0, 1)[index.clamp_min(0).flatten().to(states.device)]
    flat = flat * (index.flatten() >= 0).to(states.device, states.dtype).view(-1, *[1] * (states.dim() - 2))
    return flat.view(*index.shape, *states.shape[2:])
