"""The console's live feed: server-sent events when versions, pointers or feedback change.

`ChangeFeed.stream()` yields SSE text for one listening page:

    retry: 3000              reconnect after 3 s (EventSource does it by itself)
    event: ready             once per connection: the page reloads what it shows
    event: agents            {"changed": [agent rows]}: a publish, a pointer move, a pin
    event: feedback          {"joined": n, "parked": n, "dead": n}: totals moved
    : ping                   every `PING_S` seconds of quiet, so proxies keep it open

Changes are found by polling, every `console.poll_interval_s`, one snapshot
shared by every connection (`_Snapshots`): the registry's agent listing and
the feedback store's event counts. Polling keeps it correct with pointer moves
made by other processes (trainers, other gateways on one PostgreSQL database)
without a notification channel of its own. A reconnecting page gets `ready`
and rereads its data, so nothing that changed while it was away is missed.

Not here: what the pages read (`views`), the route and its login (`routes`).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from clora_feedback.gateway.console.views import FeedbackReader
from clora_feedback.store.versions import AdapterStore, AgentInfo

PING_S = 15.0
RETRY_MS = 3000

_Snapshot = tuple[dict[str, tuple[Any, ...]], dict[str, int]]


def _event(name: str, payload: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n"


def _agent_key(info: AgentInfo) -> tuple[Any, ...]:
    return (info.active_version, info.pinned, info.num_versions, info.latest_version,
            info.activated_by, info.activated_at)  # fmt: skip


def _agent_json(info: AgentInfo) -> dict[str, Any]:
    return {
        "agent": info.agent,
        "active_version": info.active_version,
        "pinned": info.pinned,
        "num_versions": info.num_versions,
        "latest_version": info.latest_version,
        "activated_by": info.activated_by,
        "activated_at": info.activated_at,
    }


class ChangeFeed:
    """Polls the registry and the feedback counts, shared by every listening page.

    Args:
        registry: the adapter registry.
        feedback: the feedback store (its event counts).
        interval_s: seconds between polls.
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(
        self,
        registry: AdapterStore,
        feedback: FeedbackReader,
        interval_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._registry = registry
        self._feedback = feedback
        self.interval_s = interval_s
        self._clock = clock
        self._lock = asyncio.Lock()
        self._taken_at = float("-inf")
        self._last: tuple[_Snapshot, dict[str, AgentInfo]] | None = None

    def _read(self) -> tuple[_Snapshot, dict[str, AgentInfo]]:
        agents = {a.agent: a for a in self._registry.agents()}
        counts = self._feedback.state_counts()
        keys = {name: _agent_key(info) for name, info in agents.items()}
        return (keys, counts), agents

    async def snapshot(self) -> tuple[_Snapshot, dict[str, AgentInfo]]:
        """The newest snapshot, read again only when the last is older than the interval."""
        async with self._lock:
            if self._last is None or self._clock() - self._taken_at >= self.interval_s:
                self._last = await asyncio.to_thread(self._read)
                self._taken_at = self._clock()
            return self._last

    async def stream(self) -> AsyncIterator[str]:
        """SSE text for one connection, until the client leaves (the response cancels it)."""
        yield f"retry: {RETRY_MS}\n\n"
        (keys, counts), _ = await self.snapshot()
        yield _event("ready", {"feedback": counts})
        quiet_since = self._clock()
        while True:
            await asyncio.sleep(self.interval_s)
            (new_keys, new_counts), agents = await self.snapshot()
            changed = [_agent_json(agents[n]) for n, k in new_keys.items() if keys.get(n) != k]
            if changed:
                yield _event("agents", {"changed": changed})
            if new_counts != counts:
                yield _event(
                    "feedback", {k: new_counts.get(k, 0) for k in ("joined", "parked", "dead")}
                )
            if changed or new_counts != counts:
                quiet_since = self._clock()
            elif self._clock() - quiet_since >= PING_S:
                yield ": ping\n\n"
                quiet_since = self._clock()
            keys, counts = new_keys, new_counts
