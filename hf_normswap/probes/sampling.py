"""Texts sampled from a causal LM: each token drawn by the inverse of its distribution function, on a static cache."""

import contextlib
import math

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from ..devices import compute_device


class InverseCdfSampling(LogitsProcessor):
    """Draws each text's next token from softmax(scores / `temperature`), the tokens `never` left out (those it
    scores), by its inverse distribution function (one uniform draw a text), then leaves that token alone finite, so
    that greedy decoding takes it. The same distribution as `generate`'s sampling, whose multinomial draws an
    exponential for every token of the vocabulary: on a CPU that took longer than the decoding step's matrix
    products, and `min_new_tokens`' copies of the scores a sixth of a step of 256 texts
    (docs/experiments/healing.md)."""

    def __init__(self, temperature: float, never: tuple[int, ...] = ()):
        self.temperature, self.never = temperature, list(never)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        weights = scores.float() / self.temperature
        weights[:, [token for token in self.never if 0 <= token < weights.shape[-1]]] = -math.inf  # ids it scores
        cumulative = torch.softmax(weights, -1).cumsum(-1, dtype=torch.float64)
        drawn = (1 - torch.rand(len(scores), 1, device=scores.device, dtype=torch.float64)) * cumulative[:, -1:]
        tokens = torch.searchsorted(cumulative, drawn).clamp_max(scores.shape[-1] - 1)  # in (0, total]: p > 0
        return weights.fill_(-math.inf).scatter_(-1, tokens, 0.0)


def start_token(tokenizer, config) -> int | None:
    """The token a sampled text starts from: BOS, else EOS, the tokenizer's (where there is one) before those of the
    model's `config`; None where none is named."""
    named = (tokenizer.bos_token_id, tokenizer.eos_token_id) if tokenizer is not None else ()
    candidates = (*named, config.bos_token_id, config.eos_token_id)
    return next((token for token in candidates if isinstance(token, int)), None)


@contextlib.contextmanager
def seeded(model: torch.nn.Module, seed: int):
    """Draws seeded by `seed` on the device `model` runs on; the global generator is left as it was."""
    device = compute_device(model)
    with torch.random.fork_rng(devices=[device] if device.type != "cpu" else []):
        torch.manual_seed(seed)
        yield


def continue_texts(
    model: torch.nn.Module, starts: torch.Tensor, new_tokens: int, temperature: float, pad: int | None, states: bool
):
    """`generate`'s output for `starts` (texts x tokens, on `model`'s device), each continued by exactly `new_tokens`
    tokens drawn at `temperature` (EOS kept out), with the hidden states of every step where `states`."""
    eos = model.generation_config.eos_token_id
    never = (eos,) if isinstance(eos, int) else tuple(eos or ())
    return model.generate(
        starts,
        attention_mask=torch.ones_like(starts),
        do_sample=False,
        logits_processor=LogitsProcessorList([InverseCdfSampling(temperature, never)]),
        max_new_tokens=new_tokens,
        pad_token_id=pad,
        cache_implementation="static",
        return_dict_in_generate=True,
        output_hidden_states=states,
    )
