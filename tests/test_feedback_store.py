"""Feedback store: exactly-once apply, parking and TTL, joins, reward policy, diffs."""

from __future__ import annotations

import json
import sqlite3
import struct
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from feedback_support import rejoin_all
from pydantic import ValidationError

from clora_feedback.config import FeedbackConfig, RewardPolicyConfig
from clora_feedback.errors import InvalidRequestError, StoreError
from clora_feedback.feedback.diff import apply_unified_diff
from clora_feedback.feedback.rewards import (
    DefaultRewardPolicy,
    Judgement,
    RewardSignal,
)
from clora_feedback.feedback.store import SCHEMA_VERSION as FEEDBACK_SCHEMA_VERSION
from clora_feedback.feedback.store import FeedbackStore, Incoming
from clora_feedback.schemas.feedback import Correction, Resolution, Reward, parse_event
from clora_feedback.store.trajectories import SampleRecord, TrajectoryRecord, TrajectoryStore


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


def _stores(url: str | Path) -> Iterator[FeedbackStore]:
    trajectories = TrajectoryStore(url)
    s = FeedbackStore(url, trajectories=trajectories, policy=DefaultRewardPolicy(FeedbackConfig()))
    yield s
    s.close()
    trajectories.close()


@pytest.fixture
def store(store_url: str) -> Iterator[FeedbackStore]:
    """The same suite on both backends: a SQLite file, then a fresh PostgreSQL database."""
    yield from _stores(store_url)


@pytest.fixture
def sqlite_store(tmp_path: Path) -> Iterator[FeedbackStore]:
    """For the tests that read SQLite's own query plans."""
    yield from _stores(tmp_path / "t.db")


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
    joined, dead = rejoin_all(store, ttl_s=50.0, now=120.0)
    assert joined == ["early"] and dead == []
    joined, dead = rejoin_all(store, ttl_s=50.0, now=200.0)
    assert joined == [] and [d.event_id for d in dead] == ["never"]
    assert "c404" in dead[0].reason
    assert store.event_state("never") == ("dead", dead[0].reason)
    assert store.rewards_for("c9")[0]["value"] == 1.0


def test_other_agents_completion_is_rejected(store: FeedbackStore) -> None:
    store.trajectories.record(_trajectory("c1", agent="coder"))
    report = store.apply([_res("x", "c1", agent="support")])
    assert report.rejected and "not a completion of agent 'support'" in report.rejected[0].reason
    assert "coder" not in report.rejected[0].reason  # the owner is another tenant
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
    # Corrected: no credit for being close (the escalation and the correction both say 0).
    assert c2.reward == 0.0 and c2.wrong and not c2.confirmed
    assert store.training_samples("support", after_seq=samples[-1].last_seq) == []


def test_reward_policy() -> None:
    verdicts = RewardPolicyConfig().verdict_rewards | {"corrected": -1.0}
    config = FeedbackConfig(
        agent_rewards={"vip": RewardPolicyConfig(score_weight=1.0, verdict_rewards=verdicts)}
    )
    policy = DefaultRewardPolicy(config)
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
    assert signal.target == "a + b" and signal.value == 0.0 and signal.wrong
    assert signal.similarity == pytest.approx(0.75)  # reported, never rewarded
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


# -- rewards at read time, from one policy ----------------------------------------------------


def _open(path: str | Path, config: FeedbackConfig, trajectories: TrajectoryStore) -> FeedbackStore:
    return FeedbackStore(path, trajectories=trajectories, policy=DefaultRewardPolicy(config))


def test_a_new_mapping_applies_to_events_already_stored(store_url: str) -> None:
    path = store_url
    with TrajectoryStore(path) as trajectories:
        trajectories.record(_trajectory("c1", texts=("a", "b")))
        before = _open(path, FeedbackConfig(), trajectories)
        assert before.apply([_res("e1", "c1", outcome="escalated")]).joined == ["e1"]
        assert [r["value"] for r in before.rewards_for("c1")] == [0.0, 0.0]
        before.close()
        # The mapping changes in one place (the policy's config); nothing is re-ingested.
        generous = RewardPolicyConfig(outcome_rewards={"escalated": 0.25, "resolved": 1.0})
        after = _open(path, FeedbackConfig(rewards=generous), trajectories)
        assert [r["value"] for r in after.rewards_for("c1")] == [0.25, 0.25]
        assert [s.reward for s in after.training_samples("support")] == [0.25, 0.25]
        assert after.rewards_by_version("support", 1) == [0.25, 0.25]
        assert after.reward_policy_id != before.reward_policy_id
        assert after.reward_policy_id == DefaultRewardPolicy(FeedbackConfig(rewards=generous)).id
        after.close()


def test_policy_id_is_stable_and_names_the_mapping() -> None:
    assert DefaultRewardPolicy(FeedbackConfig()).id == DefaultRewardPolicy(FeedbackConfig()).id
    assert DefaultRewardPolicy(FeedbackConfig()).id.startswith("default-v2:")
    vip = FeedbackConfig(agent_rewards={"vip": RewardPolicyConfig(score_weight=1.0)})
    assert DefaultRewardPolicy(vip).id != DefaultRewardPolicy(FeedbackConfig()).id


class _EveryOutput:
    """A policy whose corrections judge every sample: the scope rule lives in the policy alone."""

    def __init__(self) -> None:
        self._inner = DefaultRewardPolicy(FeedbackConfig())

    @property
    def id(self) -> str:
        return "every-output-v1"

    def judges(self, event: object, sample_index: int) -> bool:
        return True

    def signal(self, event: Correction | Resolution | Reward, output_text: str) -> RewardSignal:
        return self._inner.signal(event, output_text)

    def reward(self, judged: Sequence[Judgement]) -> float:
        return min(j.signal.value for j in judged)

    def source(self, judged: Sequence[Judgement]) -> str:
        return "mixed" if len({j.kind for j in judged}) > 1 else judged[0].kind


def test_scope_aggregation_and_source_come_from_the_policy(store_url: str) -> None:
    path = store_url
    with TrajectoryStore(path) as trajectories:
        trajectories.record(_trajectory("c1", texts=("hello world", "hi")))
        fix = Correction(
            event_id="k", agent="support", completion_id="c1", source="t", corrected_content="hi"
        )
        default = _open(path, FeedbackConfig(), trajectories)
        default.apply([Incoming(fix, "test"), _res("r", "c1")])
        by_sample = {s.sample_index: s for s in default.training_samples("support")}
        assert by_sample[0].rewards[0][:2] == ("k", "correction") and len(by_sample[1].rewards) == 1
        assert by_sample[0].source == "resolution"  # the most recent event's kind
        default.close()
        other = FeedbackStore(path, trajectories=trajectories, policy=_EveryOutput())
        samples = {s.sample_index: s for s in other.training_samples("support")}
        assert [len(s.rewards) for s in samples.values()] == [2, 2]
        assert samples[1].reward == 1.0 and samples[1].source == "mixed"  # "hi" was the fix
        assert samples[0].reward == 0.0  # corrected: min(correction 0.0, resolution 1.0)
        other.close()


def test_joins_go_through_the_trajectory_api_only(tmp_path: Path) -> None:
    """Feedback in another file than the trajectories: no SQL can reach `completions`."""
    with TrajectoryStore(tmp_path / "trajectories.db") as trajectories:
        trajectories.record(_trajectory("c1", conv="t-1"))
        trajectories.record(_trajectory("c2", conv="t-1"))
        trajectories.record(_trajectory("c3", agent="coder", conv="t-1"))
        assert trajectories.by_conversation("t-1") == ["c1", "c2", "c3"]
        assert trajectories.by_conversation("t-1", agent="coder") == ["c3"]
        assert trajectories.exists(["c1", "c9", "c3"]) == {"c1", "c3"}
        assert set(trajectories.get_many(["c2", "c9"])) == {"c2"}
        store = _open(tmp_path / "feedback.db", FeedbackConfig(), trajectories)
        ev = Resolution(
            event_id="r", agent="support", conversation_id="t-1", source="t", outcome="resolved"
        )
        report = store.apply([Incoming(ev, "test")])
        # The conversation is read for the event's agent only: coder's c3 stays out of it.
        assert report.joined == ["r"] and store.rewards_for("c3") == []
        assert len(store.rewards_for("c1")) == len(store.rewards_for("c2")) == 1
        assert store.owners(["c1", "c3", "c9"]) == {"c1": "support", "c3": "coder"}
        store.close()


def test_training_samples_are_read_in_pages_with_a_safe_cursor(store_url: str) -> None:
    path = store_url
    with TrajectoryStore(path) as trajectories:
        store = _open(path, FeedbackConfig(), trajectories)
        for i in range(7):
            trajectories.record(_trajectory(f"c{i}", texts=("a", "b")))
            store.apply([_res(f"e{i}", f"c{i}")])
        seen: list[tuple[str, int]] = []
        cursor = 0
        while page := store.training_samples("support", after_seq=cursor, limit=3):
            seen += [(s.completion_id, s.sample_index) for s in page]
            cursor = max(s.last_seq for s in page)
        assert sorted(seen) == sorted((f"c{i}", j) for i in range(7) for j in (0, 1))
        store.close()


def _old_schema_file(path: Path) -> None:
    """A database as v1 of both stores wrote it (their DDL of the time, verbatim)."""
    conn = sqlite3.connect(path)
    conn.executescript(
        """
        CREATE TABLE schema_version (version INTEGER NOT NULL);
        INSERT INTO schema_version VALUES (1);
        CREATE TABLE completions (
            id TEXT PRIMARY KEY, agent TEXT NOT NULL, adapter_version INTEGER NOT NULL,
            kind TEXT NOT NULL CHECK (kind IN ('chat', 'completion')), request TEXT NOT NULL,
            prompt_token_ids BLOB NOT NULL, created_at REAL NOT NULL, timings TEXT NOT NULL,
            api_key_agent TEXT
        );
        CREATE INDEX completions_by_time ON completions (created_at);
        CREATE INDEX completions_by_agent_time ON completions (agent, created_at);
        CREATE TABLE samples (
            completion_id TEXT NOT NULL REFERENCES completions (id) ON DELETE CASCADE,
            idx INTEGER NOT NULL, text TEXT NOT NULL, completion_token_ids BLOB NOT NULL,
            logprobs BLOB NOT NULL, token_versions BLOB NOT NULL, finish_reason TEXT,
            tool_calls TEXT, PRIMARY KEY (completion_id, idx)
        ) WITHOUT ROWID;
        CREATE TABLE feedback_events (
            event_id TEXT PRIMARY KEY, agent TEXT NOT NULL, kind TEXT NOT NULL,
            payload TEXT NOT NULL, origin TEXT NOT NULL,
            state TEXT NOT NULL CHECK (state IN ('joined', 'parked', 'dead')),
            reason TEXT, received_at REAL NOT NULL, updated_at REAL NOT NULL
        );
        CREATE INDEX feedback_by_state ON feedback_events (state, received_at);
        CREATE TABLE rewards (
            seq INTEGER PRIMARY KEY AUTOINCREMENT,
            event_id TEXT NOT NULL REFERENCES feedback_events (event_id),
            completion_id TEXT NOT NULL, sample_idx INTEGER NOT NULL, agent TEXT NOT NULL,
            kind TEXT NOT NULL, value REAL NOT NULL, target TEXT, created_at REAL NOT NULL,
            UNIQUE (event_id, completion_id, sample_idx)
        );
        """
    )
    blob = struct.pack("<3i", 5, 6, 7)
    floats = struct.pack("<3d", -0.1, -0.2, -0.3)
    for cid, conv, version in (("c1", "t-1", 1), ("c2", "t-1", 2), ("c3", None, 2)):
        request = {"messages": [], "metadata": {"conversation_id": conv} if conv else {}}
        conn.execute(
            "INSERT INTO completions VALUES (?, 'support', ?, 'chat', ?, ?, 1.0, '{}', NULL)",
            (cid, version, json.dumps(request), struct.pack("<2i", 1, 2)),
        )
        for idx in (0, 1):
            conn.execute(
                "INSERT INTO samples VALUES (?, ?, 'hello world', ?, ?, ?, 'stop', NULL)",
                (cid, idx, blob, floats, blob),
            )
    events = [
        Resolution(
            event_id="r", agent="support", conversation_id="t-1", source="t", outcome="resolved"
        ),
        Reward(event_id="w", agent="support", completion_id="c3", source="t", value=0.5),
    ]
    for e in events:
        conn.execute(
            "INSERT INTO feedback_events VALUES (?, 'support', ?, ?, 'test', 'joined', NULL, 1.0, 1.0)",
            (e.event_id, e.kind, e.model_dump_json()),
        )
    # Frozen values (deliberately wrong: 9.0) that the migration must not keep.
    for seq, (eid, cid, idx) in enumerate(
        [
            ("r", "c1", 0),
            ("r", "c1", 1),
            ("r", "c2", 0),
            ("r", "c2", 1),
            ("w", "c3", 0),
            ("w", "c3", 1),
        ],
        start=1,
    ):
        conn.execute(
            "INSERT INTO rewards VALUES (?, ?, ?, ?, 'support', 'x', 9.0, NULL, 1.0)",
            (seq, eid, cid, idx),
        )
    conn.commit()
    conn.close()


def test_an_old_schema_file_is_migrated(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    _old_schema_file(path)
    with TrajectoryStore(path) as trajectories:
        assert trajectories.by_conversation("t-1") == ["c1", "c2"]  # backfilled, indexed
        assert trajectories.get_many(["c1"])["c1"].conversation_id == "t-1"
        store = _open(path, FeedbackConfig(), trajectories)
        samples = store.training_samples("support")
        assert [(s.completion_id, s.sample_index, s.last_seq) for s in samples] == [
            ("c1", 0, 2), ("c1", 1, 2), ("c2", 0, 4), ("c2", 1, 4), ("c3", 0, 6), ("c3", 1, 6),
        ]  # fmt: skip
        assert [s.reward for s in samples] == [1.0, 1.0, 1.0, 1.0, 0.5, 0.5]  # recomputed
        # A trainer whose cursor stood at seq 4 resumes exactly after it.
        assert {s.completion_id for s in store.training_samples("support", after_seq=4)} == {"c3"}
        assert store.rewards_by_version("support", 2) == [1.0, 1.0, 0.5, 0.5]
        assert store.rewards_by_version("support", 2, 0.0) == [1.0, 1.0, 0.5, 0.5]
        assert store.rewards_by_version("support", 2, time.time() + 60) == []  # joined before
        trajectories.record(_trajectory("c4"))  # new joins number on after the migrated ones
        store.apply([_res("late", "c4")])
        assert store.training_samples("support", after_seq=6)[0].last_seq == 7
        store.close()
        again = _open(path, FeedbackConfig(), trajectories)  # a second open changes nothing
        assert len(again.training_samples("support")) == 7
        again.close()
    conn = sqlite3.connect(path)
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    versions = conn.execute("SELECT * FROM schema_version").fetchall()
    feedback_versions = conn.execute("SELECT * FROM feedback_schema").fetchall()
    conn.close()
    assert "rewards" not in tables and versions == [(2,)]
    assert feedback_versions == [(FEEDBACK_SCHEMA_VERSION,)]  # v1 -> the current version


# -- tenancy: event ids per agent (issue 12, item 3) ---------------------------------------


def test_event_ids_are_scoped_per_agent(store: FeedbackStore) -> None:
    store.trajectories.record(_trajectory("c-a", agent="support"))
    store.trajectories.record(_trajectory("c-b", agent="sales"))
    first = store.apply([_res("ticket-be18d9", "c-a", agent="support")])
    assert first.joined == ["ticket-be18d9"]
    # Another tenant's event with the same id, on its own completion: applied, not a duplicate.
    other = store.apply([_res("ticket-be18d9", "c-b", agent="sales", outcome="rejected")])
    assert other.joined == ["ticket-be18d9"] and other.duplicates == []
    assert [r["value"] for r in store.rewards_for("c-a")] == [1.0]
    assert [r["value"] for r in store.rewards_for("c-b")] == [-1.0]
    assert store.event_state("ticket-be18d9", agent="sales") == ("joined", None)
    # The same agent twice (even in one batch) is still a duplicate.
    again = store.apply(
        [_res("ticket-be18d9", "c-a", outcome="rejected"), _res("x", "c-a"), _res("x", "c-a")]
    )
    assert again.duplicates == ["ticket-be18d9", "x"] and again.joined == ["x"]
    assert [s.rewards for s in store.training_samples("sales")] == [
        [("ticket-be18d9", "resolution", -1.0)]
    ]
    assert [len(s.rewards) for s in store.training_samples("support")] == [2]


def test_a_parked_id_does_not_block_another_agent(store: FeedbackStore) -> None:
    assert store.apply([_res("same", "c-later", agent="support")]).parked == ["same"]
    store.trajectories.record(_trajectory("c-b", agent="sales"))
    assert store.apply([_res("same", "c-b", agent="sales")]).joined == ["same"]
    store.trajectories.record(_trajectory("c-later"))
    assert rejoin_all(store, ttl_s=60.0) == (["same"], [])
    assert store.event_state("same", agent="support") == ("joined", None)


# -- bounded parking (issue 12, item 5) ----------------------------------------------------


def test_parked_events_are_capped_per_agent(store: FeedbackStore) -> None:
    from clora_feedback.errors import OverloadedError
    from clora_feedback.feedback.store import ParkedLimit

    cap = ParkedLimit(per_agent=2)
    report = store.apply([_res(f"p{i}", f"c-missing-{i}") for i in range(3)], limit=cap)
    assert report.parked == ["p0", "p1"]
    (over,) = report.rejected
    assert (over.event_id, over.code) == ("p2", "parked_limit")
    assert over.reason.startswith("parked_limit: ")
    assert store.event_state("p2") is None  # nothing stored: it may be resent later
    # Another agent has its own budget; joining events are never capped.
    store.trajectories.record(_trajectory("c1"))
    mixed = store.apply([_res("s0", "c-missing", agent="sales"), _res("j", "c1")], limit=cap)
    assert mixed.parked == ["s0"] and mixed.joined == ["j"]
    # Refusing: the whole batch rolls back, the joinable event included.
    store.trajectories.record(_trajectory("c2"))
    with pytest.raises(OverloadedError) as refused:
        store.apply(
            [_res("j2", "c2"), _res("p3", "c-missing-3")],
            limit=ParkedLimit(per_agent=2, refuse=True, retry_after_s=3.0),
        )
    assert (refused.value.code, refused.value.http_status) == ("parked_limit", 429)
    assert refused.value.retry_after_s == 3.0
    assert store.event_state("j2") is None and store.event_state("p3") is None
    # A place frees up once a parked event joins.
    store.trajectories.record(_trajectory("c-missing-0"))
    assert rejoin_all(store, ttl_s=60.0)[0] == ["p0"]
    assert store.apply([_res("p3", "c-missing-3")], limit=cap).parked == ["p3"]


def test_rejoin_reads_only_what_arrived_not_the_backlog(store: FeedbackStore) -> None:
    backlog = 3000
    for start in range(0, backlog, 500):
        store.apply([_res(f"p{i}", f"c-missing-{i}") for i in range(start, start + 500)], now=1.0)
    store.apply([_res("wanted", "c-soon"), _res("conv", "unused", conversation_id="t-9")], now=1.0)
    quiet = store.rejoin(ttl_s=3600.0, now=2.0)
    assert (quiet.trajectories_read, quiet.examined, quiet.joined) == (0, 0, [])

    store.trajectories.record(_trajectory("c-soon"))
    store.trajectories.record(_trajectory("c-other", conv="t-9"))
    report = store.rejoin(ttl_s=3600.0, now=3.0)
    assert report.joined == ["wanted"] and report.dead == []
    # Two trajectories arrived; only the events indexed under them were loaded.
    assert (report.trajectories_read, report.examined, report.more) == (2, 2, False)
    assert store.state_counts() == {"parked": backlog + 1, "joined": 1}
    assert store.rejoin(ttl_s=3600.0, now=4.0).examined == 0  # the cursor moved on

    # Expiry is bounded per pass too, oldest first.
    expiring = store.rejoin(ttl_s=10.0, now=100.0, batch=100)
    assert len(expiring.dead) == expiring.examined == 100 and expiring.more


def test_rejoin_queries_use_indexes(sqlite_store: FeedbackStore) -> None:
    """A rejoin pass and the cap drive every query from an index on what they look up."""
    from clora_feedback.feedback import parking

    store = sqlite_store
    conn = sqlite3.connect(store.path)
    queries = [
        # Outer loop: the arrived targets, by key; then each event by its key.
        (
            parking.WAITING_FOR.format(marks="?,?"),
            ("completion:a", "conversation:b"),
            ["SEARCH p USING PRIMARY KEY (target=?)", "(agent=? AND event_id=?)"],
        ),
        (parking.EXPIRED, (1.0, 10), ["feedback_by_state (state=? AND received_at<?)"]),
        (parking.PARKED_COUNT, ("support", 1000), ["feedback_parked_by_agent (agent=?)"]),
    ]
    for sql, params, expected in queries:
        steps = [r[-1] for r in conn.execute("EXPLAIN QUERY PLAN " + sql, params)]
        searches = [s for s in steps if s.startswith(("SEARCH", "SCAN")) and "subquery" not in s]
        assert len(searches) == len(expected), (sql, steps)
        for step, want in zip(searches, expected, strict=True):
            assert step.startswith("SEARCH") and want in step, (sql, steps)
    conn.close()


def _v2_file(path: Path) -> None:
    """A feedback database as schema v2 wrote it (its DDL of the time, verbatim)."""
    with TrajectoryStore(path) as trajectories:
        for cid, agent in (("c1", "support"), ("c2", "support"), ("c-sales", "sales")):
            trajectories.record(_trajectory(cid, agent=agent, texts=("a", "b")))
    conn = sqlite3.connect(path)
    conn.executescript(
        """
        CREATE TABLE feedback_schema (version INTEGER NOT NULL);
        INSERT INTO feedback_schema VALUES (2);
        CREATE TABLE feedback_events (
            event_id TEXT PRIMARY KEY, agent TEXT NOT NULL, kind TEXT NOT NULL,
            payload TEXT NOT NULL, origin TEXT NOT NULL,
            state TEXT NOT NULL CHECK (state IN ('joined', 'parked', 'dead')),
            reason TEXT, received_at REAL NOT NULL, updated_at REAL NOT NULL
        );
        CREATE INDEX feedback_by_state ON feedback_events (state, received_at);
        CREATE TABLE event_targets (
            seq INTEGER PRIMARY KEY AUTOINCREMENT,
            event_id TEXT NOT NULL REFERENCES feedback_events (event_id),
            completion_id TEXT NOT NULL, agent TEXT NOT NULL,
            adapter_version INTEGER NOT NULL, joined_at REAL NOT NULL,
            UNIQUE (event_id, completion_id)
        );
        CREATE INDEX targets_by_agent ON event_targets (agent, seq);
        CREATE INDEX targets_by_completion ON event_targets (completion_id);
        CREATE INDEX targets_by_version ON event_targets (agent, adapter_version);
        """
    )
    events = [
        (_res("shared", "c1").event, "joined"),
        (_res("w", "c2").event, "joined"),
        (_res("early", "c-later").event, "parked"),
        (_res("gone", "c-never").event, "dead"),
    ]
    for event, state in events:
        conn.execute(
            "INSERT INTO feedback_events VALUES (?, 'support', 'resolution', ?, 'test', ?, NULL, "
            "1.0, 1.0)",
            (event.event_id, event.model_dump_json(), state),
        )
    for seq, eid, cid in ((1, "shared", "c1"), (2, "w", "c2")):
        conn.execute(
            "INSERT INTO event_targets VALUES (?, ?, ?, 'support', 1, 1.0)", (seq, eid, cid)
        )
    conn.execute("UPDATE sqlite_sequence SET seq = 7 WHERE name = 'event_targets'")
    conn.commit()
    conn.close()


def test_a_v2_file_is_migrated(tmp_path: Path) -> None:
    path = tmp_path / "v2.db"
    _v2_file(path)
    with TrajectoryStore(path) as trajectories:
        store = _open(path, FeedbackConfig(), trajectories)
        samples = store.training_samples("support")
        assert [(s.completion_id, s.last_seq) for s in samples] == [("c1", 1)] * 2 + [("c2", 2)] * 2
        assert store.event_state("gone") == ("dead", None)
        # The id v2 shared across tenants is now per agent: sales' "shared" applies.
        report = store.apply([_res("shared", "c-sales", agent="sales")])
        assert report.joined == ["shared"] and report.duplicates == []
        assert store.apply([_res("shared", "c1")]).duplicates == ["shared"]
        # Seq numbers go on after the old table's counter (7), never reusing one.
        assert store.training_samples("sales")[0].last_seq == 8
        # The parked event was indexed by the migration: its arrival is all a pass reads.
        trajectories.record(_trajectory("c-later"))
        passes = store.rejoin(ttl_s=3600.0, now=2.0, batch=2)
        while passes.more and not passes.joined:
            passes = store.rejoin(ttl_s=3600.0, now=2.0, batch=2)
        assert passes.joined == ["early"] and passes.examined == 1
        store.close()
    conn = sqlite3.connect(path)
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    feedback_versions = conn.execute("SELECT * FROM feedback_schema").fetchall()
    pk = [r[1] for r in conn.execute("PRAGMA table_info(feedback_events)") if r[5]]
    conn.close()
    assert not {t for t in tables if t.startswith("_old")}
    assert feedback_versions == [(FEEDBACK_SCHEMA_VERSION,)] and sorted(pk) == ["agent", "event_id"]


def test_a_trajectory_store_outage_is_raised_not_rejected(
    store: FeedbackStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failed trajectory read is retried by the caller; a rejection would dead-letter it."""
    store.trajectories.record(_trajectory("c1"))

    def outage(ids: object) -> object:
        raise StoreError("trajectory store read failed: database is locked")

    monkeypatch.setattr(store.trajectories, "get_many", outage)
    with pytest.raises(StoreError):
        store.apply([_res("e1", "c1")])
    monkeypatch.undo()
    assert store.event_state("e1") is None  # nothing half-applied
    assert store.apply([_res("e1", "c1")]).joined == ["e1"]
