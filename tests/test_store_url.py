"""`store_url`: the setting, the commands that take it, and `clora serve` on PostgreSQL.

The service test runs the whole loop of `test_service` (completions, webhook
feedback, a trainer step publishing version 1, the admin routes) with every
store in one PostgreSQL database, next to a second gateway on the same database
and adapter directory, with no trainer of its own: it serves the version the
first one published, by following the registry's pointer, and the completions
it serves land in the same trajectory store.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import serve_app
from kafka_fixtures import KAFKA, kafka_broker, produce, store_trajectory
from pydantic import ValidationError
from test_service import _exercise, _settings

from clora_feedback.cli.main import main
from clora_feedback.config import FeedbackConfig, Settings
from clora_feedback.feedback.broker import LocalBroker
from clora_feedback.feedback.rewards import DefaultRewardPolicy
from clora_feedback.feedback.store import FeedbackStore
from clora_feedback.schemas.feedback import Resolution
from clora_feedback.service import build_service
from clora_feedback.store.trajectories import TrajectoryStore

__all__ = ["kafka_broker"]  # a fixture, imported for pytest


def test_store_url_accepts_postgres_only_and_prints_no_password() -> None:
    settings = Settings(store_url="postgresql://clora:s3cret@db:5432/clora")
    assert settings.trajectory_db_url == settings.registry_db_url == settings.store_url
    assert settings.store_display_url == "postgresql://clora:***@db:5432/clora"
    assert "s3cret" not in repr(settings) and "s3cret" not in str(settings)
    with pytest.raises(ValidationError, match="postgresql://"):
        Settings(store_url="mysql://clora@db/clora")
    with pytest.raises(ValidationError, match="postgresql://"):
        Settings(store_url="sqlite:///var/all.db")  # SQLite: leave it unset (data_dir)


def test_unset_store_url_keeps_the_sqlite_files(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, store_url="  ")
    assert settings.store_url is None
    assert settings.trajectory_db_url == tmp_path / "trajectories.db"
    assert settings.registry_db_url == tmp_path / "registry.db"
    assert settings.store_display_url == f"sqlite files in {tmp_path}"


def test_ingest_refuses_a_bad_store_url(caplog: pytest.LogCaptureFixture) -> None:
    code = main(["ingest", "--store-url", "mysql://x/y", "--bootstrap", "127.0.0.1:1"])
    assert code == 1 and "store_url must be postgresql://" in caplog.text


def test_clora_ingest_consumes_into_postgres(
    kafka_broker: LocalBroker, postgres_url: str, tmp_path: Path
) -> None:
    trajectories = TrajectoryStore(postgres_url)
    store = FeedbackStore(
        postgres_url, trajectories=trajectories, policy=DefaultRewardPolicy(FeedbackConfig())
    )
    try:
        store_trajectory(trajectories, "c-1", "support")
        event = Resolution(
            event_id="e1", agent="support", completion_id="c-1", source="t", outcome="resolved"
        )
        record = (KAFKA.resolutions_topic, b"support", event.model_dump_json().encode())
        asyncio.run(produce(kafka_broker.bootstrap, [record]))
        cmd = [sys.executable, "-m", "clora_feedback.cli", "ingest", "--store-url", postgres_url]
        cmd += ["--bootstrap", kafka_broker.bootstrap, "--group-id", "pg-test"]
        cmd += ["--session-timeout-ms", "2000", "--heartbeat-interval-ms", "300"]
        log = tmp_path / "ingest.log"
        env = {**os.environ, "CLORA_DATA_DIR": str(tmp_path / "unused")}  # no SQLite fallback
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            _wait(lambda: proc.poll() is None and store.event_state("e1") == ("joined", None))
            os.kill(proc.pid, signal.SIGTERM)
            assert proc.wait(timeout=30) == 0, log.read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
        assert json.loads(log.read_text().strip().splitlines()[-1])["applied"] == 1
        assert store.rewards_for("c-1")[0]["value"] == 1.0
        assert not (tmp_path / "unused").exists()
    finally:
        store.close()
        trajectories.close()


def _wait(predicate: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


@pytest.mark.slow
def test_two_gateways_on_one_postgres_database(
    tiny_model_dir: Path, tmp_path: Path, postgres_url: str
) -> None:
    base = _settings(tiny_model_dir, tmp_path, None)
    leader = base.model_copy(update={"store_url": postgres_url})
    trainer = base.trainer.model_copy(update={"enabled": False})
    follower_settings = leader.model_copy(
        update={"data_dir": tmp_path / "var2", "trainer": trainer}
    )
    service = build_service(leader)
    follower = build_service(follower_settings)
    assert service.trainer is not None and follower.trainer is None
    with serve_app(follower.app, None) as gw2:
        _exercise(service, cluster=False)  # trains and publishes version 1 on PostgreSQL
        assert not (tmp_path / "var" / "trajectories.db").exists()  # nothing went to SQLite
        _wait(lambda: follower.deployer.serving("support") == 1)
        reply = gw2.openai().chat.completions.create(
            model="support", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert reply.model_extra is not None
        assert reply.model_extra["clora"]["adapter_version"] == 1
        _wait(lambda: bool(service.feedback.trajectories.exists([reply.id])))
