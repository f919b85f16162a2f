"""One feedback ingest for both paths: the webhook and Kafka dead-letter an expired parked event alike.

Also: the log sink's structured record, and `clora ingest` running a consumer
as its own process against a real Tansu broker.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from kafka_fixtures import (
    FAST_GROUP,
    KAFKA,
    feedback_store,
    kafka_broker,
    produce,
    read_topic,
    store_trajectory,
    wait_until,
)
from test_webhook import resolution, serve

from clora_feedback.config import FeedbackConfig, KafkaConfig, Settings
from clora_feedback.feedback.broker import LocalBroker
from clora_feedback.feedback.ingest import DeadLetter, FeedbackIngest, LogDeadLetters
from clora_feedback.feedback.kafka import FeedbackConsumer
from clora_feedback.feedback.pipeline import FeedbackPipeline
from clora_feedback.feedback.records import HEADER_REASON
from clora_feedback.feedback.store import FeedbackStore
from clora_feedback.gateway.auth import KeyAuthenticator
from clora_feedback.gateway.errors import install_error_handlers
from clora_feedback.gateway.feedback import build_feedback_router
from clora_feedback.schemas.feedback import Resolution

__all__ = ["feedback_store", "kafka_broker"]  # fixtures, imported for pytest

AGENTS = [{"name": "support", "api_keys": ["k-support"]}]
ADMIN = {"authorization": "Bearer k-admin"}


class RecordingSink:
    """A `DeadLetterSink` that keeps what it gets."""

    def __init__(self) -> None:
        self.letters: list[DeadLetter] = []

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    async def dead_letter(self, letters: Sequence[DeadLetter]) -> None:
        self.letters.extend(letters)


def webhook_app(ingest: FeedbackIngest) -> FastAPI:
    """`POST /v1/feedback` over `ingest`, mounted as `create_app` mounts it."""
    settings = Settings(agents=AGENTS, admin_api_key="k-admin")
    app = FastAPI()
    app.state.authenticator = KeyAuthenticator(settings)
    install_error_handlers(app)
    app.include_router(build_feedback_router(ingest, settings))
    return app


def shape(letter: DeadLetter) -> tuple[Any, ...]:
    """What a dead letter says, without the event's own id and target."""
    event = json.loads(letter.value or b"{}")
    return (
        letter.key,
        letter.source,
        event["kind"],
        event["agent"],
        "no trajectory for" in letter.reason,
    )


async def test_webhook_and_kafka_dead_letter_an_expired_event_alike(
    kafka_broker: LocalBroker, feedback_store: FeedbackStore
) -> None:
    sink = RecordingSink()
    ingest = FeedbackIngest(feedback_store, sink, park_ttl_s=60.0)
    with serve(webhook_app(ingest)) as url:
        async with httpx.AsyncClient(base_url=url) as http:
            answer = await http.post(
                "/v1/feedback", json=resolution("by-webhook", "c-never-1"), headers=ADMIN
            )
    assert answer.status_code == 202 and answer.json()["parked"] == ["by-webhook"]
    by_kafka = Resolution(
        event_id="by-kafka",
        agent="support",
        completion_id="c-never-2",
        source="t",
        outcome="resolved",
    )
    await produce(
        kafka_broker.bootstrap,
        [(KAFKA.resolutions_topic, b"support", by_kafka.model_dump_json().encode())],
    )
    consumer = FeedbackConsumer(feedback_store, kafka_broker.bootstrap, ingest=ingest, **FAST_GROUP)
    await consumer.start()
    try:
        for _ in range(100):
            if await consumer.poll_once():
                break
    finally:
        await consumer.stop()
    assert feedback_store.event_state("by-kafka") == ("parked", None)

    joined, dead = await ingest.rejoin_parked(now=time.time() + 120)
    assert joined == [] and sorted(d.event_id for d in dead) == ["by-kafka", "by-webhook"]
    assert len(sink.letters) == 2
    first, second = sink.letters
    assert shape(first) == shape(second) == (b"support", None, "resolution", "support", True)
    for event_id in ("by-kafka", "by-webhook"):
        state, reason = feedback_store.event_state(event_id) or ("?", None)
        assert state == "dead" and reason is not None
    assert ingest.metrics.expired == ingest.metrics.dead_lettered == 2


async def test_kafka_dead_letters_an_event_over_the_parked_limit(
    kafka_broker: LocalBroker, feedback_store: FeedbackStore
) -> None:
    sink = RecordingSink()
    ingest = FeedbackIngest(feedback_store, sink, park_ttl_s=60.0, max_parked_per_agent=1)
    events = [
        Resolution(
            event_id=f"k{i}", agent="support", completion_id=f"c-none-{i}", source="t",
            outcome="resolved",
        )
        for i in range(2)
    ]  # fmt: skip
    await produce(
        kafka_broker.bootstrap,
        [(KAFKA.resolutions_topic, b"support", e.model_dump_json().encode()) for e in events],
    )
    consumer = FeedbackConsumer(feedback_store, kafka_broker.bootstrap, ingest=ingest, **FAST_GROUP)
    await consumer.start()
    try:
        for _ in range(100):  # polls, not time: a batch may hold one record or both
            if ingest.metrics.parked + ingest.metrics.rejected == 2:
                break
            await consumer.poll_once()
    finally:
        await consumer.stop()
    parked = [e for e in ("k0", "k1") if feedback_store.event_state(e) == ("parked", None)]
    (over,) = {"k0", "k1"} - set(parked)
    assert len(parked) == 1 and feedback_store.event_state(over) is None
    (letter,) = sink.letters
    assert json.loads(letter.value or b"{}")["event_id"] == over
    assert "parked_limit" in letter.reason and letter.source is not None
    assert ingest.metrics.over_parked_limit == 1 and ingest.metrics.dead_lettered == 1


async def test_pipeline_dead_letters_both_paths_to_the_topic(
    tmp_path: Path, feedback_store: FeedbackStore
) -> None:
    config = FeedbackConfig(
        park_ttl_s=0.3, rejoin_interval_s=0.1, kafka=KafkaConfig(embedded_broker=True)
    )
    pipeline = FeedbackPipeline(
        config, feedback_store, lambda: {"support"}, broker_dir=tmp_path / "kafka"
    )
    await pipeline.start()
    try:
        assert pipeline.broker is not None and pipeline.producer is not None
        with serve(webhook_app(pipeline.ingest)) as url:
            async with httpx.AsyncClient(base_url=url) as http:
                answer = await http.post(
                    "/v1/feedback", json=resolution("by-webhook", "c-x"), headers=ADMIN
                )
        assert answer.status_code == 202  # the embedded broker is not durable: applied directly
        await pipeline.send(
            Resolution(
                event_id="by-kafka", agent="support", completion_id="c-y", source="t",
                outcome="resolved",
            )
        )  # fmt: skip
        await wait_until(lambda: pipeline.metrics.dead_lettered == 2, what="both dead-lettered")
        dead = await read_topic(pipeline.broker.bootstrap, config.kafka.dead_letter_topic)
    finally:
        await pipeline.stop()
    assert sorted(json.loads(r.value)["event_id"] for r in dead) == ["by-kafka", "by-webhook"]
    for record in dead:
        assert record.key == b"support"
        assert [k for k, _ in record.headers] == [HEADER_REASON]  # long committed: no source
        event_id = json.loads(record.value)["event_id"]
        assert (
            dict(record.headers)[HEADER_REASON].decode() == feedback_store.event_state(event_id)[1]
        )  # type: ignore[index]


async def test_log_sink_writes_one_structured_record(caplog: pytest.LogCaptureFixture) -> None:
    letter = DeadLetter(b"support", json.dumps({"event_id": "e1"}).encode(), "too late")
    with caplog.at_level(logging.WARNING, logger="clora_feedback.feedback.ingest"):
        await LogDeadLetters().dead_letter([letter])
    (record,) = caplog.records
    assert record.dead_letter == {"reason": "too late", "key": "support", "event_id": "e1"}  # type: ignore[attr-defined]
    assert "e1" in record.getMessage()


def test_clora_ingest_runs_a_consumer(
    kafka_broker: LocalBroker, feedback_store: FeedbackStore, tmp_path: Path
) -> None:
    store_trajectory(feedback_store.trajectories, "c-1", "support")  # type: ignore[arg-type]
    event = Resolution(
        event_id="e1", agent="support", completion_id="c-1", source="t", outcome="resolved"
    )
    asyncio.run(
        produce(
            kafka_broker.bootstrap,
            [(KAFKA.resolutions_topic, b"support", event.model_dump_json().encode())],
        )
    )
    cmd = [sys.executable, "-m", "clora_feedback.cli", "ingest", "--db", str(feedback_store.path)]
    cmd += ["--bootstrap", kafka_broker.bootstrap, "--group-id", "cli-test"]
    cmd += ["--session-timeout-ms", "2000", "--heartbeat-interval-ms", "300"]
    log = tmp_path / "ingest.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while feedback_store.event_state("e1") != ("joined", None):
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "the event was not applied"
            time.sleep(0.1)
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    metrics = json.loads(log.read_text().strip().splitlines()[-1])
    assert metrics["applied"] == 1 and metrics["records"] == 1
