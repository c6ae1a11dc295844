"""Statistics over seeds: a variant's mean with its confidence interval, paired differences between variants, the final
metric against the learning rate; which figures are the task's metrics, and which way they improve."""

import math

import numpy as np
from scipy import stats


LOWER_IS_BETTER = ("loss", "perplexity")
_LOSS_AND_TIMINGS = ("loss", "runtime", "samples_per_second", "steps_per_second")  # an evaluation's other figures


def task_metrics(metrics: dict) -> list[str]:
    """The names of the task's metrics (accuracy, perplexity, ...) among a run's final evaluation figures."""
    return [name for name in metrics if name not in _LOSS_AND_TIMINGS]


def summarize(values: list[float]) -> dict:
    """Mean, sample standard deviation and the 95% Student-t confidence interval of the mean."""
    values = [float(v) for v in values]
    mean = float(np.mean(values))
    if len(values) < 2:
        return {"n": len(values), "mean": mean, "std": None, "ci95": None}
    std = float(np.std(values, ddof=1))
    half = float(stats.t.ppf(0.975, len(values) - 1) * std / math.sqrt(len(values)))
    return {"n": len(values), "mean": mean, "std": std, "ci95": [mean - half, mean + half]}


def paired_difference(reference: dict[int, float], other: dict[int, float]) -> dict:
    """`other - reference` seed by seed (the seeds both have): the differences, their mean with the 95% paired-t
    confidence interval, and the two-sided exact sign-test p-value (ties dropped)."""
    seeds = sorted(set(reference) & set(other))
    differences = [float(other[seed]) - float(reference[seed]) for seed in seeds]
    summary = summarize(differences) if differences else {"n": 0, "mean": None, "std": None, "ci95": None}
    above, below = sum(d > 0 for d in differences), sum(d < 0 for d in differences)
    p_value = float(stats.binomtest(above, above + below, 0.5).pvalue) if above + below else 1.0
    return {"seeds": seeds, "differences": differences, **summary, "sign_test_p": p_value}


def describe(variant: str, reference: str, metric: str, difference: dict) -> str:
    """The difference in one plain sentence; fractions (accuracy, F1, ...) are said in points (x 100)."""
    n, mean, interval = difference["n"], difference["mean"], difference["ci95"]
    if interval is None or interval[0] <= 0 <= interval[1] or not all(map(math.isfinite, interval)):
        detail = f"mean difference {_amount(metric, mean)}" if n else "no seed in common"
        if interval is not None:
            detail += f", 95% CI {_amount(metric, interval[0])} to {_amount(metric, interval[1])}"
        return f"{variant} vs {reference}, {metric}: no difference detected at n={n} ({detail})"
    unit = "" if metric in LOWER_IS_BETTER else " points"
    side = "above" if mean > 0 else "below"
    low, high = (_amount(metric, bound) for bound in interval)
    return f"{variant} is {_amount(metric, abs(mean))}{unit} {side} {reference} in {metric} (95% CI {low} to {high})"


def _amount(metric: str, value: float) -> str:
    if metric in LOWER_IS_BETTER:
        return f"{value:.3g}"
    return f"{100 * value:.1f}"


def learning_rate_sensitivity(results: list[dict], metric: str) -> list[dict]:
    """The final `metric` against the learning rate (Wortsman et al. 2023) for each group of variants that differ
    only in their `@learning_rate=` pin (an unpinned one at the rate it ran at) and ran at two rates or more: per
    rate, the statistics over its seeds and its failed runs."""
    groups = {}
    for result in results:
        group = "@".join(part for part in result["variant"].split("@") if not part.startswith("learning_rate="))
        groups.setdefault(group, {}).setdefault(result["point"]["learning_rate"], []).append(result)
    return [
        {
            "group": group,
            "metric": metric,
            "points": [
                {
                    "learning_rate": learning_rate,
                    "variants": list(dict.fromkeys(run["variant"] for run in runs)),
                    "metric": summarize([run["metrics"][metric] for run in runs]),
                    "failed_runs": sum(run["failed"] for run in runs),
                    "runs": len(runs),
                }
                for learning_rate, runs in sorted(by_rate.items())
            ],
        }
        for group, by_rate in groups.items()
        if len(by_rate) > 1
    ]
