"""The asyncio side of a request: a queue the engine thread pushes chunks into.

The engine runs its decode loop on its own thread; each request's consumer
lives on an asyncio event loop. `RequestStreamImpl` is the bridge: the engine
calls `push` from its thread, the consumer iterates with `async for`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

from clora_feedback.engine.types import RequestOutput
from clora_feedback.errors import CloraError, EngineError


class RequestStreamImpl:
    """Async iterator over one request's `RequestOutput` chunks (implements `RequestStream`)."""

    def __init__(
        self, request_id: str, loop: asyncio.AbstractEventLoop, on_abort: Callable[[str], None]
    ):
        self.request_id = request_id
        self._loop = loop
        self._queue: asyncio.Queue[RequestOutput | CloraError] = asyncio.Queue()
        self._on_abort = on_abort
        self._done = False

    def push(self, item: RequestOutput | CloraError) -> None:
        """Thread-safe: hand a chunk (or a failure) to the consumer."""
        # RuntimeError: the consumer's loop is closed, so nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    def abort(self) -> None:
        if not self._done:
            self._done = True
            self._on_abort(self.request_id)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        try:
            while True:
                item = await self._queue.get()
                if isinstance(item, CloraError):
                    self._done = True
                    raise item
                if item.finished:
                    self._done = True
                yield item
                if item.finished:
                    return
        finally:
            # Consumer went away early (client disconnect, cancellation): free the batch row.
            if not self._done:
                self.abort()

    async def collect(self) -> list[RequestOutput]:
        """Drain the stream into a list (convenience for non-streaming callers)."""
        return [chunk async for chunk in self]


def engine_failure(exc: BaseException) -> CloraError:
    return exc if isinstance(exc, CloraError) else EngineError(f"engine step failed: {exc!r}")
