"""`clora bench serve --engine vllm`'s direct baseline is the gateway's own request (no server).

The first vLLM run of this benchmark compared the gateway with a "direct"
request whose prompt was `list(tokenizer.apply_chat_template(..., tokenize=True))`:
on transformers 5 that is a `BatchEncoding`, and its list is its keys, so vLLM
got the two text prompts `"input_ids"` and `"attention_mask"` (two choices of a
few tokens) instead of the gateway's 52-token prompt. The missing prefill read
as a fixed ~1.2 s "gateway gap". These tests pin the baseline to the prompt ids
the gateway recorded and to the body the engine sends; vLLM is a loopback
stand-in (`vllm_stand_in.serve`) that reads prompts the way the real server does
(a list of ints is one prompt, a list of strings is one prompt each).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from vllm_stand_in import serve

from clora_feedback.bench import vllm_serve
from clora_feedback.config import EngineConfig
from clora_feedback.engine.types import GenerationRequest, SamplingParams
from clora_feedback.engine.vllm import VLLMEngine
from clora_feedback.errors import EngineError
from clora_feedback.store.trajectories import SampleRecord, TrajectoryRecord, TrajectoryStore


@pytest.fixture
def engine(tiny_model_dir: Path) -> VLLMEngine:
    config = EngineConfig(
        kind="vllm",
        model=str(tiny_model_dir),
        vllm={"urls": ["http://vllm.test"], "served_model_name": "base"},
    )
    return VLLMEngine(tiny_model_dir, config)


@contextlib.asynccontextmanager
async def _session(handler: Any) -> AsyncIterator[aiohttp.ClientSession]:
    """A client session on a loopback server answering every request with `handler`."""
    async with serve(handler) as url, aiohttp.ClientSession(url) as session:
        yield session


def _gateway(recorded: dict[str, list[int]], store: TrajectoryStore) -> Any:
    """A gateway stand-in that records each chat completion's prompt ids, like the real one."""

    async def reply(request: web.Request) -> web.Response:
        body = await request.json()
        prompt = body["messages"][0]["content"]
        cid = f"chatcmpl-{len(recorded)}"
        recorded[cid] = [3 + (ord(c) % 50) for c in prompt]  # any ids, distinct per prompt
        sample = SampleRecord(0, "x", [7], [-0.1], [0], "length")
        store.record(
            TrajectoryRecord(cid, "bench", 0, "chat", body, recorded[cid], [sample], time.time())
        )
        return web.json_response({"id": cid, "usage": {"completion_tokens": 1}})

    return _session(reply)


def _vllm(seen: list[dict[str, Any]]) -> Any:
    """vLLM's `/v1/completions` as it reads prompts: ids are one prompt, strings one each."""

    async def reply(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append(body)
        prompt = body["prompt"]
        one = all(isinstance(t, int) for t in prompt)
        prompts = [prompt] if one else [[1, 2] for _ in prompt]  # a text prompt: 2 tokens here
        choices = [{"index": i, "text": "a", "token_ids": [9]} for i in range(len(prompts))]
        usage = {"prompt_tokens": sum(len(p) for p in prompts)}
        return web.json_response({"choices": choices, "usage": usage})

    return _session(reply)


async def test_the_direct_baseline_sends_the_gateways_recorded_prompt_ids_in_the_engines_body(
    engine: VLLMEngine, tmp_path: Path
) -> None:
    recorded: dict[str, list[int]] = {}
    seen: list[dict[str, Any]] = []
    with TrajectoryStore(tmp_path / "t.db") as store:
        async with _gateway(recorded, store) as gw, _vllm(seen) as direct:
            ids = await vllm_serve.gateway_prompt_ids(gw, direct, store, engine)
    assert ids == list(recorded.values()) and len(ids) == len(vllm_serve.PROMPTS)
    # the check request went out with the first prompt's ids, as one list of ints
    assert seen[0]["prompt"] == ids[0] and seen[0]["model"] == "base"
    # the timed bodies are exactly what the engine sends (streamed, logprobs, token ids)
    body = vllm_serve._direct_body(engine, ids[1], 64)
    assert body["prompt"] == ids[1] and all(isinstance(t, int) for t in body["prompt"])
    sampling = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    request = GenerationRequest("r", None, ids[1], sampling)
    assert body == {"model": "base", **engine.completion_body(request)}
    assert body["stream"] is True and body["logprobs"] == 0 and body["return_token_ids"] is True


async def test_a_baseline_vllm_reads_as_several_prompts_is_refused(
    engine: VLLMEngine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The old rendering: the keys of a BatchEncoding instead of its ids.
    keys = {"model": "base", "prompt": ["input_ids", "attention_mask"]}
    monkeypatch.setattr(vllm_serve, "_direct_body", lambda engine, ids, new_tokens: keys)
    with TrajectoryStore(tmp_path / "t.db") as store:
        async with _gateway({}, store) as gw, _vllm([]) as direct:
            with pytest.raises(EngineError, match="2 prompts"):
                await vllm_serve.gateway_prompt_ids(gw, direct, store, engine)


async def test_a_streamed_direct_reply_with_a_second_choice_is_refused() -> None:
    chunks = [
        {"choices": [{"index": 0, "token_ids": [5]}]},
        {"choices": [{"index": 1, "token_ids": [6]}]},
    ]
    sse = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"

    def answer(text: str) -> Any:
        async def reply(request: web.Request) -> web.Response:
            return web.Response(text=text, content_type="text/event-stream")

        return _session(reply)

    async with answer(sse) as http:
        with pytest.raises(EngineError, match="several completions"):
            await vllm_serve._direct(http, {"prompt": ["input_ids", "attention_mask"]})
    one = "data: " + json.dumps(chunks[0]) + "\n\ndata: [DONE]\n\n"
    async with answer(one) as http:
        assert await vllm_serve._direct(http, {"prompt": [1, 2, 3]}) == 1


def test_process_cpu_s_reads_a_processes_own_cpu_time_from_proc() -> None:
    import os
    import subprocess
    import sys

    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys\nx = 0\nfor i in range(5_000_000): x += i\nsys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
    )
    try:
        first = vllm_serve.process_cpu_s(child.pid)
        assert first is not None and first >= 0.0
        deadline = time.monotonic() + 60
        while (now := vllm_serve.process_cpu_s(child.pid)) is not None and now <= first:
            assert time.monotonic() < deadline, "the child's CPU time never grew"
            time.sleep(0.05)
        assert now is not None and now > first  # the busy loop's CPU is counted
    finally:
        child.communicate(b"")
    assert vllm_serve.process_cpu_s(child.pid) is None  # gone: no /proc entry
    assert vllm_serve.process_cpu_s(None) is None
    assert vllm_serve.process_cpu_s(os.getpid()) is not None
