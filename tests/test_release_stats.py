"""The release statistics: t tails and quantiles against closed forms and scipy, the gate's
paired bound, and the canary's sequential test on synthetic numbers (calibration included).

Carried over from the regression guard's tests (its Welch test moved here), plus the
paired bound and the sequential level spending that replaced it.
"""

from __future__ import annotations

import math
import random

import pytest

from clora_feedback.release.stats import (
    FIRST_LOOK,
    paired_verdict,
    regularized_beta,
    sequential_alpha,
    sequential_worse,
    student_t_ppf,
    student_t_sf,
    welch_one_sided,
)


def test_regularized_beta_closed_forms() -> None:
    for x in (0.0, 0.01, 0.3, 0.5, 0.77, 0.999, 1.0):
        assert regularized_beta(x, 1.0, 1.0) == pytest.approx(x, abs=1e-12)
        assert regularized_beta(x, 3.0, 1.0) == pytest.approx(x**3, abs=1e-12)
        assert regularized_beta(x, 1.0, 2.5) == pytest.approx(1 - (1 - x) ** 2.5, abs=1e-12)


def test_student_t_tail_and_quantile_match_closed_forms_and_tables() -> None:
    for t in (-3.0, -0.4, 0.0, 0.7, 2.0, 12.0):
        assert student_t_sf(t, 1.0) == pytest.approx(0.5 - math.atan(t) / math.pi, abs=1e-12)
        assert student_t_sf(t, 2.0) == pytest.approx(
            0.5 - t / (2 * math.sqrt(t * t + 2)), abs=1e-12
        )
    assert student_t_sf(1.812461, 10) == pytest.approx(0.05, abs=1e-6)  # t table, 95%, df 10
    assert student_t_ppf(0.95, 10) == pytest.approx(1.812461, abs=1e-5)
    assert student_t_ppf(0.975, 5) == pytest.approx(2.570582, abs=1e-5)
    assert student_t_ppf(0.1, 7) == pytest.approx(-student_t_ppf(0.9, 7), abs=1e-8)
    assert student_t_sf(math.inf, 3) == 0.0 and student_t_sf(-math.inf, 3) == 1.0
    with pytest.raises(ValueError):
        student_t_ppf(1.0, 3)


def test_welch_and_quantile_match_scipy() -> None:
    from scipy import stats  # a dev dependency: the reference implementation

    rng = random.Random(7)
    reference = [rng.gauss(0.7, 0.3) for _ in range(37)]
    new = [rng.gauss(0.5, 0.1) for _ in range(52)]
    result = welch_one_sided(reference, new, margin=0.1)
    ref = stats.ttest_ind([r - 0.1 for r in reference], new, equal_var=False, alternative="greater")
    assert result.t == pytest.approx(float(ref.statistic), rel=1e-9)
    assert result.p == pytest.approx(float(ref.pvalue), rel=1e-7)
    assert result.df == pytest.approx(float(ref.df), rel=1e-9)
    for p, df in ((0.9, 3), (0.95, 15), (0.99, 40.5)):
        assert student_t_ppf(p, df) == pytest.approx(float(stats.t.ppf(p, df)), abs=1e-7)


def test_paired_bound_passes_improvements_and_fails_collapses() -> None:
    better = [1.0] * 6 + [0.0] * 10  # the candidate fixed 6 of 16 cases, broke none
    assert paired_verdict(better, max_drop=0.1, confidence=0.9).passed
    same = [0.0] * 16  # identical answers: the bound is exactly 0
    result = paired_verdict(same, max_drop=0.0, confidence=0.9)
    assert result.passed and result.lower == 0.0
    collapsed = [-1.0] * 8 + [0.0] * 8  # lost half the cases it had right
    verdict = paired_verdict(collapsed, max_drop=0.1, confidence=0.9)
    assert verdict.outcome == "failed" and verdict.lower < -0.3 and verdict.upper < 0
    assert verdict.as_evidence()["n"] == 16
    with pytest.raises(ValueError):
        paired_verdict([0.5], max_drop=0.1, confidence=0.9)


def test_an_equal_candidate_that_answers_differently_is_inconclusive_not_failed() -> None:
    """Two versions of the same quality that disagree on most of 24 binary cases (what
    successive versions of a learning agent do): neither shown within the margin nor shown
    worse, so nothing is rejected; the same numbers with the candidate ahead pass."""
    swapped = [1.0] * 9 + [-1.0] * 9 + [0.0] * 6  # mean 0, sd 0.89
    equal = paired_verdict(swapped, max_drop=0.1, confidence=0.9)
    assert equal.outcome == "inconclusive" and equal.lower < -0.1 < 0 < equal.upper
    ahead = paired_verdict([1.0] * 11 + [-1.0] * 7 + [0.0] * 6, max_drop=0.1, confidence=0.9)
    assert ahead.outcome == "passed", ahead
    behind = paired_verdict([1.0] * 3 + [-1.0] * 11 + [0.0] * 10, max_drop=0.1, confidence=0.9)
    assert behind.outcome == "failed" and behind.upper < 0


def test_a_few_lost_cases_against_a_perfect_serving_version_are_not_shown_worse() -> None:
    """Serving answered all 24 cases; the candidate lost 2 and won none. The t bound alone
    says worse (upper -0.007), but 2 of 2 differing cases going one way happens by luck
    a quarter of the time: inconclusive, not rejected. Lost 5 of 5: shown worse."""
    from clora_feedback.release.stats import sign_test_p

    two = paired_verdict([-1.0] * 2 + [0.0] * 22, max_drop=0.1, confidence=0.9)
    assert two.upper < 0 and two.sign_p == 0.25 and two.outcome == "inconclusive"
    assert two.reason(0.1, 0.9).endswith(  # the words say which rule held it back
        "< 0 but only 2 of 2 differing cases worse (sign p 0.250 >= 0.10)"
    )
    five = paired_verdict([-1.0] * 5 + [0.0] * 19, max_drop=0.1, confidence=0.9)
    assert five.sign_p == 1 / 32 and five.outcome == "failed"
    assert (five.worse, five.better) == (5, 0)
    assert sign_test_p(0, 0) == 1.0 and sign_test_p(1, 1) == 0.75


def test_an_equal_candidate_is_rarely_failed() -> None:
    """At a true mean difference of 0 the upper bound falls below 0 about 1 - confidence."""
    rng = random.Random(5)
    trials = 2000
    failed = sum(
        paired_verdict([rng.choice((1.0, -1.0, 0.0)) for _ in range(24)], max_drop=0.1,
                       confidence=0.9).outcome == "failed"
        for _ in range(trials)
    )  # fmt: skip
    assert 0.06 <= failed / trials <= 0.13


def test_paired_bound_false_reject_rate_is_calibrated_at_the_margin() -> None:
    """At a true mean difference of exactly -max_drop the bound fails about 1 - confidence."""
    rng = random.Random(3)
    trials, passed = 2000, 0
    for _ in range(trials):
        diffs = [rng.gauss(-0.1, 0.3) for _ in range(30)]
        passed += paired_verdict(diffs, max_drop=0.1, confidence=0.9).passed
    assert 0.07 <= passed / trials <= 0.13


def test_sequential_levels_sum_to_alpha() -> None:
    total = sum(sequential_alpha(0.05, k) for k in range(1, 200_000))
    assert total == pytest.approx(0.05, rel=1e-4)
    assert sequential_alpha(0.05, FIRST_LOOK - 1) == 0.0


def test_sequential_test_rarely_aborts_an_equal_arm_over_every_look() -> None:
    """Looking after every canary reward, an arm as good as serving is aborted at most
    about 1 - confidence of the time over a whole canary (here far less: union bound)."""
    rng = random.Random(5)
    trials, aborted = 300, 0
    for _ in range(trials):
        serving = [float(rng.random() < 0.6) for _ in range(60)]
        canary: list[float] = []
        for _ in range(40):
            canary.append(float(rng.random() < 0.6))
            if sequential_worse(serving, canary, confidence=0.95)[0]:
                aborted += 1
                break
    assert aborted / trials <= 0.05


def test_sequential_test_aborts_a_collapsed_arm_within_a_few_rewards() -> None:
    rng = random.Random(9)
    serving = [float(rng.random() < 0.6) for _ in range(60)]
    canary: list[float] = []
    for _ in range(30):
        canary.append(0.0)
        worse, result, level = sequential_worse(serving, canary, confidence=0.95)
        if worse:
            assert result is not None and result.p < level
            break
    assert worse and len(canary) <= 12, len(canary)
    assert sequential_worse(serving, [0.0] * 3, confidence=0.95)[1] is None  # before the first look
