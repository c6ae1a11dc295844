"""Texts sampled from a causal LM: each token drawn by the inverse of its distribution function, on a static cache."""

import contextlib
import math

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from ..devices import compute_device


class InverseCdfSampling(LogitsProcessor):
    """Draws each text's next token from softmax(scores / `temperature`), the tokens `never` left out (those it
    scores), by its inverse distribution function (one uniform draw a text), then scores that token above every
    other, so that greedy decoding takes it. The same distribution as `generate`'s sampling, whose multinomial draws
    an exponential for every token of the vocabulary: on a CPU that took longer than the decoding step's matrix
    products (docs/experiments/healing.md). The distribution function is summed in float64 over blocks of `block`
    tokens, then within the block drawn, so that each token's probability is exact to float64's rounding."""

    block = 256

    def __init__(self, temperature: float, never: tuple[int, ...] = ()):
        self.temperature, self.never = temperature, list(never)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        texts, vocabulary = scores.shape
        weights = scores.float() / self.temperature
        weights[:, [token for token in self.never if 0 <= token < vocabulary]] = -math.inf  # ids it scores
        weights = weights.sub_(weights.amax(-1, keepdim=True)).exp_()  # each token's probability, times a constant
        padding = -vocabulary % self.block
        blocks = (torch.nn.functional.pad(weights, (0, padding)) if padding else weights).view(texts, -1, self.block)
        ends = torch.nn.functional.pad(blocks.sum(-1, dtype=torch.float64).cumsum(-1), (1, 0))  # 0, then each block's
        drawn = (1 - torch.rand(texts, 1, device=scores.device, dtype=torch.float64)) * ends[:, -1:]  # in (0, total]
        block = (torch.searchsorted(ends, drawn) - 1).clamp(0, blocks.shape[1] - 1)  # ends[block] < drawn <= next
        within = blocks.gather(1, block[:, :, None].expand(-1, -1, self.block))[:, 0].cumsum(-1, dtype=torch.float64)
        rest = (drawn - ends.gather(-1, block)).minimum(within[:, -1:])  # > 0: the token found has probability > 0
        tokens = block * self.block + torch.searchsorted(within, rest)
        return weights.scatter_(-1, tokens, 2.0)  # every other token's weight is at most 1


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
