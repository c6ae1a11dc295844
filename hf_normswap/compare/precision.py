"""How precisely a comparison measured each paired difference: its 95% interval over seeds and evaluation examples
together, the spread's parts, the difference it would detect, equivalence at a width, the seeds a width needs, the
family-wise reading, failure rates; and when a comparison run in rounds of seeds stops."""

import math

import numpy as np
from scipy import stats


MIN_SEEDS_TO_STOP = 5  # no comparison run to a width stops on fewer seeds
POWER = 0.8  # of the detectable difference
BOOTSTRAP_SAMPLES = 2000  # of one seed's paired bootstrap over the evaluation examples
BOOTSTRAP_SEED = 0
_UNMEASURED = {  # the figures of an interval that one seed cannot give
    "seeds_part": None,
    "examples_part": None,
    "se": None,
    "df": None,
    "half_width": None,
    "ci95": None,
    "p_value": None,
    "detectable": None,
}


def difference_precision(reference: dict[int, np.ndarray], other: dict[int, np.ndarray]) -> dict:
    """The precision of the mean of `other - reference` over the seeds both hold, from each seed's per-example scores
    (1.0 for a correct prediction, else 0.0; the same examples in the same order for every run).

    The seeds and the examples are two crossed random factors (a two-way random-effects analysis of variance): the
    seeds' part is the spread of the seeds' differences over their number, and the examples' part is what the
    examples' own effect adds, since every seed is evaluated on the same examples; the interval is Student's t on
    their sum, with Satterthwaite's degrees of freedom."""
    seeds = sorted(set(reference) & set(other))
    scores = np.stack([np.asarray(other[s], float) - np.asarray(reference[s], float) for s in seeds])
    n, m = scores.shape
    mean = float(scores.mean())
    per_seed = scores.mean(axis=1)
    figures = {"seeds": seeds, "n": n, "examples": m, "mean": mean, "seed_std": None}
    if n < 2:
        return {**figures, **_UNMEASURED}
    by_example = scores.mean(axis=0)
    residual = scores - per_seed[:, None] - by_example[None, :] + mean
    seed_square = m * per_seed.var(ddof=1)  # the mean squares of the analysis of variance
    example_square = n * by_example.var(ddof=1)
    residual_square = float((residual**2).sum() / ((n - 1) * (m - 1)))
    seeds_part = seed_square / (n * m)
    examples_part = max(example_square - residual_square, 0.0) / (n * m)
    return {
        **figures,
        "seed_std": float(per_seed.std(ddof=1)),
        "example_variance": max(example_square - residual_square, 0.0) / n,  # the examples' effect, one example
        **_interval(mean, seeds_part, examples_part, n, m),
    }


def seeds_only_precision(differences: list[float]) -> dict:
    """The precision of a mean difference from its seeds alone (no per-example scores: a loss, a causal LM)."""
    n, mean = len(differences), float(np.mean(differences))
    figures = {"seeds": None, "n": n, "examples": None, "mean": mean, "seed_std": None, "example_variance": 0.0}
    if n < 2:
        return {**figures, **_UNMEASURED}
    std = float(np.std(differences, ddof=1))
    return {**figures, "seed_std": std, **_interval(mean, std**2 / n, 0.0, n, None)}


def _interval(mean: float, seeds_part: float, examples_part: float, n: int, m: int | None) -> dict:
    """The 95% interval on the sum of the two variance parts (Satterthwaite's degrees of freedom)."""
    variance = seeds_part + examples_part
    df = float(_satterthwaite(seeds_part, n - 1, examples_part, (m or 2) - 1))
    half = float(stats.t.ppf(0.975, df) * math.sqrt(variance))
    return {
        "seeds_part": math.sqrt(seeds_part),
        "examples_part": math.sqrt(examples_part),
        "se": math.sqrt(variance),
        "df": df,
        "half_width": half,
        "ci95": [mean - half, mean + half],
        "p_value": float(2 * stats.t.sf(abs(mean) / math.sqrt(variance), df)) if variance > 0 else float(mean == 0),
        "detectable": float((stats.t.ppf(0.975, df) + stats.t.ppf(POWER, df)) * math.sqrt(variance)),
    }


def _satterthwaite(first, first_df: int, second, second_df: int):
    """The degrees of freedom of a sum of two variance estimates (`first` may be an array)."""
    total = first + second
    denominator = first**2 / first_df + second**2 / second_df
    return np.where(denominator > 0, total**2 / np.where(denominator > 0, denominator, 1), first_df) * 1.0


def equivalence(figures: dict, half_width: float) -> dict:
    """Two one-sided tests (Schuirmann 1987) of `|difference| < half_width`: the larger one-sided p-value, and whether
    the difference is equivalent to none at that width (p < 0.05)."""
    if figures["se"] is None:
        return {"half_width": half_width, "p_value": None, "equivalent": False}
    mean, se, df = figures["mean"], figures["se"], figures["df"]
    if se == 0:
        p = 0.0 if abs(mean) < half_width else 1.0
    else:
        p = max(float(stats.t.sf((mean + half_width) / se, df)), float(stats.t.cdf((mean - half_width) / se, df)))
    return {"half_width": half_width, "p_value": p, "equivalent": p < 0.05}


def seeds_needed(first_stage: dict, half_width: float, max_seeds: int) -> int | None:
    """Stein's second-stage count: the fewest seeds (at least the first stage's) whose interval, at the first stage's
    spread and degrees of freedom, is within `half_width`, up to `max_seeds` times 10; None when the examples' part
    alone is too wide (more seeds cannot narrow it)."""
    if first_stage["se"] is None:
        return None
    n = first_stage["n"]
    if stats.norm.ppf(0.975) * first_stage["examples_part"] >= half_width:
        return None
    counts = np.arange(n, 10 * max_seeds + 2)
    within = np.flatnonzero(_stein_half_width(first_stage, counts) <= half_width)
    return int(counts[within[0]]) if len(within) else 10 * max_seeds + 1


def _stein_half_width(first_stage: dict, count):
    """The half-width of `count` seeds' interval (an array of counts gives an array) at the first stage's seed
    spread, examples' part and degrees of freedom (Stein 1945: exact, since the first stage's spread is independent
    of the means)."""
    seed_part, example_part = (
        first_stage["seed_std"] ** 2 / np.asarray(count, float),
        first_stage["examples_part"] ** 2,
    )
    df = _satterthwaite(seed_part, first_stage["n"] - 1, example_part, (first_stage["examples"] or 2) - 1)
    return stats.t.ppf(0.975, df) * np.sqrt(seed_part + example_part)


def at_width(first_stage: dict, final: dict, half_width: float, max_seeds: int) -> dict:
    """A difference run to `half_width` by Stein's two-stage rule: the seeds its first stage asks for, and the
    interval of the final seeds' mean at the first stage's spread, and whether it holds the width."""
    needed = seeds_needed(first_stage, half_width, max_seeds)
    figures = {"first_stage_seeds": first_stage["n"], "seeds_needed": needed, "half_width": None, "ci95": None}
    if first_stage["se"] is not None and final["n"] >= first_stage["n"]:
        half = float(_stein_half_width(first_stage, final["n"]))
        figures.update(half_width=half, ci95=[final["mean"] - half, final["mean"] + half])
    figures["within"] = figures["half_width"] is not None and figures["half_width"] <= half_width
    return figures


def examples_needed(figures: dict, half_width: float) -> int | None:
    """The evaluation examples whose part alone would take half the allowed variance at `half_width`."""
    if not figures.get("examples") or figures["se"] is None:
        return None
    return math.ceil(2 * figures["example_variance"] * (stats.norm.ppf(0.975) / half_width) ** 2)


def first_stage_seeds(seeds: int) -> int:
    """The seeds of a comparison's first stage when it runs to a width: `seeds`, and at least MIN_SEEDS_TO_STOP."""
    return max(seeds, MIN_SEEDS_TO_STOP)


def second_stage_seeds(
    first_stages: dict[str, dict], first: int, half_width: float, max_seeds: int
) -> tuple[dict[str, int], str]:
    """The seeds each compared variant runs in all after a first stage of `first` (Stein's second stage: what its
    difference's first stage asks for, at most max_seeds), and why it stops there: the width `reached`, `max_seeds`,
    `examples` (a difference that more seeds cannot narrow to the width), or `unmeasured` (a difference without two
    first-stage seeds where neither run failed)."""
    if any(f["se"] is None for f in first_stages.values()):
        return dict.fromkeys(first_stages, first), "unmeasured"
    needed = {variant: seeds_needed(f, half_width, max_seeds) for variant, f in first_stages.items()}
    counts = {variant: min(max_seeds, max(first, count or first)) for variant, count in needed.items()}
    if any(count is not None and count > max_seeds for count in needed.values()):
        return counts, "max_seeds"
    return counts, "examples" if None in needed.values() else "reached"


def holm(p_values: dict[str, float]) -> dict[str, float]:
    """Holm's step-down adjusted p-values (family-wise error), by name."""
    order = sorted(p_values, key=p_values.get)
    adjusted, running = {}, 0.0
    for rank, name in enumerate(order):
        running = max(running, min(1.0, (len(order) - rank) * p_values[name]))
        adjusted[name] = running
    return adjusted


def failure_rate(failed: int, runs: int) -> dict:
    """The share of failed runs with its 95% Wilson interval."""
    interval = stats.binomtest(failed, runs).proportion_ci(method="wilson") if runs else None
    return {
        "failed": failed,
        "runs": runs,
        "rate": failed / runs if runs else None,
        "ci95": [float(bound) for bound in interval or []],
    }


def per_seed_tests(reference: dict[int, np.ndarray], other: dict[int, np.ndarray]) -> dict:
    """Each seed alone, from its per-example correctness: McNemar's exact test of its two runs, and the standard
    error of its difference from a paired bootstrap over the examples (both variants resampled alike)."""
    seeds = sorted(set(reference) & set(other))
    return {
        "mcnemar_p": [_mcnemar(reference[s], other[s]) for s in seeds],
        "bootstrap_se": [_bootstrap_se(np.asarray(other[s], float) - np.asarray(reference[s], float)) for s in seeds],
    }


def _mcnemar(reference: np.ndarray, other: np.ndarray) -> float:
    """McNemar's exact test of one seed's two runs: the examples only one of them got right."""
    reference, other = np.asarray(reference, bool), np.asarray(other, bool)
    only_other, only_reference = int((other & ~reference).sum()), int((reference & ~other).sum())
    if only_other + only_reference == 0:
        return 1.0
    return float(stats.binomtest(only_other, only_other + only_reference, 0.5).pvalue)


def _bootstrap_se(differences: np.ndarray) -> float:
    """The standard error of one seed's mean difference, from a paired bootstrap over the examples."""
    generator = np.random.default_rng(BOOTSTRAP_SEED)
    counts = generator.multinomial(
        len(differences), np.full(len(differences), 1 / len(differences)), BOOTSTRAP_SAMPLES
    )
    return float((counts @ differences / len(differences)).std(ddof=1))


def stage_one(
    results: list[dict],
    reference: str,
    labels: list[int] | None,
    metric: str,
    seeds: int,
    half_width: float,
    max_seeds: int,
) -> tuple[dict[str, dict], dict[str, int], str]:
    """The first stage's `paired_precision` of a comparison run to `half_width`, and `second_stage_seeds` with the
    reference's count (the most of any variant) added."""
    first = first_stage_seeds(seeds)
    stage = paired_precision([r for r in results if r["seed"] < first], reference, labels, metric)
    counts, stopped = second_stage_seeds(stage, first, half_width, max_seeds)
    return stage, {reference: max(counts.values(), default=first), **counts}, stopped


def paired_precision(results: list[dict], reference: str, labels: list[int] | None, metric: str) -> dict[str, dict]:
    """Each other variant's `difference_precision` from the reference in `metric` (accuracy, from the runs' kept
    predictions of the evaluation `labels`; else the metric's per-seed values alone), over the seeds where neither
    run failed."""
    kept = [r for r in results if not r["failed"]]
    by_variant = {}
    for result in kept:
        by_variant.setdefault(result["variant"], {})[result["seed"]] = result
    figures = {}
    for variant in dict.fromkeys(r["variant"] for r in results):
        if variant == reference:
            continue
        runs, base = by_variant.get(variant, {}), by_variant.get(reference, {})
        seeds = sorted(set(runs) & set(base))
        if not seeds:
            figures[variant] = {"seeds": [], "n": 0, "examples": None, "mean": None, "seed_std": None, **_UNMEASURED}
        elif labels is not None and all(runs[s].get("predictions") and base[s].get("predictions") for s in seeds):
            correct = {
                name: {s: np.asarray(group[s]["predictions"]) == np.asarray(labels) for s in seeds}
                for name, group in (("reference", base), ("other", runs))
            }
            figures[variant] = {
                **difference_precision(correct["reference"], correct["other"]),
                "per_seed": per_seed_tests(correct["reference"], correct["other"]),
            }
        else:
            differences = [runs[s]["metrics"][metric] - base[s]["metrics"][metric] for s in seeds]
            figures[variant] = {**seeds_only_precision(differences), "seeds": seeds}
    return figures
