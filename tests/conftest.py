import pytest
import torch

from hf_normswap import NormSwapConfig


def tiny_config(**overrides) -> NormSwapConfig:
    """A NormSwap config small enough for fast CPU tests; dropout off so outputs are deterministic."""
    fields = dict(
        vocab_size=99,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    fields.update(overrides)
    return NormSwapConfig(**fields)


def padded_batch(vocab_size: int = 99, lengths=(9, 6), seed: int = 0):
    """Random token ids, right-padded with id 0, and the matching attention mask."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, vocab_size, (len(lengths), max(lengths)), generator=generator)
    attention_mask = torch.zeros_like(input_ids)
    for row, length in enumerate(lengths):
        attention_mask[row, :length] = 1
    return input_ids.masked_fill(attention_mask == 0, 0), attention_mask


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
