"""What the worker commands (`clora ingest`, `clora train`) share: the `--store-url` check and
running a worker until SIGTERM or SIGINT.

Not here: the workers (`clora_feedback.service.workers`), each command's flags.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable


def checked_store_url(url: str | None) -> str | None:
    """`url` if it is a PostgreSQL URL, by the settings' own rule (None: not given)."""
    from pydantic import ValidationError

    from clora_feedback.config import Settings
    from clora_feedback.errors import InvalidRequestError

    if url is None:
        return None
    try:
        checked = Settings(store_url=url).store_url
    except ValidationError as exc:
        message = exc.errors()[0]["msg"]
        raise InvalidRequestError(f"--store-url: {message}", param="store_url") from exc
    if checked is None:  # blank text: the setting's "unset"
        raise InvalidRequestError("--store-url is empty", param="store_url")
    return checked


async def until_signalled(run: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    """`run(stop)` with `stop` set on SIGTERM or SIGINT (a worker's `run`)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await run(stop)
