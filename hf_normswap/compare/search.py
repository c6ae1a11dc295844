"""Per-variant settings search: a development split carved from the training data, and each variant's best point."""

import math

from datasets import Dataset

from .statistics import LOWER_IS_BETTER


DEV_SEED = 0


def dev_split(train: Dataset, fraction: float) -> tuple[Dataset, Dataset]:
    """(training data without the development split, the development split), the same for every variant and run."""
    if round(fraction * len(train)) < 1 or round(fraction * len(train)) >= len(train):
        raise ValueError(f"dev_fraction={fraction} of {len(train)} training examples leaves an empty split")
    parts = train.train_test_split(test_size=fraction, seed=DEV_SEED)
    return parts["train"], parts["test"]


def choose(grid: list[dict], results: list[dict], metric: str) -> dict:
    """The grid with each point's development score (mean over search seeds) and the best point (first of ties).
    A run that ends with a non-finite score ranks last."""
    sign = -1.0 if metric in LOWER_IS_BETTER else 1.0
    points = []
    for point in grid:
        scores = [r["metrics"][metric] for r in results if r["point"] == point]
        mean = sum(scores) / len(scores)
        points.append({**point, "scores": scores, "dev_score": mean})
    best = max(points, key=lambda p: sign * p["dev_score"] if math.isfinite(p["dev_score"]) else -math.inf)
    return {"metric": metric, "points": points, "chosen": {k: best[k] for k in grid[0]}}
