"""The durable feedback store: facts in (events applied once, joined to completions), rewards out.

It keeps facts only: each event as received, and which completions it names
(table `event_targets`, one row per (event, completion), with a sequence
number that is the trainer's durable cursor). Rewards are not stored: the
`RewardPolicy` given to the store turns events into per-sample rewards when
samples are read (`training_samples`, `rewards_by_version`, `rewards_for`), so
a new mapping applies to every stored event at once, and both sides of a
regression-guard comparison are judged by the same policy by construction.

At ingest the policy is asked once per judged sample, only to refuse an event
it cannot score (a diff that does not apply, say); at read time an event the
current policy cannot score is skipped with a warning.

Completions are read through the trajectory store's API (`TrajectoryReader`),
never from its tables. One transaction covers a whole batch of events: either
every event of a Kafka batch is durable, or none is and the uncommitted
offsets replay them.

State of an event (table `feedback_events`, primary key `event_id`):

    joined  its targets are in `event_targets`
    parked  a completion it names is not stored yet; retried by `rejoin_parked`
    dead    it waited longer than the TTL, or turned out invalid when joined

An event id seen before is a duplicate and changes nothing (idempotency).

Schema version 2 (table `feedback_schema`). Version 1 stored policy output
(`rewards`: one value per event and sample); opening a v1 file keeps its
facts (events, and which completions they joined, with their sequence
numbers, so trainer cursors stay valid) and drops the frozen values.

Not here: Kafka, HTTP, reward arithmetic and scope (see `rewards`).
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

from clora_feedback.errors import CloraError, StoreError, UnprocessableError
from clora_feedback.feedback.rewards import Judgement, RewardPolicy, RewardSignal
from clora_feedback.schemas.feedback import Event, parse_event
from clora_feedback.store.sql import in_chunks
from clora_feedback.store.trajectories import SampleRecord, TrajectoryRecord

log = logging.getLogger(__name__)

SCHEMA_VERSION = 2

_SCHEMA = """
CREATE TABLE IF NOT EXISTS feedback_schema (version INTEGER NOT NULL);
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
CREATE TABLE IF NOT EXISTS event_targets (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    event_id TEXT NOT NULL REFERENCES feedback_events (event_id),
    completion_id TEXT NOT NULL,
    agent TEXT NOT NULL,
    adapter_version INTEGER NOT NULL,
    joined_at REAL NOT NULL,
    UNIQUE (event_id, completion_id)
);
CREATE INDEX IF NOT EXISTS targets_by_agent ON event_targets (agent, seq);
CREATE INDEX IF NOT EXISTS targets_by_completion ON event_targets (completion_id);
CREATE INDEX IF NOT EXISTS targets_by_version ON event_targets (agent, adapter_version)
"""
# `adapter_version` is copied from the (immutable) trajectory at join time, so
# the guard's per-version read is one indexed query here.
_INSERT_TARGET = (
    "INSERT INTO event_targets (seq, event_id, completion_id, agent, adapter_version, joined_at) "
    "VALUES (?, ?, ?, ?, ?, ?)"
)
_SIGNAL_CACHE = (
    100_000  # (event, completion, sample) -> signal; exact, since all three are immutable
)


class TrajectoryReader(Protocol):
    """What the join needs from the trajectory store (`store.trajectories.TrajectoryStore`)."""

    def exists(self, ids: Iterable[str]) -> set[str]: ...

    def get_many(self, ids: Iterable[str]) -> dict[str, TrajectoryRecord]: ...

    def by_conversation(self, conversation_id: str, agent: str | None = None) -> list[str]: ...


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
        rewards: (event_id, kind, value) of every event judging this sample, oldest first.
        targets: corrected contents to learn with supervised loss.
        last_seq: highest event-target sequence number included (for incremental reads).
        created_at: when the completion was served.
        reward: the policy's aggregate of `rewards`.
        source: the policy's reward source, which admission balances by.
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
    reward: float
    source: str


_Reader = TypeVar("_Reader", bound=TrajectoryReader)

_Judged = dict[tuple[str, int], list[tuple[int, Judgement]]]
"""(completion id, sample index) -> (seq, judgement) of each event judging it, oldest first."""


class FeedbackStore(Generic[_Reader]):
    """Applies feedback events durably and exactly once, and reads them as rewards; thread-safe.

    Args:
        path: the SQLite file (may be the trajectory store's; its own connection).
        trajectories: the trajectory store's read API, which every join goes through.
        policy: turns events into rewards when samples are read.
    """

    def __init__(self, path: Path, *, trajectories: _Reader, policy: RewardPolicy):
        self.path = Path(path)
        self.policy = policy
        self.trajectories = trajectories
        self._lock = threading.Lock()
        self._signals: dict[tuple[str, str, int], RewardSignal] = {}
        with self._translate("open"):
            self._conn = sqlite3.connect(
                self.path, check_same_thread=False, isolation_level=None, timeout=30.0
            )
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=NORMAL")
        with self._transaction() as conn:
            self._init_schema(conn)

    @property
    def reward_policy_id(self) -> str:
        """Id of the policy that every reward read from this store comes from."""
        return self.policy.id

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

    # -- schema ---------------------------------------------------------------------

    def _init_schema(self, conn: sqlite3.Connection) -> None:
        had_v1 = _has_table(conn, "rewards") and not _has_table(conn, "feedback_schema")
        for statement in _SCHEMA.split(";"):
            if statement.strip():
                conn.execute(statement)
        row = conn.execute("SELECT max(version) FROM feedback_schema").fetchone()
        if row[0] is not None and row[0] > SCHEMA_VERSION:
            raise StoreError(
                f"{self.path}: feedback schema version {row[0]} is newer than this code "
                f"({SCHEMA_VERSION}); upgrade clora-feedback"
            )
        if had_v1:
            self._migrate_v1(conn)
        if row[0] is None:
            conn.execute("INSERT INTO feedback_schema (version) VALUES (?)", (SCHEMA_VERSION,))

    def _migrate_v1(self, conn: sqlite3.Connection) -> None:
        """v1 `rewards` (event, completion, sample, value) -> v2 `event_targets` (event, completion).

        Each (event, completion) keeps the highest seq of its v1 rows, so a sample a
        trainer's cursor already covers is not trained again, and new rows number on
        from there (AUTOINCREMENT follows the largest seq inserted).
        """
        rows = conn.execute(
            "SELECT max(seq), event_id, completion_id, agent, min(created_at) FROM rewards "
            "GROUP BY event_id, completion_id ORDER BY max(seq)"
        ).fetchall()
        versions: dict[str, int] = {}
        for chunk, _ in in_chunks(r[2] for r in rows):
            versions |= {c: t.adapter_version for c, t in self.trajectories.get_many(chunk).items()}
        conn.executemany(
            _INSERT_TARGET,
            [(seq, e, c, a, versions.get(c, 0), at) for seq, e, c, a, at in rows],
        )
        conn.execute("DROP TABLE rewards")
        log.info("feedback store %s: migrated %d joins from schema v1", self.path, len(rows))

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
                payload = event.model_dump_json()
                try:
                    records = self._join(event)
                except CloraError as exc:
                    report.rejected.append(Rejected(event.event_id, payload, exc.message))
                    continue
                seen.add(event.event_id)
                state = "joined" if records is not None else "parked"
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
                if records is not None:
                    self._insert_targets(conn, event, records, now)
                (report.joined if records is not None else report.parked).append(event.event_id)
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
                    records = self._join(event)
                    if records is not None:
                        self._insert_targets(conn, event, records, now)
                        joined.append(event_id)
                        conn.execute(
                            "UPDATE feedback_events SET state='joined', updated_at=? WHERE event_id=?",
                            (now, event_id),
                        )
                        continue
                    if now - received_at > ttl_s:
                        reason = f"no trajectory for {self._missing_text(event)} after {ttl_s:g} s"
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

    def _targets(self, event: Event) -> tuple[list[str], list[str]]:
        """(completion ids found, ids named but missing)."""
        wanted = event.targets()
        stored = self.trajectories.exists(wanted)
        found = [c for c in wanted if c in stored]
        if event.conversation_id is not None:
            found += [
                c
                for c in self.trajectories.by_conversation(event.conversation_id)
                if c not in found
            ]
        return found, [c for c in wanted if c not in found]

    def _missing_text(self, event: Event) -> str:
        _, missing = self._targets(event)
        return ", ".join(missing) if missing else f"conversation {event.conversation_id!r}"

    def _join(self, event: Event) -> list[TrajectoryRecord] | None:
        """The completions `event` names if all are stored, else None (park).

        Raises:
            UnprocessableError: a named completion belongs to another agent.
            CloraError: the policy cannot score the event on a sample it judges.
        """
        found, missing = self._targets(event)
        if missing or not found:
            return None
        records = self.trajectories.get_many(found)
        if len(records) < len(found):
            return None
        for record in records.values():
            if record.agent != event.agent:
                raise UnprocessableError(
                    f"completion {record.id} belongs to agent {record.agent!r}, not {event.agent!r}"
                )
            for sample in record.samples:
                if self.policy.judges(event, sample.index):
                    self._signal(event, record, sample)  # refuses an unscorable event now
        return [records[c] for c in found]

    def _insert_targets(
        self,
        conn: sqlite3.Connection,
        event: Event,
        records: list[TrajectoryRecord],
        now: float,
    ) -> None:
        conn.executemany(
            _INSERT_TARGET,
            [(None, event.event_id, t.id, event.agent, t.adapter_version, now) for t in records],
        )

    def _signal(self, event: Event, record: TrajectoryRecord, sample: SampleRecord) -> RewardSignal:
        key = (event.event_id, record.id, sample.index)
        signal = self._signals.get(key)
        if signal is None:
            signal = self.policy.signal(event, sample.text)
            if len(self._signals) >= _SIGNAL_CACHE:
                self._signals.clear()
            self._signals[key] = signal
        return signal

    # -- reading facts as rewards ---------------------------------------------------------

    def _events(self, ids: Iterable[str]) -> dict[str, Event]:
        """Stored events by id (caller holds the lock)."""
        out: dict[str, Event] = {}
        for chunk, marks in in_chunks(ids):
            for event_id, payload in self._conn.execute(
                f"SELECT event_id, payload FROM feedback_events WHERE event_id IN ({marks})", chunk
            ):
                out[event_id] = parse_event(payload)
        return out

    def _judge(
        self, rows: Sequence[tuple[int, str, str]], events: dict[str, Event]
    ) -> tuple[_Judged, dict[str, TrajectoryRecord]]:
        """Apply the policy to (seq, event id, completion id) rows, in seq order."""
        records = self.trajectories.get_many(c for *_, c in rows)
        judged: _Judged = defaultdict(list)
        for seq, event_id, completion_id in rows:
            event, record = events[event_id], records.get(completion_id)
            if record is None:
                continue
            for sample in record.samples:
                if not self.policy.judges(event, sample.index):
                    continue
                try:
                    signal = self._signal(event, record, sample)
                except CloraError as exc:  # stored under an earlier policy that could score it
                    log.warning(
                        "reward policy %s skips event %s: %s", self.policy.id, event_id, exc.message
                    )
                    continue
                judged[(completion_id, sample.index)].append(
                    (seq, Judgement(event_id, event.kind, signal))
                )
        return judged, records

    def _judged_where(
        self, where: str, params: tuple[Any, ...]
    ) -> tuple[_Judged, dict[str, TrajectoryRecord]]:
        with self._lock, self._translate("read"):
            rows = self._conn.execute(
                f"SELECT seq, event_id, completion_id FROM event_targets WHERE {where} ORDER BY seq",
                params,
            ).fetchall()
            events = self._events(r[1] for r in rows)
        return self._judge(rows, events)

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

    def owners(self, completion_ids: Iterable[str]) -> dict[str, str]:
        """Agent of each stored completion among `completion_ids` (ids not stored are absent)."""
        return {c: t.agent for c, t in self.trajectories.get_many(completion_ids).items()}

    def rewards_for(self, completion_id: str) -> list[dict[str, Any]]:
        """Every (event, sample) reward of one completion under the current policy, oldest first."""
        judged, _ = self._judged_where("completion_id = ?", (completion_id,))
        flat = [(seq, idx, j) for (_, idx), items in judged.items() for seq, j in items]
        return [
            {
                "event_id": j.event_id,
                "sample_index": idx,
                "kind": j.kind,
                "value": j.signal.value,
                "target": j.signal.target,
            }
            for _, idx, j in sorted(flat, key=lambda x: (x[0], x[1]))
        ]

    def rewards_by_version(self, agent: str, version: int) -> list[float]:
        """One reward per sample served by `version` of `agent`, under the current policy.

        For the regression guard: a parent and a child read here are judged by the
        same policy, whatever policy was current when either was trained.
        """
        judged, _ = self._judged_where("agent = ? AND adapter_version = ?", (agent, version))
        ordered = sorted(judged.values(), key=lambda items: items[-1][0])
        return [self.policy.reward([j for _, j in items]) for items in ordered]

    def agents_with_rewards(self) -> list[str]:
        with self._lock, self._translate("read"):
            return [
                r[0]
                for r in self._conn.execute(
                    "SELECT DISTINCT agent FROM event_targets ORDER BY agent"
                )
            ]

    def training_samples(
        self, agent: str, *, after_seq: int = 0, limit: int = 1000
    ) -> list[TrainingSample]:
        """Samples of `agent` judged by an event joined after `after_seq`, oldest first.

        Reads at most `limit` new joins per page (a sample's rewards include its
        older events too; joins after the page's last one wait for the next call, so
        the largest `last_seq` returned is a safe cursor). A page whose events the
        policy judges no sample with (all skipped) moves on to the next one.
        """
        while True:
            with self._lock, self._translate("read"):
                page = self._conn.execute(
                    "SELECT seq, completion_id FROM event_targets WHERE agent = ? AND seq > ? "
                    "ORDER BY seq LIMIT ?",
                    (agent, after_seq, limit),
                ).fetchall()
                if not page:
                    return []
                cutoff = page[-1][0]
                rows: list[tuple[int, str, str]] = []
                for chunk, marks in in_chunks(c for _, c in page):
                    rows += self._conn.execute(
                        "SELECT seq, event_id, completion_id FROM event_targets "
                        f"WHERE completion_id IN ({marks}) AND seq <= ?",
                        (*chunk, cutoff),
                    ).fetchall()
                rows.sort()
                events = self._events(r[1] for r in rows)
            judged, records = self._judge(rows, events)
            out = [
                self._sample(records[cid], idx, items)
                for (cid, idx), items in judged.items()
                if items[-1][0] > after_seq
            ]
            if out or len(page) < limit:
                return sorted(out, key=lambda s: (s.last_seq, s.completion_id, s.sample_index))
            after_seq = cutoff

    def _sample(
        self, t: TrajectoryRecord, index: int, items: list[tuple[int, Judgement]]
    ) -> TrainingSample:
        sample = next(s for s in t.samples if s.index == index)
        judged = [j for _, j in items]
        return TrainingSample(
            completion_id=t.id,
            sample_index=index,
            agent=t.agent,
            adapter_version=t.adapter_version,
            prompt_token_ids=t.prompt_token_ids,
            completion_token_ids=sample.completion_token_ids,
            logprobs=sample.logprobs,
            token_versions=sample.token_versions,
            rewards=[(j.event_id, j.kind, j.signal.value) for j in judged],
            targets=[j.signal.target for j in judged if j.signal.target is not None],
            last_seq=items[-1][0],
            created_at=t.created_at,
            reward=self.policy.reward(judged),
            source=self.policy.source(judged),
        )

    def close(self) -> None:
        """Close this store's connection (the trajectory store is its owner's to close)."""
        with self._lock:
            self._conn.close()


def _has_table(conn: sqlite3.Connection, name: str) -> bool:
    return (
        conn.execute(
            "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (name,)
        ).fetchone()
        is not None
    )
