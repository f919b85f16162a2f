"""The whole loop in one process, as `clora serve` wires it: serve, capture, listen, learn, version.

A real uvicorn gateway built by `build_service` on the tiny model, a real Tansu
broker, the official `openai` client, feedback through the webhook (with a
cluster configured: produced to Kafka, consumed, joined; with the embedded,
memory-only broker: written straight to the durable store), the trainer
publishing a version that the next completion is served by, and the admin
routes listing it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from conftest import serve_app

from clora_feedback.client import FeedbackClient
from clora_feedback.config import (
    AgentConfig,
    EngineConfig,
    FeedbackConfig,
    KafkaConfig,
    ReleaseConfig,
    Settings,
    TrainerConfig,
)
from clora_feedback.feedback.broker import LocalBroker
from clora_feedback.service import Service, build_service


def _wait(predicate: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def _settings(model_dir: Path, tmp_path: Path, bootstrap: str | None) -> Settings:
    return Settings(
        data_dir=tmp_path / "var",
        adapters_dir=tmp_path / "adapters",
        engine=EngineConfig(
            model=str(model_dir), max_model_len=1024, num_threads=1, max_num_seqs=4
        ),
        agents=[AgentConfig(name="support")],
        feedback=FeedbackConfig(kafka=KafkaConfig(bootstrap_servers=bootstrap)),
        trainer=TrainerConfig(admission={"min_batch": 3}, poll_interval_s=0.1, lr=1e-2),  # type: ignore[arg-type]
        # The loop, not its release: version 1 must serve the next completion. The release
        # path (the default) is tested through the service in test_release_service.py.
        release=ReleaseConfig(enabled=False),
    )


@pytest.mark.slow
@pytest.mark.parametrize("cluster", [True, False], ids=["kafka-cluster", "embedded-broker"])
def test_feedback_trains_a_version_that_serves_next(
    tiny_model_dir: Path, tmp_path: Path, cluster: bool
) -> None:
    kafka = KafkaConfig()
    broker = (
        LocalBroker(tmp_path / "tansu", topics=[*kafka.topics, kafka.dead_letter_topic])
        if cluster
        else None
    )
    if broker is not None:
        broker.start()
    try:
        service = build_service(
            _settings(tiny_model_dir, tmp_path, broker.bootstrap if broker else None)
        )
        _exercise(service, cluster)
    finally:
        if broker is not None:
            broker.stop()


def _exercise(service: Service, cluster: bool) -> None:
    with serve_app(service.app, None) as gw:
        client = gw.openai()
        ids = []
        for i in range(3):
            reply = client.chat.completions.create(
                model="support", messages=[{"role": "user", "content": f"ticket {i}"}], max_tokens=8
            )
            assert (
                reply.model_extra["clora"]["adapter_version"] == 0
            )  # nothing trained yet: the base model
            ids.append(reply.id)
        with FeedbackClient(gw.url) as feedback:
            receipt = feedback.resolution("support", "resolved", completion_id=ids[0])
            assert receipt.delivery == ("kafka" if cluster else "store")
            feedback.resolution("support", "escalated", completion_id=ids[1])
            feedback.reward("support", 0.5, completion_id=ids[2])
        store = service.feedback
        _wait(lambda: all(store.rewards_for(i) for i in ids))
        assert [store.rewards_for(i)[0]["value"] for i in ids] == [1.0, 0.0, 0.5]

        registry = service.registry
        _wait(lambda: any(a.active_version == 1 for a in registry.agents()))
        reply = client.chat.completions.create(
            model="support", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert reply.model_extra["clora"]["adapter_version"] == 1
        assert set(reply.choices[0].model_extra["clora"]["token_versions"]) == {1}

        http = httpx.Client(base_url=gw.url)
        agents = http.get("/v1/adapters").json()
        assert any(a["agent"] == "support" and a["active_version"] == 1 for a in agents["data"])
        versions = http.get("/v1/adapters/support/versions").json()["data"]
        assert versions[0]["version"] == 1 and versions[0]["feedback_window"]["samples"] == 3
        assert http.post("/v1/adapters/support/pin").status_code == 200
        metrics = http.get("/metrics").text
        assert 'clora_trainer_steps_total{agent="support"} 1' in metrics
        assert 'clora_trainer_staleness_mean{agent="support"}' in metrics
        assert "clora_feedback_consumer" in metrics
