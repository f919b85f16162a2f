"""kill -9 of the consumer process between the durable write and the offset commit.

The consumer runs as its own process (`clora ingest`, i.e. `python -m clora_feedback.cli ingest`)
with small batches and a pause before each commit, so a SIGKILL almost surely
lands after a batch is in SQLite but before Kafka knows. The test checks that
it did (applied > committed at the kill), restarts the process, and compares
what the store holds with what was produced: every event once, same content.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from kafka_fixtures import (
    KAFKA,
    committed_offsets,
    feedback_store,
    kafka_broker,
    produce,
    store_trajectory,
    wait_until,
)

from clora_feedback.feedback.broker import LocalBroker
from clora_feedback.feedback.store import FeedbackStore
from clora_feedback.schemas.feedback import Reward

__all__ = ["feedback_store", "kafka_broker"]  # fixtures, imported for pytest

GROUP = "kill-test"
N_EVENTS = 300


def start_consumer(db: Path, bootstrap: str, log: Path, *extra: str) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "clora_feedback.cli", "ingest", "--db", str(db)]
    cmd += ["--bootstrap", bootstrap, "--group-id", GROUP, "--max-batch", "20"]
    cmd += ["--session-timeout-ms", "2000", "--heartbeat-interval-ms", "300", *extra]
    with open(log, "ab") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)


def applied_rows(db: Path) -> list[tuple[str, str, float]]:
    with sqlite3.connect(db, timeout=10) as conn:
        return conn.execute(  # the stored facts: which completion each event joined, its value
            "SELECT t.event_id, t.completion_id, json_extract(e.payload, '$.value') "
            "FROM event_targets t JOIN feedback_events e USING (event_id) ORDER BY t.event_id"
        ).fetchall()


def event_count(db: Path) -> int:
    with sqlite3.connect(db, timeout=10) as conn:
        return int(conn.execute("SELECT count(*) FROM feedback_events").fetchone()[0])


@pytest.mark.slow
async def test_sigkill_mid_batch_then_restart_applies_every_event_once(
    kafka_broker: LocalBroker, feedback_store: FeedbackStore, tmp_path: Path
) -> None:
    db = feedback_store.path
    for i in range(30):
        store_trajectory(feedback_store.trajectories, f"chatcmpl-{i}", "agent-a")
    events = [
        Reward(
            event_id=f"k-{i:04d}",
            agent="agent-a",
            completion_id=f"chatcmpl-{i % 30}",
            source="kill-test",
            value=i / 7,
        )
        for i in range(N_EVENTS)
    ]
    await produce(
        kafka_broker.bootstrap,
        [(KAFKA.rewards_topic, e.agent.encode(), e.model_dump_json().encode()) for e in events],
    )
    log = tmp_path / "consumer.log"

    first = start_consumer(db, kafka_broker.bootstrap, log, "--commit-delay-s", "0.5")
    try:
        await wait_until(lambda: event_count(db) >= 60, timeout_s=30, what="60 events applied")
    finally:
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
    applied_at_kill = event_count(db)
    committed_at_kill = await committed_offsets(kafka_broker.bootstrap, GROUP, KAFKA.topics)
    assert applied_at_kill < N_EVENTS
    # The kill hit the window this test is about: durable in SQLite, not yet committed.
    assert committed_at_kill < applied_at_kill, log.read_text()

    second = start_consumer(db, kafka_broker.bootstrap, log)
    try:
        await wait_until(lambda: event_count(db) == N_EVENTS, timeout_s=30, what="every event")
    finally:
        # A clean stop commits the batch in flight before the process exits.
        second.send_signal(signal.SIGTERM)
        second.wait(timeout=30)
    assert second.returncode == 0, log.read_text()
    metrics = json.loads(log.read_text().strip().splitlines()[-1])

    expected = sorted((e.event_id, e.completion_id, e.value) for e in events)
    assert applied_rows(db) == expected  # every event exactly once, with its own content
    assert feedback_store.state_counts() == {"joined": N_EVENTS}
    # The restart replayed what the kill left uncommitted, and each replay was a no-op.
    assert metrics["duplicates"] >= applied_at_kill - committed_at_kill > 0
    assert metrics["applied"] == N_EVENTS - applied_at_kill
