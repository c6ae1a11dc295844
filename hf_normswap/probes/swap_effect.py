"""How far a swap moved a converted model: masked-LM loss, perplexity (with KL and top-1 agreement to the source),
or hidden-state cosine similarity."""

from pathlib import Path

import torch

from .next_token import next_token_agreement
from .probe_data import SENTENCES, mask_every_sixth, probe_tokenizer


def swap_batch(folder: Path, vocab_size: int, seed: int = 0) -> dict:
    """The probe's sentences, tokenised by FOLDER's tokenizer (random tokens without one)."""
    tokenizer = probe_tokenizer(folder)
    if tokenizer is None:
        generator = torch.Generator().manual_seed(seed)
        input_ids = torch.randint(0, vocab_size, (4, 16), generator=generator)
        return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
    encoded = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    return {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}


def swap_effect(before: torch.nn.Module, after: torch.nn.Module, folder: Path, head: str, seed: int = 0) -> dict:
    """Compares the unswapped model with the written one (`after`, of `head`, written in FOLDER with its tokenizer)
    on a few sentences (`swap_batch`)."""
    tokenizer = probe_tokenizer(folder)
    batch = swap_batch(folder, after.config.vocab_size, seed)
    with torch.no_grad():
        if tokenizer is not None and head == "masked-lm":
            labels = mask_every_sixth(batch, tokenizer)
            before_loss = before(**batch, labels=labels).loss.item()
            return {
                "metric": "masked_lm_loss",
                "before": before_loss,
                "after": after(**batch, labels=labels).loss.item(),
            }
        if tokenizer is not None and head == "causal-lm":
            labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
            before_ppl = before(**batch, labels=labels).loss.exp().item()
            return {
                "metric": "perplexity",
                "before": before_ppl,
                "after": after(**batch, labels=labels).loss.exp().item(),
                **next_token_agreement(before, after, [batch]),
            }
        mask = batch["attention_mask"].unsqueeze(-1).float()
        pooled = [
            (model.base_model(**batch).last_hidden_state * mask).sum(1) / mask.sum(1) for model in (before, after)
        ]
        similarity = torch.nn.functional.cosine_similarity(*pooled, dim=-1).mean().item()
        return {"metric": "cosine_similarity", "before": 1.0, "after": similarity}
