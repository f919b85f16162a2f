"""The durable feedback store: facts in (events applied once, joined to completions), rewards out.

It keeps facts only: each event as received, and which completions it names
(table `event_targets`, one row per (event, completion), with a sequence
number that is the trainer's durable cursor). Rewards are not stored: the
`RewardPolicy` given to the store turns events into per-sample rewards when
samples are read (`training_samples`, `rewards_by_version`, `rewards_for`), so
a new mapping applies to every stored event at once, and both arms of a
canary comparison are judged by the same policy by construction.

At ingest the policy is asked once per judged sample, only to refuse an event
it cannot score (a diff that does not apply, say); at read time an event the
current policy cannot score is skipped with a warning.

Completions are read through the trajectory store's API (`TrajectoryReader`),
never from its tables. One transaction covers a whole batch of events: either
every event of a Kafka batch is durable, or none is and the uncommitted
offsets replay them.

State of an event (table `feedback_events`, key `(agent, event_id)`):

    joined  its targets are in `event_targets`
    parked  a completion it names is not stored yet; retried by `rejoin`
    dead    it waited longer than the TTL, or turned out invalid when joined

Idempotency is per agent: an `event_id` the same agent sent before is a
duplicate and changes nothing; another agent's event with the same id is its
own event. The agent is the event's `agent`, which is also the agent of every
completion it joins (the join refuses another agent's completion) and one the
sender's key may judge (the webhook checks it), so no tenant can suppress
another's feedback by reusing its ids.

Parking is bounded: `ParkedLimit` caps the parked events of one agent, and the
rejoin pass never scans the backlog. It reads the trajectories stored since its
cursor (`TrajectoryReader.recorded_since`), looks up only the parked events
indexed under them (`parked_targets`), and expires the oldest parked events past
the TTL, each bounded per pass, so its cost follows new trajectories and expiries,
not how many events are parked.

Tables and migrations (schema version 3): `tables`. The store runs on SQLite or
PostgreSQL (`store.db`). On PostgreSQL every write transaction first takes the
store's advisory lock, as SQLite's `BEGIN IMMEDIATE` admits one writer: so the
`seq` of a join commits in the order it was drawn, and a trainer paging by
`after_seq` never passes a join that commits later with a smaller `seq`
(concurrent identity draws can commit out of order); it also makes the
duplicate check, the parked cap and the rejoin cursor exact across processes.

Not here: Kafka, HTTP, reward arithmetic and scope (see `rewards`).
"""

from __future__ import annotations

import logging
import os
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

from clora_feedback.errors import CloraError, OverloadedError, StoreError, UnprocessableError
from clora_feedback.feedback import parking, tables
from clora_feedback.feedback.parking import Key, ParkedLimit, Rejected, RejoinReport
from clora_feedback.feedback.rewards import Judgement, RewardPolicy, RewardSignal
from clora_feedback.schemas.feedback import Event, parse_event
from clora_feedback.store.db import Tx, database_file, open_store
from clora_feedback.store.sql import LOCK_FEEDBACK, in_chunks, serialize_writers
from clora_feedback.store.trajectories import SampleRecord, TrajectoryRecord

log = logging.getLogger(__name__)

SCHEMA_VERSION = tables.SCHEMA_VERSION
REJOIN_BATCH = 1000
"""Most new trajectories, and most expired events, one rejoin pass reads."""
_SIGNAL_CACHE = (
    100_000  # (agent, event, completion, sample) -> signal; exact: all four are immutable
)


class TrajectoryReader(Protocol):
    """What the join needs from the trajectory store (`store.trajectories.TrajectoryStore`)."""

    def exists(self, ids: Iterable[str]) -> set[str]: ...

    def get_many(self, ids: Iterable[str]) -> dict[str, TrajectoryRecord]: ...

    def by_conversation(self, conversation_id: str, agent: str | None = None) -> list[str]: ...

    def recorded_since(self, position: int, limit: int) -> list[tuple[int, str, str | None]]:
        """(position, completion id, conversation id) recorded after `position`, in order."""
        ...


@dataclass(frozen=True)
class Incoming:
    """An event on its way in, with where it came from (`kafka:topic/partition@offset`, `webhook`)."""

    event: Event
    origin: str


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
        targets: the right answers given for it (corrected contents, correct answers,
            kept edits), distinct, oldest first: supervised targets.
        last_seq: highest event-target sequence number included (for incremental reads).
        created_at: when the completion was served.
        reward: the policy's aggregate of `rewards`.
        source: the policy's reward source, which admission balances by.
        wrong: some event says this output was wrong (its targets are preferred to it).
        confirmed: some event says this output was right, and none that it was wrong.
        logprobs_mode: what `logprobs` mean (`TrajectoryRecord.logprobs_mode`).
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
    wrong: bool = False
    confirmed: bool = False
    logprobs_mode: str = "raw"


@dataclass(frozen=True)
class RewardPoint:
    """One judged sample's reward at the time it was served (`recent_rewards`)."""

    completion_id: str
    """The completion."""
    sample_index: int
    """Which choice of it."""
    adapter_version: int
    """The version that served it (0: the base model)."""
    created_at: float
    """When it was served, seconds since the epoch."""
    reward: float
    """The policy's aggregate of the events judging it."""


@dataclass(frozen=True)
class AgentActivity:
    """One agent's feedback over a recent window (`activity_since`)."""

    events: int
    """Feedback events received in the window, in any state."""
    judged: int
    """Samples judged by the joined events among them."""
    reward_mean: float | None
    """Mean reward of those samples under the current policy (None: none judged)."""


ACTIVITY_EVENTS = (
    "SELECT agent, count(*) FROM feedback_events "
    "WHERE state IN ('joined', 'parked', 'dead') AND received_at >= ? GROUP BY agent"
)
"""Events per agent received since a time; the state list lets `feedback_by_state` serve it."""
ACTIVITY_JOINS = (
    "SELECT t.seq, t.agent, t.event_id, t.completion_id, e.payload "
    "FROM feedback_events e JOIN event_targets t ON t.agent = e.agent AND t.event_id = e.event_id "
    "WHERE e.state = 'joined' AND e.received_at >= ? ORDER BY t.seq"
)
"""The joins of the events received since a time, with their payloads."""

_Reader = TypeVar("_Reader", bound=TrajectoryReader)

_Judged = dict[tuple[str, int], list[tuple[int, Judgement]]]
"""(completion id, sample index) -> (seq, judgement) of each event judging it, oldest first."""
_Key = Key


class FeedbackStore(Generic[_Reader]):
    """Applies feedback events durably and exactly once, and reads them as rewards; thread-safe.

    Args:
        url: the database: a SQLite file (may be the trajectory store's; its own
            connection), `sqlite:///...`, or `postgresql://...` (see `store.db`).
        trajectories: the trajectory store's read API, which every join goes through.
        policy: turns events into rewards when samples are read.
    """

    def __init__(self, url: str | os.PathLike[str], *, trajectories: _Reader, policy: RewardPolicy):
        self.policy = policy
        self.trajectories = trajectories
        self._signals: dict[tuple[str, str, str, int], RewardSignal] = {}

        def init_schema(tx: Tx, display_url: str) -> None:
            serialize_writers(tx, LOCK_FEEDBACK)  # see the module docstring
            tables.init_schema(tx, display_url, trajectories)

        # Pragmas as this store always had: WAL, NORMAL, a long busy wait, no foreign keys.
        self._db = open_store(url, init_schema, sqlite_timeout_s=30.0, sqlite_foreign_keys=False)
        self.url = self._db.display_url

    @property
    def path(self) -> Path:
        """The SQLite file.

        Raises:
            StoreError: the store is on PostgreSQL (no file; see `url`).
        """
        return database_file(self._db, "feedback store")

    @property
    def reward_policy_id(self) -> str:
        """Id of the policy that every reward read from this store comes from."""
        return self.policy.id

    @contextmanager
    def _transaction(self) -> Iterator[Tx]:
        with self._db.write() as tx:
            serialize_writers(tx, LOCK_FEEDBACK)  # see the module docstring
            yield tx

    # -- writes --------------------------------------------------------------------

    def apply(
        self,
        batch: Sequence[Incoming],
        *,
        now: float | None = None,
        limit: ParkedLimit | None = None,
    ) -> ApplyReport:
        """Apply a batch in one transaction; committed (durable) when this returns.

        Args:
            batch: the events, with their origins.
            now: the time recorded (default: the clock).
            limit: the per-agent cap on parked events; None parks without limit.

        Raises:
            OverloadedError: `limit.refuse` and an event would park beyond the cap
                (code `parked_limit`); the whole batch is rolled back.
        """
        now = time.time() if now is None else now
        report = ApplyReport()
        with self._transaction() as conn:
            seen: set[_Key] = set()
            parked: dict[str, int] = {}  # agent -> parked events, counted once per batch
            for item in batch:
                event = item.event
                key = (event.agent, event.event_id)
                if key in seen or self._known(conn, key):
                    report.duplicates.append(event.event_id)
                    continue
                payload = event.model_dump_json()
                try:
                    records = self._join(event)
                    if records is None and limit is not None:
                        parking.check_limit(conn, event.agent, parked, limit)
                except CloraError as exc:
                    # An outage is not the event's fault: raise so the caller retries it
                    # (Kafka rewinds, the webhook answers 503) instead of dead-lettering it.
                    if isinstance(exc, (OverloadedError, StoreError)):
                        raise
                    report.rejected.append(Rejected(event.event_id, payload, exc.message, exc.code))
                    continue
                seen.add(key)
                self._insert(conn, item, payload, "joined" if records else "parked", now)
                if records is not None:
                    self._insert_targets(conn, event, records, now)
                    report.joined.append(event.event_id)
                else:
                    parking.park(conn, event)
                    report.parked.append(event.event_id)
        return report

    def _insert(self, conn: Tx, item: Incoming, payload: str, state: str, now: float) -> None:
        event = item.event
        conn.execute(
            "INSERT INTO feedback_events (event_id, agent, kind, payload, origin, state, reason, "
            "received_at, updated_at) VALUES (?, ?, ?, ?, ?, ?, NULL, ?, ?)",
            (event.event_id, event.agent, event.kind, payload, item.origin, state, now, now),
        )

    def rejoin(
        self, *, ttl_s: float, now: float | None = None, batch: int = REJOIN_BATCH
    ) -> RejoinReport:
        """One bounded pass: join the parked events newly stored trajectories complete; expire.

        Reads at most `batch` trajectories stored since the previous pass and only the
        parked events indexed under them, then at most `batch` of the oldest events
        parked longer than `ttl_s` (each tried once more before it dies). `more` says a
        bound was hit.
        """
        now = time.time() if now is None else now
        out = RejoinReport()
        with self._transaction() as conn:
            (position,) = conn.execute("SELECT position FROM rejoin_cursor").fetchone()
            arrived = self.trajectories.recorded_since(position, batch)
            waiting = parking.waiting_for(conn, arrived)
            expired = conn.execute(parking.EXPIRED, (now - ttl_s, batch)).fetchall()
            tried: set[_Key] = set()
            for rows, ttl in ((waiting, None), (expired, ttl_s)):
                for agent, event_id, payload in rows:
                    if (agent, event_id) not in tried:  # an arrival may be late as well
                        tried.add((agent, event_id))
                        self._retry(conn, payload, now, ttl, out)
            if arrived:
                conn.execute("UPDATE rejoin_cursor SET position = ?", (arrived[-1][0],))
        out.trajectories_read, out.examined = len(arrived), len(tried)
        out.more = len(arrived) == batch or len(expired) == batch
        return out

    def _retry(
        self,
        conn: Tx,
        payload: str,
        now: float,
        ttl_s: float | None,
        out: RejoinReport,
    ) -> None:
        """Join one parked event if it can; it dies if invalid, or if expired (`ttl_s` given)."""
        event = parse_event(payload)
        try:
            records = self._join(event)
        except CloraError as exc:
            reason = exc.message
        else:
            if records is not None:
                self._insert_targets(conn, event, records, now)
                parking.leave(conn, event, "joined", None, now)
                out.joined.append(event.event_id)
                return
            if ttl_s is None:
                return  # still waiting for another of its targets
            reason = f"no trajectory for {self._missing_text(event)} after {ttl_s:g} s"
        parking.leave(conn, event, "dead", reason, now)
        out.dead.append(Rejected(event.event_id, payload, reason))

    # -- the join ----------------------------------------------------------------------

    def _known(self, conn: Tx, key: _Key) -> bool:
        return (
            conn.execute(
                "SELECT 1 FROM feedback_events WHERE agent = ? AND event_id = ?", key
            ).fetchone()
            is not None
        )

    def _targets(self, event: Event) -> tuple[list[str], list[str]]:
        """(completion ids found, ids named but missing)."""
        wanted = event.targets()
        stored = self.trajectories.exists(wanted)
        found = [c for c in wanted if c in stored]
        if event.conversation_id is not None:
            # The event's own agent only: another tenant's conversation is as unknown (a
            # refusal naming its completions or agent would leak them).
            conversation = self.trajectories.by_conversation(event.conversation_id, event.agent)
            found += [c for c in conversation if c not in found]
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
                # As the webhook's owner check words it: never the owner's name.
                raise UnprocessableError(
                    f"completion {record.id!r} is not a completion of agent {event.agent!r}"
                )
            for sample in record.samples:
                if self.policy.judges(event, sample.index):
                    self._signal(event, record, sample)  # refuses an unscorable event now
        return [records[c] for c in found]

    def _insert_targets(
        self,
        conn: Tx,
        event: Event,
        records: list[TrajectoryRecord],
        now: float,
    ) -> None:
        rows = [(event.event_id, t.id, event.agent, t.adapter_version, now) for t in records]
        if conn.dialect == "sqlite":  # seq NULL: AUTOINCREMENT numbers it, as it always did
            conn.executemany(tables.INSERT_TARGET, [(None, *r) for r in rows])
        else:
            conn.executemany(tables.INSERT_NEW_TARGET, rows)

    def _signal(self, event: Event, record: TrajectoryRecord, sample: SampleRecord) -> RewardSignal:
        key = (event.agent, event.event_id, record.id, sample.index)
        signal = self._signals.get(key)
        if signal is None:
            signal = self.policy.signal(event, sample.text)
            if len(self._signals) >= _SIGNAL_CACHE:
                self._signals.clear()
            self._signals[key] = signal
        return signal

    # -- reading facts as rewards ---------------------------------------------------------

    @staticmethod
    def _events(tx: Tx, keys: Iterable[_Key]) -> dict[_Key, Event]:
        """Stored events by (agent, event_id) (inside the caller's read); one query per agent chunk."""
        by_agent: dict[str, list[str]] = defaultdict(list)
        for agent, event_id in keys:
            by_agent[agent].append(event_id)
        out: dict[_Key, Event] = {}
        for agent, ids in by_agent.items():
            for chunk, marks in in_chunks(ids):
                for event_id, payload in tx.execute(
                    "SELECT event_id, payload FROM feedback_events "
                    f"WHERE agent = ? AND event_id IN ({marks})",
                    (agent, *chunk),
                ):
                    out[(agent, event_id)] = parse_event(payload)
        return out

    def _judge(
        self, rows: Sequence[tuple[int, str, str, str]], events: dict[_Key, Event]
    ) -> tuple[_Judged, dict[str, TrajectoryRecord]]:
        """Apply the policy to (seq, agent, event id, completion id) rows, in seq order."""
        records = self.trajectories.get_many(c for *_, c in rows)
        judged: _Judged = defaultdict(list)
        for seq, agent, event_id, completion_id in rows:
            event, record = events[(agent, event_id)], records.get(completion_id)
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
        with self._db.read() as tx:
            rows = tx.execute(
                f"SELECT seq, agent, event_id, completion_id FROM event_targets WHERE {where} "
                "ORDER BY seq",
                params,
            ).fetchall()
            events = self._events(tx, ((r[1], r[2]) for r in rows))
        return self._judge(rows, events)

    # -- reads -----------------------------------------------------------------------

    def state_counts(self, agent: str | None = None) -> dict[str, int]:
        with self._db.read() as tx:
            sql = "SELECT state, count(*) FROM feedback_events"
            rows = tx.execute(
                sql + (" WHERE agent = ? GROUP BY state" if agent else " GROUP BY state"),
                (agent,) if agent else (),
            ).fetchall()
        return {state: n for state, n in rows}

    def event_state(self, event_id: str, agent: str | None = None) -> tuple[str, str | None] | None:
        """(state, reason) of `agent`'s event `event_id`; with no agent, the first received
        of that id (ids are scoped per agent, so several agents may each have one)."""
        where, params = "event_id = ?", [event_id]
        if agent is not None:
            where, params = "agent = ? AND event_id = ?", [agent, event_id]
        with self._db.read() as tx:
            row = tx.execute(
                f"SELECT state, reason FROM feedback_events WHERE {where} "
                "ORDER BY received_at, rowid LIMIT 1",
                params,
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

    def rewards_by_version(
        self, agent: str, version: int, since: float | None = None
    ) -> list[float]:
        """One reward per sample served by `version` of `agent`, under the current policy.

        For the canary (`release.canary`): both arms read here are judged by the same
        policy, whatever policy was current when either was trained.

        Args:
            since: only feedback joined at or after it (seconds since the epoch; the
                canary's start, so a long-serving version's history is not re-read at
                every look); None: all.
        """
        where, params = "agent = ? AND adapter_version = ?", [agent, version]
        if since is not None:
            where, params = where + " AND joined_at >= ?", [agent, version, since]
        judged, _ = self._judged_where(where, tuple(params))
        ordered = sorted(judged.values(), key=lambda items: items[-1][0])
        return [self.policy.reward([j for _, j in items]) for items in ordered]

    def recent_rewards(self, agent: str, *, limit: int = 500) -> list[RewardPoint]:
        """The rewards of `agent`'s most recently judged samples, under the current policy,
        oldest served first (for the console's reward-over-time chart).

        Reads the newest `limit` joins of the agent (a sample judged again by an older
        event outside that window is aggregated over the events inside it).
        """
        with self._db.read() as tx:
            rows = tx.execute(
                "SELECT seq, agent, event_id, completion_id FROM event_targets WHERE agent = ? "
                "ORDER BY seq DESC LIMIT ?",
                (agent, limit),
            ).fetchall()
            rows.reverse()
            events = self._events(tx, ((r[1], r[2]) for r in rows))
        judged, records = self._judge(rows, events)
        points = [
            RewardPoint(
                completion_id=cid,
                sample_index=idx,
                adapter_version=records[cid].adapter_version,
                created_at=records[cid].created_at,
                reward=self.policy.reward([j for _, j in items]),
            )
            for (cid, idx), items in judged.items()
        ]
        return sorted(points, key=lambda p: (p.created_at, p.completion_id, p.sample_index))

    def activity_since(self, since: float) -> dict[str, AgentActivity]:
        """Every agent's feedback received at or after `since` (seconds since the epoch):
        event counts and the mean reward of the samples those events judge (for the
        console's feedback per minute and its sort by reward). Agents with no event
        in the window are absent.

        Two indexed reads for all agents (`feedback_by_state`, then the joins by key);
        a sample also judged by an event older than the window is aggregated over the
        events inside it, as in `recent_rewards`.
        """
        with self._db.read() as tx:
            counts = tx.execute(ACTIVITY_EVENTS, (since,)).fetchall()
            rows = tx.execute(ACTIVITY_JOINS, (since,)).fetchall()
        events = {(r[1], r[2]): parse_event(r[4]) for r in rows}
        judged, records = self._judge([(r[0], r[1], r[2], r[3]) for r in rows], events)
        rewards: dict[str, list[float]] = defaultdict(list)
        for (cid, _), items in judged.items():
            rewards[records[cid].agent].append(self.policy.reward([j for _, j in items]))
        return {
            agent: AgentActivity(
                events=int(n),
                judged=len(rewards[agent]),
                reward_mean=sum(rewards[agent]) / len(rewards[agent]) if rewards[agent] else None,
            )
            for agent, n in counts
        }

    def agents_with_rewards(self) -> list[str]:
        with self._db.read() as tx:
            return [
                r[0] for r in tx.execute("SELECT DISTINCT agent FROM event_targets ORDER BY agent")
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
            with self._db.read() as tx:
                page = tx.execute(
                    "SELECT seq, completion_id FROM event_targets WHERE agent = ? AND seq > ? "
                    "ORDER BY seq LIMIT ?",
                    (agent, after_seq, limit),
                ).fetchall()
                if not page:
                    return []
                cutoff = page[-1][0]
                rows: list[tuple[int, str, str, str]] = []
                for chunk, marks in in_chunks(c for _, c in page):
                    rows += tx.execute(
                        "SELECT seq, agent, event_id, completion_id FROM event_targets "
                        f"WHERE completion_id IN ({marks}) AND seq <= ?",
                        (*chunk, cutoff),
                    ).fetchall()
                rows.sort()
                events = self._events(tx, ((r[1], r[2]) for r in rows))
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
        wrong = any(j.signal.wrong for j in judged)
        targets = [j.signal.target for j in judged if j.signal.target is not None]
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
            targets=list(dict.fromkeys(targets)),
            last_seq=items[-1][0],
            created_at=t.created_at,
            reward=self.policy.reward(judged),
            source=self.policy.source(judged),
            wrong=wrong,
            confirmed=not wrong and any(j.signal.confirmed for j in judged),
            logprobs_mode=t.logprobs_mode,
        )

    def close(self) -> None:
        """Close this store's connection (the trajectory store is its owner's to close)."""
        self._db.close()
