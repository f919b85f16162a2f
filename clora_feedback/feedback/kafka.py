"""Kafka connector: feedback events from topics into the feedback store, exactly once in effect.

`FeedbackConsumer` is one member of a consumer group on the feedback topics.
For every polled batch (at most `max_batch` records) it:

1. decodes each record; bad UTF-8, bad JSON, a schema violation, a key that is
   not the event's agent or an unknown agent make it *malformed*;
2. applies the valid events in one SQLite transaction (`FeedbackIngest.apply`,
   on a worker thread), which dedupes by `event_id` and parks events whose
   completion is not stored yet;
3. dead-letters every malformed record, and every event the store refused,
   through the ingest's sink (the dead-letter topic: original key and bytes,
   reason and source in headers, see `connectors/topics.json`), and waits for
   the acks;
4. only then commits, per partition, the offset after the last record.

A crash anywhere before step 4 replays the batch; replayed events are
duplicates by `event_id` and change nothing, so delivery is at-least-once and
the effect exactly-once (a replay can dead-letter the same bad record twice).
On a rebalance the revoked partitions wait for the in-flight batch to commit
(`wait_for_batch`). Parked events are retried by the ingest's one rejoin loop
(`clora_feedback.feedback.ingest`); those older than the TTL are dead-lettered
with only the `clora.reason` header (their original record is long committed;
the value is the event as stored).

The record format and `FeedbackProducer` live in `records` and are re-exported
here. Not here: the process entry (`clora ingest`, `clora_feedback.cli.ingest`),
the broker (`broker`), the store, the Kafka lifecycle of `clora serve` (`pipeline`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener
from aiokafka.errors import CommitFailedError, IllegalStateError, KafkaError

from clora_feedback.config import FeedbackConfig, KafkaConfig
from clora_feedback.errors import CloraError, InvalidRequestError
from clora_feedback.feedback.ingest import (
    DeadLetter,
    FeedbackIngest,
    IngestMetrics,
    KafkaDeadLetters,
    SourcePosition,
)
from clora_feedback.feedback.records import (
    HEADER_REASON,
    HEADER_SOURCE_OFFSET,
    HEADER_SOURCE_PARTITION,
    HEADER_SOURCE_TOPIC,
    Delivery,
    FeedbackProducer,
    build_producer,
    close_quietly,
    decode_record,
    kafka_error,
)
from clora_feedback.feedback.store import ApplyReport, FeedbackStore, Incoming, Rejected
from clora_feedback.lifecycle import AsyncLifecycle
from clora_feedback.schemas.feedback import Event

__all__ = [
    "HEADER_REASON",
    "HEADER_SOURCE_OFFSET",
    "HEADER_SOURCE_PARTITION",
    "HEADER_SOURCE_TOPIC",
    "BatchReport",
    "ConsumerMetrics",
    "Delivery",
    "FeedbackConsumer",
    "FeedbackProducer",
    "build_consumer",
    "build_producer",
    "decode_record",
]

KnownAgents = Callable[[], Collection[str]]
_DEFAULTS = KafkaConfig()

log = logging.getLogger(__name__)


# -- value types -------------------------------------------------------------------------


@dataclass
class ConsumerMetrics(IngestMetrics):
    """The ingest's counters plus the consumer's own (records, unless named events)."""

    records: int = 0
    """Records polled."""
    batches: int = 0
    """Batches applied and committed."""
    malformed: int = 0
    """Records that did not decode to a valid event of a known agent."""
    commit_failures: int = 0
    """Batches applied but not committed (the group moved on); they replay harmlessly."""
    lag: int | None = None
    """Records behind the high watermarks after the last batch (None until known)."""


@dataclass(frozen=True)
class BatchReport:
    """What one polled batch did."""

    records: int
    """Records in the batch."""
    apply: ApplyReport
    """The store's report on the valid events."""
    dead_lettered: int
    """Records sent to the dead-letter topic (malformed + rejected)."""
    committed: dict[tuple[str, int], int] = field(default_factory=dict)
    """(topic, partition) -> next offset committed; empty if the commit failed."""


# -- the consumer -------------------------------------------------------------------------


class FeedbackConsumer(AsyncLifecycle):
    """A consumer-group member that applies feedback records through a `FeedbackIngest`.

    Args:
        store: Where events are applied (shared SQLite with the trajectories).
        bootstrap_servers: `host:port[,host:port]` of the Kafka cluster.
        topics: Feedback topics to consume (any kind on any topic).
        dead_letter_topic: Where malformed, refused and expired events go.
        group_id: Consumer group; partitions are shared among its members.
        max_batch: Most records applied in one transaction.
        known_agents: Returns the accepted agent names (called once per batch);
            None accepts every agent.
        park_ttl_s: How long a parked event waits for its trajectory.
        rejoin_interval_s: How often parked events are retried.
        ingest: A shared ingest (with its own sink and rejoin loop, started by its
            owner); None builds one on `store` dead-lettering to `dead_letter_topic`,
            started and stopped with this consumer.
        metrics: The counters to update; pass the shared ingest's when there is one.
        poll_timeout_ms: Longest wait for records; also bounds `stop` latency.
        session_timeout_ms: Group session timeout (a dead member's partitions
            move after this long).
        heartbeat_interval_ms: Group heartbeat period (< session timeout / 3).
        fetch_max_wait_ms: Longest time the broker may hold a fetch for more data;
            bounds the produce-to-apply latency when traffic is light.
        rebalance_timeout_ms: How long the group waits for members to rejoin; a
            revocation waits for the in-flight batch, so this must exceed the
            longest batch (apply + dead-lettering + commit).
        client_id: Client id shown by the broker.
        commit_delay_s: Fault injection for tests: sleep between the durable
            write and the commit, widening the window a crash replays.

    Lifecycle: `await start()` (or `async with`), `await run()` until `stop()`.
    """

    def __init__(
        self,
        store: FeedbackStore,
        bootstrap_servers: str,
        *,
        topics: Sequence[str] = _DEFAULTS.topics,
        dead_letter_topic: str = _DEFAULTS.dead_letter_topic,
        group_id: str = _DEFAULTS.group_id,
        max_batch: int = _DEFAULTS.max_batch,
        known_agents: KnownAgents | None = None,
        park_ttl_s: float = 3600.0,
        rejoin_interval_s: float = 2.0,
        ingest: FeedbackIngest | None = None,
        metrics: ConsumerMetrics | None = None,
        poll_timeout_ms: int = 500,
        session_timeout_ms: int = 10_000,
        heartbeat_interval_ms: int = 3_000,
        fetch_max_wait_ms: int = 100,
        rebalance_timeout_ms: int = 60_000,
        client_id: str = "clora-feedback-ingest",
        commit_delay_s: float = 0.0,
    ):
        if max_batch < 1:
            raise InvalidRequestError(f"max_batch must be >= 1, got {max_batch}", param="max_batch")
        self.store = store
        self.bootstrap_servers = bootstrap_servers
        self.topics = tuple(topics)
        self.dead_letter_topic = dead_letter_topic
        self.group_id = group_id
        self.max_batch = max_batch
        self.poll_timeout_ms = poll_timeout_ms
        self.commit_delay_s = commit_delay_s
        self.metrics = metrics if metrics is not None else ConsumerMetrics()
        self._owns_ingest = ingest is None
        self.ingest = ingest or FeedbackIngest(
            store,
            KafkaDeadLetters(bootstrap_servers, dead_letter_topic, client_id=f"{client_id}-dlq"),
            park_ttl_s=park_ttl_s,
            rejoin_interval_s=rejoin_interval_s,
            metrics=self.metrics,
        )
        self._known_agents = known_agents
        self._client_args: dict[str, Any] = {
            "session_timeout_ms": session_timeout_ms,
            "heartbeat_interval_ms": heartbeat_interval_ms,
            "rebalance_timeout_ms": rebalance_timeout_ms,
            "fetch_max_wait_ms": fetch_max_wait_ms,
            "client_id": client_id,
        }
        self._consumer: Any = None
        # Held from the moment a batch is taken until its offsets are committed; a
        # revocation waits on it so the batch commits while the partitions are still ours.
        self._batch_lock = asyncio.Lock()
        self._closing = False
        self._running: asyncio.Event | None = None
        self._positions: dict[Any, int] = {}

    @property
    def park_ttl_s(self) -> float:
        return self.ingest.park_ttl_s

    # -- lifecycle --------------------------------------------------------------------

    async def start(self) -> None:
        """Connect, join the group (in the background) and, if owned, start the ingest.

        Raises:
            UnavailableError: the cluster cannot be reached.
        """
        if self._consumer is not None:
            raise CloraError("the feedback consumer is already started", code="already_started")
        consumer = AIOKafkaConsumer(
            bootstrap_servers=self.bootstrap_servers,
            group_id=self.group_id,
            enable_auto_commit=False,
            auto_offset_reset="earliest",  # a new group must not skip feedback sent before it
            max_poll_records=self.max_batch,
            **self._client_args,
        )
        consumer.subscribe(list(self.topics), listener=_RevokeAfterCommit(self))
        try:
            if self._owns_ingest:
                await self.ingest.start()
            await consumer.start()
        except KafkaError as exc:
            await close_quietly(consumer.stop())
            if self._owns_ingest:
                await self.ingest.stop()
            raise kafka_error(f"connect to {self.bootstrap_servers}", exc) from exc
        except CloraError:
            await close_quietly(consumer.stop())
            raise
        self._consumer, self._closing = consumer, False

    async def stop(self) -> None:
        """Finish and commit the in-flight batch, leave the group, disconnect; idempotent."""
        self._closing = True
        if self._running is not None:
            await self._running.wait()  # `run` notices `_closing` within one poll timeout
        async with self._batch_lock:
            consumer, self._consumer = self._consumer, None
        if consumer is not None:
            await close_quietly(consumer.stop())
            if self._owns_ingest:
                await self.ingest.stop()

    async def run(self) -> None:
        """Poll, apply, dead-letter and commit until `stop`.

        Raises:
            StoreError, UnavailableError: the store or the cluster failed for good; the batch in
                flight was not committed and replays on the next start.
        """
        self._require_started()
        self._running = asyncio.Event()
        try:
            while not self._closing:
                await self.poll_once()
        finally:
            self._running.set()
            self._running = None

    async def wait_for_batch(self) -> None:
        """Return once no batch is in flight (the one taken, if any, has committed)."""
        async with self._batch_lock:
            pass

    def forget_partitions(self, revoked: Collection[Any]) -> None:
        """Drop the positions of partitions this member no longer owns (lag stays honest)."""
        self._positions = {tp: o for tp, o in self._positions.items() if tp not in revoked}

    # -- one step each ----------------------------------------------------------------

    async def poll_once(self, timeout_ms: int | None = None) -> BatchReport | None:
        """Take one batch and apply, dead-letter and commit it; None if nothing came.

        Raises:
            StoreError: see `run`.
        """
        consumer = self._require_started()
        try:
            batch = await consumer.getmany(
                timeout_ms=self.poll_timeout_ms if timeout_ms is None else timeout_ms,
                max_records=self.max_batch,
            )
        except KafkaError as exc:
            raise kafka_error("poll", exc) from exc
        if not batch:
            return None
        async with self._batch_lock:
            return await self._process(batch)

    async def rejoin_parked(self, *, now: float | None = None) -> tuple[list[str], list[Rejected]]:
        """One round of the ingest's rejoin (see `FeedbackIngest.rejoin_parked`)."""
        return await self.ingest.rejoin_parked(now=now)

    # -- the batch ----------------------------------------------------------------------

    async def _process(self, batch: dict[Any, list[Any]]) -> BatchReport:
        known = set(self._known_agents()) if self._known_agents is not None else None
        valid: list[tuple[Any, Event]] = []
        bad: list[tuple[Any, str]] = []
        for records in batch.values():
            for record in records:
                try:
                    valid.append((record, decode_record(record.key, record.value, known)))
                except InvalidRequestError as exc:
                    bad.append((record, exc.message))
        self.metrics.records += len(valid) + len(bad)
        self.metrics.malformed += len(bad)

        report = await self.ingest.apply([Incoming(e, _origin(r)) for r, e in valid])
        refused = {(r.event_id, r.payload): r.reason for r in report.rejected}
        if refused:
            for record, event in valid:
                reason = refused.get((event.event_id, event.model_dump_json()))
                if reason is not None:
                    bad.append((record, f"refused by the store: {reason}"))
        await self.ingest.dead_letter([_letter(r, reason) for r, reason in bad])
        self._mirror(report, dead_lettered=len(bad))
        if self.commit_delay_s:
            await asyncio.sleep(self.commit_delay_s)
        offsets = {tp: records[-1].offset + 1 for tp, records in batch.items()}
        committed = await self._commit(offsets)
        self.metrics.batches += 1
        self._update_lag()
        return BatchReport(
            records=len(valid) + len(bad),
            apply=report,
            dead_lettered=len(bad),
            committed={(tp.topic, tp.partition): o for tp, o in offsets.items()}
            if committed
            else {},
        )

    def _mirror(self, report: ApplyReport, *, dead_lettered: int) -> None:
        """The ingest counted this batch into its metrics; count it into ours if they differ."""
        if self.metrics is self.ingest.metrics:
            return
        self.metrics.dead_lettered += dead_lettered
        self.metrics.applied += len(report.joined)
        self.metrics.parked += len(report.parked)
        self.metrics.duplicates += len(report.duplicates)
        self.metrics.rejected += len(report.rejected)

    async def _commit(self, offsets: dict[Any, int]) -> bool:
        try:
            await self._consumer.commit(offsets)
        except (CommitFailedError, IllegalStateError) as exc:
            # The group moved these partitions on (e.g. our session expired): the new
            # owner replays the batch, and the replay is a no-op by event_id.
            self.metrics.commit_failures += 1
            log.warning("offsets not committed, the batch will replay: %r", exc)
            return False
        except KafkaError as exc:
            raise kafka_error("commit", exc) from exc
        self._positions.update(offsets)
        return True

    def _update_lag(self) -> None:
        lag, known = 0, False
        for tp in self._consumer.assignment():
            high, pos = self._consumer.highwater(tp), self._positions.get(tp)
            if high is not None and pos is not None:
                lag, known = lag + max(0, high - pos), True
        self.metrics.lag = lag if known else None

    def _require_started(self) -> Any:
        if self._consumer is None:
            raise CloraError("the feedback consumer is not started", code="not_started")
        return self._consumer


class _RevokeAfterCommit(ConsumerRebalanceListener):
    """Rebalance listener: partitions leave only after the in-flight batch committed."""

    def __init__(self, owner: FeedbackConsumer):
        self._owner = owner

    async def on_partitions_revoked(self, revoked: Any) -> None:
        await self._owner.wait_for_batch()
        self._owner.forget_partitions(revoked)
        log.info("partitions revoked: %s", sorted(f"{t.topic}/{t.partition}" for t in revoked))

    async def on_partitions_assigned(self, assigned: Any) -> None:
        log.info("partitions assigned: %s", sorted(f"{t.topic}/{t.partition}" for t in assigned))


def _origin(record: Any) -> str:
    return f"kafka:{record.topic}/{record.partition}@{record.offset}"


def _letter(record: Any, reason: str) -> DeadLetter:
    position = SourcePosition(record.topic, record.partition, record.offset)
    return DeadLetter(record.key, record.value, reason, position)


# -- builders ---------------------------------------------------------------------------


def build_consumer(
    store: FeedbackStore,
    config: FeedbackConfig,
    bootstrap_servers: str,
    *,
    known_agents: KnownAgents | None = None,
    **options: Any,
) -> FeedbackConsumer:
    """A consumer wired from configuration; `options` pass through (e.g. session timeouts)."""
    kafka = config.kafka
    return FeedbackConsumer(
        store,
        bootstrap_servers,
        topics=kafka.topics,
        dead_letter_topic=kafka.dead_letter_topic,
        group_id=kafka.group_id,
        max_batch=kafka.max_batch,
        known_agents=known_agents,
        park_ttl_s=config.park_ttl_s,
        **options,
    )
