"""Kafka connector: feedback events from topics into the feedback store, exactly once in effect.

`FeedbackConsumer` is one member of a consumer group on the feedback topics.
For every polled batch (at most `max_batch` records) it:

1. decodes each record; bad UTF-8, bad JSON, a schema violation, a key that is
   not the event's agent or an unknown agent make it *malformed*;
2. applies the valid events in one SQLite transaction (`FeedbackStore.apply`,
   on a worker thread), which dedupes by `event_id` and parks events whose
   completion is not stored yet;
3. produces every malformed record, and every event the store refused, to the
   dead-letter topic: original key and bytes, reason and source in headers
   (see `connectors/topics.json`), and waits for the acks;
4. only then commits, per partition, the offset after the last record.

A crash anywhere before step 4 replays the batch; replayed events are
duplicates by `event_id` and change nothing, so delivery is at-least-once and
the effect exactly-once (a replay can dead-letter the same bad record twice).
On a rebalance the revoked partitions wait for the in-flight batch to commit.
Parked events are retried every `rejoin_interval_s`; those older than the TTL
are dead-lettered with only the `clora.reason` header (their original record
is long committed; the value is the event as stored).

The record format and `FeedbackProducer` live in `records` and are
re-exported here. `python -m clora_feedback.feedback.kafka --db PATH --bootstrap HOST:PORT` runs
one consumer until SIGTERM/SIGINT. Not here: the broker (`broker`), the store.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener
from aiokafka.errors import CommitFailedError, IllegalStateError, KafkaError

from clora_feedback.config import FeedbackConfig, KafkaConfig, load_settings
from clora_feedback.errors import CloraError, InvalidRequestError, StoreError, UnavailableError
from clora_feedback.feedback.records import (
    HEADER_REASON,
    HEADER_SOURCE_OFFSET,
    HEADER_SOURCE_PARTITION,
    HEADER_SOURCE_TOPIC,
    MAX_REASON_CHARS,
    Delivery,
    FeedbackProducer,
    build_producer,
    close_quietly,
    decode_record,
    kafka_error,
)
from clora_feedback.feedback.rewards import RewardPolicy
from clora_feedback.feedback.store import ApplyReport, FeedbackStore, Incoming, Rejected
from clora_feedback.lifecycle import AsyncLifecycle
from clora_feedback.schemas.feedback import Correction, Resolution, Reward

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
    "main",
]

Event = Correction | Resolution | Reward
KnownAgents = Callable[[], Collection[str]]
_DEFAULTS = KafkaConfig()

log = logging.getLogger(__name__)


# -- value types -------------------------------------------------------------------------


@dataclass
class ConsumerMetrics:
    """Counters since the consumer was created (events, unless named records)."""

    records: int = 0
    """Records polled."""
    batches: int = 0
    """Batches applied and committed."""
    applied: int = 0
    """Events joined to their trajectories when they arrived."""
    parked: int = 0
    """Events parked because a completion they name was not stored yet."""
    rejoined: int = 0
    """Parked events joined later."""
    duplicates: int = 0
    """Events whose `event_id` was already applied (replays, resends)."""
    malformed: int = 0
    """Records that did not decode to a valid event of a known agent."""
    rejected: int = 0
    """Valid events the store refused (e.g. another agent's completion)."""
    expired: int = 0
    """Parked events that outlived the TTL (or turned out invalid when joined)."""
    dead_lettered: int = 0
    """Records produced to the dead-letter topic."""
    commit_failures: int = 0
    """Batches applied but not committed (the group moved on); they replay harmlessly."""
    lag: int | None = None
    """Records behind the high watermarks after the last batch (None until known)."""

    def as_dict(self) -> dict[str, int | None]:
        return asdict(self)


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
    """A consumer-group member that applies feedback records to a `FeedbackStore`.

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
        rejoin_interval_s: How often parked events are retried by `run`.
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
        self.park_ttl_s = park_ttl_s
        self.rejoin_interval_s = rejoin_interval_s
        self.poll_timeout_ms = poll_timeout_ms
        self.commit_delay_s = commit_delay_s
        self.metrics = ConsumerMetrics()
        self._known_agents = known_agents
        self._client_args: dict[str, Any] = {
            "session_timeout_ms": session_timeout_ms,
            "heartbeat_interval_ms": heartbeat_interval_ms,
            "rebalance_timeout_ms": rebalance_timeout_ms,
            "fetch_max_wait_ms": fetch_max_wait_ms,
            "client_id": client_id,
        }
        self._consumer: Any = None
        self._producer: Any = None
        # Held from the moment a batch is taken until its offsets are committed; a
        # revocation waits on it so the batch commits while the partitions are still ours.
        self._batch_lock = asyncio.Lock()
        self._closing = False
        self._running: asyncio.Event | None = None
        self._positions: dict[Any, int] = {}

    # -- lifecycle --------------------------------------------------------------------

    async def start(self) -> None:
        """Connect, join the group (in the background) and open the dead-letter producer.

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
        producer = AIOKafkaProducer(
            bootstrap_servers=self.bootstrap_servers,
            acks="all",
            client_id=f"{self._client_args['client_id']}-dlq",
        )
        try:
            await producer.start()
            await consumer.start()
        except KafkaError as exc:
            await close_quietly(producer.stop())
            await close_quietly(consumer.stop())
            raise kafka_error(f"connect to {self.bootstrap_servers}", exc) from exc
        self._consumer, self._producer, self._closing = consumer, producer, False

    async def stop(self) -> None:
        """Finish and commit the in-flight batch, leave the group, disconnect; idempotent."""
        self._closing = True
        if self._running is not None:
            await self._running.wait()  # `run` notices `_closing` within one poll timeout
        async with self._batch_lock:
            consumer, producer, self._consumer, self._producer = (
                self._consumer,
                self._producer,
                None,
                None,
            )
        if consumer is not None:
            await close_quietly(consumer.stop())
        if producer is not None:
            await close_quietly(producer.stop())

    async def run(self) -> None:
        """Poll, apply, dead-letter and commit until `stop`; retry parked events on the way.

        Raises:
            StoreError, UnavailableError: the store or the cluster failed for good; the batch in
                flight was not committed and replays on the next start.
        """
        self._require_started()
        self._running = asyncio.Event()
        next_rejoin = time.monotonic()
        try:
            while not self._closing:
                if time.monotonic() >= next_rejoin:
                    await self.rejoin_parked()
                    next_rejoin = time.monotonic() + self.rejoin_interval_s
                await self.poll_once()
        finally:
            self._running.set()
            self._running = None

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
        """Retry parked events once; dead-letter those past the TTL.

        Returns:
            (event ids joined now, events that died with their reasons).
        """
        joined, dead = await asyncio.to_thread(
            self.store.rejoin_parked, ttl_s=self.park_ttl_s, now=now
        )
        self.metrics.rejoined += len(joined)
        self.metrics.expired += len(dead)
        if dead:
            await self._dead_letter(
                [(_agent_key(r.payload), r.payload.encode(), r.reason, None) for r in dead]
            )
        return joined, dead

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

        report = await self._apply([Incoming(e, _origin(r)) for r, e in valid])
        refused = {(r.event_id, r.payload): r.reason for r in report.rejected}
        if refused:
            for record, event in valid:
                reason = refused.get((event.event_id, event.model_dump_json()))
                if reason is not None:
                    bad.append((record, f"refused by the store: {reason}"))
        self.metrics.applied += len(report.joined)
        self.metrics.parked += len(report.parked)
        self.metrics.duplicates += len(report.duplicates)
        self.metrics.rejected += len(report.rejected)

        await self._dead_letter([(r.key, r.value, reason, r) for r, reason in bad])
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

    async def _apply(self, incoming: list[Incoming], attempts: int = 3) -> ApplyReport:
        if not incoming:
            return ApplyReport()
        for attempt in range(attempts):
            try:
                return await asyncio.to_thread(self.store.apply, incoming)
            except (StoreError, UnavailableError) as exc:
                if not exc.retriable or attempt == attempts - 1:
                    raise
                log.warning("feedback store busy (%s); retrying the batch", exc.message)
                await asyncio.sleep(0.5 * 2**attempt)
        raise AssertionError("unreachable")

    async def _dead_letter(self, items: list[tuple[bytes | None, bytes | None, str, Any]]) -> None:
        """Produce (key, value, reason, source record or None) to the DLQ; wait for every ack."""
        if not items:
            return
        try:
            pending = []
            for key, value, reason, source in items:
                headers = [(HEADER_REASON, reason[:MAX_REASON_CHARS].encode())]
                if source is not None:
                    headers += [
                        (HEADER_SOURCE_TOPIC, source.topic.encode()),
                        (HEADER_SOURCE_PARTITION, str(source.partition).encode()),
                        (HEADER_SOURCE_OFFSET, str(source.offset).encode()),
                    ]
                pending.append(
                    await self._producer.send(
                        self.dead_letter_topic, value=value, key=key, headers=headers
                    )
                )
            await asyncio.gather(*pending)
        except KafkaError as exc:
            raise kafka_error(f"produce to {self.dead_letter_topic}", exc) from exc
        self.metrics.dead_lettered += len(items)
        for _, _, reason, source in items:
            log.info("dead-lettered %s: %s", _origin(source) if source else "parked event", reason)

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
        async with self._owner._batch_lock:
            pass
        self._owner._positions = {
            tp: o for tp, o in self._owner._positions.items() if tp not in revoked
        }
        log.info("partitions revoked: %s", sorted(f"{t.topic}/{t.partition}" for t in revoked))

    async def on_partitions_assigned(self, assigned: Any) -> None:
        log.info("partitions assigned: %s", sorted(f"{t.topic}/{t.partition}" for t in assigned))


def _origin(record: Any) -> str:
    return f"kafka:{record.topic}/{record.partition}@{record.offset}"


def _agent_key(payload: str) -> bytes | None:
    try:
        return str(json.loads(payload)["agent"]).encode()
    except (ValueError, KeyError, TypeError):
        return None


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


# -- process entry ------------------------------------------------------------------------


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m clora_feedback.feedback.kafka",
        description="Consume feedback topics into the feedback store until SIGTERM/SIGINT.",
    )
    p.add_argument("--db", type=Path, required=True, help="SQLite database (trajectories.db)")
    p.add_argument("--bootstrap", required=True, help="Kafka bootstrap servers host:port[,...]")
    p.add_argument("--config", type=Path, help="settings file (JSON/YAML) for topics and rewards")
    p.add_argument("--group-id", help="consumer group (default from settings)")
    p.add_argument("--max-batch", type=int, help="records per transaction (default from settings)")
    p.add_argument("--agents", help="comma-separated accepted agents (default: settings, or any)")
    p.add_argument("--park-ttl-s", type=float, help="parked-event TTL (default from settings)")
    p.add_argument("--rejoin-interval-s", type=float, default=2.0)
    p.add_argument("--session-timeout-ms", type=int, default=10_000)
    p.add_argument("--heartbeat-interval-ms", type=int, default=3_000)
    p.add_argument("--commit-delay-s", type=float, default=0.0, help="fault injection (tests)")
    p.add_argument("--log-level", default="INFO")
    return p.parse_args(argv)


async def _serve(args: argparse.Namespace) -> ConsumerMetrics:
    settings = load_settings(args.config)
    feedback = settings.feedback
    kafka = feedback.kafka.model_copy(
        update={
            k: v
            for k, v in (("group_id", args.group_id), ("max_batch", args.max_batch))
            if v is not None
        }
    )
    if args.park_ttl_s is not None:
        feedback = feedback.model_copy(update={"park_ttl_s": args.park_ttl_s})
    feedback = feedback.model_copy(update={"kafka": kafka})
    names = (
        {a for a in args.agents.split(",") if a}
        if args.agents
        else {a.name for a in settings.agents}
    )
    store = FeedbackStore(args.db, RewardPolicy(feedback))
    consumer = build_consumer(
        store,
        feedback,
        args.bootstrap,
        known_agents=(lambda: names) if names else None,
        rejoin_interval_s=args.rejoin_interval_s,
        session_timeout_ms=args.session_timeout_ms,
        heartbeat_interval_ms=args.heartbeat_interval_ms,
        commit_delay_s=args.commit_delay_s,
    )
    stop_requested = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop_requested.set)
    try:
        async with consumer:
            log.info("consuming %s as group %s", ", ".join(consumer.topics), consumer.group_id)
            run = asyncio.create_task(consumer.run())
            stopper = asyncio.create_task(stop_requested.wait())
            await asyncio.wait({run, stopper}, return_when=asyncio.FIRST_COMPLETED)
            stopper.cancel()
        await run  # re-raises what ended the loop, if it was not a stop
    finally:
        store.close()
    return consumer.metrics


def main(argv: Sequence[str] | None = None) -> int:
    """Run one consumer; prints its metrics as JSON on exit. Returns the exit status."""
    args = _parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        metrics = asyncio.run(_serve(args))
    except CloraError as exc:
        log.error("feedback consumer failed: %s", exc.message)
        return 1
    print(json.dumps(metrics.as_dict()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
