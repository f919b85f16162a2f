"""Lifecycle helpers for long-running parts: `with`, `async with` and one background task.

Every long-running part (consumer, producer, stores, trainer, release loop) has
`start()`/`stop()`; `AsyncLifecycle` adds `async with` on top, and
`BackgroundTask` is the common case of a part whose work is one asyncio task
(`start` creates it, `stop` cancels it and waits for it to finish;
`cancel_and_wait` does the same for tasks a caller holds itself). The blocking
kinds get plain `with` the same way: `Lifecycle` for a part with `start`/`stop`
(a server, a broker), `Closing` for a resource that is open once built (a store,
a client) and only needs `close`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Any, Self


class Lifecycle:
    """Mixin: `with part:` means `part.start()` ... `part.stop()`."""

    def start(self) -> object:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


class Closing:
    """Mixin: `with resource:` gives the (already open) resource and closes it at the end."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class AsyncLifecycle:
    """Mixin: `async with part:` means `await part.start()` ... `await part.stop()`."""

    async def start(self) -> None:
        raise NotImplementedError

    async def stop(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()


class BackgroundTask(AsyncLifecycle):
    """A part whose work is the coroutine `_run`, run as one task between `start` and `stop`."""

    task_name = "clora-background"
    _task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        raise NotImplementedError

    def _should_run(self) -> bool:
        """Override to stay idle (e.g. when disabled by configuration)."""
        return True

    async def start(self) -> None:
        """Begin the background work (idempotent)."""
        if self._task is None and self._should_run():
            self._task = asyncio.create_task(self._run(), name=self.task_name)

    async def stop(self) -> None:
        """Cancel the background work and wait until it has finished."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def cancel_and_wait(tasks: Sequence[asyncio.Task[Any]]) -> None:
    """Cancel `tasks` and wait until every one has finished (their results and errors dropped)."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
