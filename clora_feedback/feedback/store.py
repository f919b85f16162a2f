"""The durable feedback store: events applied once, joined to trajectories as rewards.

Lives in the same SQLite database as the trajectories (WAL mode, its own
connection), so a join is one query and one transaction covers a whole batch
of events: either every event of a Kafka batch is durable, or none is and the
uncommitted offsets replay them.

State of an event (table `feedback_events`, primary key `event_id`):

    joined  its rewards are in `rewards`, one row per (event, completion, sample)
    parked  a completion it names is not stored yet; retried by `rejoin_parked`
    dead    it waited longer than the TTL, or turned out invalid when joined

An event id seen before is a duplicate and changes nothing (idempotency).
Scope of each kind: a correction judges sample 0 of each named completion (the
output the developer edited); a resolution or reward judges every sample.

Not here: Kafka, HTTP, reward arithmetic (see `rewards`).
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clora_feedback.errors import CloraError, StoreError, UnprocessableError
from clora_feedback.feedback.rewards import RewardPolicy, RewardSignal
from clora_feedback.schemas.feedback import Correction, Resolution, Reward, parse_event
from clora_feedback.store.trajectories import TrajectoryRecord, TrajectoryStore

Event = Correction | Resolution | Reward

_SCHEMA = """
CREATE TABLE IF NOT EXISTS feedback_events (
    event_id TEXT PRIMARY KEY,
    agent TEXT NOT NULL,
    kind TEXT NOT NULL,
    payload TEXT NOT NULL,
    origin TEXT NOT NULL,
    state TEXT NOT NULL CHECK (state IN ('joined', 'parked', 'dead')),
    reason TEXT,
    received_at REAL NOT NULL,
    updated_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS feedback_by_state ON feedback_events (state, received_at);
CREATE TABLE IF NOT EXISTS rewards (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    event_id TEXT NOT NULL REFERENCES feedback_events (event_id),
    completion_id TEXT NOT NULL,
    sample_idx INTEGER NOT NULL,
    agent TEXT NOT NULL,
    kind TEXT NOT NULL,
    value REAL NOT NULL,
    target TEXT,
    created_at REAL NOT NULL,
    UNIQUE (event_id, completion_id, sample_idx)
);
CREATE INDEX IF NOT EXISTS rewards_by_agent ON rewards (agent, seq);
CREATE INDEX IF NOT EXISTS rewards_by_completion ON rewards (completion_id);
"""


@dataclass(frozen=True)
class Incoming:
    """An event on its way in, with where it came from (`kafka:topic/partition@offset`, `webhook`)."""

    event: Event
    origin: str


@dataclass(frozen=True)
class Rejected:
    """An event that cannot be applied, and why (goes to the dead-letter record)."""

    event_id: str
    payload: str
    reason: str


@dataclass
class ApplyReport:
    """Outcome of one `apply` call."""

    joined: list[str] = field(default_factory=list)
    parked: list[str] = field(default_factory=list)
    duplicates: list[str] = field(default_factory=list)
    rejected: list[Rejected] = field(default_factory=list)


@dataclass(frozen=True)
class TrainingSample:
    """A rewarded sample, ready for the trainer (token ids exactly as the engine produced them).

    Attributes:
        completion_id: the completion.
        sample_index: which choice of it.
        agent: the agent.
        adapter_version: version live when the request was admitted.
        prompt_token_ids: [P] prompt ids.
        completion_token_ids: [C] generated ids.
        logprobs: [C] behaviour logprobs.
        token_versions: [C] adapter version per token.
        rewards: (event_id, kind, value) of every reward joined to this sample.
        targets: corrected contents to learn with supervised loss.
        last_seq: highest reward sequence number included (for incremental reads).
        created_at: when the completion was served.
    """

    completion_id: str
    sample_index: int
    agent: str
    adapter_version: int
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    logprobs: list[float]
    token_versions: list[int]
    rewards: list[tuple[str, str, float]]
    targets: list[str]
    last_seq: int
    created_at: float

    @property
    def reward(self) -> float:
        """Mean of the joined rewards."""
        return sum(v for _, _, v in self.rewards) / len(self.rewards)


class FeedbackStore:
    """Applies feedback events durably and exactly once; thread-safe."""

    def __init__(
        self, path: Path, policy: RewardPolicy, *, trajectories: TrajectoryStore | None = None
    ):
        self.path = Path(path)
        self.policy = policy
        self.trajectories = trajectories or TrajectoryStore(
            self.path
        )  # creates the trajectory tables
        self._lock = threading.Lock()
        with self._translate("open"):
            self._conn = sqlite3.connect(
                self.path, check_same_thread=False, isolation_level=None, timeout=30.0
            )
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=NORMAL")
            self._conn.executescript(_SCHEMA)

    @contextmanager
    def _translate(self, action: str) -> Iterator[None]:
        try:
            yield
        except sqlite3.Error as exc:
            raise StoreError(f"feedback store {action} failed ({self.path}): {exc}") from exc

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock, self._translate("write"):
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield self._conn
                self._conn.execute("COMMIT")
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise

    # -- writes --------------------------------------------------------------------

    def apply(self, batch: Sequence[Incoming], *, now: float | None = None) -> ApplyReport:
        """Apply a batch in one transaction; committed (durable) when this returns."""
        now = time.time() if now is None else now
        report = ApplyReport()
        with self._transaction() as conn:
            seen: set[str] = set()
            for item in batch:
                event = item.event
                if event.event_id in seen or self._known(conn, event.event_id):
                    report.duplicates.append(event.event_id)
                    continue
                seen.add(event.event_id)
                payload = event.model_dump_json()
                try:
                    joined = self._join(conn, event, now)
                except CloraError as exc:
                    report.rejected.append(Rejected(event.event_id, payload, exc.message))
                    seen.discard(event.event_id)
                    continue
                state = "joined" if joined else "parked"
                conn.execute(
                    "INSERT INTO feedback_events VALUES (?, ?, ?, ?, ?, ?, NULL, ?, ?)",
                    (
                        event.event_id,
                        event.agent,
                        event.kind,
                        payload,
                        item.origin,
                        state,
                        now,
                        now,
                    ),
                )
                (report.joined if joined else report.parked).append(event.event_id)
        return report

    def rejoin_parked(
        self, *, ttl_s: float, now: float | None = None
    ) -> tuple[list[str], list[Rejected]]:
        """Retry parked events; those older than `ttl_s` (or now invalid) become dead.

        Returns:
            (event ids joined now, events that died with their reasons).
        """
        now = time.time() if now is None else now
        joined: list[str] = []
        dead: list[Rejected] = []
        with self._transaction() as conn:
            rows = conn.execute(
                "SELECT event_id, payload, received_at FROM feedback_events WHERE state = 'parked'"
            ).fetchall()
            for event_id, payload, received_at in rows:
                event = parse_event(payload)
                reason = None
                try:
                    if self._join(conn, event, now):
                        joined.append(event_id)
                        conn.execute(
                            "UPDATE feedback_events SET state='joined', updated_at=? WHERE event_id=?",
                            (now, event_id),
                        )
                        continue
                    if now - received_at > ttl_s:
                        reason = (
                            f"no trajectory for {self._missing_text(conn, event)} after {ttl_s:g} s"
                        )
                except CloraError as exc:
                    reason = exc.message
                if reason is not None:
                    dead.append(Rejected(event_id, payload, reason))
                    conn.execute(
                        "UPDATE feedback_events SET state='dead', reason=?, updated_at=? WHERE event_id=?",
                        (reason, now, event_id),
                    )
        return joined, dead

    # -- the join ----------------------------------------------------------------------

    def _known(self, conn: sqlite3.Connection, event_id: str) -> bool:
        return (
            conn.execute("SELECT 1 FROM feedback_events WHERE event_id = ?", (event_id,)).fetchone()
            is not None
        )

    def _targets(self, conn: sqlite3.Connection, event: Event) -> tuple[list[str], list[str]]:
        """(completion ids found, ids named but missing)."""
        wanted = event.targets()
        found = [
            c
            for c in wanted
            if conn.execute("SELECT 1 FROM completions WHERE id=?", (c,)).fetchone()
        ]
        if event.conversation_id is not None:
            rows = conn.execute(
                "SELECT id FROM completions WHERE json_extract(request, '$.metadata.conversation_id') = ? "
                "ORDER BY created_at",
                (event.conversation_id,),
            ).fetchall()
            found += [r[0] for r in rows if r[0] not in found]
        return found, [c for c in wanted if c not in found]

    def _missing_text(self, conn: sqlite3.Connection, event: Event) -> str:
        _, missing = self._targets(conn, event)
        return ", ".join(missing) if missing else f"conversation {event.conversation_id!r}"

    def _join(self, conn: sqlite3.Connection, event: Event, now: float) -> bool:
        """Insert the event's rewards if every completion it names is stored; else False (park)."""
        found, missing = self._targets(conn, event)
        if missing or not found:
            return False
        rows = []
        for completion_id in found:
            trajectory = self._trajectory(completion_id)
            if trajectory.agent != event.agent:
                raise UnprocessableError(
                    f"completion {completion_id} belongs to agent {trajectory.agent!r}, not {event.agent!r}"
                )
            samples = (
                trajectory.samples[:1] if isinstance(event, Correction) else trajectory.samples
            )
            for sample in samples:
                signal: RewardSignal = self.policy.signal(event, sample.text)
                rows.append(
                    (
                        event.event_id,
                        completion_id,
                        sample.index,
                        event.agent,
                        event.kind,
                        signal.value,
                        signal.target,
                        now,
                    )
                )
        conn.executemany(
            "INSERT INTO rewards (event_id, completion_id, sample_idx, agent, kind, value, target, created_at) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            rows,
        )
        return True

    def _trajectory(self, completion_id: str) -> TrajectoryRecord:
        return self.trajectories.get(completion_id)

    # -- reads -----------------------------------------------------------------------

    def state_counts(self, agent: str | None = None) -> dict[str, int]:
        with self._lock, self._translate("read"):
            sql = "SELECT state, count(*) FROM feedback_events"
            rows = self._conn.execute(
                sql + (" WHERE agent = ? GROUP BY state" if agent else " GROUP BY state"),
                (agent,) if agent else (),
            ).fetchall()
        return {state: n for state, n in rows}

    def event_state(self, event_id: str) -> tuple[str, str | None] | None:
        with self._lock, self._translate("read"):
            row = self._conn.execute(
                "SELECT state, reason FROM feedback_events WHERE event_id = ?", (event_id,)
            ).fetchone()
        return (row[0], row[1]) if row else None

    def rewards_for(self, completion_id: str) -> list[dict[str, Any]]:
        with self._lock, self._translate("read"):
            rows = self._conn.execute(
                "SELECT event_id, sample_idx, kind, value, target FROM rewards WHERE completion_id = ? ORDER BY seq",
                (completion_id,),
            ).fetchall()
        return [
            dict(zip(("event_id", "sample_index", "kind", "value", "target"), r, strict=True))
            for r in rows
        ]

    def rewards_by_version(self, agent: str, version: int) -> list[float]:
        """Live rewards of the samples served by `version` of `agent` (for the regression guard)."""
        with self._lock, self._translate("read"):
            rows = self._conn.execute(
                "SELECT r.value FROM rewards r JOIN completions c ON c.id = r.completion_id "
                "WHERE r.agent = ? AND c.adapter_version = ? ORDER BY r.seq",
                (agent, version),
            ).fetchall()
        return [float(r[0]) for r in rows]

    def agents_with_rewards(self) -> list[str]:
        with self._lock, self._translate("read"):
            return [
                r[0]
                for r in self._conn.execute("SELECT DISTINCT agent FROM rewards ORDER BY agent")
            ]

    def training_samples(
        self, agent: str, *, after_seq: int = 0, limit: int = 1000
    ) -> list[TrainingSample]:
        """Samples of `agent` with rewards joined after `after_seq`, oldest reward first."""
        with self._lock, self._translate("read"):
            rows = self._conn.execute(
                "SELECT completion_id, sample_idx, max(seq) FROM rewards WHERE agent = ? AND seq > ? "
                "GROUP BY completion_id, sample_idx ORDER BY max(seq) LIMIT ?",
                (agent, after_seq, limit),
            ).fetchall()
            details = {
                (r[0], r[1]): self._conn.execute(
                    "SELECT event_id, kind, value, target FROM rewards WHERE completion_id=? AND sample_idx=? "
                    "ORDER BY seq",
                    (r[0], r[1]),
                ).fetchall()
                for r in rows
            }
        out = []
        for completion_id, idx, last_seq in rows:
            t = self._trajectory(completion_id)
            sample = next(s for s in t.samples if s.index == idx)
            rewards = details[(completion_id, idx)]
            out.append(
                TrainingSample(
                    completion_id=completion_id,
                    sample_index=idx,
                    agent=t.agent,
                    adapter_version=t.adapter_version,
                    prompt_token_ids=t.prompt_token_ids,
                    completion_token_ids=sample.completion_token_ids,
                    logprobs=sample.logprobs,
                    token_versions=sample.token_versions,
                    rewards=[(e, k, v) for e, k, v, _ in rewards],
                    targets=[tg for *_, tg in rewards if tg is not None],
                    last_seq=last_seq,
                    created_at=t.created_at,
                )
            )
        return out

    def close(self) -> None:
        with self._lock:
            self._conn.close()
        self.trajectories.close()
