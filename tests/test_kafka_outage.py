"""A store outage under the Kafka consumer loses nothing (real Tansu broker, real SQLite).

The outage is injected at the store seam: `OutageStore` is the real feedback
store whose `apply` raises what a locked or failing SQLite raises while the
outage lasts (a real `BEGIN IMMEDIATE` lock would need the store's 30 s busy
timeout to run out three times per batch). The consumer runs under a restart
loop like `clora serve`'s, so a consumer that dies and restarts past the
failed batch would show up as lost events.
"""

from __future__ import annotations

import asyncio
import itertools
import sqlite3
import threading
from collections import Counter
from collections.abc import Sequence
from typing import Any

from kafka_fixtures import (
    KAFKA,
    committed_offsets,
    feedback_store,
    kafka_broker,
    produce,
    store_trajectory,
    wait_until,
)

from clora_feedback.errors import StoreError
from clora_feedback.feedback.broker import LocalBroker
from clora_feedback.feedback.kafka import FeedbackConsumer
from clora_feedback.feedback.store import ApplyReport, FeedbackStore, Incoming
from clora_feedback.schemas.feedback import Reward

__all__ = ["feedback_store", "kafka_broker"]  # fixtures, imported for pytest

AGENTS = [f"agent-{i}" for i in range(6)]  # keys spread over the three partitions
GROUP = "outage-test"


class OutageStore:
    """The real store; while `down` is set, `apply` fails the way a sick SQLite does."""

    def __init__(self, store: FeedbackStore) -> None:
        self._store = store
        self.down = threading.Event()
        self.failed_applies = 0
        self._errors = itertools.cycle(
            [
                lambda: sqlite3.OperationalError("database is locked"),
                lambda: StoreError("feedback store write failed: database is locked"),
                lambda: OSError(28, "No space left on device"),
            ]
        )

    def apply(self, batch: Sequence[Incoming], **kwargs: Any) -> ApplyReport:
        if self.down.is_set():
            self.failed_applies += 1
            raise next(self._errors)()
        return self._store.apply(batch, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def rewards(ids: range) -> list[tuple[str, bytes, bytes]]:
    events = [
        Reward(
            event_id=f"ev-{i}",
            agent=AGENTS[i % len(AGENTS)],
            completion_id=f"chatcmpl-{AGENTS[i % len(AGENTS)]}",
            source="ci",
            value=i / 100,
        )
        for i in ids
    ]
    return [(KAFKA.rewards_topic, e.agent.encode(), e.model_dump_json().encode()) for e in events]


async def supervised(consumer: FeedbackConsumer, restarts: list[BaseException]) -> None:
    """What `clora serve` does with its consumer: run it again whenever `run` raises."""
    while True:
        try:
            await consumer.run()
            return
        except Exception as exc:
            restarts.append(exc)
            await asyncio.sleep(0.1)


async def test_store_outage_loses_nothing_and_commits_nothing_past_it(
    kafka_broker: LocalBroker, feedback_store: FeedbackStore
) -> None:
    for agent in AGENTS:
        store_trajectory(feedback_store.trajectories, f"chatcmpl-{agent}", agent)
    store = OutageStore(feedback_store)
    consumer = FeedbackConsumer(
        store,  # type: ignore[arg-type]  # the store seam, duck-typed
        kafka_broker.bootstrap,
        group_id=GROUP,
        max_batch=10,
        session_timeout_ms=2000,
        heartbeat_interval_ms=300,
        poll_timeout_ms=200,
        rejoin_interval_s=0.2,
        retry_initial_s=0.05,
        retry_max_s=0.2,
    )
    restarts: list[BaseException] = []
    await produce(kafka_broker.bootstrap, rewards(range(0, 30)))
    await consumer.start()
    task = asyncio.create_task(supervised(consumer, restarts))
    try:
        await wait_until(lambda: consumer.metrics.applied == 30, what="30 events before")
        await wait_until(lambda: consumer.metrics.lag == 0, what="their offsets committed")

        store.down.set()
        await produce(kafka_broker.bootstrap, rewards(range(30, 60)))
        await wait_until(lambda: store.failed_applies >= 6, what="the batch failing repeatedly")
        await produce(kafka_broker.bootstrap, rewards(range(60, 90)))  # more, still down
        await wait_until(lambda: store.failed_applies >= 12, what="later batches failing too")
        # Nothing committed past the first unapplied record.
        assert await committed_offsets(kafka_broker.bootstrap, GROUP, KAFKA.topics) == 30
        assert consumer.metrics.applied == 30

        store.down.clear()
        await wait_until(lambda: consumer.metrics.applied == 90, what="every event applied")
        await wait_until(lambda: consumer.metrics.lag == 0, what="every offset committed")
    finally:
        await consumer.stop()
        await task

    assert restarts == []  # the consumer stayed alive through the outage
    assert consumer.metrics.batch_retries >= 6
    assert feedback_store.state_counts() == {"joined": 90}
    applied = Counter(
        r["event_id"] for a in AGENTS for r in feedback_store.rewards_for(f"chatcmpl-{a}")
    )
    assert applied == Counter({f"ev-{i}": 1 for i in range(90)})  # each exactly once
    assert consumer.metrics.duplicates == 0 and consumer.metrics.dead_lettered == 0
    assert await committed_offsets(kafka_broker.bootstrap, GROUP, KAFKA.topics) == 90


async def test_stop_during_an_outage_is_prompt_and_the_next_member_resumes(
    kafka_broker: LocalBroker, feedback_store: FeedbackStore
) -> None:
    """A long retry pause does not hold `stop`; a restarted consumer picks the batch up."""
    for agent in AGENTS:
        store_trajectory(feedback_store.trajectories, f"chatcmpl-{agent}", agent)
    store = OutageStore(feedback_store)
    options: dict[str, Any] = {
        "group_id": GROUP,
        "session_timeout_ms": 2000,
        "heartbeat_interval_ms": 300,
        "poll_timeout_ms": 200,
        "retry_initial_s": 600.0,  # a pause that `stop` must cut short
        "retry_max_s": 600.0,
    }
    await produce(kafka_broker.bootstrap, rewards(range(0, 12)))
    store.down.set()
    first = FeedbackConsumer(store, kafka_broker.bootstrap, **options)  # type: ignore[arg-type]
    await first.start()
    task = asyncio.create_task(first.run())
    await wait_until(lambda: first.metrics.batch_retries == 1, what="the first failure")
    await asyncio.wait_for(first.stop(), timeout=60)  # generous: only hangs matter here
    await task
    assert await committed_offsets(kafka_broker.bootstrap, GROUP, KAFKA.topics) == 0

    store.down.clear()
    second = FeedbackConsumer(store, kafka_broker.bootstrap, **options)  # type: ignore[arg-type]
    await second.start()
    task = asyncio.create_task(second.run())
    try:
        await wait_until(lambda: second.metrics.applied == 12, what="the batch applied")
        await wait_until(lambda: second.metrics.lag == 0, what="its offsets committed")
    finally:
        await second.stop()
        await task
    assert feedback_store.state_counts() == {"joined": 12}
