"""The fixed inputs probes run on: sentences of the shipped SST-2 sample, a few plain sentences, masked tokens."""

import json
from pathlib import Path

import torch

from ..devices import compute_device
from ..tasks import DATA_DIR
from .sampling import continue_texts, start_token, uniform_draws


PROBE_SIZE = 64
_SAMPLE = DATA_DIR / "sst2"
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Layer normalization keeps the activations of deep networks in a stable range.",
    "Paris is the capital and most populous city of France.",
    "She poured the coffee, opened the window and started to read the letter.",
    "Researchers trained the model for three epochs with a learning rate of two times ten to the minus five.",
    "A small dog barked at the postman every morning.",
]


def probe_tokenizer(folder: Path):
    """The checkpoint's tokenizer, if it has one that pads; else None (probes are then random tokens)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError, TypeError):
        return None
    return tokenizer if tokenizer.pad_token is not None else None


def probe_batches(
    tokenizer, vocab_size: int, size: int = PROBE_SIZE, batch_size: int = 32, split: str = "validation"
) -> list[dict]:
    """The fixed probe set: the first `size` sentences of a split of the shipped SST-2 sample (repeated beyond its
    length), or random tokens (always the same) when there is no tokenizer."""
    if tokenizer is None:
        generator = torch.Generator().manual_seed(0)
        input_ids = torch.randint(0, vocab_size, (size, 16), generator=generator)
        return [{"input_ids": ids, "attention_mask": torch.ones_like(ids)} for ids in input_ids.split(batch_size)]
    lines = (_SAMPLE / f"{split}.jsonl").read_text().splitlines()
    sentences = [json.loads(line)["sentence"] for line in lines * -(-size // len(lines))][:size]
    return [
        dict(
            tokenizer(
                sentences[start : start + batch_size],
                padding=True,
                truncation=True,
                max_length=128,
                return_tensors="pt",
            )
        )
        for start in range(0, len(sentences), batch_size)
    ]


def sampled_batches(model: torch.nn.Module, tokenizer, count: int = 16, length: int = 128, seed: int = 0) -> list:
    """`count` texts of `length` tokens sampled from the causal LM `model` at temperature 1 from BOS (else EOS, else
    token 0), one batch, the same for a seed on every device, no longer than the model's positions."""
    config = model.config
    length = min(length, config.max_position_embeddings - getattr(config, "position_offset", 0))
    start = start_token(tokenizer, config)
    start = 0 if start is None else start
    starts = torch.full((count, 1), start, device=compute_device(model))
    draws = uniform_draws(seed, count, length - 1)
    ids = continue_texts(model, starts, draws, temperature=1.0, pad=start, states=False).sequences.cpu()
    return [{"input_ids": ids, "attention_mask": torch.ones_like(ids)}]


def mask_every_sixth(batch: dict, tokenizer) -> torch.Tensor:
    """Masks every 6th real, non-special token; returns the labels and masks `batch` in place."""
    input_ids = batch["input_ids"]
    special = torch.tensor(
        [tokenizer.get_special_tokens_mask(row, already_has_special_tokens=True) for row in input_ids.tolist()]
    ).bool()
    candidates = (batch["attention_mask"] == 1) & ~special
    positions = torch.cumsum(candidates.long(), dim=1)
    chosen = candidates & (positions % 6 == 1)
    labels = input_ids.masked_fill(~chosen, -100)
    batch["input_ids"] = input_ids.masked_fill(chosen, tokenizer.mask_token_id)
    return labels


def on_device(batch: dict, model: torch.nn.Module, keys: tuple[str, ...] | None = None) -> dict:
    """`batch` (its `keys` only, where given) on the device `model` runs on: models compared may sit on different
    devices."""
    device = compute_device(model)
    return {key: value.to(device) for key, value in batch.items() if keys is None or key in keys}
