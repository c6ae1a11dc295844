"""The collapse figure: how alike a model makes the pooled representations of different inputs.

It is the mean pairwise cosine similarity between the pooled vectors (first token, and mean over real tokens) of a
fixed probe set, at every layer boundary (0: the embeddings' output, the last: the final output). A model that maps
every input to the same vector scores 1.0; all-MiniLM-L6-v2 scores about 0.7 on SST-2 sentences.
"""

import json
from pathlib import Path

import torch


POOLINGS = ("first_token", "mean")
COLLAPSE_MARGIN = 0.1  # a variant whose figure exceeds its source's by more than this is flagged
PROBE_SIZE = 64
_SAMPLE = Path(__file__).parent / "data" / "sst2"


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
        per_boundary = [pool(boundary.float(), mask) for boundary in batch_states]
        for name in POOLINGS:
            pooled[name].append(torch.stack([vectors[name] for vectors in per_boundary]))
    return {name: [mean_pairwise_cosine(v) for v in torch.cat(pooled[name], dim=1)] for name in POOLINGS}


@torch.no_grad()
def collapse_profile(model: torch.nn.Module, batches: list[dict]) -> dict[str, list[float]]:
    """The collapse figure of each pooling at each layer boundary, over all sequences of `batches`."""
    was_training = model.training
    model.eval()
    states = [boundary_states(model, batch) for batch in batches]
    model.train(was_training)
    return collapse_of_states(states, [batch["attention_mask"] for batch in batches])


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
    """The fixed probe set: the first `size` sentences of a split of the shipped SST-2 sample, or random tokens
    (always the same) when there is no tokenizer."""
    if tokenizer is None:
        generator = torch.Generator().manual_seed(0)
        input_ids = torch.randint(0, vocab_size, (size, 16), generator=generator)
        return [{"input_ids": ids, "attention_mask": torch.ones_like(ids)} for ids in input_ids.split(batch_size)]
    lines = (_SAMPLE / f"{split}.jsonl").read_text().splitlines()[:size]
    sentences = [json.loads(line)["sentence"] for line in lines]
    return [
        dict(tokenizer(sentences[start : start + batch_size], padding=True, truncation=True, max_length=128, return_tensors="pt"))
        for start in range(0, len(sentences), batch_size)
    ]


def exceeds(variant: dict[str, list[float]], source: dict[str, list[float]]) -> bool:
    """Whether the variant's final-output figure is above the source's by more than COLLAPSE_MARGIN, for a pooling."""
    return any(variant[name][-1] > source[name][-1] + COLLAPSE_MARGIN for name in POOLINGS)


def conversion_collapse(source: torch.nn.Module, folder: Path) -> dict:
    """The collapse figures of the unswapped model and of the checkpoint written in `folder`, on the probe set."""
    from .modeling_normswap import NormSwapModel

    variant = NormSwapModel.from_pretrained(folder, dtype=torch.float32)
    tokenizer = probe_tokenizer(folder)
    batches = probe_batches(tokenizer, variant.config.vocab_size)
    figures = {"source": collapse_profile(source, batches), "variant": collapse_profile(variant, batches)}
    probe = f"the first {PROBE_SIZE} sentences of the shipped SST-2 validation sample" if tokenizer else f"{PROBE_SIZE} random token sequences"
    return {"probe": probe, **figures, "flagged": exceeds(figures["variant"], figures["source"])}


def summarize_runs(runs: list[dict]) -> dict | None:
    """A variant's final-output collapse figures in a comparison (means over seeds): its source's, at the start and
    at the end of fine-tuning, and whether the start is flagged; None without diagnostics or source."""
    runs = [run for run in runs if run.get("source_collapse") and "collapse" in run["diagnostics"][0]]
    if not runs:
        return None
    ends = [next(r["collapse"] for r in reversed(run["diagnostics"]) if "collapse" in r) for run in runs]

    def mean_last(profiles: list[dict]) -> dict[str, float]:
        return {p: sum(profile[p][-1] for profile in profiles) / len(profiles) for p in POOLINGS}

    summary = {
        "source": mean_last([run["source_collapse"] for run in runs]),
        "start": mean_last([run["diagnostics"][0]["collapse"] for run in runs]),
        "end": mean_last(ends),
    }
    summary["flagged"] = any(summary["start"][p] > summary["source"][p] + COLLAPSE_MARGIN for p in POOLINGS)
    return summary


def report_lines(summary: dict) -> list[str]:
    """The comparison report's collapse section."""
    rows = {variant: s["collapse"] for variant, s in summary.items() if s.get("collapse")}
    if not rows:
        return []
    lines = [
        "## Collapse",
        "",
        "Mean pairwise cosine between the first-token / mean-pooled final outputs of the diagnostics probe "
        "(1.0: every input gets the same vector), means over seeds. A variant that starts fine-tuning more than "
        f"{COLLAPSE_MARGIN} above its source is flagged: its runs measure a broken model, not the placement.",
        "",
        "| variant | source | start of fine-tuning | end of fine-tuning | flag |",
        "|---|---|---|---|---|",
    ]
    for variant, figures in rows.items():
        cells = [" / ".join(f"{figures[when][p]:.3f}" for p in POOLINGS) for when in ("source", "start", "end")]
        lines.append(f"| {variant} | " + " | ".join(cells) + f" | {'**collapsed**' if figures['flagged'] else ''} |")
    return lines + [""]
