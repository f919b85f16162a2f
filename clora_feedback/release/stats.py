"""The statistics of a release: the offline gate's paired bound and the canary's sequential test.

Two questions, each answered with Student's t (only `math` needed):

- **Offline gate** (`paired_verdict`): candidate and serving answered the same
  `n` cases; `d_i = score(candidate, i) - score(serving, i)`. The one-sided
  confidence bounds of the mean difference are
  `mean(d) -/+ t(confidence, n - 1) * sd(d) / sqrt(n)`. Three outcomes: **passed**
  when the lower bound is at least `-max_drop` (shown not worse than serving by
  more than `max_drop`); **failed** when shown worse than serving: the upper
  bound is below 0 *and* an exact sign test on the cases the two versions scored
  differently says so at the same confidence (`sign_test_p`: with binary scores
  the t bound alone is anti-conservative when few cases differ: a candidate that
  lost 2 of 24 cases a perfect serving version answered, and won none, has an
  upper bound of -0.007, while the chance of 2 of 2 differing cases going against
  it by luck is 0.25); **inconclusive** otherwise (neither shown: on two dozen
  binary cases that two versions answer differently the bound is +-0.2 wide, so a
  candidate equal to serving is neither). Pairing removes the variance of the
  cases themselves (hard cases are hard for both versions), so a few dozen cases
  decide what two independent samples could not.
- **Canary** (`sequential_worse`): two independent arms of live rewards, judged
  at every look (each new canary reward from the `FIRST_LOOK`-th on). The
  one-sided Welch test of H0: `mean(serving) - mean(canary) <= 0` is rejected
  ("worse") at the look made with `n` canary rewards when
  `p < alpha * FIRST_LOOK / (n * (n + 1))`: the levels of all looks sum to
  `alpha`, so looking after every reward never raises the chance of aborting a
  canary that is not worse above `1 - confidence` (a union bound, conservative
  and assumption-light). The canary arm's variance is never taken below
  serving's: a handful of identical binary rewards has sample variance 0, and
  Welch's test would call two zeros against a 60% arm a certain regression
  (measured: 13% false aborts of an equal arm without the floor). A collapsed arm
  (all rewards 0 against serving's 0.6) is still aborted by its 12th reward.

The Student t tail comes from the regularized incomplete beta function
(continued fraction, modified Lentz), exact to ~1e-12; the quantile inverts it
by bisection.

Not here: where scores and rewards come from (`gate`, `canary`), any I/O.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "PairedOutcome",
    "PairedResult",
    "WelchResult",
    "paired_verdict",
    "regularized_beta",
    "sequential_alpha",
    "sequential_worse",
    "sign_test_p",
    "student_t_ppf",
    "student_t_sf",
    "welch_one_sided",
]


def _beta_continued_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of I_x(a, b), evaluated by the modified Lentz method."""
    tiny, eps = 1e-300, 1e-14
    f, c, d = 1.0, 1.0, 0.0
    for j in range(1, 1000):
        m = j // 2
        if j % 2:  # odd terms: d_{2m+1}
            coef = -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))
        else:  # even terms: d_{2m}
            coef = m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m))
        d = 1.0 + coef * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + coef / c
        c = c if abs(c) > tiny else tiny
        delta = c * d
        f *= delta
        if abs(delta - 1.0) < eps:
            break
    return f


def regularized_beta(x: float, a: float, b: float) -> float:
    """I_x(a, b), the regularized incomplete beta function, for 0 <= x <= 1 and a, b > 0."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = (
        math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    )
    front = math.exp(log_front)
    # The fraction converges fast only below the mean; use the symmetry I_x(a,b) = 1 - I_{1-x}(b,a).
    if x < (a + 1.0) / (a + b + 2.0):
        return front / (a * _beta_continued_fraction(a, b, x))
    return 1.0 - front / (b * _beta_continued_fraction(b, a, 1.0 - x))


def student_t_sf(t: float, df: float) -> float:
    """P(T > t) for Student's t with `df` degrees of freedom (df > 0, not necessarily integer)."""
    if math.isinf(t):
        return 0.0 if t > 0 else 1.0
    tail = 0.5 * regularized_beta(df / (df + t * t), df / 2.0, 0.5)
    return tail if t >= 0 else 1.0 - tail


def student_t_ppf(p: float, df: float) -> float:
    """The `p` quantile of Student's t with `df` degrees of freedom (0 < p < 1), by bisection."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"quantile level must be in (0, 1), got {p}")
    lo, hi = -1e6, 1e6
    for _ in range(200):
        mid = (lo + hi) / 2.0
        if 1.0 - student_t_sf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-10:
            break
    return (lo + hi) / 2.0


PairedOutcome = Literal["passed", "failed", "inconclusive"]


@dataclass(frozen=True)
class PairedResult:
    """The offline gate's statistics over `n` paired differences (candidate - serving)."""

    n: int
    """Cases both versions answered."""
    mean: float
    """Mean difference of scores (positive: the candidate scored higher)."""
    sd: float
    """Sample standard deviation of the differences (0 with one case)."""
    lower: float
    """One-sided lower confidence bound of the mean difference."""
    upper: float
    """One-sided upper confidence bound of the mean difference."""
    worse: int
    """Cases the candidate scored lower on."""
    better: int
    """Cases the candidate scored higher on."""
    sign_p: float
    """Exact one-sided sign-test p-value of "the candidate is worse" (`sign_test_p`)."""
    outcome: PairedOutcome
    """`passed` (`lower >= -max_drop`), `failed` (`upper < 0` and `sign_p < 1 -
    confidence`), else `inconclusive`."""

    @property
    def passed(self) -> bool:
        return self.outcome == "passed"

    def reason(self, max_drop: float, confidence: float) -> str:
        """Why the outcome is what it is, in the words of the rule."""
        differing = f"{self.worse} of {self.worse + self.better} differing cases worse"
        if self.passed:
            return f"lower {confidence:.0%} bound {self.lower:+.3f} >= -{max_drop:g}"
        if self.outcome == "failed":
            return (
                f"upper {confidence:.0%} bound {self.upper:+.3f} < 0 and {differing} "
                f"(sign p {self.sign_p:.3f})"
            )
        if self.upper >= 0:
            return f"bounds {self.lower:+.3f} < -{max_drop:g} and {self.upper:+.3f} >= 0"
        return (
            f"lower bound {self.lower:+.3f} < -{max_drop:g}; upper {self.upper:+.3f} < 0 but "
            f"only {differing} (sign p {self.sign_p:.3f} >= {1 - confidence:.2f})"
        )

    def as_evidence(self) -> dict[str, float | int | bool | str]:
        return {
            "n": self.n,
            "mean_diff": round(self.mean, 6),
            "sd_diff": round(self.sd, 6),
            "lower_bound": round(self.lower, 6),
            "upper_bound": round(self.upper, 6),
            "worse_cases": self.worse,
            "better_cases": self.better,
            "sign_p": round(self.sign_p, 6),
            "outcome": self.outcome,
            "passed": self.passed,
        }


def paired_verdict(diffs: Sequence[float], *, max_drop: float, confidence: float) -> PairedResult:
    """Judge paired score differences: not worse by more than `max_drop`, worse, or unknown?

    Args:
        diffs: candidate score - serving score, one per case (at least 2).
        max_drop: tolerated drop of the mean score, in reward units (>= 0).
        confidence: one-sided confidence of each bound, in (0.5, 1).

    Raises:
        ValueError: fewer than 2 differences.
    """
    n = len(diffs)
    if n < 2:
        raise ValueError("a paired bound needs at least 2 cases")
    mean = statistics.fmean(diffs)
    sd = statistics.stdev(diffs)
    half = student_t_ppf(confidence, n - 1) * sd / math.sqrt(n) if sd > 0 else 0.0
    lower, upper = mean - half, mean + half
    worse, better = sum(d < 0 for d in diffs), sum(d > 0 for d in diffs)
    sign_p = sign_test_p(worse, better)
    shown_worse = upper < 0 and sign_p < 1.0 - confidence
    outcome: PairedOutcome = (
        "passed" if lower >= -max_drop else "failed" if shown_worse else "inconclusive"
    )
    return PairedResult(n, mean, sd, lower, upper, worse, better, sign_p, outcome)


def sign_test_p(worse: int, better: int) -> float:
    """P(at least `worse` of the `worse + better` differing cases go against the candidate)
    when each is a fair coin: the exact one-sided sign test (1.0 when no case differs)."""
    n = worse + better
    return sum(math.comb(n, k) for k in range(worse, n + 1)) / 2**n if n else 1.0


@dataclass(frozen=True)
class WelchResult:
    """A one-sided Welch test of H0: mean(reference) - mean(new) <= margin."""

    drop: float
    """mean(reference) - mean(new): positive when `new` earned less."""
    t: float | None
    """Welch t of (drop - margin); None when both variances are zero."""
    df: float | None
    """Welch-Satterthwaite degrees of freedom."""
    p: float
    """One-sided p-value of H0 (small: `new` is worse by more than `margin`)."""


FIRST_LOOK = 4
"""Canary rewards before the first look of the sequential test."""


def welch_one_sided(
    reference: Sequence[float],
    new: Sequence[float],
    margin: float,
    *,
    floor_new_variance: bool = False,
) -> WelchResult:
    """One-sided Welch test of H0: mean(reference) - mean(new) <= margin.

    Args:
        reference: rewards of the version compared with (>= 2 values).
        new: rewards of the new version (>= 2 values).
        margin: tolerated drop.
        floor_new_variance: use `max(var(new), var(reference))` for `new` (a small arm's
            sample variance is no evidence of a small true variance).

    Returns:
        With zero variance in both samples the drop is known exactly: t and df are
        None and p is 0.0 when it exceeds `margin`, else 1.0.
    """
    n_r, n_n = len(reference), len(new)
    drop = statistics.fmean(reference) - statistics.fmean(new)
    se_r = statistics.variance(reference) / n_r
    var_new = statistics.variance(new)
    if floor_new_variance:
        var_new = max(var_new, statistics.variance(reference))
    se_n = var_new / n_n
    se2 = se_r + se_n
    if se2 == 0.0:
        return WelchResult(drop, None, None, 0.0 if drop > margin else 1.0)
    t = (drop - margin) / math.sqrt(se2)
    df = se2 * se2 / (se_r * se_r / (n_r - 1) + se_n * se_n / (n_n - 1))
    return WelchResult(drop, t, df, student_t_sf(t, df))


def sequential_alpha(alpha: float, n: int) -> float:
    """The level spent at the look with `n` canary rewards: `alpha * FIRST_LOOK / (n * (n + 1))`
    from `FIRST_LOOK` on (0 before); summed over every look they make `alpha`."""
    return alpha * FIRST_LOOK / (n * (n + 1)) if n >= FIRST_LOOK else 0.0


def sequential_worse(
    serving: Sequence[float], canary: Sequence[float], *, confidence: float
) -> tuple[bool, WelchResult | None, float]:
    """Whether the canary arm is worse than serving at this look (see the module docstring).

    The look's index is the number of canary rewards, so every new reward is one look.

    Returns:
        (worse, the test or None before the first look (fewer than `FIRST_LOOK` canary
        rewards, or fewer than 2 serving ones), the level spent here).
    """
    level = sequential_alpha(1.0 - confidence, len(canary))
    if len(serving) < 2 or len(canary) < FIRST_LOOK:
        return False, None, level
    result = welch_one_sided(serving, canary, 0.0, floor_new_variance=True)
    return result.p < level, result, level
