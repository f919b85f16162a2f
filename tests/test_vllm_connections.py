"""The vLLM engine keeps one keep-alive connection per server instead of one per request.

A streamed completion used to be dropped at vLLM's finish chunk (or at
`[DONE]`), before the body's end: httpx then closes the connection, so every
request opened a new one and vLLM saw every client leave. The engine now reads
a finished stream to its end after the final output went out, and still closes
at once a stream it stops itself (a stop string), which is what makes vLLM stop.

The first test runs on a small vLLM stand-in on uvicorn (vLLM's own server),
whose answers are the shapes the real server sends, and counts the client
ports vLLM saw; the others run on the loopback stand-in of `vllm_stand_in`
(aiohttp's server, which cancels a request whose client left, as vLLM aborts
it) and watch which streams keep their connection and which are closed. No
timings.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from aiohttp import web
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from transformers import AutoTokenizer
from vllm_stand_in import client_port, serve, sse, start_up_answer

from clora_feedback.config import EngineConfig
from clora_feedback.engine.types import GenerationRequest, SamplingParams
from clora_feedback.engine.vllm import VLLMEngine
from clora_feedback.engine.vllm.client import VLLMClient


def _models() -> dict[str, Any]:
    entry = {"id": "tiny", "root": "/elsewhere", "parent": None, "max_model_len": 512}
    return {"data": [entry]}


def _probe(temperature: float) -> dict[str, Any]:
    """The logprobs probe's answer of a server in `raw_logprobs` mode (temperature plays no part)."""
    del temperature
    logits = [2.0, 1.0, 0.0]
    norm = math.log(sum(math.exp(x) for x in logits))
    top = {f"token_id:{i}": x - norm for i, x in enumerate(logits)}
    return {"choices": [{"logprobs": {"top_logprobs": [top]}}]}


def _chunk(token_ids: list[int], finish: str | None) -> str:
    logprobs = {"token_logprobs": [-0.5] * len(token_ids), "top_logprobs": [None] * len(token_ids)}
    choice = {"index": 0, "token_ids": token_ids, "finish_reason": finish, "logprobs": logprobs}
    return f"data: {json.dumps({'choices': [choice]})}\n\n"


def _engine(model_dir: Path, url: str) -> Any:
    config = EngineConfig(kind="vllm", vllm={"urls": [url]}, max_model_len=512)
    return VLLMEngine(model_dir, config, model_name="t")


@pytest.fixture
def vllm_stand_in(tiny_model_dir: Path) -> Iterator[tuple[str, list[int]]]:
    """A vLLM stand-in on a real socket; yields its URL and the client port of each
    streamed completion it served."""
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    ports: list[int] = []

    async def completions(request: Request) -> Response:
        body = await request.json()
        if not body.get("stream"):
            return JSONResponse(_probe(body["temperature"]))
        assert request.client is not None
        ports.append(request.client.port)

        async def events() -> AsyncIterator[str]:
            yield _chunk([65], None)
            yield _chunk([66], "length")
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def tokenize(request: Request) -> Response:
        prompt = (await request.json())["prompt"]
        return JSONResponse({"tokens": tokenizer.encode(prompt, add_special_tokens=False)})

    app = Starlette(
        routes=[
            Route("/health", lambda request: Response(status_code=200)),
            Route("/metrics", lambda request: Response(status_code=404)),
            Route("/v1/models", lambda request: JSONResponse(_models())),
            Route("/tokenize", tokenize, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
        ]
    )
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    for _ in range(1000):  # a guard against a hang, not a timing
        if server.started:
            break
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", ports
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


async def test_sequential_requests_reuse_one_connection(
    tiny_model_dir: Path, vllm_stand_in: tuple[str, list[int]]
) -> None:
    url, ports = vllm_stand_in
    engine = _engine(tiny_model_dir, url)
    await engine.start()
    try:
        for i in range(4):
            request = GenerationRequest(f"r{i}", None, [70, 71], SamplingParams(max_tokens=2))
            chunks = [c async for c in engine.add_request(request)]
            assert [t.token_id for c in chunks for t in c.tokens] == [65, 66]
            assert chunks[-1].finished and chunks[-1].finish_reason == "length"
    finally:
        await engine.stop()
    assert len(ports) == 4 and len(set(ports)) == 1, ports


async def test_a_finished_stream_is_read_to_its_end_and_a_stream_stopped_here_is_closed(
    tiny_model_dir: Path,
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    ab = list(tokenizer.encode("ab", add_special_tokens=False))
    ports: dict[int, int] = {}  # per prompt: the client port its stream came on
    left = asyncio.Event()  # the client of prompt 71 closed its stream midway

    async def events(key: int) -> AsyncIterator[str]:
        yield _chunk(ab, None)
        if key == 71:  # the engine stops this one at its stop string "b"
            await asyncio.Event().wait()  # until the client leaves
        yield _chunk(ab, "length") + "data: [DONE]\n\n"

    async def handler(request: web.Request) -> web.StreamResponse:
        answer = await start_up_answer(request, tokenizer, max_model_len=512)
        if answer is not None:
            return answer
        key = (await request.json())["prompt"][0]
        ports[key] = client_port(request)
        try:
            return await sse(request, events(key))
        except asyncio.CancelledError:
            left.set()
            raise

    async with serve(handler) as url:
        engine = _engine(tiny_model_dir, url)
        await engine.start()
        try:
            finished = GenerationRequest("full", None, [70], SamplingParams(max_tokens=4))
            chunks = [c async for c in engine.add_request(finished)]
            assert chunks[-1].finish_reason == "length"
            sp = SamplingParams(max_tokens=4, stop=("b",))
            chunks = [c async for c in engine.add_request(GenerationRequest("cut", None, [71], sp))]
            assert chunks[-1].finish_reason == "stop" and "".join(c.text for c in chunks) == "a"
            await asyncio.wait_for(left.wait(), 60)  # a guard against a hang, not a timing
        finally:
            await engine.stop()
    assert ports[71] == ports[70]  # the finished stream was read to its end: its connection
    # went back to the pool (the only one idle: the start-up calls each read theirs to the end)


async def test_a_stream_closed_or_cancelled_midway_closes_its_connection() -> None:
    ports: list[int] = []  # the client port of each stream, in order
    left: asyncio.Queue[int] = asyncio.Queue()  # the ports whose client left midway
    go_on = asyncio.Event()

    async def events() -> AsyncIterator[str]:
        yield _chunk([5], None)
        await go_on.wait()
        yield _chunk([6], "length") + "data: [DONE]\n\n"

    async def handler(request: web.Request) -> web.StreamResponse:
        port = client_port(request)
        ports.append(port)
        try:
            return await sse(request, events())
        except asyncio.CancelledError:
            left.put_nowait(port)
            raise

    async def read_on(client: VLLMClient, first: asyncio.Event) -> None:
        async for _ in client.stream({"stream": True}):
            first.set()  # then it waits inside the stream for the next chunk

    async with serve(handler) as url:
        client = VLLMClient(url)
        try:
            async with contextlib.aclosing(client.stream({"stream": True})) as chunks:
                await anext(chunks)  # closed after its first chunk
            assert await asyncio.wait_for(left.get(), 60) == ports[0]  # a guard, not a timing
            first = asyncio.Event()
            task = asyncio.get_running_loop().create_task(read_on(client, first))
            await asyncio.wait_for(first.wait(), 60)
            task.cancel()  # cancelled while it waits for its second chunk
            with contextlib.suppress(asyncio.CancelledError):
                await task
            assert await asyncio.wait_for(left.get(), 60) == ports[1]
            go_on.set()
            whole = [c["choices"][0]["token_ids"] async for c in client.stream({"stream": True})]
            again = [c["choices"][0]["token_ids"] async for c in client.stream({"stream": True})]
        finally:
            await client.close()
    assert whole == again == [[5], [6]]
    assert len(set(ports[:3])) == 3 and ports[3] == ports[2]  # two closed, then one kept
