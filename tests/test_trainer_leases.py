"""Trainer ownership: two trainers on one registry split the agents by lease, a trainer that
lost a lease discards its step and drops the agent's state, and no sample is trained twice.

Leases are moved by explicit lease calls (`now` given), never by waiting out a TTL.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from test_trainer import World, engine  # noqa: F401  (the module's tiny engine fixture)

from clora_feedback.config import AdmissionConfig, TrainerConfig
from clora_feedback.engine.embedded import EmbeddedEngine
from clora_feedback.store.lease import TrainerLeases
from clora_feedback.store.registry import AdapterRegistry
from clora_feedback.train.policy import DecoderPolicy
from clora_feedback.train.trainer import ContinualTrainer

AGENTS = ["a", "b", "c", "d"]


def _second_trainer(world: World, registry: AdapterRegistry) -> ContinualTrainer:
    cfg = TrainerConfig(admission=AdmissionConfig(min_batch=2, max_batch=8), lr=1e-2)
    return ContinualTrainer(
        DecoderPolicy.shared_with(world.engine),
        world.feedback,
        registry,
        cfg,
        leases=TrainerLeases(registry.database, owner="t2"),
    )


def _windows(registry: AdapterRegistry, agent: str) -> list[tuple[int, int]]:
    return [
        (int(v.feedback_window["from_seq"]), int(v.feedback_window["to_seq"]))
        for v in registry.versions(agent)
        if v.feedback_window is not None
    ]


@pytest.fixture
def world(engine: EmbeddedEngine, tmp_path: Path):  # noqa: F811
    world = World(tmp_path, engine)
    world.trainer.leases = TrainerLeases(world.registry.database, owner="t1")
    other = AdapterRegistry(tmp_path / "adapters", tmp_path / "registry.db", collect_on_open=False)
    yield world, _second_trainer(world, other)
    other.close()
    world.close()


def test_two_trainers_train_disjoint_agents(world) -> None:
    world, t2 = world
    t1 = world.trainer
    for agent in AGENTS:
        world.serve_and_reward(agent, 1.0)
        world.serve_and_reward(agent, 0.0)
    # Both alive; t1 first takes all, then gives up its surplus over the fair share.
    assert t1.leases.refresh(AGENTS) == set(AGENTS)
    assert t2.leases.refresh(AGENTS) == set()
    assert t1.leases.refresh(AGENTS) == {"a", "b"}
    assert t2.leases.refresh(AGENTS) == {"c", "d"}
    first = {r.agent for r in t1.run_round()}
    second = {r.agent for r in t2.run_round()}
    assert first == {"a", "b"} and second == {"c", "d"}
    for agent in AGENTS:
        assert [v.version for v in world.registry.versions(agent)] == [1]


def test_a_lost_lease_discards_the_step_and_nothing_is_trained_twice(world) -> None:
    world, t2 = world
    t1 = world.trainer
    world.serve_and_reward("a", 1.0)
    world.serve_and_reward("a", 0.0)
    assert [r.agent for r in t1.run_round()] == ["a"]  # alone: it refreshes and holds "a"
    world.serve_and_reward("a", 1.0)
    world.serve_and_reward("a", 1.0)
    # t1 stalls past its TTL: at t1's expiry, t2 takes "a" (t1 does not know yet).
    later = time.time() + 2 * t1.leases.ttl_s
    assert t2.leases.refresh(["a"], now=later) == {"a"}
    assert t1.leases.held() == {"a"}  # its cached view, still within its own TTL
    # t1 steps, but the lease check before publishing refuses: the step is void.
    assert t1.run_round() == []
    assert world.registry.active("a").version == 1  # type: ignore[union-attr]
    assert "a" not in t1.metrics()  # its run (and waiting samples) were dropped
    # t2 trains the same samples into the next version of the one chain.
    [result] = t2.run_round()
    assert result.agent == "a" and result.num_pg == 2
    # t2 stops cleanly; t1 gets "a" back and reads the registry again (parent 2).
    t2.leases.release()
    t1.leases.refresh(["a"])
    world.serve_and_reward("a", 0.0)
    world.serve_and_reward("a", 1.0)
    [result] = t1.run_round()
    assert result.num_pg == 2
    versions = world.registry.versions("a")
    assert [(v.version, v.parent) for v in versions] == [(1, None), (2, 1), (3, 2)]
    windows = _windows(world.registry, "a")
    assert windows == [(0, 2), (2, 4), (4, 6)]  # contiguous, disjoint: each sample once
