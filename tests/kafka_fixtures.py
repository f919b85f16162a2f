"""Shared Kafka test fixtures: a real Tansu broker on a free loopback port, and helpers.

Import the fixtures into a test module (`from kafka_fixtures import kafka_broker, ...`).
Producers and readers here are plain aiokafka clients, independent of the code
under test, so a test sees the topics exactly as any other Kafka client would.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from clora_feedback.config import FeedbackConfig, KafkaConfig
from clora_feedback.feedback.broker import LocalBroker
from clora_feedback.feedback.kafka import FeedbackConsumer
from clora_feedback.feedback.rewards import DefaultRewardPolicy
from clora_feedback.feedback.store import FeedbackStore
from clora_feedback.store.trajectories import SampleRecord, TrajectoryRecord, TrajectoryStore

KAFKA = KafkaConfig()
PARTITIONS = 3
# Tansu holds a group's first join for about half the session timeout, and a
# killed member's partitions move only after it: keep both short in tests.
FAST_GROUP: dict[str, Any] = {
    "session_timeout_ms": 2000,
    "heartbeat_interval_ms": 300,
    "poll_timeout_ms": 200,
}


@pytest.fixture
def kafka_broker(tmp_path: Path) -> Iterator[LocalBroker]:
    """A fresh broker with the feedback topics (3 partitions each) and the dead-letter topic."""
    with LocalBroker(
        tmp_path / "tansu", topics=[*KAFKA.topics, KAFKA.dead_letter_topic], partitions=PARTITIONS
    ) as broker:
        yield broker


@pytest.fixture
def feedback_store(tmp_path: Path) -> Iterator[FeedbackStore]:
    """A feedback store (with its trajectory tables) in `tmp_path/trajectories.db`."""
    store = FeedbackStore(
        tmp_path / "trajectories.db",
        trajectories=TrajectoryStore(tmp_path / "trajectories.db"),
        policy=DefaultRewardPolicy(FeedbackConfig()),
    )
    yield store
    store.close()


def store_trajectory(
    trajectories: TrajectoryStore,
    completion_id: str,
    agent: str,
    texts: Sequence[str] = ("The answer is 42.",),
) -> TrajectoryRecord:
    """Record a small trajectory with one sample per text."""
    samples = [
        SampleRecord(
            index=i,
            text=text,
            completion_token_ids=[10 + i, 11, 12],
            logprobs=[-0.1, -0.2, -0.3],
            token_versions=[1, 1, 1],
            finish_reason="stop",
        )
        for i, text in enumerate(texts)
    ]
    record = TrajectoryRecord(
        id=completion_id,
        agent=agent,
        adapter_version=1,
        kind="chat",
        request={"messages": [{"role": "user", "content": "q"}]},
        prompt_token_ids=[1, 2, 3],
        samples=samples,
        created_at=time.time(),
    )
    trajectories.record(record)
    return record


async def produce(
    bootstrap: str,
    records: Sequence[tuple[str, bytes | None, bytes | None]],
    *,
    max_request_size: int = 1_048_576,
) -> list[Any]:
    """Produce (topic, key, value) records with a plain aiokafka producer; their metadata.

    `max_request_size` is the producer's own limit (aiokafka's default: 1 MiB).
    """
    from aiokafka import AIOKafkaProducer

    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap, acks="all", max_request_size=max_request_size
    )
    await producer.start()
    try:
        pending = [await producer.send(t, value=v, key=k) for t, k, v in records]
        return list(await asyncio.gather(*pending))
    finally:
        await producer.stop()


async def read_topic(bootstrap: str, topic: str, timeout_s: float = 10.0) -> list[Any]:
    """Every record of `topic` now in the log (up to its end offsets), without a group."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    try:
        partitions = [TopicPartition(topic, p) for p in range(PARTITIONS)]
        consumer.assign(partitions)
        await consumer.seek_to_beginning(*partitions)
        ends = await consumer.end_offsets(partitions)
        out: list[Any] = []
        deadline = time.monotonic() + timeout_s
        while any([await consumer.position(tp) < ends[tp] for tp in partitions]):
            if time.monotonic() > deadline:
                raise TimeoutError(f"could not read {topic} to its end offsets {ends}")
            for records in (await consumer.getmany(timeout_ms=200)).values():
                out.extend(records)
        return out
    finally:
        await consumer.stop()


async def committed_offsets(bootstrap: str, group_id: str, topics: Sequence[str]) -> int:
    """Sum of the group's committed offsets over `topics` (what a restart resumes from)."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=group_id)
    await consumer.start()
    try:
        total = 0
        for topic in topics:
            for p in range(PARTITIONS):
                total += await consumer.committed(TopicPartition(topic, p)) or 0
        return total
    finally:
        await consumer.stop()


async def wait_until(
    condition: Callable[[], bool], timeout_s: float = 15.0, what: str = "condition"
) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.05)


@asynccontextmanager
async def running(consumer: FeedbackConsumer) -> AsyncIterator[FeedbackConsumer]:
    """Start `consumer`, run it in a task, stop it on exit (re-raising what ended `run`)."""
    await consumer.start()
    task = asyncio.create_task(consumer.run())
    try:
        yield consumer
    finally:
        await consumer.stop()
        await task
