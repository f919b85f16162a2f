"""The stores' grouped reads behind the console's per-minute rates and its sort by reward.

`TrajectoryStore.counts_since` (requests per agent in a window) and
`FeedbackStore.activity_since` (feedback events and mean reward per agent in a
window), on SQLite and PostgreSQL, and the SQLite query plans that keep them
indexed with many agents.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from clora_feedback.config import FeedbackConfig
from clora_feedback.feedback.rewards import DefaultRewardPolicy
from clora_feedback.feedback.store import ACTIVITY_EVENTS, ACTIVITY_JOINS, FeedbackStore, Incoming
from clora_feedback.schemas.feedback import Resolution, Reward
from clora_feedback.store.trajectories import (
    COUNTS_SINCE,
    SampleRecord,
    TrajectoryRecord,
    TrajectoryStore,
)


def _trajectory(cid: str, agent: str, created_at: float) -> TrajectoryRecord:
    sample = SampleRecord(0, "ok", [5, 6], [-0.1, -0.2], [1, 1], "stop")
    request = {"messages": [{"role": "user", "content": "hi"}]}
    return TrajectoryRecord(cid, agent, 1, "chat", request, [1, 2], [sample], created_at)


def _reward(eid: str, cid: str, agent: str, value: float) -> Incoming:
    return Incoming(Reward(event_id=eid, agent=agent, completion_id=cid, source="t", value=value),
                    "test")  # fmt: skip


def _resolved(eid: str, cid: str, agent: str) -> Incoming:
    event = Resolution(event_id=eid, agent=agent, completion_id=cid, source="t", outcome="resolved")
    return Incoming(event, "test")


@pytest.fixture
def store(store_url: str) -> Iterator[FeedbackStore[TrajectoryStore]]:
    """Both stores on one database: a SQLite file, then a fresh PostgreSQL database."""
    trajectories = TrajectoryStore(store_url)
    feedback = FeedbackStore(
        store_url, trajectories=trajectories, policy=DefaultRewardPolicy(FeedbackConfig())
    )
    yield feedback
    feedback.close()
    trajectories.close()


def test_requests_per_agent_since_a_time(store: FeedbackStore[TrajectoryStore]) -> None:
    now = time.time()
    trajectories = store.trajectories
    for i in range(3):
        trajectories.record(_trajectory(f"a{i}", "alpha", now - i))
    trajectories.record(_trajectory("b0", "beta", now))
    trajectories.record(_trajectory("old", "beta", now - 3600))
    trajectories.record(_trajectory("g0", "gamma", now - 3600))
    assert trajectories.counts_since(now - 60) == {"alpha": 3, "beta": 1}
    assert trajectories.counts_since(now + 1) == {}


def test_feedback_and_mean_reward_per_agent_since_a_time(
    store: FeedbackStore[TrajectoryStore],
) -> None:
    now = time.time()
    for cid, agent in (("a0", "alpha"), ("a1", "alpha"), ("b0", "beta")):
        store.trajectories.record(_trajectory(cid, agent, now))
    report = store.apply(
        [
            _reward("e0", "a0", "alpha", 1.0),
            _reward("e1", "a1", "alpha", 0.0),
            _resolved("e2", "b0", "beta"),
            _reward("e3", "missing", "beta", 1.0),  # parked: counted, judges nothing
        ]
    )
    assert sorted(report.joined) == ["e0", "e1", "e2"]
    activity = store.activity_since(now - 60)
    assert set(activity) == {"alpha", "beta"}
    alpha, beta = activity["alpha"], activity["beta"]
    expected = [p.reward for p in store.recent_rewards("alpha")]
    assert alpha.events == 2 and alpha.judged == 2
    assert alpha.reward_mean == pytest.approx(sum(expected) / len(expected))
    assert beta.events == 2 and beta.judged == 1
    assert beta.reward_mean == pytest.approx(store.recent_rewards("beta")[0].reward)
    assert store.activity_since(time.time() + 1) == {}


def test_agent_with_only_parked_feedback_has_no_mean(store: FeedbackStore[TrajectoryStore]) -> None:
    store.apply([_reward("e0", "nowhere", "alpha", 1.0)])
    activity = store.activity_since(time.time() - 60)["alpha"]
    assert (activity.events, activity.judged, activity.reward_mean) == (1, 0, None)


def test_window_reads_are_driven_by_indexes(tmp_path: Path) -> None:
    """Each read starts from an index on the window's time, never a scan of every row."""
    path = tmp_path / "t.db"
    with TrajectoryStore(path) as trajectories:
        FeedbackStore(path, trajectories=trajectories,
                      policy=DefaultRewardPolicy(FeedbackConfig())).close()  # fmt: skip
    conn = sqlite3.connect(path)
    for sql, index in (
        (COUNTS_SINCE, "completions_by_time (created_at>?)"),
        (ACTIVITY_EVENTS, "feedback_by_state (state=? AND received_at>?)"),
        (ACTIVITY_JOINS, "feedback_by_state (state=? AND received_at>?)"),
    ):
        steps = [r[-1] for r in conn.execute("EXPLAIN QUERY PLAN " + sql, (0.0,))]
        assert not any(s.startswith("SCAN") for s in steps), (sql, steps)
        assert any(index in s for s in steps), (sql, steps)
    conn.close()


@pytest.mark.postgres
def test_window_reads_can_be_served_by_indexes_on_postgresql(postgres_url: str) -> None:
    """PostgreSQL scans tiny tables whole; with scans made dear it uses the time indexes."""
    import psycopg

    with TrajectoryStore(postgres_url) as trajectories:
        FeedbackStore(postgres_url, trajectories=trajectories,
                      policy=DefaultRewardPolicy(FeedbackConfig())).close()  # fmt: skip
    with psycopg.connect(postgres_url) as conn:
        conn.execute("SET enable_seqscan = off")
        for sql, index in (
            (COUNTS_SINCE, "completions_by_time"),
            (ACTIVITY_EVENTS, "feedback_by_state"),
            (ACTIVITY_JOINS, "feedback_by_state"),
        ):
            plan = conn.execute("EXPLAIN " + sql.replace("?", "%s"), (0.0,)).fetchall()
            text = "\n".join(row[0] for row in plan)
            assert index in text and "Seq Scan" not in text, (sql, text)
