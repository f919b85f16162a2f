"""The regression guard: its statistics against closed forms, and its decisions on synthetic rewards.

Reward streams are drawn from seeded generators: a clear regression must be
rolled back (and the reason recorded in the registry), noise within the margin
must be kept, and too few samples must never trigger a rollback. A calibration
test checks that at a true drop exactly equal to the margin the guard rolls
back at about the nominal 1 - confidence rate.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from clora_feedback.config import FeedbackConfig, RewardPolicyConfig
from clora_feedback.feedback.rewards import DefaultRewardPolicy
from clora_feedback.feedback.store import FeedbackStore, Incoming
from clora_feedback.lora.weights import LoRALimits, random_lora_weights
from clora_feedback.schemas.feedback import Resolution
from clora_feedback.store.registry import AdapterRegistry
from clora_feedback.store.trajectories import SampleRecord, TrajectoryRecord, TrajectoryStore
from clora_feedback.train.guard import (
    GuardConfig,
    RegressionGuard,
    regularized_beta,
    student_t_sf,
    welch_one_sided,
)

LIMITS = LoRALimits(
    max_rank=4,
    target_modules=("q_proj", "v_proj"),
    num_layers=1,
    shapes={"q_proj": (8, 8), "v_proj": (8, 4)},
)


def test_regularized_beta_closed_forms() -> None:
    for x in (0.0, 0.01, 0.3, 0.5, 0.77, 0.999, 1.0):
        assert regularized_beta(x, 1.0, 1.0) == pytest.approx(x, abs=1e-12)
        assert regularized_beta(x, 3.0, 1.0) == pytest.approx(x**3, abs=1e-12)
        assert regularized_beta(x, 1.0, 2.5) == pytest.approx(1 - (1 - x) ** 2.5, abs=1e-12)


def test_student_t_tail_matches_closed_forms_and_tables() -> None:
    for t in (-3.0, -0.4, 0.0, 0.7, 2.0, 12.0):
        # df = 1 is the Cauchy distribution; df = 2 has a closed form too.
        assert student_t_sf(t, 1.0) == pytest.approx(0.5 - math.atan(t) / math.pi, abs=1e-12)
        assert student_t_sf(t, 2.0) == pytest.approx(
            0.5 - t / (2 * math.sqrt(t * t + 2)), abs=1e-12
        )
    assert student_t_sf(1.812461, 10) == pytest.approx(0.05, abs=1e-6)  # t table, 95%, df 10
    assert student_t_sf(2.570582, 5) == pytest.approx(0.025, abs=1e-6)  # t table, 97.5%, df 5
    assert student_t_sf(1.959964, 1e7) == pytest.approx(0.025, abs=1e-6)  # -> normal
    assert student_t_sf(math.inf, 3) == 0.0 and student_t_sf(-math.inf, 3) == 1.0


def test_welch_matches_scipy() -> None:
    from scipy import stats  # a dev dependency: the reference implementation

    rng = random.Random(7)
    parent = [rng.gauss(0.7, 0.3) for _ in range(37)]
    new = [rng.gauss(0.5, 0.1) for _ in range(52)]
    t, df, p = welch_one_sided(parent, new, margin=0.1)
    shifted = [r - 0.1 for r in parent]
    ref = stats.ttest_ind(shifted, new, equal_var=False, alternative="greater")
    assert t == pytest.approx(float(ref.statistic), rel=1e-9)
    assert p == pytest.approx(float(ref.pvalue), rel=1e-7)
    assert df == pytest.approx(float(ref.df), rel=1e-9)


def test_false_rollback_rate_is_calibrated_at_the_margin() -> None:
    rng = random.Random(11)
    trials, rejected = 2000, 0
    for _ in range(trials):
        parent = [rng.gauss(0.6, 0.25) for _ in range(40)]
        new = [rng.gauss(0.5, 0.25) for _ in range(40)]  # true drop == margin: H0 holds
        rejected += welch_one_sided(parent, new, margin=0.1)[2] < 0.05
    assert 0.03 <= rejected / trials <= 0.07


class Rewards:
    """A reward source backed by a dict: (agent, version) -> rewards."""

    def __init__(self) -> None:
        self.by_version: dict[tuple[str, int], list[float]] = {}

    def __call__(self, agent: str, version: int) -> Sequence[float]:
        return self.by_version.get((agent, version), [])


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[AdapterRegistry]:
    with AdapterRegistry(tmp_path / "adapters", tmp_path / "registry.db") as reg:
        for version in (1, 2):
            reg.publish(
                "support",
                random_lora_weights(LIMITS, rank=2, seed=version),
                optimizer_state=None,
                base_model="tiny",
                parent=version - 1 or None,
                step=version,
                metrics={},
                feedback_window=None,
            )
        yield reg


def _normal(seed: int, mean: float, std: float, n: int) -> list[float]:
    rng = random.Random(seed)
    return [rng.gauss(mean, std) for _ in range(n)]


def test_clear_regression_is_rolled_back_with_the_reason(registry: AdapterRegistry) -> None:
    rewards = Rewards()
    rewards.by_version[("support", 1)] = _normal(1, 0.8, 0.2, 60)
    rewards.by_version[("support", 2)] = _normal(2, 0.4, 0.2, 60)
    guard = RegressionGuard(registry, rewards, GuardConfig(margin=0.05, min_samples=30))
    decision = guard.check("support")
    assert decision.rollback and (decision.version, decision.parent) == (2, 1)
    assert decision.p_value is not None and decision.p_value < 1e-6
    assert decision.mean_parent is not None and decision.mean_version is not None
    assert decision.mean_parent - decision.mean_version > 0.3
    active = registry.active("support")
    assert active is not None and active.version == 1
    rolled = registry.get("support", 2)
    assert rolled.status == "rolled_back"
    assert rolled.rolled_back_reason is not None
    assert rolled.rolled_back_reason.startswith("regression guard: regressed: v2")
    # The version now active was chosen by rollback: the guard leaves it alone.
    again = guard.check("support")
    assert not again.rollback and "activated by rollback" in again.reason


def test_binary_rewards_regression(registry: AdapterRegistry) -> None:
    rng = random.Random(5)
    rewards = Rewards()
    rewards.by_version[("support", 1)] = [float(rng.random() < 0.8) for _ in range(120)]
    rewards.by_version[("support", 2)] = [float(rng.random() < 0.45) for _ in range(120)]
    assert RegressionGuard(registry, rewards, GuardConfig(margin=0.1)).check("support").rollback


def test_noise_within_margin_is_kept(registry: AdapterRegistry) -> None:
    rewards = Rewards()
    rewards.by_version[("support", 1)] = _normal(3, 0.60, 0.3, 200)
    rewards.by_version[("support", 2)] = _normal(4, 0.57, 0.3, 200)
    decision = RegressionGuard(registry, rewards, GuardConfig(margin=0.1)).check("support")
    assert not decision.rollback and decision.reason.startswith("no regression shown")
    assert decision.p_value is not None and decision.p_value >= 0.05
    active = registry.active("support")
    assert active is not None and active.version == 2


def test_too_few_samples_are_kept_even_when_worse(registry: AdapterRegistry) -> None:
    rewards = Rewards()
    rewards.by_version[("support", 1)] = [1.0] * 100
    rewards.by_version[("support", 2)] = [0.0] * 29
    guard = RegressionGuard(registry, rewards, GuardConfig(min_samples=30))
    decision = guard.check("support")
    assert not decision.rollback and "too few" in decision.reason
    assert (decision.n_version, decision.n_parent) == (29, 100)
    rewards.by_version[("support", 2)].append(0.0)  # the 30th sample: now it is judged
    decision = guard.check("support")
    assert decision.rollback and decision.t_statistic is None and decision.p_value == 0.0


def test_rollback_is_skipped_when_the_active_version_moved(registry: AdapterRegistry) -> None:
    rewards = Rewards()
    rewards.by_version[("support", 1)] = _normal(1, 0.9, 0.1, 50)
    rewards.by_version[("support", 2)] = _normal(2, 0.1, 0.1, 50)

    def racing(agent: str, version: int) -> Sequence[float]:
        if version == 1 and registry.agent(agent).active_version == 2:
            registry.rollback(agent, 1, reason="operator was faster")
        return rewards(agent, version)

    decision = RegressionGuard(registry, racing).check("support")
    assert not decision.rollback and "not rolled back" in decision.reason
    assert registry.get("support", 2).rolled_back_reason == "operator was faster"


async def test_background_loop_rolls_back_and_notifies(registry: AdapterRegistry) -> None:
    rewards = Rewards()
    rewards.by_version[("support", 1)] = _normal(1, 0.8, 0.1, 40)
    rewards.by_version[("support", 2)] = _normal(2, 0.2, 0.1, 40)
    activated: list[tuple[str, int]] = []
    done = asyncio.Event()

    async def on_rollback(agent: str, version: int) -> None:
        activated.append((agent, version))
        done.set()

    config = GuardConfig(check_interval_s=0.01)
    async with RegressionGuard(registry, rewards, config, on_rollback=on_rollback):
        await asyncio.wait_for(done.wait(), timeout=10)
        await asyncio.sleep(0.05)  # more rounds: the rollback must not repeat
    assert activated == [("support", 1)]


def test_a_reward_mapping_change_alone_is_not_a_regression(tmp_path: Path) -> None:
    """v1's feedback arrived under one mapping, v2's under another: judged under one policy."""
    old = FeedbackConfig()  # "escalated" -> 0.0
    new = FeedbackConfig(rewards=RewardPolicyConfig(outcome_rewards={"escalated": -1.0}))
    old_policy, new_policy = DefaultRewardPolicy(old), DefaultRewardPolicy(new)
    path = tmp_path / "t.db"
    with (
        AdapterRegistry(tmp_path / "adapters", tmp_path / "registry.db") as registry,
        TrajectoryStore(path) as trajectories,
    ):
        for version, policy in ((1, old_policy), (2, new_policy)):
            registry.publish(
                "support", random_lora_weights(LIMITS, rank=2, seed=version), optimizer_state=None,
                base_model="tiny", parent=version - 1 or None, step=version, metrics={},
                feedback_window={"reward_policy": policy.id},
            )  # fmt: skip
        stores = {}
        for version, policy in ((1, old_policy), (2, new_policy)):  # a restart in between
            stores[version] = FeedbackStore(path, trajectories=trajectories, policy=policy)
            for i in range(8):  # the same outcome for both versions: nothing got worse
                cid = f"v{version}-{i}"
                sample = SampleRecord(0, "ok", [1], [-0.5], [version], "stop")
                trajectories.record(
                    TrajectoryRecord(cid, "support", version, "chat", {}, [1], [sample], 1.0)
                )
                event = Resolution(
                    event_id=f"e-{cid}", agent="support", completion_id=cid, source="t",
                    outcome="escalated", score=0.2 * (i % 4),
                )  # fmt: skip
                stores[version].apply([Incoming(event, "test")])
        config = GuardConfig(margin=0.05, min_samples=5)
        current = RegressionGuard(
            registry, stores[2].rewards_by_version, config, reward_policy=new_policy.id
        )
        decision = current.evaluate("support")
        assert not decision.rollback, decision.reason
        assert decision.mean_parent == pytest.approx(decision.mean_version)
        assert f"v1 under {old_policy.id} trained" in decision.reason

        # Frozen values (each version's rewards from the mapping of its time) would roll back.
        def frozen(agent: str, version: int) -> Sequence[float]:
            return stores[version].rewards_by_version(agent, version)

        assert RegressionGuard(registry, frozen, config).evaluate("support").rollback
        for store in stores.values():
            store.close()
