"""Feedback naming another tenant's conversation learns nothing about it (issue 25 item 2).

A conversation id is scoped by the event's agent: feedback from agent A that names
a conversation only agent B's completions carry is answered exactly as a
conversation nobody has used (parked, then dead after the TTL), so the answer
never names B or B's completion ids. Checked on the store and through the webhook
with an agent key.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from feedback_support import rejoin_all
from test_webhook import AGENTS, SUPPORT, feedback_app, serve

from clora_feedback.config import FeedbackConfig, Settings
from clora_feedback.feedback.rewards import DefaultRewardPolicy
from clora_feedback.feedback.store import FeedbackStore, Incoming
from clora_feedback.schemas.feedback import Resolution
from clora_feedback.store.trajectories import SampleRecord, TrajectoryRecord, TrajectoryStore


def _trajectory(cid: str, agent: str, conversation: str) -> TrajectoryRecord:
    sample = SampleRecord(0, "hello", [5, 6], [-0.1, -0.2], [1, 1], "stop")
    request = {"messages": [], "metadata": {"conversation_id": conversation}}
    return TrajectoryRecord(cid, agent, 1, "chat", request, [1, 2], [sample], time.time())


def _resolution(event_id: str, conversation: str, agent: str = "support") -> Resolution:
    return Resolution(
        event_id=event_id, agent=agent, conversation_id=conversation, source="t", outcome="resolved"
    )


@pytest.fixture
def store(tmp_path: Path) -> Iterator[FeedbackStore]:
    trajectories = TrajectoryStore(tmp_path / "feedback.db")
    s = FeedbackStore(
        tmp_path / "feedback.db",
        trajectories=trajectories,
        policy=DefaultRewardPolicy(FeedbackConfig()),
    )
    s.trajectories.record(_trajectory("c-sales-secret", "sales", "conv-sales"))
    s.trajectories.record(_trajectory("c-support", "support", "conv-shared"))
    s.trajectories.record(_trajectory("c-sales-shared", "sales", "conv-shared"))
    yield s
    s.close()
    trajectories.close()


def test_another_agents_conversation_is_an_unknown_conversation(store: FeedbackStore) -> None:
    theirs = store.apply([Incoming(_resolution("e-theirs", "conv-sales"), "test")], now=10.0)
    unknown = store.apply([Incoming(_resolution("e-unknown", "conv-nobody"), "test")], now=10.0)
    assert theirs.parked == ["e-theirs"] and unknown.parked == ["e-unknown"]
    assert theirs.rejected == unknown.rejected == []
    assert store.rewards_for("c-sales-secret") == []
    rejoin_all(store, ttl_s=5.0, now=11.0)  # the first pass reads the stored arrivals
    _, dead = rejoin_all(store, ttl_s=5.0, now=100.0)
    reasons = {d.event_id: d.reason for d in dead}
    assert reasons["e-theirs"] == reasons["e-unknown"].replace("conv-nobody", "conv-sales")
    assert "sales" not in reasons["e-theirs"].replace("conv-sales", "")
    assert "c-sales-secret" not in reasons["e-theirs"]


def test_a_shared_conversation_joins_only_the_events_own_agent(store: FeedbackStore) -> None:
    report = store.apply([Incoming(_resolution("e-shared", "conv-shared"), "test")])
    assert report.joined == ["e-shared"] and report.rejected == []
    assert [r["value"] for r in store.rewards_for("c-support")] == [1.0]
    assert store.rewards_for("c-sales-shared") == []


def _post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    import httpx

    response = httpx.post(f"{url}/v1/feedback", json=body, headers=SUPPORT, timeout=10)
    return response.status_code, response.json()


def test_the_webhook_answers_both_alike_and_names_nothing_of_theirs(store: FeedbackStore) -> None:
    settings = Settings(agents=AGENTS, admin_api_key="k-admin")  # type: ignore[arg-type]
    with serve(feedback_app(store, settings)) as url:
        theirs = _post(url, _resolution("w-theirs", "conv-sales").model_dump(mode="json"))
        unknown = _post(url, _resolution("w-unknown", "conv-nobody").model_dump(mode="json"))
    assert theirs[0] == unknown[0] == 202
    assert theirs[1] == {
        **unknown[1],
        "event_ids": ["w-theirs"],
        "parked": ["w-theirs"],
    }
    text = str(theirs[1])
    assert "sales" not in text and "c-sales-secret" not in text
