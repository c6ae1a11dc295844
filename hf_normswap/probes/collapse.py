"""The collapse figure: how alike a model makes the pooled representations of different inputs.

It is the mean pairwise cosine similarity between the pooled vectors (first token, and mean over real tokens) of a
fixed probe set, at every layer boundary (0: the embeddings' output, the last: the final output). A model that maps
every input to the same vector scores 1.0; all-MiniLM-L6-v2 scores about 0.7 on SST-2 sentences.
"""

from pathlib import Path

import torch

from ..model.evaluation_mode import evaluation_mode
from .probe_data import PROBE_SIZE, probe_batches, probe_tokenizer


POOLINGS = ("first_token", "mean")
COLLAPSE_MARGIN = 0.1  # a variant whose figure exceeds its source's by more than this is flagged


def mean_pairwise_cosine(vectors: torch.Tensor) -> float:
    """Mean cosine similarity over all pairs of distinct rows of `vectors` (n, d), n >= 2."""
    unit = torch.nn.functional.normalize(vectors.double(), dim=-1)
    similarity = unit @ unit.T
    count = len(unit)
    return ((similarity.sum() - similarity.diagonal().sum()) / (count * (count - 1))).item()


def pool(hidden_states: torch.Tensor, attention_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """The first-token and the mean (over real tokens) vectors of each sequence."""
    mask = attention_mask.to(hidden_states.dtype).unsqueeze(-1)
    return {"first_token": hidden_states[:, 0], "mean": (hidden_states * mask).sum(1) / mask.sum(1)}


def boundary_states(model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, ...]:
    """The hidden states at every layer boundary of a base model or head model (BERT, LLaMA or NormSwap)."""
    inputs = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "token_type_ids")}
    return model.base_model(**inputs, output_hidden_states=True).hidden_states


def collapse_of_states(states: list[tuple[torch.Tensor, ...]], masks: list[torch.Tensor]) -> dict[str, list[float]]:
    """The collapse figure of each pooling at each layer boundary, from every batch's boundary states and mask."""
    pooled = {name: [] for name in POOLINGS}
    for batch_states, mask in zip(states, masks):
        per_boundary = [pool(boundary.float(), mask.to(boundary.device)) for boundary in batch_states]
        for name in POOLINGS:
            pooled[name].append(torch.stack([vectors[name] for vectors in per_boundary]))
    return {name: [mean_pairwise_cosine(v) for v in torch.cat(pooled[name], dim=1)] for name in POOLINGS}


@torch.no_grad()
def collapse_profile(model: torch.nn.Module, batches: list[dict]) -> dict[str, list[float]]:
    """The collapse figure of each pooling at each layer boundary, over all sequences of `batches`."""
    with evaluation_mode(model):
        states = [boundary_states(model, batch) for batch in batches]
    return collapse_of_states(states, [batch["attention_mask"] for batch in batches])


def exceeds(variant: dict[str, list[float]], source: dict[str, list[float]]) -> bool:
    """Whether the variant's final-output figure is above the source's by more than COLLAPSE_MARGIN, for a pooling."""
    return any(variant[name][-1] > source[name][-1] + COLLAPSE_MARGIN for name in POOLINGS)


def conversion_collapse(source: torch.nn.Module, variant: torch.nn.Module, folder: Path) -> dict:
    """The collapse figures of the unswapped model and of the `variant` written in FOLDER (with its tokenizer), on
    the probe set."""
    tokenizer = probe_tokenizer(folder)
    batches = probe_batches(tokenizer, variant.config.vocab_size)
    figures = {"source": collapse_profile(source, batches), "variant": collapse_profile(variant, batches)}
    probe = (
        f"the first {PROBE_SIZE} sentences of the shipped SST-2 validation sample"
        if tokenizer
        else f"{PROBE_SIZE} random token sequences"
    )
    return {"probe": probe, **figures, "flagged": exceeds(figures["variant"], figures["source"])}
