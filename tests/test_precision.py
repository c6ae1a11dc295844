import math

import numpy as np
import pytest
from scipy import stats

from hf_normswap.compare.precision import (
    MIN_SEEDS_TO_STOP,
    at_width,
    difference_precision,
    equivalence,
    examples_needed,
    failure_rate,
    first_stage_seeds,
    holm,
    per_seed_tests,
    second_stage_seeds,
    seeds_needed,
    seeds_only_precision,
)


def _correct(generator, n, m, accuracy=0.8):
    return {seed: generator.random(m) < accuracy for seed in range(n)}


def test_the_interval_is_the_two_way_analysis_of_variance():
    generator = np.random.default_rng(1)
    reference, other = _correct(generator, 4, 30), _correct(generator, 4, 30, accuracy=0.7)
    figures = difference_precision(reference, other)
    scores = np.array([other[s].astype(float) - reference[s] for s in range(4)])
    n, m = scores.shape
    grand = scores.mean()
    seeds = sum(m * (scores[s].mean() - grand) ** 2 for s in range(n)) / (n - 1)
    examples = sum(n * (scores[:, i].mean() - grand) ** 2 for i in range(m)) / (m - 1)
    residual = sum(
        (scores[s, i] - scores[s].mean() - scores[:, i].mean() + grand) ** 2 for s in range(n) for i in range(m)
    ) / ((n - 1) * (m - 1))
    assert figures["mean"] == pytest.approx(grand, abs=1e-12)
    assert figures["seeds_part"] ** 2 == pytest.approx(seeds / (n * m), rel=1e-9)
    assert figures["examples_part"] ** 2 == pytest.approx(max(examples - residual, 0) / (n * m), rel=1e-9)
    variance = (seeds + max(examples - residual, 0)) / (n * m)
    assert figures["se"] == pytest.approx(math.sqrt(variance), rel=1e-9)
    half = stats.t.ppf(0.975, figures["df"]) * math.sqrt(variance)
    assert figures["ci95"] == pytest.approx([grand - half, grand + half], abs=1e-12)
    assert n - 1 <= figures["df"] <= (n - 1) + (m - 1)
    # Detectable with 80% power: the two quantiles' sum times the standard error.
    expected = (stats.t.ppf(0.975, figures["df"]) + stats.t.ppf(0.8, figures["df"])) * math.sqrt(variance)
    assert figures["detectable"] == pytest.approx(expected, rel=1e-9)


def test_one_seed_has_no_interval_and_no_seed_count():
    generator = np.random.default_rng(0)
    figures = difference_precision(_correct(generator, 1, 20), _correct(generator, 1, 20))
    assert figures["n"] == 1 and figures["ci95"] is None and figures["se"] is None
    assert seeds_needed(figures, 0.01, 12) is None and not equivalence(figures, 0.01)["equivalent"]


@pytest.mark.parametrize("seed_sd, example_sd", [(0.02, 0.0), (0.005, 0.3), (0.01, 0.15)])
def test_the_interval_covers_the_difference_at_its_stated_rate(seed_sd, example_sd):
    """Under crossed random effects (a seed's shift, an example's shift, noise), 95% intervals from 5 seeds and 200
    examples cover the true difference of the task (the mean over examples and seeds) about 95% of the time."""
    generator = np.random.default_rng(2)
    covered, trials, n, m = 0, 1500, 5, 200
    for _ in range(trials):
        scores = (
            0.01
            + generator.normal(0, seed_sd, (n, 1))
            + generator.normal(0, example_sd, (1, m))
            + generator.normal(0, 0.2, (n, m))
        )
        figures = difference_precision({s: np.zeros(m) for s in range(n)}, dict(enumerate(scores)))
        covered += figures["ci95"][0] <= 0.01 <= figures["ci95"][1]
    assert 0.93 <= covered / trials <= 0.985


def test_stein_two_stage_rule_reaches_the_width_with_exact_coverage():
    """Five seeds first, then the seeds their spread asks for (`second_stage_seeds`): the final interval at the
    first stage's spread (`at_width`) holds the width and covers the true difference 95% of the time."""
    generator = np.random.default_rng(3)
    covered, totals, trials = 0, [], 2000
    for _ in range(trials):
        differences = list(generator.normal(0.01, 0.02, first_stage_seeds(3)))
        first = seeds_only_precision(differences)
        counts, stopped = second_stage_seeds({"pre": first}, 5, half_width=0.01, max_seeds=200)
        seeds = counts["pre"]
        differences += list(generator.normal(0.01, 0.02, seeds - len(differences)))
        final = at_width(first, seeds_only_precision(differences), half_width=0.01, max_seeds=200)
        assert stopped == "reached" and final["within"] and seeds == final["seeds_needed"] >= MIN_SEEDS_TO_STOP
        covered += final["ci95"][0] <= 0.01 <= final["ci95"][1]
        totals.append(seeds)
    assert 0.94 <= covered / trials <= 0.96
    assert 25 <= np.mean(totals) <= 40  # (2.78 * 0.02 / 0.01)^2 * E[s^2]/sigma^2: about 31


def test_the_second_stage_stops_at_max_seeds_or_where_the_examples_bound_it():
    wide = {"se": 0.02, "n": 5, "examples": 100, "seed_std": 0.05, "examples_part": 0.001}
    count = seeds_needed(wide, 0.05, 12)
    half = {c: stats.t.ppf(0.975, 4) * math.sqrt(0.05**2 / c + 0.001**2) for c in (count - 1, count)}
    assert half[count] <= 0.05 < half[count - 1]  # the first count to hold the width, at 4 degrees of freedom
    assert second_stage_seeds({"pre": wide}, 5, 0.05, 12) == ({"pre": count}, "reached")
    assert second_stage_seeds({"pre": wide}, 5, 0.01, 12) == ({"pre": 12}, "max_seeds")
    unmeasured = {"pre": wide, "sandwich": {**wide, "se": None}}
    assert second_stage_seeds(unmeasured, 5, 0.05, 12) == ({"pre": 5, "sandwich": 5}, "unmeasured")
    bounded = {**wide, "examples_part": 0.03}  # 1.96 * 0.03 > 0.05: more seeds cannot help
    assert seeds_needed(bounded, 0.05, 12) is None
    # Each difference runs the seeds its own spread asks for; one the examples bound stays at the first stage.
    assert second_stage_seeds({"pre": bounded, "post_pre": wide}, 5, 0.05, 12) == (
        {"pre": 5, "post_pre": count},
        "examples",
    )
    assert first_stage_seeds(3) == 5 and first_stage_seeds(8) == 8


def test_examples_needed_and_equivalence():
    figures = {"examples": 400, "se": 0.004, "example_variance": 0.01, "mean": 0.001, "df": 20.0}
    assert examples_needed(figures, 0.01) == math.ceil(2 * 0.01 * (1.959963984540054 / 0.01) ** 2)  # 769
    inside = equivalence(figures, 0.01)
    p = max(stats.t.sf((0.001 + 0.01) / 0.004, 20.0), stats.t.cdf((0.001 - 0.01) / 0.004, 20.0))
    assert inside["p_value"] == pytest.approx(p, rel=1e-12) and inside["equivalent"]
    assert not equivalence({**figures, "mean": 0.008}, 0.01)["equivalent"]


def test_holm_wilson_mcnemar_and_the_bootstrap():
    assert holm({"a": 0.01, "b": 0.04, "c": 0.03}) == pytest.approx({"a": 0.03, "b": 0.06, "c": 0.06})
    rate = failure_rate(0, 5)
    assert rate["rate"] == 0 and rate["ci95"] == pytest.approx([0.0, 0.4345], abs=1e-4)
    reference = {0: np.array([1, 1, 0, 0, 1, 1, 1, 0], bool)}
    other = {0: np.array([1, 0, 1, 1, 1, 1, 1, 1], bool)}  # 3 right only here, 1 only in the reference
    tests = per_seed_tests(reference, other)
    assert tests["mcnemar_p"] == pytest.approx([stats.binomtest(3, 4, 0.5).pvalue])
    differences = other[0].astype(float) - reference[0]
    assert tests["bootstrap_se"][0] == pytest.approx(differences.std() / math.sqrt(8), rel=0.1)
