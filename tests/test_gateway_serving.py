"""Serving behaviour: 429 under overload, client disconnects free batch rows at once,
and the operations routes (/health, /metrics, /v1/models)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import openai
import pytest

if TYPE_CHECKING:
    from conftest import GatewayFactory, GatewayServer

HI = [{"role": "user", "content": "hello there"}]
LONG = 2000  # greedy decoding of the tiny model runs this long (it does not pick EOS on HI)


def engine_stats(gateway: GatewayServer) -> dict[str, Any]:
    stats: dict[str, Any] = httpx.get(f"{gateway.url}/health").json()["engine"]
    return stats


def wait_until_idle(gateway: GatewayServer, timeout_s: float = 5.0) -> float:
    """Seconds until the engine has no running or waiting sequence."""
    start = time.monotonic()
    while True:
        stats = engine_stats(gateway)
        if stats["running"] == 0 and stats["waiting"] == 0:
            return time.monotonic() - start
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"engine still busy: {stats}")
        time.sleep(0.01)


def open_long_stream(http: httpx.Client, model: str = "support") -> Any:
    """Start a long greedy stream and read until its first token chunk.

    Returns the open stream context and its line iterator; both must stay referenced
    (a collected iterator closes the connection, which the gateway rightly treats as a
    disconnect)."""
    body = {"model": model, "messages": HI, "max_tokens": LONG, "temperature": 0, "stream": True}
    context = http.stream("POST", "/v1/chat/completions", json=body)
    response = context.__enter__()
    assert response.status_code == 200
    lines = response.iter_lines()
    seen = 0
    for line in lines:
        if line.startswith("data: "):
            seen += 1
            if seen == 2:  # the role chunk, then one with a token
                break
    return context, lines


@pytest.fixture
def single_row(start_gateway: GatewayFactory) -> GatewayServer:
    return start_gateway(engine={"max_num_seqs": 1, "max_waiting": 0}, agents=[{"name": "support"}])


async def test_overload_answers_429_with_retry_after(single_row: GatewayServer) -> None:
    with single_row.http() as http:
        holder, _lines = open_long_stream(http)
        try:
            client = single_row.async_openai()
            results = await asyncio.gather(
                *(
                    client.chat.completions.create(model="support", messages=HI, max_tokens=2)
                    for _ in range(3)
                ),
                return_exceptions=True,
            )
            assert all(isinstance(r, openai.RateLimitError) for r in results), results
            error = results[0]
            assert isinstance(error, openai.RateLimitError)
            assert error.response.headers["retry-after"] == "1"
            assert error.type == "rate_limit_error" and error.code == "overloaded"
            raw = http.post(
                "/v1/completions", json={"model": "support", "prompt": "x", "max_tokens": 1}
            )
            assert raw.status_code == 429 and int(raw.headers["Retry-After"]) >= 1
            await client.close()
        finally:
            holder.__exit__(None, None, None)
    wait_until_idle(single_row)
    # Capacity is back once the row is free.
    reply = single_row.openai().chat.completions.create(model="support", messages=HI, max_tokens=2)
    assert reply.choices[0].finish_reason in ("stop", "length")
    metrics = httpx.get(f"{single_row.url}/metrics").text
    assert (
        'clora_http_requests_total{route="/v1/chat/completions",method="POST",status="429"} 3'
        in metrics
    )


def test_stream_disconnect_frees_the_row_at_once(single_row: GatewayServer) -> None:
    before = engine_stats(single_row)["generated_tokens"]
    with single_row.http() as http:
        holder, _lines = open_long_stream(http)
        assert engine_stats(single_row)["running"] == 1
        holder.__exit__(None, None, None)  # closes the connection mid-stream
    waited = wait_until_idle(single_row)
    generated = engine_stats(single_row)["generated_tokens"] - before
    assert generated < LONG / 2, f"the request ran on after the disconnect ({generated} tokens)"
    assert waited < 2.0
    # Nothing is recorded for a completion the client never received.
    with single_row.http() as http:
        assert http.get("/v1/trajectories").json()["data"] == []


def test_non_stream_disconnect_frees_the_row(single_row: GatewayServer) -> None:
    before = engine_stats(single_row)["generated_tokens"]
    body = {"model": "support", "messages": HI, "max_tokens": LONG, "temperature": 0}
    with (
        pytest.raises(httpx.ReadTimeout),
        httpx.Client(base_url=single_row.url, timeout=0.3) as http,
    ):
        http.post("/v1/chat/completions", json=body)
    wait_until_idle(single_row)
    assert engine_stats(single_row)["generated_tokens"] - before < LONG / 2
    with single_row.http() as http:
        assert http.get("/v1/trajectories").json()["data"] == []


def test_health_metrics_and_models(module_gateway: GatewayServer) -> None:
    client = module_gateway.openai()
    client.chat.completions.create(model="support", messages=HI, max_tokens=3)
    client.completions.create(model="sales", prompt="x", max_tokens=2)
    health = httpx.get(f"{module_gateway.url}/health").json()
    assert health["status"] == "ok" and health["model"] == "tiny-base"
    assert health["engine"]["max_num_seqs"] == 16 and health["agents"] == 2
    metrics = httpx.get(f"{module_gateway.url}/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    text = metrics.text
    for needle in (
        'clora_completions_total{agent="support",endpoint="chat"} 1',
        'clora_completions_total{agent="sales",endpoint="completions"} 1',
        "clora_engine_running 0",
        "clora_engine_waiting 0",
        "# TYPE clora_generation_tokens_total counter",
        'clora_prompt_tokens_total{agent="support"}',
    ):
        assert needle in text, needle
    models = client.models.list()
    assert [m.id for m in models] == ["tiny-base", "support", "sales"]
    assert all(m.object == "model" and m.owned_by == "clora-feedback" for m in models)
    assert models.data[1].model_extra["parent"] == "tiny-base"


def test_build_app_from_settings_serves_a_model_directory(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from fastapi.testclient import TestClient

    from clora_feedback.config import EngineConfig, Settings
    from clora_feedback.service import build_service

    settings = Settings(
        data_dir=tmp_path,
        engine=EngineConfig(model=str(tiny_model_dir), max_model_len=128, num_threads=1),
        agents=[{"name": "helpdesk"}],
    )
    with TestClient(build_service(settings).app) as client:
        models = [m["id"] for m in client.get("/v1/models").json()["data"]]
        assert models == [tiny_model_dir.name, "helpdesk"]
        reply = client.post(
            "/v1/completions", json={"model": "helpdesk", "prompt": "hi", "max_tokens": 2}
        ).json()
        assert reply["object"] == "text_completion"
    assert settings.trajectory_db.exists()


class _NarrowEngine:
    """The embedded engine behind a narrower promise: one version per request, no constraints
    (what an out-of-process engine may declare)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    @property
    def capabilities(self) -> Any:
        import dataclasses

        caps = self._inner.capabilities
        return dataclasses.replace(caps, per_token_versions=False, constraints=frozenset())


def test_the_gateway_follows_the_engines_capabilities(tiny_model_dir: Path, tmp_path: Path) -> None:
    from conftest import serve_app

    from clora_feedback.config import EngineConfig, Settings
    from clora_feedback.engine.embedded import EmbeddedEngine
    from clora_feedback.gateway.app import create_app
    from clora_feedback.service import gateway_deployer
    from clora_feedback.store.trajectories import AsyncTrajectoryStore

    config = EngineConfig(model=str(tiny_model_dir), max_model_len=2048, num_threads=1)
    settings = Settings(data_dir=tmp_path, engine=config, agents=[{"name": "support"}])
    engine = _NarrowEngine(EmbeddedEngine(tiny_model_dir, config, model_name="tiny-base"))
    app = create_app(
        settings,
        engine,
        AsyncTrajectoryStore(settings.trajectory_db),
        deployer=gateway_deployer(settings, engine),
    )
    tool = {"type": "function", "function": {"name": "ping", "parameters": {"type": "object"}}}
    with serve_app(app, engine) as gateway:
        client = gateway.openai()
        with pytest.raises(openai.BadRequestError) as refused:  # no constraint: a clear 400
            client.chat.completions.create(
                model="support", messages=HI, tools=[tool], tool_choice="required", max_tokens=5
            )
        assert "tool_call" in str(refused.value)
        for fmt in ({"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": "r"}}):
            with pytest.raises(openai.BadRequestError) as no_json:  # nor a JSON reply
                client.chat.completions.create(
                    model="support", messages=HI, response_format=fmt, max_tokens=5
                )
            assert no_json.value.param == "response_format"
            assert "json_schema" in no_json.value.message
        reply = client.chat.completions.create(model="support", messages=HI, max_tokens=4)
        extension = reply.model_extra["clora"]
        assert extension["version_attribution"] == "request"
        versions = reply.choices[0].model_extra["clora"]["token_versions"]
        assert len(set(versions)) == 1
        with gateway.http() as http:
            record = http.get(f"/v1/trajectories/{reply.id}").json()
        assert record["version_attribution"] == "request" and record["logprobs_mode"] == "raw"


def test_a_real_engine_says_its_versions_are_per_token(module_gateway: GatewayServer) -> None:
    reply = module_gateway.openai().chat.completions.create(
        model="support", messages=HI, max_tokens=3
    )
    assert "version_attribution" not in reply.model_extra["clora"]
    with module_gateway.http() as http:
        record = http.get(f"/v1/trajectories/{reply.id}").json()
    assert record["version_attribution"] == "token" and record["logprobs_mode"] == "raw"
