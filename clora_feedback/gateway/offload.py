"""Prompt rendering and tokenisation off the event loop.

Applying a chat template to a long conversation and tokenising a big prompt
are CPU work measured in seconds for megabyte prompts; on the event loop they
would stall every other request, `/health` included. `off_loop` runs them on
one dedicated worker thread: prompts are still prepared one at a time, as they
were on the loop (a Hugging Face tokenizer is not promised to be safe for
concurrent encodes), but the loop keeps serving meanwhile, and a queue of big
prompts waits without holding the default executor's threads (the trajectory
store uses those).

Not here: what is rendered (see `chat`, `completions`).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

_T = TypeVar("_T")


@functools.cache
def _worker() -> ThreadPoolExecutor:
    # One per process, started on first use; its idle thread costs nothing.
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="clora-tokenize")


async def off_loop(work: Callable[[], _T]) -> _T:
    """Run `work` on the tokenising thread and return its result (or raise its error)."""
    return await asyncio.get_running_loop().run_in_executor(_worker(), work)
