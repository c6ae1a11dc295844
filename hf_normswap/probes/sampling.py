"""Texts sampled from a causal LM: each token drawn by the inverse of its distribution function, from uniform draws
made on the CPU, so that a seed gives the same texts on every device, in groups of any size, on a static cache."""

import math

import torch
from transformers import LogitsProcessor, LogitsProcessorList


def uniform_draws(seed: int, texts: int, steps: int) -> torch.Tensor:
    """`texts` x `steps` uniform draws in [0, 1) (float64) from a CPU generator seeded by `seed`: each text's row is
    the same whatever the device that samples it, and whatever texts are sampled beside it."""
    return torch.rand(texts, steps, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


class InverseCdfSampling(LogitsProcessor):
    """Draws each text's next token from softmax(scores / `temperature`), the tokens `never` left out (those it
    scores), by its inverse distribution function at the text's next uniform draw (`draws`: texts x steps, one
    column a call), then leaves that token alone finite, so that greedy decoding takes it. The same distribution as
    `generate`'s sampling, whose multinomial draws an exponential for every token of the vocabulary on the device's
    generator: on a CPU that took longer than the decoding step's matrix products, and `min_new_tokens`' copies of
    the scores a sixth of a step of 256 texts (docs/experiments/healing.md)."""

    def __init__(self, temperature: float, draws: torch.Tensor, never: tuple[int, ...] = ()):
        self.temperature, self.draws, self.never, self.step = temperature, draws, list(never), 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        weights = scores.float() / self.temperature
        weights[:, [token for token in self.never if 0 <= token < weights.shape[-1]]] = -math.inf  # ids it scores
        cumulative = torch.softmax(weights, -1).cumsum(-1, dtype=torch.float64)
        drawn = (1 - self.draws[:, self.step : self.step + 1]) * cumulative[:, -1:]
        self.step += 1
        tokens = torch.searchsorted(cumulative, drawn).clamp_max(scores.shape[-1] - 1)  # in (0, total]: p > 0
        return weights.fill_(-math.inf).scatter_(-1, tokens, 0.0)


def start_token(tokenizer, config) -> int | None:
    """The token a sampled text starts from: BOS, else EOS, the tokenizer's (where there is one) before those of the
    model's `config`; None where none is named."""
    named = (tokenizer.bos_token_id, tokenizer.eos_token_id) if tokenizer is not None else ()
    candidates = (*named, config.bos_token_id, config.eos_token_id)
    return next((token for token in candidates if isinstance(token, int)), None)


def continue_texts(
    model: torch.nn.Module,
    starts: torch.Tensor,
    draws: torch.Tensor,
    temperature: float,
    pad: int | None,
    states: bool,
):
    """`generate`'s output for `starts` (texts x tokens, on `model`'s device), each continued by exactly as many
    tokens as it has uniform `draws` (texts x steps), drawn at `temperature` (EOS kept out), with the hidden states of
    every step where `states`."""
    eos = model.generation_config.eos_token_id
    never = (eos,) if isinstance(eos, int) else tuple(eos or ())
    return model.generate(
        starts,
        attention_mask=torch.ones_like(starts),
        do_sample=False,
        logits_processor=LogitsProcessorList([InverseCdfSampling(temperature, draws.to(starts.device), never)]),
        max_new_tokens=draws.shape[1],
        pad_token_id=pad,
        cache_implementation="static",
        return_dict_in_generate=True,
        output_hidden_states=states,
    )
