"""Feedback store: exactly-once apply, parking and TTL, joins, reward policy, diffs."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from clora_feedback.config import FeedbackConfig, RewardPolicyConfig
from clora_feedback.errors import InvalidRequestError
from clora_feedback.feedback.diff import apply_unified_diff
from clora_feedback.feedback.rewards import RewardPolicy, edit_similarity
from clora_feedback.feedback.store import FeedbackStore, Incoming
from clora_feedback.schemas.feedback import Correction, Resolution, Reward, parse_event
from clora_feedback.store.trajectories import SampleRecord, TrajectoryRecord


def _trajectory(
    cid: str,
    agent: str = "support",
    texts: tuple[str, ...] = ("hello world",),
    conv: str | None = None,
) -> TrajectoryRecord:
    samples = [
        SampleRecord(i, t, [5, 6, 7], [-0.1, -0.2, -0.3], [1, 1, 2], "stop")
        for i, t in enumerate(texts)
    ]
    request = {
        "messages": [{"role": "user", "content": "hi"}],
        "metadata": {"conversation_id": conv} if conv else {},
    }
    return TrajectoryRecord(cid, agent, 1, "chat", request, [1, 2, 3], samples, time.time())


@pytest.fixture
def store(tmp_path: Path) -> FeedbackStore:
    s = FeedbackStore(tmp_path / "t.db", RewardPolicy(FeedbackConfig()))
    yield s
    s.close()


def _res(
    eid: str, cid: str, outcome: str = "resolved", agent: str = "support", **kw: object
) -> Incoming:
    return Incoming(
        Resolution(event_id=eid, agent=agent, completion_id=cid, source="t", outcome=outcome, **kw),
        "test",
    )  # type: ignore[arg-type]


def test_applied_once_and_duplicates_reported(store: FeedbackStore) -> None:
    store.trajectories.record(_trajectory("c1", texts=("a", "b")))
    first = store.apply([_res("e1", "c1"), _res("e1", "c1")])
    assert first.joined == ["e1"] and first.duplicates == ["e1"]
    again = store.apply([_res("e1", "c1", outcome="rejected")])
    assert again.duplicates == ["e1"] and not again.joined
    rewards = store.rewards_for("c1")
    assert [(r["sample_index"], r["value"]) for r in rewards] == [(0, 1.0), (1, 1.0)]


def test_parked_until_trajectory_arrives_then_ttl(store: FeedbackStore) -> None:
    report = store.apply([_res("early", "c9"), _res("never", "c404")], now=100.0)
    assert report.parked == ["early", "never"]
    store.trajectories.record(_trajectory("c9"))
    joined, dead = store.rejoin_parked(ttl_s=50.0, now=120.0)
    assert joined == ["early"] and dead == []
    joined, dead = store.rejoin_parked(ttl_s=50.0, now=200.0)
    assert joined == [] and [d.event_id for d in dead] == ["never"]
    assert "c404" in dead[0].reason
    assert store.event_state("never") == ("dead", dead[0].reason)
    assert store.rewards_for("c9")[0]["value"] == 1.0


def test_other_agents_completion_is_rejected(store: FeedbackStore) -> None:
    store.trajectories.record(_trajectory("c1", agent="coder"))
    report = store.apply([_res("x", "c1", agent="support")])
    assert report.rejected and "belongs to agent 'coder'" in report.rejected[0].reason
    assert store.event_state("x") is None  # nothing stored: it may be resent fixed
    assert store.rewards_for("c1") == []


def test_conversation_and_training_view(store: FeedbackStore) -> None:
    store.trajectories.record(_trajectory("c1", conv="t-1"))
    store.trajectories.record(_trajectory("c2", conv="t-1"))
    store.trajectories.record(_trajectory("c3", conv="t-2"))
    ev = Resolution(
        event_id="r", agent="support", conversation_id="t-1", source="t", outcome="escalated"
    )
    assert store.apply([Incoming(ev, "test")]).joined == ["r"]
    fix = Correction(
        event_id="k",
        agent="support",
        completion_id="c2",
        source="t",
        corrected_content="hello there world",
    )
    store.apply([Incoming(fix, "test")])
    samples = store.training_samples("support")
    assert [s.completion_id for s in samples] == ["c1", "c2"]
    c2 = samples[1]
    assert c2.completion_token_ids == [5, 6, 7] and c2.token_versions == [1, 1, 2]
    assert c2.targets == ["hello there world"]
    assert c2.reward == pytest.approx(
        (0.0 + edit_similarity("hello world", "hello there world")) / 2
    )
    assert store.training_samples("support", after_seq=samples[-1].last_seq) == []


def test_reward_policy() -> None:
    config = FeedbackConfig(
        agent_rewards={"vip": RewardPolicyConfig(score_weight=1.0, correction_floor=-1.0)}
    )
    policy = RewardPolicy(config)
    res = Resolution(
        event_id="e", agent="a", completion_id="c", source="s", outcome="reopened", score=0.8
    )
    assert policy.signal(res, "x").value == pytest.approx(0.5 * -0.5 + 0.5 * 0.8)
    assert policy.signal(res.model_copy(update={"agent": "vip"}), "x").value == pytest.approx(0.8)
    same = Correction(event_id="e", agent="a", completion_id="c", source="s")
    assert policy.signal(same, "out").value == 1.0 and policy.signal(same, "out").target is None
    rewrite = Correction(
        event_id="e", agent="vip", completion_id="c", source="s", corrected_content="zzzz"
    )
    assert policy.signal(rewrite, "aaaa").value == pytest.approx(-1.0)
    diff = Correction(
        event_id="e", agent="a", completion_id="c", source="s", diff="@@ -1 +1 @@\n-a+b\n+a + b\n"
    )
    signal = policy.signal(diff, "a+b")
    assert signal.target == "a + b" and 0 < signal.value < 1
    with pytest.raises(InvalidRequestError):
        policy.signal(diff, "something else")
    assert (
        policy.signal(
            Reward(event_id="e", agent="a", completion_id="c", source="s", value=-2.5), ""
        ).value
        == -2.5
    )


def test_event_validation() -> None:
    with pytest.raises(ValidationError, match="completion_id"):
        parse_event({"kind": "reward", "event_id": "e", "agent": "a", "source": "s", "value": 1})
    with pytest.raises(ValidationError):
        parse_event(
            {
                "kind": "resolution",
                "event_id": "e",
                "agent": "a",
                "completion_id": "c",
                "source": "s",
                "outcome": "meh",
            }
        )
    with pytest.raises(ValidationError):
        parse_event(
            b'{"kind": "reward", "event_id": "e", "agent": "a b", "completion_id": "c", "source": "s", "value": 1}'
        )
    with pytest.raises(ValidationError):
        parse_event(
            {
                "kind": "correction",
                "event_id": "e",
                "agent": "a",
                "completion_id": "c",
                "source": "s",
                "diff": "x",
                "corrected_content": "y",
            }
        )


@pytest.mark.parametrize(
    ("before", "after"),
    [
        ("a\nb\nc\n", "a\nB\nc\nd\n"),
        ("def f():\n    return 1", "def f():\n    return 2"),
        ("x", "y"),
        ("", "new\n"),
        ("a\nb\n", ""),
        ("1\n2\n3\n4\n5\n6\n7\n8\n9\n", "1\ntwo\n3\n4\n5\n6\n7\n8\nnine\n"),
    ],
)
def test_unified_diff_from_gnu_diff_applies(tmp_path: Path, before: str, after: str) -> None:
    (tmp_path / "a").write_text(before)
    (tmp_path / "b").write_text(after)
    diff = subprocess.run(
        ["diff", "-u", tmp_path / "a", tmp_path / "b"], capture_output=True, text=True
    ).stdout
    assert apply_unified_diff(before, diff) == after


def test_diff_that_does_not_match_is_refused() -> None:
    with pytest.raises(InvalidRequestError, match="does not apply"):
        apply_unified_diff("a\nb\n", "@@ -1,2 +1,2 @@\n a\n-c\n+d\n")
    with pytest.raises(InvalidRequestError, match="no hunks"):
        apply_unified_diff("a\n", "--- a\n+++ b\n")
