"""A vLLM stand-in on a real loopback socket, for the vLLM engine's tests without a server.

`serve(handler)` runs aiohttp's web server on 127.0.0.1 (a free port) in the
test's own event loop and routes every path to `handler`; the engine's client
talks to it over real HTTP/1.1 keep-alive connections, so connection reuse,
closed streams and refused connections are the real ones. A client that
leaves cancels the handler (as vLLM aborts a request whose client left).
`start_up_answer` gives what a vLLM server answers while the engine starts
(health, metrics, models, tokenize, the logprobs-mode probe), in the shapes
the real server sends.
"""

from __future__ import annotations

import contextlib
import json
import math
import socket
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from typing import Any

from aiohttp import web

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@contextlib.asynccontextmanager
async def serve(handler: Handler) -> AsyncIterator[str]:
    """Serve `handler` for every method and path; yields the base URL (no `/v1`)."""
    app = web.Application()
    app.router.add_route("*", "/{path:.*}", handler)
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=0)
    await runner.setup()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    site = web.SockSite(runner, sock)
    await site.start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        await runner.cleanup()
        sock.close()


def refused_url() -> str:
    """A loopback URL nothing listens on (connections are refused)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def client_port(request: web.Request) -> int:
    """The client's port: one per connection, so equal ports mean a reused connection."""
    assert request.transport is not None
    return int(request.transport.get_extra_info("peername")[1])


async def sse(request: web.Request, events: AsyncIterable[bytes | str]) -> web.StreamResponse:
    """Stream `events` (each written as it comes) as `text/event-stream`, chunked."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    async for event in events:
        await response.write(event.encode() if isinstance(event, str) else event)
    await response.write_eof()
    return response


def sse_chunk(token_ids: list[int], finish: str | None) -> str:
    """One streamed `/v1/completions` event of vLLM with token ids and their logprobs."""
    logprobs = {"token_logprobs": [-0.5] * len(token_ids), "top_logprobs": [None] * len(token_ids)}
    choice = {"index": 0, "token_ids": token_ids, "finish_reason": finish, "logprobs": logprobs}
    return f"data: {json.dumps({'choices': [choice]})}\n\n"


def probe_answer(temperature: float, *, processed: bool = False) -> dict[str, Any]:
    """The logprobs probe's answer: the top-2 gap doubles at temperature 0.5 when
    `processed` (logits / T, `processed_logprobs`), and stays put when raw."""
    scale = 1.0 / temperature if processed else 1.0
    logits = [2.0 * scale, 1.0 * scale, 0.0]
    norm = math.log(sum(math.exp(x) for x in logits))
    top = {f"token_id:{i}": x - norm for i, x in enumerate(logits)}
    return {"choices": [{"logprobs": {"top_logprobs": [top]}}]}


async def start_up_answer(
    request: web.Request,
    tokenizer: Any,
    *,
    processed: bool = False,
    tokenize_as: list[int] | None = None,
    max_model_len: int = 2048,
) -> web.Response | None:
    """What a vLLM server on one base model (`tiny`) answers while the engine starts;
    None for any other request (a streamed completion, the adapter routes)."""
    path = request.path
    if path == "/health":
        return web.Response()
    if path == "/metrics":
        return web.Response(status=404)
    if path == "/v1/models":
        entry = {"id": "tiny", "root": "/elsewhere", "parent": None, "max_model_len": max_model_len}
        return web.json_response({"data": [entry]})
    if path == "/tokenize":
        prompt = (await request.json())["prompt"]
        ids = tokenize_as or tokenizer.encode(prompt, add_special_tokens=False)
        return web.json_response({"tokens": ids})
    if path == "/v1/completions":
        body = await request.json()
        if not body.get("stream"):
            return web.json_response(probe_answer(body["temperature"], processed=processed))
    return None
