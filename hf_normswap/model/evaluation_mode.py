"""A model in evaluation mode for a block, back in the mode it had after."""

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def evaluation_mode(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Puts `model` in evaluation mode (no dropout) for the block, then back in the mode it was in."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)
