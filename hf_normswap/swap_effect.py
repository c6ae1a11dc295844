"""How far a swap moved a converted model: masked-LM loss, perplexity, or hidden-state cosine similarity."""

from pathlib import Path

import torch

from .collapse import probe_tokenizer
from .heads import HEAD_CLASSES


SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Layer normalization keeps the activations of deep networks in a stable range.",
    "Paris is the capital and most populous city of France.",
    "She poured the coffee, opened the window and started to read the letter.",
    "Researchers trained the model for three epochs with a learning rate of two times ten to the minus five.",
    "A small dog barked at the postman every morning.",
]


def swap_effect(before: torch.nn.Module, after_folder: Path, head: str, seed: int = 0) -> dict:
    """Compares the unswapped model with the written one on a few sentences (random tokens without a tokenizer)."""
    after = HEAD_CLASSES[head].from_pretrained(after_folder, dtype=torch.float32).eval()
    tokenizer = probe_tokenizer(after_folder)
    if tokenizer is None:
        generator = torch.Generator().manual_seed(seed)
        input_ids = torch.randint(0, after.config.vocab_size, (4, 16), generator=generator)
        batch = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
    else:
        encoded = tokenizer(SENTENCES, padding=True, return_tensors="pt")
        batch = {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}

    with torch.no_grad():
        if tokenizer is not None and head == "masked-lm":
            labels = mask_every_sixth(batch, tokenizer)
            before_loss = before(**batch, labels=labels).loss.item()
            return {"metric": "masked_lm_loss", "before": before_loss, "after": after(**batch, labels=labels).loss.item()}
        if tokenizer is not None and head == "causal-lm":
            labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
            before_ppl = before(**batch, labels=labels).loss.exp().item()
            return {"metric": "perplexity", "before": before_ppl, "after": after(**batch, labels=labels).loss.exp().item()}
        mask = batch["attention_mask"].unsqueeze(-1).float()
        pooled = [
            (model.base_model(**batch).last_hidden_state * mask).sum(1) / mask.sum(1) for model in (before, after)
        ]
        similarity = torch.nn.functional.cosine_similarity(*pooled, dim=-1).mean().item()
        return {"metric": "cosine_similarity", "before": 1.0, "after": similarity}


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
