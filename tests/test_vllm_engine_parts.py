"""The vLLM engine's parts without a server: error translation, versioned names, constraints.

The HTTP side runs against a vLLM stand-in on a loopback socket
(`vllm_stand_in`: vLLM's replies in the real server's shapes); the real-server
tests are `test_engine_contract.py` and `test_gateway_vllm.py` (marked `vllm`).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from transformers import AutoTokenizer
from vllm_stand_in import refused_url, serve, sse, sse_chunk, start_up_answer

from clora_feedback.config import EngineConfig
from clora_feedback.engine.types import JSONSchemaSpec, ToolCallSpec
from clora_feedback.engine.vllm import VLLMEngine
from clora_feedback.engine.vllm.client import ADAPTER_MISSING, VLLMClient
from clora_feedback.engine.vllm.guided import structured_outputs
from clora_feedback.engine.vllm.names import AdapterNames, ServedName
from clora_feedback.errors import (
    AdapterError,
    ConfigError,
    ContextLengthError,
    EngineError,
    EngineUnavailableError,
    InvalidRequestError,
    OverloadedError,
)
from clora_feedback.gateway.errors import error_response


async def test_server_errors_map_onto_ours_and_internals_stay_in_the_log() -> None:
    answer: list[tuple[int, str]] = []

    async def handler(request: web.Request) -> web.Response:
        status, message = answer[-1]
        error = {"message": message, "type": "BadRequestError", "param": None, "code": status}
        return web.json_response({"error": error}, status=status)

    async with serve(handler) as url:
        client = VLLMClient(f"{url}/v1")
        try:
            answer.append((400, "This model's maximum context length is 512 tokens. However"))
            with pytest.raises(ContextLengthError) as exc:
                await client.complete({"prompt": [1]})
            assert exc.value.param == "max_tokens" and exc.value.http_status == 400
            answer.append((400, "temperature must be >= 0"))
            with pytest.raises(InvalidRequestError, match="temperature must be"):
                await client.complete({"prompt": [1]})
            answer.append((500, "Traceback: EngineCore died at worker.py:42"))
            with pytest.raises(EngineError) as failed:
                await client.complete({})
            assert "Traceback" not in failed.value.message and failed.value.http_status == 500
            answer.append((429, "too many requests"))
            with pytest.raises(OverloadedError):
                await client.complete({})
            answer.append((503, "draining"))
            with pytest.raises(EngineUnavailableError) as unavailable:
                async for _ in client.stream({}):
                    pass
            assert unavailable.value.retriable and "draining" not in unavailable.value.message
            answer.append((404, "The model `a@v1+x` does not exist."))
            with pytest.raises(EngineUnavailableError) as lost:
                async for _ in client.stream({}):
                    pass
            assert lost.value.code == ADAPTER_MISSING
            answer.append((400, "Loading lora failed"))
            with pytest.raises(AdapterError):
                await client.load_lora("a@v1", "/nowhere")
            answer.append((404, "Not Found"))
            with pytest.raises(AdapterError, match="VLLM_ALLOW_RUNTIME_LORA_UPDATING"):
                await client.load_lora("a@v1", "/nowhere")
        finally:
            await client.close()


async def test_a_timeout_a_refused_connection_or_a_dropped_stream_is_retriable_503() -> None:
    never = asyncio.Event()

    async def handler(request: web.Request) -> web.StreamResponse:
        if request.path == "/health" or (await request.json()).get("prompt") == [1]:
            await never.wait()  # a stuck server: no byte comes (cancelled when the client leaves)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(sse_chunk([5], None).encode())
        assert request.transport is not None
        request.transport.close()  # the server dies midway through the body
        await never.wait()
        return response

    async with serve(handler) as url:
        stuck = VLLMClient(url, read_timeout_s=0.2)
        refused = VLLMClient(refused_url())
        try:
            for client, body, kind in (
                (stuck, {"prompt": [1]}, "timed out"),
                (refused, {"prompt": [1]}, "is unreachable"),
                (stuck, {"prompt": [2]}, "is unreachable"),  # one chunk, then the stream drops
            ):
                seen = []
                with pytest.raises(EngineUnavailableError, match=kind) as exc:
                    async for chunk in client.stream(body):
                        seen.append(chunk["choices"][0]["token_ids"])
                assert seen == ([[5]] if body["prompt"] == [2] else [])
                assert exc.value.retriable and exc.value.http_status == 503
                response = error_response(exc.value)
                assert response.status_code == 503 and response.headers["Retry-After"] == "1"
                assert json.loads(bytes(response.body))["error"]["code"] == "engine_unavailable"
            assert not await stuck.healthy(0.2) and not await refused.healthy()
            with pytest.raises(EngineUnavailableError, match="is unreachable"):
                await refused.models()
        finally:
            await stuck.close()
            await refused.close()


async def test_a_stream_yields_chunks_split_across_reads_and_an_error_event_raises() -> None:
    first = 'data: {"choices": [{"index": 0, "token_ids": [5], "finish_reason": null}]}\n\n'
    rest = ['data: {"error": {"message": "boom", "code": 500}}\n\n', "data: [DONE]\n\n"]

    async def events() -> Any:
        yield ": a comment line, then one event in three writes\n\n"
        for piece in (first[:9], first[9:40], first[40:]):
            yield piece
            await asyncio.sleep(0.01)  # pacing only: the pieces arrive as separate reads
        for event in rest:
            yield event

    async def handler(request: web.Request) -> web.StreamResponse:
        return await sse(request, events())

    async with serve(handler) as url:
        client = VLLMClient(url)
        seen = []
        try:
            with pytest.raises(EngineError):
                async for chunk in client.stream({}):
                    seen.append(chunk["choices"][0]["token_ids"])
        finally:
            await client.close()
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


def _engine(model_dir: Path, url: str) -> VLLMEngine:
    config = EngineConfig(kind="vllm", vllm={"urls": [url]})  # type: ignore[arg-type]
    return VLLMEngine(model_dir, config, model_name="t")


async def test_start_refuses_processed_logprobs_and_another_tokenizer(
    tiny_model_dir: Path,
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    server = {"processed": False, "tokenize_as": None}

    async def handler(request: web.Request) -> web.Response:
        answer = await start_up_answer(request, tokenizer, **server)  # type: ignore[arg-type]
        assert answer is not None, request.path
        return answer

    async with serve(handler) as url:
        good = _engine(tiny_model_dir, url)
        await good.start()
        assert good.served_model == "tiny" and good.max_model_len == 2048
        await good.stop()
        server["processed"] = True
        with pytest.raises(ConfigError, match=r"processed logprobs.*--logprobs-mode raw_logprobs"):
            await _engine(tiny_model_dir, url).start()
        server.update(processed=False, tokenize_as=[1])
        with pytest.raises(ConfigError, match="tokenizer differs"):
            await _engine(tiny_model_dir, url).start()


def test_clora_serve_engine_vllm_without_a_url_supervises_a_local_server(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from clora_feedback import service
    from clora_feedback.cli.main import main
    from clora_feedback.config import Settings
    from clora_feedback.service.parts import engine_settings

    seen: list[Settings] = []
    monkeypatch.setattr(service, "serve", seen.append)
    monkeypatch.setenv("CLORA_DATA_DIR", str(tmp_path))
    assert main(["serve", "--engine", "vllm"]) == 0
    assert seen[-1].engine.kind == "vllm" and not seen[-1].engine.vllm.urls
    # The CLI only turns flags into settings; the builder starts the local server.
    local = engine_settings(seen[-1]).engine.vllm.local
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
    assert command[command.index("--logprobs-mode") + 1] == "raw_logprobs"
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
