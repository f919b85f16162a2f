"""Feedback ingest: the one component that applies events, rejoins parked ones, dead-letters.

Both paths into the feedback store go through a `FeedbackIngest`:

    webhook (no Kafka, or the embedded broker) --\\
                                                  >-- FeedbackIngest.apply --> FeedbackStore
    Kafka topics -> FeedbackConsumer ------------/         |
                                                           +-- rejoin loop (parked events)
                                                           +-- DeadLetterSink

`apply` writes a batch in one store transaction on a worker thread, retrying a
busy store (`retriable` errors) with backoff, and caps the parked events of each
agent (`max_parked_per_agent`): beyond it the webhook's batch is refused whole
(`OverloadedError`, 429 with `Retry-After`) and a Kafka event is rejected with
reason `parked_limit`, which its consumer dead-letters. `start` runs the one
rejoin loop: every `rejoin_interval_s` the store's bounded passes join the parked
events that newly stored trajectories complete (never a scan of the backlog),
and those older than `park_ttl_s` (or found invalid when joined) die. A dead
event has the same outcome on both paths:

1. the store marks it `dead` with its reason, in the rejoin transaction: this
   durable row is the record of truth (`FeedbackStore.event_state`);
2. the sink gets a `DeadLetter` for it: `KafkaDeadLetters` produces it to the
   dead-letter topic when a cluster is there (operators already watch that
   topic for malformed records), `LogDeadLetters` writes one structured log
   record otherwise. The log suffices there because step 1 already made the
   record durable; a second durable copy in a file would only drift from it.

Malformed Kafka records (never stored) reach the same sink with their source
position, so the dead-letter topic carries every record the ingest gave up on.

Not here: decoding Kafka records (`records`), polling and committing (`kafka`),
HTTP validation (`clora_feedback.gateway.feedback`), the join itself (`store`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from aiokafka.errors import KafkaError

from clora_feedback.errors import CloraError, OverloadedError, StoreError, UnavailableError
from clora_feedback.feedback.records import (
    HEADER_REASON,
    HEADER_SOURCE_OFFSET,
    HEADER_SOURCE_PARTITION,
    HEADER_SOURCE_TOPIC,
    MAX_REASON_CHARS,
    close_quietly,
    kafka_error,
    start_producer,
)
from clora_feedback.feedback.store import (
    ApplyReport,
    FeedbackStore,
    Incoming,
    ParkedLimit,
    Rejected,
)
from clora_feedback.lifecycle import BackgroundTask

log = logging.getLogger(__name__)

DEFAULT_MAX_PARKED = 1000
"""`feedback.max_parked_per_agent`'s default, for ingests built without settings."""


# -- value types --------------------------------------------------------------------------


@dataclass(frozen=True)
class SourcePosition:
    """Where a dead record was read from (absent for a parked event: long committed)."""

    topic: str
    partition: int
    offset: int


@dataclass(frozen=True)
class DeadLetter:
    """One record the ingest gave up on."""

    key: bytes | None
    """The record key: the agent's name for an event, or a malformed record's own key."""
    value: bytes | None
    """The original bytes (malformed record) or the event as stored (dead parked event)."""
    reason: str
    """Why it was given up on (shown to operators, cut to `MAX_REASON_CHARS`)."""
    source: SourcePosition | None = None
    """The Kafka position it came from; None for a parked event."""

    @classmethod
    def of_rejected(cls, rejected: Rejected) -> DeadLetter:
        """A dead (expired or invalid) parked event, keyed by its agent like any record."""
        return cls(_agent_key(rejected.payload), rejected.payload.encode(), rejected.reason)


@dataclass
class IngestMetrics:
    """Counters of what the ingest did (events, since it was created)."""

    applied: int = 0
    """Events joined to their trajectories when they arrived."""
    parked: int = 0
    """Events parked because a completion they name was not stored yet."""
    rejoined: int = 0
    """Parked events joined later."""
    duplicates: int = 0
    """Events whose `event_id` was already applied (replays, resends)."""
    rejected: int = 0
    """Valid events the store refused (e.g. another agent's completion)."""
    expired: int = 0
    """Parked events that outlived the TTL (or turned out invalid when joined)."""
    over_parked_limit: int = 0
    """Events refused because their agent already had `max_parked_per_agent` parked."""
    rejoin_examined: int = 0
    """Parked events the rejoin passes loaded and tried (follows arrivals, not the backlog)."""
    dead_lettered: int = 0
    """Records handed to the dead-letter sink."""

    def as_dict(self) -> dict[str, int | None]:
        return asdict(self)


# -- dead-letter sinks --------------------------------------------------------------------


class DeadLetterSink(Protocol):
    """Where given-up records go. `dead_letter` returns once they are safely there."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def dead_letter(self, letters: Sequence[DeadLetter]) -> None:
        """Record `letters`; raise a retriable `CloraError` if they could not be recorded."""
        ...


class LogDeadLetters:
    """Dead letters as one structured WARNING record each (`extra={"dead_letter": {...}}`)."""

    def __init__(self, logger: logging.Logger | None = None) -> None:
        self._log = logger or log

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    async def dead_letter(self, letters: Sequence[DeadLetter]) -> None:
        for letter in letters:
            fields = _letter_fields(letter)
            self._log.warning(
                "dead-lettered %s: %s",
                fields.get("event_id") or _where(letter),
                letter.reason,
                extra={"dead_letter": fields},
            )


class KafkaDeadLetters:
    """Dead letters produced to `topic` (`acks=all`), headers as in `connectors/topics.json`.

    Args:
        bootstrap_servers: the cluster; may be set later (before `start`) when the
            cluster is a broker the service starts itself.
        topic: the dead-letter topic.
        client_id: client id shown by the broker.
        client_options: more aiokafka producer arguments: security and the size
            limit (`clora_feedback.feedback.records.dead_letter_options`).
    """

    def __init__(
        self,
        bootstrap_servers: str | None,
        topic: str,
        *,
        client_id: str = "clora-feedback-ingest-dlq",
        client_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.bootstrap_servers = bootstrap_servers
        self.topic = topic
        self._client_id = client_id
        self._client_options = dict(client_options or {})
        self._producer: Any = None

    async def start(self) -> None:
        """Connect. Raises `UnavailableError` when the cluster cannot be reached."""
        if self.bootstrap_servers is None:
            raise CloraError("no bootstrap servers for the dead-letter topic", code="not_started")
        self._producer = await start_producer(
            self.bootstrap_servers, client_id=self._client_id, **self._client_options
        )

    async def stop(self) -> None:
        producer, self._producer = self._producer, None
        if producer is not None:
            await close_quietly(producer.stop())

    async def dead_letter(self, letters: Sequence[DeadLetter]) -> None:
        if not letters:
            return
        if self._producer is None:
            raise CloraError("the dead-letter producer is not started", code="not_started")
        try:
            pending = [
                await self._producer.send(self.topic, value=d.value, key=d.key, headers=_headers(d))
                for d in letters
            ]
            await asyncio.gather(*pending)
        except KafkaError as exc:
            raise kafka_error(f"produce to {self.topic}", exc) from exc
        for letter in letters:
            log.info("dead-lettered %s: %s", _where(letter), letter.reason)


def _headers(letter: DeadLetter) -> list[tuple[str, bytes]]:
    headers = [(HEADER_REASON, letter.reason[:MAX_REASON_CHARS].encode())]
    if letter.source is not None:
        headers += [
            (HEADER_SOURCE_TOPIC, letter.source.topic.encode()),
            (HEADER_SOURCE_PARTITION, str(letter.source.partition).encode()),
            (HEADER_SOURCE_OFFSET, str(letter.source.offset).encode()),
        ]
    return headers


def _letter_fields(letter: DeadLetter) -> dict[str, Any]:
    fields: dict[str, Any] = {"reason": letter.reason[:MAX_REASON_CHARS]}
    if letter.key is not None:
        fields["key"] = letter.key.decode("utf-8", errors="replace")
    if letter.source is not None:
        fields["source"] = asdict(letter.source)
    with contextlib.suppress(ValueError, KeyError, TypeError):  # a malformed record has none
        fields["event_id"] = json.loads(letter.value or b"")["event_id"]
    return fields


def _where(letter: DeadLetter) -> str:
    s = letter.source
    return f"kafka:{s.topic}/{s.partition}@{s.offset}" if s else "parked event"


def _agent_key(payload: str) -> bytes | None:
    try:
        return str(json.loads(payload)["agent"]).encode()
    except (ValueError, KeyError, TypeError):
        return None


# -- the component ------------------------------------------------------------------------


class FeedbackIngest(BackgroundTask):
    """Applies feedback to a `FeedbackStore`, rejoins parked events, dead-letters the rest.

    Args:
        store: the feedback store (shared SQLite with the trajectories).
        dead_letters: where dead events go (started and stopped with this component).
        park_ttl_s: how long a parked event waits for its trajectory.
        rejoin_interval_s: pause between rejoin rounds of the loop `start` runs.
        max_parked_per_agent: most parked events one agent may have; None = no cap.
        metrics: the counters to update (a consumer passes its own, which extend these).

    Lifecycle: `await start()` (or `async with`) opens the sink and runs the
    rejoin loop; `stop()` ends the loop, then closes the sink. `apply` and
    `rejoin_parked` work between the two.
    """

    task_name = "clora-feedback-rejoin"

    def __init__(
        self,
        store: FeedbackStore,
        dead_letters: DeadLetterSink,
        *,
        park_ttl_s: float,
        rejoin_interval_s: float = 2.0,
        max_parked_per_agent: int | None = DEFAULT_MAX_PARKED,
        metrics: IngestMetrics | None = None,
    ) -> None:
        self.store = store
        self.dead_letters = dead_letters
        self.park_ttl_s = park_ttl_s
        self.rejoin_interval_s = rejoin_interval_s
        self.max_parked_per_agent = max_parked_per_agent
        self.metrics = metrics if metrics is not None else IngestMetrics()

    async def start(self) -> None:
        await self.dead_letters.start()
        await super().start()

    async def stop(self) -> None:
        await super().stop()
        await self.dead_letters.stop()

    async def apply(
        self, incoming: Sequence[Incoming], attempts: int = 3, *, refuse_over_limit: bool = False
    ) -> ApplyReport:
        """Apply a batch in one store transaction (worker thread); retry a busy store.

        Args:
            incoming: the events.
            attempts: tries while the store is busy.
            refuse_over_limit: an event beyond its agent's parked cap refuses the whole
                batch (the webhook); by default only that event is rejected (Kafka).

        Raises:
            StoreError, UnavailableError: the store failed for good (nothing applied).
            OverloadedError: `refuse_over_limit` and the cap was reached (code
                `parked_limit`, `retry_after_s` set; nothing applied).
        """
        if not incoming:
            return ApplyReport()
        limit = None
        if self.max_parked_per_agent is not None:
            # The next rejoin round is the first moment a place may free up.
            retry = max(1.0, self.rejoin_interval_s)
            limit = ParkedLimit(self.max_parked_per_agent, refuse_over_limit, retry)
        for attempt in range(attempts):
            try:
                report = await asyncio.to_thread(self.store.apply, list(incoming), limit=limit)
            except OverloadedError:
                self.metrics.over_parked_limit += 1
                raise
            except (StoreError, UnavailableError) as exc:
                if not exc.retriable or attempt == attempts - 1:
                    raise
                log.warning("feedback store busy (%s); retrying the batch", exc.message)
                await asyncio.sleep(0.5 * 2**attempt)
                continue
            self._count(report)
            return report
        raise AssertionError("unreachable")

    async def rejoin_parked(self, *, now: float | None = None) -> tuple[list[str], list[Rejected]]:
        """One round: bounded store passes until none has more work; dead-letter the dead.

        Each pass is its own short transaction on a worker thread, so webhook and
        Kafka batches interleave with a long catch-up instead of waiting for it.

        Returns:
            (event ids joined now, events that died with their reasons).
        """
        joined: list[str] = []
        dead: list[Rejected] = []
        while True:
            report = await asyncio.to_thread(self.store.rejoin, ttl_s=self.park_ttl_s, now=now)
            self.metrics.rejoined += len(report.joined)
            self.metrics.expired += len(report.dead)
            self.metrics.rejoin_examined += report.examined
            await self.dead_letter([DeadLetter.of_rejected(r) for r in report.dead])
            joined += report.joined
            dead += report.dead
            if not report.more:
                return joined, dead

    async def dead_letter(self, letters: Sequence[DeadLetter]) -> None:
        """Hand `letters` to the sink and count them (raises what the sink raises)."""
        if not letters:
            return
        await self.dead_letters.dead_letter(letters)
        self.metrics.dead_lettered += len(letters)

    def _count(self, report: ApplyReport) -> None:
        self.metrics.applied += len(report.joined)
        self.metrics.parked += len(report.parked)
        self.metrics.duplicates += len(report.duplicates)
        self.metrics.rejected += len(report.rejected)
        self.metrics.over_parked_limit += sum(r.code == "parked_limit" for r in report.rejected)

    async def _run(self) -> None:
        while True:
            try:
                await self.rejoin_parked()
            except CloraError as exc:
                # A locked database or an unreachable DLQ: the store's dead rows are already
                # durable, so the next round only retries what is still parked.
                log.error("retrying parked feedback failed: %s", exc.message)
            await asyncio.sleep(self.rejoin_interval_s)
