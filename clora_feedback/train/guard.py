"""The regression guard: roll a newly published adapter back when live rewards say it got worse.

After a version goes live through `publish`, its rewards on live traffic are
compared with its parent's. The test is a one-sided Welch t-test of

    H0: mean(parent) - mean(new) <= margin     against     H1: ... > margin

and the version is rolled back to its parent when H0 is rejected at the
configured confidence (p < 1 - confidence) with at least `min_samples` rewards
for each version. Why Welch: the two versions' reward variances differ in
general, the samples are independent requests, and with tens of samples the
t-test is accurate even for bounded or binary rewards; it needs only `math`.
The Student t tail comes from the regularized incomplete beta function
(continued fraction, modified Lentz), exact to ~1e-12.

The guard judges only a version that became active by `publish`: a version an
operator (or the guard itself) activated by rollback is left alone, so the
guard never fights an operator and never rolls back twice. It acts on pinned
agents too: pinning freezes training, not protection.

Rewards compared are made under one reward policy: the reward source computes
both the parent's and the child's rewards from stored facts under the CURRENT
policy, at read time, so they are comparable by construction. A version's
manifest names the policy it was trained under (`feedback_window
["reward_policy"]`); when that differs from the current one (`reward_policy`),
the comparison still runs under the current policy, and the decision's reason
and the log say so: a mapping change alone never looks like a regression.

Not here: where the rewards come from (a callable the feedback store supplies),
installing weights in the engine: with a deployer, the guard's rollback is
`Deployer.activate` (the engine loads the parent first, then the pointer moves
with a compare-and-set, the one order of every move); without one, the guard
moves only the pointer and a deployer following the registry brings its engine.
"""

from __future__ import annotations

import asyncio
import logging
import math
import statistics
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from clora_feedback.config import GuardConfig
from clora_feedback.errors import CloraError, ConflictError
from clora_feedback.lifecycle import BackgroundTask
from clora_feedback.store.versions import AdapterStore

log = logging.getLogger(__name__)

RewardSource = Callable[[str, int], Sequence[float]]
"""(agent, version) -> rewards of live traffic served by that version (one per sample)."""


class Rollbacks(Protocol):
    """What rolls back for the guard: `clora_feedback.engine.deployer.Deployer`."""

    async def activate(
        self, agent: str, version: int, *, expected_active: int | None, reason: str
    ) -> object: ...


@dataclass(frozen=True)
class GuardDecision:
    """The outcome of judging one agent's active version against its parent."""

    agent: str
    """The agent judged."""
    rollback: bool
    """Whether the active version should be (or, from `check`, was) rolled back."""
    reason: str
    """Why, in words, with the statistics."""
    version: int | None = None
    """The active version judged."""
    parent: int | None = None
    """Its parent, the version compared with (and rolled back to)."""
    n_version: int = 0
    """Rewards seen for `version`."""
    n_parent: int = 0
    """Rewards seen for `parent`."""
    mean_version: float | None = None
    """Mean reward of `version`."""
    mean_parent: float | None = None
    """Mean reward of `parent`."""
    t_statistic: float | None = None
    """Welch t of (mean_parent - mean_version - margin); None when both variances are zero."""
    df: float | None = None
    """Welch-Satterthwaite degrees of freedom."""
    p_value: float | None = None
    """One-sided p-value of H0: the drop is at most `margin`."""


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


def welch_one_sided(
    parent: Sequence[float], new: Sequence[float], margin: float
) -> tuple[float | None, float | None, float]:
    """One-sided Welch test of H0: mean(parent) - mean(new) <= margin.

    Args:
        parent: rewards of the parent version (>= 2 values).
        new: rewards of the new version (>= 2 values).
        margin: tolerated drop.

    Returns:
        (t, df, p). With zero variance in both samples the drop is known exactly:
        t and df are None and p is 0.0 when it exceeds `margin`, else 1.0.
    """
    n_p, n_n = len(parent), len(new)
    drop = statistics.fmean(parent) - statistics.fmean(new)
    se_p = statistics.variance(parent) / n_p
    se_n = statistics.variance(new) / n_n
    se2 = se_p + se_n
    if se2 == 0.0:
        return None, None, 0.0 if drop > margin else 1.0
    t = (drop - margin) / math.sqrt(se2)
    df = se2 * se2 / (se_p * se_p / (n_p - 1) + se_n * se_n / (n_n - 1))
    return t, df, student_t_sf(t, df)


class RegressionGuard(BackgroundTask):
    """Judges active versions against their parents and rolls regressions back.

    Args:
        registry: the adapter store (its `rollback` records the reason).
        rewards: (agent, version) -> live rewards of that version.
        config: margin, confidence, minimum samples, interval.
        on_rollback: awaited after an automatic rollback with (agent, version now
            active), e.g. to notify; used by the background loop (`start`), not by `check`.
        deployer: rolls back for the background loop (engine first, then the pointer);
            None: the loop moves the pointer alone, as `check` does.
        reward_policy: id of the current reward policy (the one `rewards` judges
            by), to name a version trained under another one in the reason.
    """

    def __init__(
        self,
        registry: AdapterStore,
        rewards: RewardSource,
        config: GuardConfig | None = None,
        *,
        on_rollback: Callable[[str, int], Awaitable[None]] | None = None,
        deployer: Rollbacks | None = None,
        reward_policy: str | None = None,
    ) -> None:
        self.registry = registry
        self.rewards = rewards
        self.config = config or GuardConfig()
        self.on_rollback = on_rollback
        self.deployer = deployer
        self.reward_policy = reward_policy

    def evaluate(self, agent: str) -> GuardDecision:
        """Judge `agent`'s active version; changes nothing.

        Raises:
            NotFoundError: the registry does not know `agent`.
        """
        info = self.registry.agent(agent)
        version = info.active_version
        if version is None:
            return GuardDecision(agent, False, "no active version")
        parent = self.registry.get(agent, version).parent
        if info.activated_by != "publish":
            return GuardDecision(
                agent, False, f"v{version} was activated by rollback; not judged", version, parent
            )
        if parent is None:
            return GuardDecision(agent, False, f"v{version} has no parent to compare with", version)
        new, old = list(self.rewards(agent, version)), list(self.rewards(agent, parent))
        cfg = self.config
        counts = {"version": version, "parent": parent, "n_version": len(new), "n_parent": len(old)}
        if len(new) < cfg.min_samples or len(old) < cfg.min_samples:
            return GuardDecision(
                agent,
                False,
                f"too few rewards to judge v{version} ({len(new)}) against v{parent} "
                f"({len(old)}); need {cfg.min_samples} each",
                **counts,
            )
        t, df, p = welch_one_sided(old, new, cfg.margin)
        policy_note = self._policy_note(agent, version, parent)
        mean_new, mean_old = statistics.fmean(new), statistics.fmean(old)
        alpha = 1.0 - cfg.confidence
        rollback = p < alpha
        verdict = "regressed" if rollback else "no regression shown"
        t_text = "" if t is None or df is None else f"t={t:.2f}, df={df:.1f}, "
        reason = (
            f"{verdict}: v{version} mean reward {mean_new:.4f} (n={len(new)}) vs parent "
            f"v{parent} {mean_old:.4f} (n={len(old)}), drop {mean_old - mean_new:.4f}, "
            f"margin {cfg.margin}; one-sided Welch {t_text}p={p:.3g} "
            f"{'<' if rollback else '>='} {alpha:.3g}{policy_note}"
        )
        return GuardDecision(
            agent,
            rollback,
            reason,
            mean_version=mean_new,
            mean_parent=mean_old,
            t_statistic=t,
            df=df,
            p_value=p,
            **counts,
        )

    def _policy_note(self, agent: str, version: int, parent: int) -> str:
        """Words for the reason when a manifest names another reward policy than the current one."""
        if self.reward_policy is None:
            return ""
        trained: dict[int, object] = {}
        for v in (version, parent):
            window = self.registry.get(agent, v).feedback_window or {}
            trained[v] = window.get("reward_policy")
        other = {
            v: pid for v, pid in trained.items() if pid is not None and pid != self.reward_policy
        }
        if not other:
            return ""
        named = ", ".join(f"v{v} under {pid}" for v, pid in sorted(other.items()))
        log.info(
            "regression guard: %s: %s trained; both judged under %s",
            agent, named, self.reward_policy,
        )  # fmt: skip
        return f"; {named} trained, both judged under current reward policy {self.reward_policy}"

    def check(self, agent: str) -> GuardDecision:
        """Evaluate `agent` and, on a regression, roll it back to the parent with the reason.

        The rollback is a compare-and-set on the judged version: if the active
        version moved meanwhile, nothing is changed and the decision says so.
        """
        decision = self.evaluate(agent)
        if not decision.rollback:
            return decision
        assert decision.version is not None and decision.parent is not None
        try:
            self.registry.rollback(
                agent,
                decision.parent,
                reason=f"regression guard: {decision.reason}",
                expected_active=decision.version,
            )
        except ConflictError as exc:
            return GuardDecision(
                agent, False, f"not rolled back: {exc.message}", decision.version, decision.parent
            )
        return decision

    # -- background loop ------------------------------------------------------------

    async def _check_async(self, agent: str) -> GuardDecision:
        """`check`, with the rollback made by the deployer when there is one."""
        if self.deployer is None:
            return await asyncio.to_thread(self.check, agent)
        decision = await asyncio.to_thread(self.evaluate, agent)
        if not decision.rollback:
            return decision
        assert decision.version is not None and decision.parent is not None
        try:
            await self.deployer.activate(
                agent,
                decision.parent,
                expected_active=decision.version,
                reason=f"regression guard: {decision.reason}",
            )
        except ConflictError as exc:
            return GuardDecision(
                agent, False, f"not rolled back: {exc.message}", decision.version, decision.parent
            )
        return decision

    async def check_all(self) -> list[GuardDecision]:
        """Check every agent once (off the event loop); awaits `on_rollback` after each rollback."""
        decisions: list[GuardDecision] = []
        for info in await asyncio.to_thread(self.registry.agents):
            try:
                decision = await self._check_async(info.agent)
                if decision.rollback and self.on_rollback is not None:
                    assert decision.parent is not None
                    await self.on_rollback(info.agent, decision.parent)
            except CloraError as exc:  # one agent's failure must not stop the others' checks
                log.error("regression guard: checking %s failed: %s", info.agent, exc.message)
                continue
            if decision.rollback:
                log.warning("regression guard rolled back %s: %s", info.agent, decision.reason)
            decisions.append(decision)
        return decisions

    async def _run(self) -> None:
        while True:
            try:
                await self.check_all()
            except CloraError as exc:  # e.g. the registry is briefly unavailable: try again later
                log.error("regression guard: listing agents failed: %s", exc.message)
            await asyncio.sleep(self.config.check_interval_s)

    task_name = "regression-guard"

    def _should_run(self) -> bool:
        return self.config.enabled
