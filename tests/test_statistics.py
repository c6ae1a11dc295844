import math

import pytest
from scipy import stats

from hf_normswap.compare.statistics import describe, paired_difference, summarize


def test_paired_difference_on_known_numbers():
    reference = {0: 0.80, 1: 0.82, 2: 0.78}
    other = {0: 0.78, 1: 0.79, 2: 0.77, 3: 0.5}  # seed 3 has no partner and is left out
    difference = paired_difference(reference, other)
    assert difference["seeds"] == [0, 1, 2]
    assert difference["differences"] == pytest.approx([-0.02, -0.03, -0.01], abs=1e-12)
    assert difference["mean"] == pytest.approx(-0.02, abs=1e-12)
    assert difference["std"] == pytest.approx(0.01, abs=1e-12)
    half = 4.302652729911275 * 0.01 / math.sqrt(3)  # t(0.975, 2)
    assert difference["ci95"] == pytest.approx([-0.02 - half, -0.02 + half], abs=1e-9)
    assert difference["sign_test_p"] == pytest.approx(0.25, abs=1e-12)  # 3 of 3 below: 2 * 0.5^3
    assert describe("pre", "post", "accuracy", difference) == (
        "pre vs post, accuracy: no difference detected at n=3 (mean difference -2.0, 95% CI -4.5 to 0.5)"
    )
    # The paired t interval is that of scipy's paired t-test.
    result = stats.ttest_rel([0.78, 0.79, 0.77], [0.80, 0.82, 0.78])
    low, high = result.confidence_interval(0.95)
    assert difference["ci95"] == pytest.approx([low, high], abs=1e-9)


def test_a_detected_difference_is_said_with_its_interval():
    difference = paired_difference(
        {0: 0.80, 1: 0.82, 2: 0.78, 3: 0.81, 4: 0.79}, {0: 0.78, 1: 0.801, 2: 0.761, 3: 0.79, 4: 0.77}
    )
    assert difference["mean"] == pytest.approx(-0.0196, abs=1e-12)
    assert difference["ci95"][1] < 0
    assert difference["sign_test_p"] == pytest.approx(0.0625, abs=1e-12)  # 5 of 5 below
    low, high = (100 * bound for bound in difference["ci95"])
    assert describe("pre+heal", "post", "accuracy", difference) == (
        f"pre+heal is 2.0 points below post in accuracy (95% CI {low:.1f} to {high:.1f})"
    )
    loss = paired_difference({0: 1.0, 1: 1.1, 2: 0.9}, {0: 1.5, 1: 1.62, 2: 1.41})
    assert describe("pre", "post", "loss", loss).startswith("pre is 0.51 above post in loss (95% CI ")


def test_ties_and_single_seeds():
    tied = paired_difference({0: 0.5, 1: 0.6}, {0: 0.5, 1: 0.7})
    assert tied["differences"] == pytest.approx([0.0, 0.1]) and tied["sign_test_p"] == pytest.approx(
        1.0
    )  # tie dropped
    single = paired_difference({0: 0.5}, {0: 0.7})
    assert single["n"] == 1 and single["ci95"] is None and single["sign_test_p"] == pytest.approx(1.0)
    assert (
        describe("pre", "post", "accuracy", single)
        == "pre vs post, accuracy: no difference detected at n=1 (mean difference 20.0)"
    )
    constant = paired_difference({0: 0.5, 1: 0.5, 2: 0.5}, {0: 0.4, 1: 0.4, 2: 0.4})
    assert constant["ci95"] == pytest.approx([-0.1, -0.1]) and constant["std"] == pytest.approx(0.0, abs=1e-12)
    assert summarize([1.0, 2.0, 3.0])["ci95"] == pytest.approx(
        [2 - 4.302652729911275 / math.sqrt(3), 2 + 4.302652729911275 / math.sqrt(3)]
    )
