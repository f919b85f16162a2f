"""Prompt rendering and tokenisation off the event loop.

Applying a chat template to a long conversation and tokenising a big prompt
are CPU work measured in seconds for megabyte prompts; on the event loop they
would stall every other request, `/health` included. `off_loop` runs them on
one dedicated worker thread: prompts are still prepared one at a time, as they
were on the loop (a Hugging Face tokenizer is not promised to be safe for
concurrent encodes), but the loop keeps serving meanwhile, and a queue of big
prompts waits without holding the default executor's threads (the trajectory
store uses those).

A small prompt is prepared inline instead: rendering and tokenising a short
chat takes ~0.2 ms here, while the hop to the worker thread and back costs
~1 ms on a busy 2-core box (a thread wake-up and two handovers of the
interpreter lock), the largest part of what the gateway adds to a short
request. `size` is what the caller knows of the work (the request body's
bytes, the prompt's characters); up to `INLINE_MAX_BYTES` it runs on the loop,
which it then holds for well under a millisecond.

Not here: what is rendered (see `chat`, `completions`).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from starlette.requests import Request

_T = TypeVar("_T")


@functools.cache
def _worker() -> ThreadPoolExecutor:
    # One per process, started on first use; its idle thread costs nothing.
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="clora-tokenize")


INLINE_MAX_BYTES = 8 * 1024
"""Largest `size` prepared on the event loop itself."""


async def off_loop(work: Callable[[], _T], *, size: int | None = None) -> _T:
    """Run `work` on the tokenising thread and return its result (or raise its error);
    inline when `size` (bytes or characters of its input) is known and at most
    `INLINE_MAX_BYTES`."""
    if size is not None and size <= INLINE_MAX_BYTES:
        return work()
    return await asyncio.get_running_loop().run_in_executor(_worker(), work)


def body_size(request: Request) -> int | None:
    """The request body's declared bytes (`Content-Length`); None when not declared."""
    declared = request.headers.get("content-length", "")
    return int(declared) if declared.isdigit() else None
