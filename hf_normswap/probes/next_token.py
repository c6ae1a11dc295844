"""How far a causal LM is from its source as a language model: the KL divergence of their next-token distributions,
how often their most likely next tokens agree, and how much of their greedy continuations agree."""

import math
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F

from ..model.evaluation_mode import evaluation_mode
from .probe_data import on_device


TOKENS = ("input_ids", "attention_mask")


POSITION_BINS = {"0": (0, 1), "1": (1, 2), "2-3": (2, 4), "4-15": (4, 16), "16-63": (16, 64), "64+": (64, math.inf)}


@torch.no_grad()
def next_token_agreement(source: torch.nn.Module, model: torch.nn.Module, batches: list[dict]) -> dict:
    """Over the real tokens of padded `batches`: the mean KL(source || model) of the next-token distributions in nats
    per token, overall and by the token's position in its text (`POSITION_BINS` that hold tokens: where the distance
    lives, the first tokens against the rest), and the fraction of tokens where both rank the same next token first."""
    return agreement_with(next_token_log_probs(source, batches), model, batches)


def token_log_probs(model: torch.nn.Module, states: torch.Tensor) -> torch.Tensor:
    """The causal LM's next-token log-probabilities (float32) for final states, as its head computes them."""
    head = model.get_output_embeddings()
    logits = head(states.to(head.weight.dtype))  # under mixed precision the head computes in its own dtype
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    return F.log_softmax(logits.float(), -1)


def next_token_log_probs(model: torch.nn.Module, batches: list[dict]) -> Iterator[torch.Tensor]:
    """Per batch of padded `batches`, one at a time, `model`'s next-token log-probabilities at its real tokens
    (tokens, vocabulary)."""
    with torch.no_grad(), evaluation_mode(model):
        for batch in batches:
            logits = model(**on_device(batch, model, TOKENS)).logits
            yield F.log_softmax(logits[batch["attention_mask"].to(logits.device).bool()].float(), -1)


@torch.no_grad()
def final_state_log_probs(
    model: torch.nn.Module, states: list[torch.Tensor], batches: list[dict]
) -> Iterator[torch.Tensor]:
    """`next_token_log_probs` from `model`'s final states on each of `batches` (its last boundary states), through
    its head alone: a model whose states are at hand is not run again."""
    for final, batch in zip(states, batches, strict=True):
        yield token_log_probs(model, final[batch["attention_mask"].to(final.device).bool()])


@torch.no_grad()
def agreement_with(expected: Iterable[torch.Tensor], model: torch.nn.Module, batches: list[dict]) -> dict:
    """`next_token_agreement` against a source's `next_token_log_probs` on the same `batches`."""
    return agreement(expected, next_token_log_probs(model, batches), batches)


@torch.no_grad()
def agreement(expected: Iterable[torch.Tensor], given: Iterable[torch.Tensor], batches: list[dict]) -> dict:
    """`next_token_agreement` of a model's next-token log-probabilities `given` on `batches` against a source's
    `expected` (each per batch, at its real tokens); with the model's cross-entropy on the texts' next tokens minus
    the source's (`cross_entropy_gap`, nats per token; None for texts of one token)."""
    kl, positions, gap, agree = [], [], [], 0
    for batch, source, model in zip(batches, expected, given, strict=True):
        mask, source = batch["attention_mask"].to(model.device).bool(), source.to(model.device)
        kl.append(F.kl_div(model, source, log_target=True, reduction="none").sum(-1))
        agree += (model.argmax(-1) == source.argmax(-1)).sum().item()
        positions.append((mask.cumsum(-1) - 1)[mask])
        followed = torch.zeros_like(mask)
        followed[:, :-1] = mask[:, :-1] & mask[:, 1:]  # a real token whose next one is real
        following = batch["input_ids"].to(model.device).roll(-1, dims=1)[mask][followed[mask]].unsqueeze(-1)
        gap.append((source[followed[mask]].gather(-1, following) - model[followed[mask]].gather(-1, following)))
    kl, positions, gap = torch.cat(kl), torch.cat(positions), torch.cat(gap)
    bins = {name: (positions >= start) & (positions < end) for name, (start, end) in POSITION_BINS.items()}
    by_position = {name: kl[chosen].mean().item() for name, chosen in bins.items() if chosen.any()}
    return {
        "kl": kl.mean().item(),
        "kl_by_position": by_position,
        "top1_agreement": agree / len(kl),
        "cross_entropy_gap": gap.mean().item() if len(gap) else None,
    }


@torch.no_grad()
def greedy_continuation(model: torch.nn.Module, prompts: dict, new_tokens: int = 32) -> torch.Tensor:
    """The `new_tokens` tokens that `model` generates greedily after each of the left-padded `prompts` (input_ids,
    attention_mask)."""
    settings = dict(do_sample=False, min_new_tokens=new_tokens, max_new_tokens=new_tokens)
    with evaluation_mode(model):
        generated = model.generate(
            **on_device(prompts, model, TOKENS), **settings, pad_token_id=model.config.pad_token_id
        )
    return generated[:, prompts["input_ids"].shape[1] :]


def greedy_agreement(expected: torch.Tensor, model: torch.nn.Module, prompts: dict) -> float:
    """The fraction of a source's greedy tokens `expected` (its `greedy_continuation` of `prompts`) that `model`
    generates too, position by position."""
    given = greedy_continuation(model, prompts, new_tokens=expected.shape[1])
    return (expected.to(given.device) == given).float().mean().item()


def greedy_prompts(batches: list[dict], tokenizer, count: int = 32, length: int = 8) -> dict:
    """The first `length` real tokens of the first `count` texts of padded `batches`, left-padded for generation."""
    rows = []
    for batch in batches:
        for ids, mask in zip(batch["input_ids"], batch["attention_mask"]):
            rows.append(ids[mask.bool()][:length].tolist())
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    try:
        return dict(tokenizer.pad({"input_ids": rows[:count]}, return_tensors="pt"))
    finally:
        tokenizer.padding_side = side
