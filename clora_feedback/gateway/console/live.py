"""The console's live feed: server-sent events when versions, pointers or feedback change.

`ChangeFeed.stream()` yields SSE text for one listening page:

    retry: 3000              reconnect after 3 s if the connection drops
    id: <snapshot id>        on every event: what the page was last told about
    event: ready             once per connection, {"resumed": bool}: false means
                             something changed since the `Last-Event-ID` the
                             browser sent back (or `?last_event_id=`), and the page rereads its data
    event: agents            {"changed": [agent rows]}: a publish, a pointer move, a pin
    event: feedback          {"joined": n, "parked": n, "dead": n}: totals moved

Each response ends after `STREAM_S` seconds with `retry: 250`, and the
browser's `EventSource` reconnects at once with the last id: a stream never
holds the server's shutdown for longer than that (uvicorn waits for open
responses before it stops, and tells the app nothing), and a resumed
connection costs one shared snapshot read, not a reload of the page.

Changes are found by polling, every `console.poll_interval_s`, one snapshot
shared by every connection: the registry's agent listing and the feedback
store's event counts. Polling keeps it correct with pointer moves made by other
processes (trainers, other gateways on one PostgreSQL database) without a
notification channel of its own.

Not here: what the pages read (`views`), the route and its login (`routes`).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from clora_feedback.gateway.console.views import FeedbackReader
from clora_feedback.store.versions import AdapterStore, AgentInfo

RETRY_MS = 3000
STREAM_S = 5.0
"""Longest one response lasts; the browser reconnects at once and resumes."""

_Snapshot = tuple[dict[str, tuple[Any, ...]], dict[str, int]]


def _event(name: str, payload: dict[str, Any], event_id: str) -> str:
    data = json.dumps(payload, separators=(",", ":"))
    return f"id: {event_id}\nevent: {name}\ndata: {data}\n\n"


def snapshot_id(snapshot: _Snapshot) -> str:
    """A short digest of what a snapshot says (the SSE event id a page resumes from)."""
    keys, counts = snapshot
    text = json.dumps([sorted(keys.items()), sorted(counts.items())], default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


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

    async def stream(self, last_event_id: str | None = None) -> AsyncIterator[str]:
        """SSE text for one connection: `STREAM_S` seconds, or until the client leaves.

        Args:
            last_event_id: the browser's `Last-Event-ID` (a reconnect): `ready` says
                whether anything changed since.
        """
        yield f"retry: {RETRY_MS}\n\n"
        snapshot, _ = await self.snapshot()
        keys, counts = snapshot
        current = snapshot_id(snapshot)
        yield _event("ready", {"resumed": last_event_id == current}, current)
        started = self._clock()
        while self._clock() - started < STREAM_S:
            await asyncio.sleep(min(self.interval_s, STREAM_S))
            snapshot, agents = await self.snapshot()
            new_keys, new_counts = snapshot
            current = snapshot_id(snapshot)
            changed = [_agent_json(agents[n]) for n, k in new_keys.items() if keys.get(n) != k]
            if changed:
                yield _event("agents", {"changed": changed}, current)
            if new_counts != counts:
                totals = {k: new_counts.get(k, 0) for k in ("joined", "parked", "dead")}
                yield _event("feedback", totals, current)
            keys, counts = new_keys, new_counts
        yield "retry: 250\n\n"  # a planned end: come back at once, with the last id
