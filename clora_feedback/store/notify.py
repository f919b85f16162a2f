"""Pointer notifications: LISTEN for the registry's `NOTIFY clora_adapters, '<agent>'` (PostgreSQL).

Every transaction that moves an agent's active pointer sends the notification
(`registry_schema.notify_pointer_moved`); PostgreSQL delivers it to every
listening connection once the transaction commits, and never for one rolled
back. `listen_pointer_moves` keeps one psycopg 3 async connection (autocommit)
listening: each notification calls `on_moved(agent)`. When the connection fails
it reconnects with a capped back-off, and after every (re)connect it calls
`on_connected()`, because a notification sent while nothing listened is lost:
the caller resynchronises everything then. Polling stays the caller's fallback.

Not here: what a pointer move means (`registry`), what a deployer does about it
(`clora_feedback.engine.deployer`). SQLite has no notifications.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from clora_feedback.store.db import redact
from clora_feedback.store.registry.schema import POINTER_CHANNEL

log = logging.getLogger(__name__)

MAX_BACKOFF_S = 5.0


async def listen_pointer_moves(
    url: str,
    on_moved: Callable[[str], None],
    on_connected: Callable[[], Awaitable[None]],
    *,
    channel: str = POINTER_CHANNEL,
) -> None:
    """Listen until cancelled; reconnects on any connection failure.

    Args:
        url: the registry's `postgresql://` URL.
        on_moved: called on the event loop with the agent named by each notification.
        on_connected: awaited after every successful LISTEN (catch up on missed moves);
            its `CloraError`s are the caller's to log, other errors end this loop.
        channel: the notification channel.
    """
    import psycopg

    backoff = 0.1
    while True:
        try:
            conn = await psycopg.AsyncConnection.connect(url, autocommit=True, connect_timeout=10)
        except psycopg.Error as exc:
            log.warning("pointer notifications: cannot connect to %s (%s)", redact(url), exc)
            await asyncio.sleep(backoff)
            backoff = min(MAX_BACKOFF_S, backoff * 2)
            continue
        try:
            async with conn:
                await conn.execute(f"LISTEN {channel}")
                log.info("pointer notifications: listening on %s", channel)
                backoff = 0.1
                await on_connected()
                async for notice in conn.notifies():
                    on_moved(notice.payload)
        except psycopg.Error as exc:
            log.warning("pointer notifications: connection lost (%s); reconnecting", exc)
            await asyncio.sleep(backoff)
            backoff = min(MAX_BACKOFF_S, backoff * 2)
