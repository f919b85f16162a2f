"""The vLLM engine's parts without a server: error translation, versioned names, constraints.

The HTTP side runs on `httpx.MockTransport` (vLLM's replies as captured from
the real server's shapes); the real-server tests are `test_engine_contract.py`
and `test_gateway_vllm.py` (marked `vllm`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer

from clora_feedback.config import EngineConfig
from clora_feedback.engine.types import JSONSchemaSpec, ToolCallSpec
from clora_feedback.engine.vllm import VLLMEngine
from clora_feedback.engine.vllm.client import VLLMClient
from clora_feedback.engine.vllm.guided import structured_outputs
from clora_feedback.engine.vllm.names import AdapterNames, ServedName
from clora_feedback.errors import (
    AdapterError,
    ConfigError,
    ContextLengthError,
    EngineError,
    EngineUnavailableError,
    InvalidRequestError,
)
from clora_feedback.gateway.errors import error_response


def _client(handler: httpx.MockTransport) -> VLLMClient:
    return VLLMClient("http://vllm.test/v1", transport=handler)


def _error(status: int, message: str) -> httpx.MockTransport:
    body = {"error": {"message": message, "type": "BadRequestError", "param": None, "code": status}}
    return httpx.MockTransport(lambda request: httpx.Response(status, json=body))


async def test_server_errors_map_onto_ours_and_internals_stay_in_the_log() -> None:
    too_long = "This model's maximum context length is 512 tokens. However, you requested 900"
    with pytest.raises(ContextLengthError) as exc:
        await _client(_error(400, too_long)).complete({"prompt": [1]})
    assert exc.value.param == "max_tokens" and exc.value.http_status == 400
    with pytest.raises(InvalidRequestError):
        await _client(_error(400, "temperature must be >= 0")).complete({"prompt": [1]})
    with pytest.raises(EngineError) as failed:
        await _client(_error(500, "Traceback: EngineCore died at worker.py:42")).complete({})
    assert "Traceback" not in failed.value.message and failed.value.http_status == 500
    with pytest.raises(AdapterError):
        await _client(_error(400, "Loading lora failed")).load_lora("a@v1", "/nowhere")


async def test_a_timeout_or_refused_connection_is_retriable_503_with_retry_after() -> None:
    def timeout(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("no bytes", request=request)

    def refused(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    for handler in (timeout, refused):
        client = _client(httpx.MockTransport(handler))
        with pytest.raises(EngineUnavailableError) as exc:
            async for _ in client.stream({"prompt": [1]}):
                pass
        assert exc.value.retriable and exc.value.http_status == 503
        response = error_response(exc.value)
        assert response.status_code == 503 and response.headers["Retry-After"] == "1"
        assert json.loads(bytes(response.body))["error"]["code"] == "engine_unavailable"


async def test_a_stream_yields_chunks_and_an_error_event_raises() -> None:
    lines = [
        'data: {"choices": [{"index": 0, "token_ids": [5], "finish_reason": null}]}',
        'data: {"error": {"message": "boom", "code": 500}}',
        "data: [DONE]",
    ]
    transport = httpx.MockTransport(
        lambda request: httpx.Response(200, text="\n\n".join(lines) + "\n\n")
    )
    seen = []
    with pytest.raises(EngineError):
        async for chunk in _client(transport).stream({}):
            seen.append(chunk["choices"][0]["token_ids"])
    assert seen == [[5]]


def test_names_are_never_reused_and_a_retired_name_waits_for_its_last_request(
    tmp_path: Path,
) -> None:
    names = AdapterNames()
    other = AdapterNames()
    first = names.new_name("a", 1)
    assert first.startswith("a@v1+") and first != names.new_name("a", 1) != other.new_name("a", 1)
    v1 = ServedName("a", 1, first, tmp_path)
    assert names.publish(v1) is None
    lease = names.acquire("a")
    assert lease is not None and lease.version == 1 and names.acquire("b") is None
    assert names.publish(ServedName("a", 2, names.new_name("a", 2), tmp_path)) is None
    assert names.acquire("a").version == 2  # type: ignore[union-attr]
    assert names.release(lease) is v1  # the last request on v1: now it may be unloaded
    base = names.acquire(None)
    assert base is not None and base.version == 0 and names.release(base) is None
    assert names.withdraw("a") is None  # v2 still has the lease taken above
    assert [s.version for s in names.everything()] == [2]


def test_constraints_become_structural_tags_that_continue_the_call_prefix() -> None:
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}}
    named = json.loads(structured_outputs(ToolCallSpec({"f": schema}, name="f"))["structural_tag"])
    assert named["format"]["type"] == "sequence"
    assert [e["type"] for e in named["format"]["elements"]] == ["json_schema", "const_string"]
    picked = json.loads(
        structured_outputs(ToolCallSpec({"f": schema, "g": None}))["structural_tag"]
    )
    heads = [b["elements"][0]["value"] for b in picked["format"]["elements"]]
    assert heads == ['f", "arguments": ', 'g", "arguments": ']
    plain = json.loads(structured_outputs(JSONSchemaSpec(None))["structural_tag"])
    assert plain["format"]["json_schema"] == {"type": "object"}
    with pytest.raises(InvalidRequestError):  # no object satisfies it: refused before sending
        structured_outputs(
            JSONSchemaSpec({"type": "object", "required": ["x"], "additionalProperties": False})
        )
    with pytest.raises(InvalidRequestError):
        structured_outputs(ToolCallSpec({"f": None}, name="g"))


def _fake_server(tokenizer: Any, *, processed: bool, tokenize_as: list[int] | None = None) -> Any:
    """A vLLM server's start-up answers: one base model; top-2 logprobs whose gap doubles at
    temperature 0.5 when `processed` (logits / T), and stays put when raw."""

    def handler(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/health":
            return httpx.Response(200)
        if path == "/metrics":
            return httpx.Response(404)
        if path == "/v1/models":
            entry = {"id": "tiny", "root": "/elsewhere", "parent": None, "max_model_len": 2048}
            return httpx.Response(200, json={"data": [entry]})
        if path == "/tokenize":
            prompt = json.loads(request.content)["prompt"]
            ids = tokenize_as or tokenizer.encode(prompt, add_special_tokens=False)
            return httpx.Response(200, json={"tokens": ids})
        body = json.loads(request.content)
        scale = 1.0 / body["temperature"] if processed else 1.0
        logits = [2.0 * scale, 1.0 * scale, 0.0]
        norm = math.log(sum(math.exp(x) for x in logits))
        top = {f"token_id:{i}": x - norm for i, x in enumerate(logits)}
        return httpx.Response(200, json={"choices": [{"logprobs": {"top_logprobs": [top]}}]})

    return httpx.MockTransport(handler)


def _engine(model_dir: Path, transport: Any) -> VLLMEngine:
    config = EngineConfig(kind="vllm", vllm={"urls": ["http://vllm.test"]})  # type: ignore[arg-type]
    return VLLMEngine(model_dir, config, model_name="t", transport=transport)


async def test_start_refuses_raw_logprobs_and_another_tokenizer(tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    good = _engine(tiny_model_dir, _fake_server(tokenizer, processed=True))
    await good.start()
    assert good.served_model == "tiny" and good.max_model_len == 2048
    await good.stop()
    with pytest.raises(ConfigError, match="--logprobs-mode processed_logprobs"):
        await _engine(tiny_model_dir, _fake_server(tokenizer, processed=False)).start()
    with pytest.raises(ConfigError, match="tokenizer differs"):
        await _engine(
            tiny_model_dir, _fake_server(tokenizer, processed=True, tokenize_as=[1])
        ).start()


def test_clora_serve_engine_vllm_without_a_url_supervises_a_local_server(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from clora_feedback import service
    from clora_feedback.cli.main import main
    from clora_feedback.config import Settings

    seen: list[Settings] = []
    monkeypatch.setattr(service, "serve", seen.append)
    monkeypatch.setenv("CLORA_DATA_DIR", str(tmp_path))
    assert main(["serve", "--engine", "vllm"]) == 0
    local = seen[-1].engine.vllm.local
    assert local.enabled and local.log_dir == tmp_path / "vllm"
    urls = ["--vllm-url", "http://a:8000", "--vllm-url", "http://b:8000"]
    assert main(["serve", "--engine", "vllm", *urls]) == 0
    vllm = seen[-1].engine.vllm
    assert vllm.urls == ["http://a:8000", "http://b:8000"] and not vllm.local.enabled


def test_the_supervisor_runs_vllm_with_what_the_engine_needs(tmp_path: Path) -> None:
    from clora_feedback.engine.vllm.supervisor import VLLMSupervisor, lora_rank_bucket

    config = EngineConfig(
        kind="vllm",
        max_lora_rank=12,
        max_loras=3,
        vllm={"local": {"enabled": True, "venv": tmp_path / "venv", "kv_cache_gib": 3}},  # type: ignore[arg-type]
    )
    supervisor = VLLMSupervisor(tmp_path / "model", config)
    command = supervisor.command()
    flags = dict(zip(command[3::2], command[4::2], strict=False))
    assert command[:3] == [str((tmp_path / "venv" / "bin" / "vllm").resolve()), "serve",
                           str(tmp_path / "model")]  # fmt: skip
    assert "--enable-lora" in command and "--logprobs-mode" in command
    assert command[command.index("--logprobs-mode") + 1] == "processed_logprobs"
    assert command[command.index("--max-lora-rank") + 1] == "16" == str(lora_rank_bucket(12))
    assert command[command.index("--max-loras") + 1] == "3"
    assert flags["--host"] == "127.0.0.1" and supervisor.url.endswith(f":{supervisor.port}")
    env = supervisor.environment()
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "3" and "VLLM_CPU_OMP_THREADS_BIND" in env


async def test_the_supervisor_refuses_without_vllm_and_reports_a_crash_with_its_log(
    tmp_path: Path,
) -> None:
    from clora_feedback.engine.vllm.supervisor import VLLMSupervisor

    venv = tmp_path / "venv"
    config = EngineConfig(
        kind="vllm",
        vllm={"startup_timeout_s": 60, "local": {"venv": venv, "log_dir": tmp_path / "logs"}},  # type: ignore[arg-type]
    )
    with pytest.raises(ConfigError, match=r"install_vllm\.sh"):
        await VLLMSupervisor(tmp_path, config).start()
    (venv / "bin").mkdir(parents=True)
    fake = venv / "bin" / "vllm"
    fake.write_text("#!/bin/sh\necho 'ValueError: no such model' >&2\nexit 3\n")
    fake.chmod(0o755)
    with pytest.raises(EngineUnavailableError, match=r"(?s)exited with 3.*no such model"):
        await VLLMSupervisor(tmp_path, config).start()
