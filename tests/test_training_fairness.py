"""Fair training across many agents (issue 27): every agent whose batch is ready when a
round admits gets its step in that round, whatever the other agents' traffic, in an
order that rotates; the wait of each ready batch is recorded (`ready_waits`)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from test_trainer import World

from clora_feedback.config import EngineConfig
from clora_feedback.engine.embedded import EmbeddedEngine
from clora_feedback.model.tiny import build_tiny_model_dir

AGENTS = [f"agent-{i}" for i in range(6)]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> EmbeddedEngine:
    d = build_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "m", seed=3)
    return EmbeddedEngine(d, EngineConfig(max_num_seqs=2, max_loras=8, max_model_len=256))


def _ready(world: World, agent: str, samples: int) -> None:
    for i in range(samples):
        world.serve_and_reward(agent, correction=f"{agent} answer {i}")


def test_every_ready_agent_steps_once_per_round_and_the_order_rotates(
    engine: EmbeddedEngine, tmp_path: Path
) -> None:
    world = World(tmp_path, engine)
    try:
        firsts, rounds = [], []
        for round_ in range(4):
            ready = AGENTS if round_ else AGENTS[:4]
            for agent in ready:  # a hot agent with 4x the feedback of the others
                _ready(world, agent, 8 if agent == "agent-0" else 2)
            results = world.trainer.run_round()
            stepped = [r.agent for r in results]
            rounds.append(stepped)
            # Everyone ready got exactly one step this round: the hot agent did not take
            # a second one, nobody waits for a later round.
            assert sorted(stepped) == sorted(ready), (round_, stepped)
            firsts.append(stepped[0])
        assert len(set(firsts)) > 1  # the rotation moves who goes first
        waits = list(world.trainer.ready_waits)
        assert len(waits) == 4 + 3 * 6
        # The bound, measured: a ready batch waits at most for the other ready agents'
        # steps of its round (R - 1 of them), never for a round of its own.
        per_step = max(r.step_s for r in world.trainer.history)
        assert max(waits) <= (len(AGENTS) - 1) * per_step * 1.5 + 1.0
    finally:
        world.close()


@pytest.mark.slow  # 400 steps on the tiny model
def test_two_hundred_ready_agents_each_step_once_a_round_within_the_bound(
    engine: EmbeddedEngine, tmp_path: Path
) -> None:
    """The same rule at the scale of issue 27: 200 agents with ready batches, a few of them
    hot (10x the feedback). Each round steps every ready agent once, the hot ones no more
    often; the slowest wait is bounded by the round's other steps."""
    many = [f"agent-{i:03d}" for i in range(200)]
    hot = set(many[::50])
    world = World(tmp_path, engine)
    try:
        orders = []
        for _ in range(2):
            for agent in many:
                _ready(world, agent, 8 if agent in hot else 2)
            began = time.monotonic()
            results = world.trainer.run_round()
            elapsed = time.monotonic() - began
            order = [r.agent for r in results]
            assert sorted(order) == many  # once each, the hot ones no more often
            orders.append(order)
            # The bound, counted in steps (a wall-clock bound on shared cores flaked: 6.3 s
            # against 5.2 once): a batch ready at admission waits for at most the R - 1
            # other steps of its round, and its recorded wait grows with its place.
            waits = list(world.trainer.ready_waits)[-len(many) :]
            assert waits == sorted(waits)
            assert max(waits) <= elapsed
        assert orders[0][0] != orders[1][0]  # the rotation moves who goes first
        assert orders[1] == orders[0][1:] + orders[0][:1]  # by one agent a round
    finally:
        world.close()


def test_a_stop_ends_the_round_after_its_step_and_loses_no_batch(
    engine: EmbeddedEngine, tmp_path: Path
) -> None:
    """A round of many ready agents does not outlive `stop` (it went on stepping against
    closed stores); the batches it had not reached are trained by the next run."""
    world = World(tmp_path, engine)
    trainer = world.trainer
    try:
        for agent in AGENTS[:4]:
            _ready(world, agent, 2)
        step = trainer._step

        def step_then_stop(group: list[Any]) -> list[Any]:
            results = step(group)
            trainer._halt.set()  # what `stop` does, from the event loop's side
            return results

        trainer._step = step_then_stop  # type: ignore[method-assign]
        (first,) = trainer.run_round()
        trainer._step = step  # type: ignore[method-assign]
        trainer._halt.clear()  # what `start` does
        later = trainer.run_round()
        assert sorted(r.agent for r in later) == sorted(set(AGENTS[:4]) - {first.agent})
        assert all(r.num_sft + r.num_pg > 0 for r in later)
    finally:
        world.close()
