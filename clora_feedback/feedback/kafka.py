"""Kafka connector: feedback events from topics into the feedback store, exactly once in effect.

`FeedbackConsumer` is one member of a consumer group on the feedback topics.
For every polled batch (at most `max_batch` records) it:

1. decodes each record; bad UTF-8, bad JSON, a schema violation, a key that is
   not the event's agent or an unknown agent make it *malformed*, and so does a
   record over `max_record_bytes` (reason `too_large`, never parsed);
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

A batch that fails anywhere in steps 2-4 (the store locked or down, the
dead-letter topic unreachable, a commit error) is not skipped: every partition
of it is sought back to the batch's first offset, which is still the first
uncommitted one, and the consumer reads it again after a pause that doubles
from `retry_initial_s` up to `retry_max_s`, for as long as it takes. Nothing is
committed past a record that was not applied or dead-lettered, and the consumer
stays in its group meanwhile (it keeps polling; `stop` interrupts the pause).

A dead letter that would not fit `dead_letter_max_bytes` (the dead-letter
producer's `max_request_size`) is sent as a bounded JSON envelope instead of
the original bytes (`records.fit_dead_letter`), so no record can wedge the
consumer by its size.

The record format and `FeedbackProducer` live in `records` and are re-exported
here. Not here: the process entry (`clora ingest`, `clora_feedback.cli.ingest`),
the broker (`broker`), the store, the Kafka lifecycle of `clora serve` (`pipeline`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener
from aiokafka.errors import CommitFailedError, IllegalStateError, KafkaError

from clora_feedback.config import FeedbackConfig, KafkaConfig
from clora_feedback.errors import CloraError, InvalidRequestError
from clora_feedback.feedback.ingest import (
    DEFAULT_MAX_PARKED,
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
    fit_dead_letter,
    kafka_client_options,
    kafka_error,
)
from clora_feedback.feedback.store import ApplyReport, FeedbackStore, Incoming
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
    batch_retries: int = 0
    """Failed batches (store or dead-letter topic down, commit error) read again from the start."""
    too_large: int = 0
    """Records over `max_record_bytes`, dead-lettered unparsed."""
    truncated: int = 0
    """Dead letters too large to send whole, sent as a truncated envelope."""
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
        max_record_bytes: Largest record (key + value) parsed; larger ones are
            dead-lettered unparsed with reason `too_large`.
        dead_letter_max_bytes: Largest dead-letter record (the owned dead-letter
            producer's `max_request_size`); larger ones go as a truncated envelope.
        retry_initial_s: Pause before a failed batch is read again; it doubles
            with each further failure in a row, up to `retry_max_s`.
        retry_max_s: Longest pause between two reads of a failed batch.
        client_options: More aiokafka arguments for the consumer and the owned
            dead-letter producer: the cluster's security (`kafka_client_options`).
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
        max_parked_per_agent: int | None = DEFAULT_MAX_PARKED,
        rejoin_interval_s: float = 2.0,
        ingest: FeedbackIngest | None = None,
        metrics: ConsumerMetrics | None = None,
        poll_timeout_ms: int = 500,
        session_timeout_ms: int = 10_000,
        heartbeat_interval_ms: int = 3_000,
        fetch_max_wait_ms: int = 100,
        rebalance_timeout_ms: int = 60_000,
        client_id: str = "clora-feedback-ingest",
        max_record_bytes: int = _DEFAULTS.max_record_bytes,
        dead_letter_max_bytes: int = _DEFAULTS.dead_letter_max_bytes,
        retry_initial_s: float = _DEFAULTS.retry_initial_s,
        retry_max_s: float = _DEFAULTS.retry_max_s,
        client_options: Mapping[str, Any] | None = None,
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
        self.max_record_bytes = max_record_bytes
        self.dead_letter_max_bytes = dead_letter_max_bytes
        self.retry_initial_s = retry_initial_s
        self.retry_max_s = retry_max_s
        self.metrics = metrics if metrics is not None else ConsumerMetrics()
        self._owns_ingest = ingest is None
        security = dict(client_options or {})
        self.ingest = ingest or FeedbackIngest(
            store,
            KafkaDeadLetters(
                bootstrap_servers,
                dead_letter_topic,
                client_id=f"{client_id}-dlq",
                client_options={**security, "max_request_size": dead_letter_max_bytes},
            ),
            park_ttl_s=park_ttl_s,
            max_parked_per_agent=max_parked_per_agent,
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
            **security,
        }
        self._consumer: Any = None
        # Held from the moment a batch is taken until its offsets are committed; a
        # revocation waits on it so the batch commits while the partitions are still ours.
        self._batch_lock = asyncio.Lock()
        self._closing = False
        self._running: asyncio.Event | None = None
        self._positions: dict[Any, int] = {}
        self._failures = 0  # failed batches in a row
        self._wake = asyncio.Event()  # set by `stop`: ends a retry pause early

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
        self._wake = asyncio.Event()

    async def stop(self) -> None:
        """Finish and commit the in-flight batch, leave the group, disconnect; idempotent."""
        self._closing = True
        self._wake.set()
        if self._running is not None:
            await self._running.wait()  # `run` notices `_closing` within one poll timeout
        async with self._batch_lock:
            consumer, self._consumer = self._consumer, None
        if consumer is not None:
            await close_quietly(consumer.stop())
            if self._owns_ingest:
                await self.ingest.stop()

    async def run(self) -> None:
        """Poll, apply, dead-letter and commit until `stop`; a failed batch is retried.

        Raises:
            UnavailableError: polling the cluster failed; nothing uncommitted was
                skipped, so the next start resumes at the first unapplied record.
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
        """Take one batch and apply, dead-letter and commit it.

        Returns:
            What the batch did; None if nothing came, or if the batch failed: then
            its partitions were sought back to its first offsets and this waited
            the retry pause, so the next call reads the same records again.

        Raises:
            UnavailableError: polling failed (see `run`).
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
            try:
                report = await self._process(batch)
            except Exception as exc:  # any failure: the batch must be read again, not skipped
                self._rewind(batch)
                failure = exc
            else:
                self._failures = 0
                return report
        await self._back_off(failure, sum(len(records) for records in batch.values()))
        return None

    # -- the batch ----------------------------------------------------------------------

    async def _process(self, batch: dict[Any, list[Any]]) -> BatchReport:
        valid, bad = self._decode(batch)
        malformed, too_large = len(bad), sum(_size(r) > self.max_record_bytes for r, _ in bad)

        report = await self.ingest.apply([Incoming(e, _origin(r)) for r, e in valid])
        refused = {(r.event_id, r.payload): r.reason for r in report.rejected}
        if refused:
            for record, event in valid:
                reason = refused.get((event.event_id, event.model_dump_json()))
                if reason is not None:
                    bad.append((record, f"refused by the store: {reason}"))
        letters = [_letter(r, reason, self.dead_letter_max_bytes) for r, reason in bad]
        await self.ingest.dead_letter(letters)
        # Counted once the batch can no longer fail before its commit, so a retried
        # batch is not counted twice.
        self.metrics.records += len(valid) + malformed
        self.metrics.malformed += malformed
        self.metrics.too_large += too_large
        self.metrics.truncated += sum(
            d.value is not r.value for d, (r, _) in zip(letters, bad, strict=True)
        )
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

    def _decode(
        self, batch: dict[Any, list[Any]]
    ) -> tuple[list[tuple[Any, Event]], list[tuple[Any, str]]]:
        """(record, event) for the valid records, (record, reason) for the malformed ones."""
        known = set(self._known_agents()) if self._known_agents is not None else None
        valid: list[tuple[Any, Event]] = []
        bad: list[tuple[Any, str]] = []
        for records in batch.values():
            for record in records:
                size = _size(record)
                if size > self.max_record_bytes:
                    # Not parsed: a huge value would cost the event loop its JSON parse.
                    reason = (
                        f"too_large: {size} bytes, over max_record_bytes {self.max_record_bytes}"
                    )
                    bad.append((record, reason))
                    continue
                try:
                    valid.append((record, decode_record(record.key, record.value, known)))
                except InvalidRequestError as exc:
                    bad.append((record, exc.message))
        return valid, bad

    def _rewind(self, batch: dict[Any, list[Any]]) -> None:
        """Seek the batch's partitions back to its first records, still the first uncommitted.

        A revocation waits for the batch lock, so the partitions are still ours here;
        one lost otherwise (an expired session) resumes at its committed offset anyway.
        """
        assigned = self._consumer.assignment()
        for tp, records in batch.items():
            if tp in assigned:
                self._consumer.seek(tp, records[0].offset)

    async def _back_off(self, failure: Exception, records: int) -> None:
        """Count and log a failed batch, then pause (capped doubling) unless stopping."""
        self._failures += 1
        self.metrics.batch_retries += 1
        delay = min(self.retry_max_s, self.retry_initial_s * 2.0 ** min(self._failures - 1, 30))
        why = failure.message if isinstance(failure, CloraError) else repr(failure)
        log.warning(
            "feedback batch of %d records failed (%d in a row): %s; nothing committed, "
            "reading it again from its first offsets in %.2f s",
            records,
            self._failures,
            why,
            delay,
        )
        if not self._closing:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), delay)

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


def _size(record: Any) -> int:
    return len(record.key or b"") + len(record.value or b"")


def _origin(record: Any) -> str:
    return f"kafka:{record.topic}/{record.partition}@{record.offset}"


def _letter(record: Any, reason: str, max_bytes: int) -> DeadLetter:
    """The record as a dead letter: its own key and bytes, or an envelope when too large."""
    position = SourcePosition(record.topic, record.partition, record.offset)
    key, value = fit_dead_letter(
        record.key,
        record.value,
        reason,
        source=(record.topic, record.partition, record.offset),
        max_bytes=max_bytes,
    )
    return DeadLetter(key, value, reason, position)


# -- builders ---------------------------------------------------------------------------


def build_consumer(
    store: FeedbackStore,
    config: FeedbackConfig,
    bootstrap_servers: str,
    *,
    known_agents: KnownAgents | None = None,
    **options: Any,
) -> FeedbackConsumer:
    """A consumer wired from configuration; `options` (e.g. session timeouts) override it."""
    kafka = config.kafka
    configured: dict[str, Any] = {
        "topics": kafka.topics,
        "dead_letter_topic": kafka.dead_letter_topic,
        "group_id": kafka.group_id,
        "max_batch": kafka.max_batch,
        "park_ttl_s": config.park_ttl_s,
        "max_parked_per_agent": config.max_parked_per_agent,
        "max_record_bytes": kafka.max_record_bytes,
        "dead_letter_max_bytes": kafka.dead_letter_max_bytes,
        "retry_initial_s": kafka.retry_initial_s,
        "retry_max_s": kafka.retry_max_s,
        "rejoin_interval_s": config.rejoin_interval_s,
        "session_timeout_ms": kafka.session_timeout_ms,
        "heartbeat_interval_ms": kafka.heartbeat_interval_ms,
        "commit_delay_s": kafka.commit_delay_s,
        "client_options": kafka_client_options(kafka),
    }
    return FeedbackConsumer(
        store, bootstrap_servers, known_agents=known_agents, **{**configured, **options}
    )
