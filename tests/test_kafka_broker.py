"""The local Tansu broker: start, answer Kafka Metadata, create topics, fail loudly."""

from __future__ import annotations

import asyncio
import stat
from pathlib import Path

import pytest
from aiokafka.admin import AIOKafkaAdminClient

from clora_feedback.errors import CloraError
from clora_feedback.feedback.broker import LocalBroker, probe_metadata


async def partition_count(bootstrap: str, topic: str) -> int:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        (described,) = await admin.describe_topics([topic])
        return len(described["partitions"])
    finally:
        await admin.close()


def test_broker_answers_metadata_and_creates_topics(tmp_path: Path) -> None:
    broker = LocalBroker(tmp_path / "tansu", topics=["a.b", "c"], partitions=4)
    with broker:
        host, port = broker.bootstrap.split(":")
        assert probe_metadata(host, int(port)) == [(host, int(port))]
        assert asyncio.run(partition_count(broker.bootstrap, "a.b")) == 4
        assert asyncio.run(partition_count(broker.bootstrap, "c")) == 4
        assert "tansu" in broker.log_path.read_text()
    assert not broker.running
    with pytest.raises(OSError):
        probe_metadata(host, int(port), timeout_s=0.5)
    broker.stop()  # idempotent


async def test_async_broker_context(tmp_path: Path) -> None:
    async with LocalBroker(tmp_path / "tansu", topics=["t"], partitions=2) as broker:
        assert await partition_count(broker.bootstrap, "t") == 2
    with pytest.raises(CloraError):
        _ = broker.bootstrap


def fake_binary(tmp_path: Path, body: str) -> str:
    path = tmp_path / "fake-tansu"
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_broker_that_exits_reports_its_log(tmp_path: Path) -> None:
    binary = fake_binary(tmp_path, 'echo "storage engine exploded" >&2; exit 3')
    with pytest.raises(CloraError) as info:
        LocalBroker(tmp_path / "d", port=1, binary=binary).start()
    assert info.value.code == "broker_start_failed"
    assert "status 3" in info.value.message and "storage engine exploded" in info.value.message


def test_broker_that_never_answers_times_out(tmp_path: Path) -> None:
    binary = fake_binary(tmp_path, 'echo "still thinking"; exec sleep 30')
    broker = LocalBroker(tmp_path / "d", binary=binary, startup_timeout_s=0.5)
    with pytest.raises(CloraError) as info:
        broker.start()
    assert info.value.code == "broker_start_timeout"
    assert "still thinking" in info.value.message
    assert not broker.running  # the silent process was killed, not left behind
