"""Server-sent events, OpenAI style, and client-disconnect detection.

A stream is `data: {json}\\n\\n` events ending with `data: [DONE]\\n\\n`.
`SSEResponse` always listens for the client's disconnect while streaming
(Starlette only does so for ASGI servers older than spec 2.4) and cancels the
body iterator at once when it comes, so the generator's `finally` aborts the
engine requests before the next decode step rather than at the next token write.

`run_unless_disconnected` does the same for non-streamed responses: a client
that hangs up while its completion is generating cancels the generation.

`openai_stream` frames a handler's events: it adds the final `[DONE]`, and a
failure midway ends the stream with an OpenAI error event and `[DONE]` (the
HTTP status is long sent by then).

Not here: what the events contain (see `chat`, `completions`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine
from typing import Any, TypeVar

import anyio
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from clora_feedback.errors import CloraError, EngineError
from clora_feedback.gateway.errors import error_event

log = logging.getLogger(__name__)
_T = TypeVar("_T")

DONE = "data: [DONE]\n\n"


def sse_event(payload: dict[str, Any]) -> str:
    """One `data:` event (compact JSON, non-ASCII kept as is)."""
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def openai_stream(
    events: AsyncGenerator[str, None], *, name: str, on_exit: Callable[[], None]
) -> AsyncIterator[str]:
    """`events`, then `[DONE]`; a failure ends the stream with an error event and `[DONE]`.

    Args:
        events: the `data:` events of one response.
        name: what is streamed, for the log of an unexpected failure.
        on_exit: called however the stream ends (it aborts the engine requests).
    """
    try:
        async with contextlib.aclosing(events):  # a client that left closes `events` now
            async for event in events:
                yield event
    except CloraError as exc:
        yield sse_event(error_event(exc))
    except Exception:
        log.exception("%s failed", name)
        yield sse_event(error_event(EngineError("the stream failed; see the server log")))
    finally:
        on_exit()
    yield DONE


class ClientDisconnected(Exception):
    """The client closed the connection before the response was ready."""


class SSEResponse(StreamingResponse):
    """`text/event-stream` response whose body stops as soon as the client leaves.

    Args:
        content: the events.
        on_close: called once the response is over, however it ended; it covers a
            client that leaves before the body iterator ever started (whose `finally`
            would then never run).
    """

    media_type = "text/event-stream"

    def __init__(
        self, content: AsyncIterator[str], *, on_close: Callable[[], None] | None = None
    ) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def stream_then_stop() -> None:
                    with contextlib.suppress(OSError):  # the client vanished mid-write
                        await self.stream_response(send)
                    group.cancel_scope.cancel()

                async def watch_disconnect() -> None:
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    group.cancel_scope.cancel()

                group.start_soon(stream_then_stop)
                group.start_soon(watch_disconnect)
        finally:
            if self._on_close is not None:
                self._on_close()


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def run_unless_disconnected(request: Request, work: Coroutine[Any, Any, _T]) -> _T:
    """Await `work`, cancelling it if the client disconnects first.

    Raises:
        ClientDisconnected: the client left; `work` was cancelled (its cleanup ran).
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task.cancelled() or not task.done():
        await asyncio.gather(task, return_exceptions=True)
        raise ClientDisconnected("the client disconnected before the completion finished")
    return task.result()
