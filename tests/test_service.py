"""The whole loop in one process, as `clora serve` wires it: serve, capture, listen, learn, version.

A real uvicorn gateway built by `build_service` on the tiny model, a real Tansu
broker started by the service itself, the official `openai` client, feedback
through the webhook (produced to Kafka, consumed, joined), the trainer
publishing a version that the next completion is served by, and the admin
routes listing and rolling it back.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from conftest import serve_app

from clora_feedback.client import FeedbackClient
from clora_feedback.config import AgentConfig, EngineConfig, Settings, TrainerConfig
from clora_feedback.service import build_service


def _wait(predicate, timeout: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


@pytest.mark.slow
def test_feedback_through_kafka_trains_a_version_that_serves_next(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    settings = Settings(
        data_dir=tmp_path / "var",
        adapters_dir=tmp_path / "adapters",
        engine=EngineConfig(
            model=str(tiny_model_dir), max_model_len=1024, num_threads=1, max_num_seqs=4
        ),
        agents=[AgentConfig(name="support")],
        trainer=TrainerConfig(admission={"min_batch": 3}, poll_interval_s=0.1, lr=1e-2),  # type: ignore[arg-type]
    )
    app = build_service(settings)
    with serve_app(app, None) as gw:
        client = gw.openai()
        ids = []
        for i in range(3):
            reply = client.chat.completions.create(
                model="support", messages=[{"role": "user", "content": f"ticket {i}"}], max_tokens=8
            )
            assert (
                reply.model_extra["clora"]["adapter_version"] == 0
            )  # no trained version yet: the base model
            ids.append(reply.id)
        with FeedbackClient(gw.url) as feedback:
            receipt = feedback.resolution("support", "resolved", completion_id=ids[0])
            assert receipt.delivery == "kafka"
            feedback.resolution("support", "escalated", completion_id=ids[1])
            feedback.reward("support", 0.5, completion_id=ids[2])
        store = app.state.feedback
        _wait(lambda: all(store.rewards_for(i) for i in ids))
        assert [store.rewards_for(i)[0]["value"] for i in ids] == [1.0, 0.0, 0.5]

        registry = app.state.registry
        _wait(lambda: registry.active("support") is not None if registry.agents() else False)
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
