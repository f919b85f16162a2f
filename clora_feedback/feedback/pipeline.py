"""The feedback path of `clora serve`: one `FeedbackIngest`, and the Kafka side when there is one.

    settings.feedback.kafka          ingest's dead letters   webhook delivers by
    bootstrap_servers set            DLQ topic               producing (durable log)
    none, embedded_broker (default)  DLQ topic (local)       applying to the store
    none, embedded_broker false      structured log          applying to the store

With a cluster, the webhook produces every event to the topics and the
consumer group applies them: every piece of feedback flows through the log.
With none, the embedded default starts a local Tansu broker for outside
producers (on `feedback.kafka.embedded_broker_port`: unset, 9092 when free, else
any free port; `bootstrap` says which, `/health` shows it to the admin key)
and the webhook writes straight to the store: this Tansu build keeps
its log in memory only, so an event acknowledged through it could be lost
with the process, while the store's commit is durable.

Serving does not wait for the consumer group: `start` starts the broker (when
embedded), the producer (which proves the cluster reachable) and the ingest,
then the consumer connects and joins its group in the background (about 5 s
on the embedded broker, longer while a group rebalances). Records produced
meanwhile are consumed once it has joined (a new group reads from the
earliest offset); `joined` is set then.

Either way there is exactly one `FeedbackIngest`, shared by the webhook and
the consumer, so there is one rejoin loop and an expired parked event has
one outcome whichever path brought it.

Not here: the consumer's batch semantics (`kafka`), HTTP (`clora_feedback.gateway.feedback`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Collection
from pathlib import Path

from clora_feedback.config import FeedbackConfig
from clora_feedback.errors import CloraError, ConfigError, StoreError
from clora_feedback.feedback.broker import LocalBroker
from clora_feedback.feedback.ingest import FeedbackIngest, KafkaDeadLetters, LogDeadLetters
from clora_feedback.feedback.kafka import ConsumerMetrics, FeedbackConsumer, build_consumer
from clora_feedback.feedback.records import (
    Delivery,
    FeedbackProducer,
    build_producer,
    dead_letter_options,
)
from clora_feedback.feedback.store import FeedbackStore
from clora_feedback.schemas.feedback import Event

log = logging.getLogger(__name__)

KAFKA_PORT = 9092
"""The embedded broker's port when `feedback.kafka.embedded_broker_port` is unset and it is free."""


class FeedbackPipeline:
    """A local broker when needed, the webhook's producer, the consumer group, the ingest.

    Args:
        config: the feedback settings (`kafka`, `park_ttl_s`, `max_parked_per_agent`).
        store: the feedback store every path applies to.
        known_agents: the accepted agent names (asked once per consumed batch).
        broker_dir: where an embedded broker keeps its files.
    """

    def __init__(
        self,
        config: FeedbackConfig,
        store: FeedbackStore,
        known_agents: Callable[[], Collection[str]],
        *,
        broker_dir: Path,
    ) -> None:
        self.config = config
        self.store = store
        self.broker_dir = broker_dir
        self._known_agents = known_agents
        self.broker: LocalBroker | None = None
        self.producer: FeedbackProducer | None = None
        self.consumer: FeedbackConsumer | None = None
        self.metrics = ConsumerMetrics()
        self._dlq: KafkaDeadLetters | None = None
        if self.enabled:
            kafka = config.kafka
            self._dlq = KafkaDeadLetters(
                kafka.bootstrap_servers,
                kafka.dead_letter_topic,
                client_options=dead_letter_options(kafka),
            )
        self.ingest = FeedbackIngest(
            store,
            self._dlq or LogDeadLetters(),
            park_ttl_s=config.park_ttl_s,
            rejoin_interval_s=config.rejoin_interval_s,
            max_parked_per_agent=config.max_parked_per_agent,
            metrics=self.metrics,
        )
        self._task: asyncio.Task[None] | None = None
        self._join: asyncio.Task[None] | None = None
        self._closing = False
        self.joined = asyncio.Event()
        """Set once the consumer has joined its group (never without a Kafka side)."""

    @property
    def enabled(self) -> bool:
        """Whether there is a Kafka side (a configured cluster or the embedded broker)."""
        kafka = self.config.kafka
        return kafka.bootstrap_servers is not None or kafka.embedded_broker

    @property
    def durable_log(self) -> bool:
        """Whether producing to the log is as durable as writing the store (a real cluster)."""
        return self.config.kafka.bootstrap_servers is not None

    @property
    def bootstrap(self) -> str | None:
        """Where outside producers send feedback: the configured cluster, or the embedded
        broker's address while it runs; None when there is no Kafka side."""
        if self.config.kafka.bootstrap_servers is not None:
            return self.config.kafka.bootstrap_servers
        return self.broker.bootstrap if self.broker is not None and self.broker.running else None

    async def start(self) -> None:
        """Start the broker (if embedded), the producer, the consumer, then the ingest."""
        bootstrap = await self._bootstrap() if self.enabled else None
        if self._dlq is not None:
            self._dlq.bootstrap_servers = bootstrap  # known only now for an embedded broker
        await self.ingest.start()  # before the consumer: its batches dead-letter through it
        if bootstrap is not None:
            producer = build_producer(self.config.kafka, bootstrap)
            await producer.start()
            self.producer = producer
            consumer = build_consumer(
                self.store,
                self.config,
                bootstrap,
                known_agents=self._known_agents,
                ingest=self.ingest,
                metrics=self.metrics,
            )
            self.consumer = consumer
            self._closing = False
            self._join = asyncio.create_task(
                self._start_consumer(consumer), name="clora-feedback-join"
            )
            self._task = asyncio.create_task(
                self._consume(consumer, self._join), name="clora-feedback-consumer"
            )

    async def _start_consumer(self, consumer: FeedbackConsumer) -> None:
        """Connect and join the group, retrying every second until it works or `stop`."""
        t0 = time.perf_counter()
        while not self._closing:
            try:
                await consumer.start()
            except CloraError as exc:
                log.error("feedback consumer: %s; retrying in 1 s", exc.message)
                await asyncio.sleep(1.0)
                continue
            self.joined.set()
            log.info("feedback consumer joined its group in %.1f s", time.perf_counter() - t0)
            return

    async def _bootstrap(self) -> str:
        kafka = self.config.kafka
        if kafka.bootstrap_servers is not None:
            return kafka.bootstrap_servers
        broker = LocalBroker(
            self.broker_dir,
            topics=(*kafka.topics, kafka.dead_letter_topic),
            partitions=3,
            port=kafka.embedded_broker_port,
            preferred_port=KAFKA_PORT,
        )
        try:
            await broker.astart()
        except CloraError as exc:
            if exc.code != "broker_port_in_use":
                raise
            raise ConfigError(
                f"{exc.message}: set feedback.kafka.embedded_broker_port to a free port, or "
                "leave it unset for 9092 when free, else any free port",
                code="broker_port_in_use",
            ) from exc
        self.broker = broker
        log.info("embedded Kafka-protocol broker (Tansu) on %s", broker.bootstrap)
        return broker.bootstrap

    async def _consume(self, consumer: FeedbackConsumer, join: asyncio.Task[None]) -> None:
        """Keep the consumer running: a failed batch was not committed, so it replays."""
        await asyncio.shield(join)  # cancelling this task leaves the join to `stop`
        if not self.joined.is_set():
            return
        while True:
            try:
                await consumer.run()
                return
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception(
                    "feedback consumer failed; retrying in 1 s (uncommitted records replay)"
                )
                await asyncio.sleep(1.0)

    async def send(self, event: Event) -> Delivery:
        """`FeedbackSink` for the webhook: produce to the event's topic, acked by the cluster."""
        if self.producer is None:
            raise StoreError("the feedback pipeline is not started", code="not_started")
        return await self.producer.send(event)

    async def stop(self) -> None:
        """Stop in reverse: consumer, ingest, producer, broker (each only if started)."""
        self._closing = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task  # the consumer's own errors were logged by it
        if self._join is not None:
            # A join in progress is awaited, not cancelled: a consumer cancelled inside its
            # start would be left open; it ends within one attempt once `_closing` is set.
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._join
        if self.consumer is not None:
            await self.consumer.stop()
        await self.ingest.stop()
        if self.producer is not None:
            await self.producer.stop()
        if self.broker is not None:
            await self.broker.astop()
