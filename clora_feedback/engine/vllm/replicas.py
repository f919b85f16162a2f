"""The vLLM engine's replica set: health, placement by rendezvous hashing, loaded names per replica.

Placement: each agent ranks the replicas by a rendezvous (highest random
weight) hash of `(replica url, agent)`; its home is the first that is up, and it
spills over to the next in its own order when the home is down or full. Adding
or removing a replica moves only the agents whose first choice it is (about
1/N of them), so adapters stay where they are already loaded. Base-model
requests (no adapter) go to the least busy replica that is up.

Loaded names: a replica keeps at most `max_loras` adapter names loaded (from
the server's `/metrics` when it reports them, else the config). An adapter is
loaded where a request needs it, on first use; to make room the least recently
used name with no request in flight on that replica is unloaded. A replica
whose every name is in use is full; when all are, a request waits (up to
`queue_timeout_s`) for a name to go idle, as it would wait in an engine queue.

Health: `poll` asks every replica's `/health`; one that fails `health_failures`
polls in a row (or one poll right after a request on it failed) is taken out
(its loaded set forgotten, `on_down` called so the engine fails its in-flight
requests with a retriable 503). One that answers again is admitted back after
the engine's start-up checks (`admit`), and what it still has loaded is
reconciled with what is wanted (a restarted server has lost everything).

One event loop; loads and unloads on a replica are serialised by its lock.

Not here: HTTP (see `client`), which version a name serves (see `names`), streaming (see `engine`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import re
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from clora_feedback.engine.vllm.names import ServedName
from clora_feedback.errors import CloraError, EngineUnavailableError, OverloadedError

log = logging.getLogger(__name__)

_MAX_LORA = re.compile(r'^vllm:lora_requests_info\{[^}]*max_lora="(\d+)"', re.MULTILINE)


class ReplicaClient(Protocol):
    """What the replica set needs of one server (`VLLMClient`; fakes in tests)."""

    async def healthy(self, timeout_s: float | None = None) -> bool: ...

    async def load_lora(self, name: str, path: str) -> None: ...

    async def unload_lora(self, name: str) -> None: ...

    async def models(self) -> list[dict[str, Any]]: ...

    async def metrics_text(self) -> str | None: ...


def rendezvous_score(url: str, key: str) -> int:
    """The rendezvous hash weight of replica `url` for `key` (stable across processes)."""
    digest = hashlib.blake2b(f"{url}\0{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def max_loras_from_metrics(text: str | None) -> int | None:
    """`--max-loras` as vLLM's Prometheus `vllm:lora_requests_info{max_lora=...}` reports it
    (present once the server has logged stats; None before or without LoRA)."""
    match = _MAX_LORA.search(text or "")
    return int(match.group(1)) if match else None


@dataclass(eq=False)
class Replica:
    """One vLLM server.

    Attributes:
        url: its base URL (the hash key).
        client: its HTTP client.
        max_loras: most adapter names kept loaded on it (its `--max-cpu-loras` when
            configured, else its `--max-loras` as it reports them).
        fixed_max_loras: `max_loras` is configured: what the server reports does not
            replace it.
        up: answering `/health` and admitted; only up replicas get requests.
        loaded: names loaded on it, least recently used first.
        inflight: requests in flight per name (the base model under "").
        lock: serialises its loads and unloads.
    """

    url: str
    client: ReplicaClient
    max_loras: int
    fixed_max_loras: bool = False
    up: bool = False
    loaded: OrderedDict[str, ServedName] = field(default_factory=OrderedDict)
    inflight: Counter[str] = field(default_factory=Counter)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    failed_polls: int = 0

    @property
    def busy(self) -> int:
        return sum(self.inflight.values())

    def idle_lru(self) -> str | None:
        """The least recently used loaded name with nothing in flight here, if any."""
        return next((n for n in self.loaded if self.inflight[n] == 0), None)


class ReplicaSet:
    """The replicas of one engine, and where each adapter name is loaded.

    Args:
        replicas: the servers, in configuration order.
        on_down: called when a replica is taken out (the engine fails its requests).
        admit: start-up checks a replica passes before it is up (raises to keep it out).
        wanted: the served name behind a server-side adapter name, if still live or draining.
        ours: whether a server-side name was loaded by this engine (its tag).
        health_timeout_s: longest wait for one `/health` answer.
        health_failures: failed polls in a row that take a replica out.
        queue_timeout_s: how long a request waits for a replica to have room for its
            adapter (a name in use going idle) before it fails with 429.
    """

    def __init__(
        self,
        replicas: Sequence[Replica],
        *,
        on_down: Callable[[Replica], None],
        admit: Callable[[Replica], Awaitable[None]],
        wanted: Callable[[str], ServedName | None],
        ours: Callable[[str], bool],
        health_timeout_s: float = 2.0,
        queue_timeout_s: float = 60.0,
        health_failures: int = 3,
    ) -> None:
        self.replicas = list(replicas)
        self._on_down = on_down
        self._admit = admit
        self._wanted = wanted
        self._ours = ours
        self._health_timeout_s = health_timeout_s
        self._queue_timeout_s = queue_timeout_s
        self._health_failures = health_failures
        self._idle = asyncio.Event()  # set when a loaded name's last request ends

    def order(self, key: str) -> list[Replica]:
        """Every replica, `key`'s first choice first (rendezvous hashing)."""
        return sorted(self.replicas, key=lambda r: rendezvous_score(r.url, key), reverse=True)

    def up(self) -> list[Replica]:
        return [r for r in self.replicas if r.up]

    def home(self, agent: str) -> Replica | None:
        """The replica `agent`'s requests go to first: its first choice that is up."""
        return next((r for r in self.order(agent) if r.up), None)

    # -- placement ------------------------------------------------------------------

    async def place(self, served: ServedName | None, key: str) -> Replica:
        """The replica to send a request to, with `served` loaded there; counts it in flight.

        Raises:
            EngineUnavailableError: no replica is up.
            OverloadedError: every replica that is up is full of names in use.
            AdapterError: a replica refused to load the adapter.
        """
        if served is None:
            ups = [r for r in self.order(key) if r.up]
            if not ups:
                raise _none_up()
            replica = min(ups, key=lambda r: r.busy)  # ties: the key's own order
            replica.inflight[""] += 1
            return replica
        replica = await self._first_with(served)
        replica.inflight[served.name] += 1
        replica.loaded.move_to_end(served.name)
        return replica

    def release(self, replica: Replica, served: ServedName | None) -> None:
        """A request placed by `place` ended."""
        name = "" if served is None else served.name
        replica.inflight[name] -= 1
        if replica.inflight[name] <= 0:
            del replica.inflight[name]
            self._idle.set()  # a request waiting for room may now evict it

    async def load_where_needed(self, served: ServedName, previous: ServedName | None) -> None:
        """Load a new version on its agent's home (spilling over like a request would) and on
        every replica the previous version is loaded on, so each switches at once.

        Raises:
            EngineUnavailableError, OverloadedError, AdapterError: as `place`, for the home.
        """
        home = await self._first_with(served)
        for replica in self.up():
            if replica is home or previous is None or previous.name not in replica.loaded:
                continue
            try:
                await self._ensure(replica, served)
            except CloraError as exc:  # loaded there on first use instead
                log.warning("vLLM replica %s: could not preload %s: %s", replica.url,
                            served.name, exc.message)  # fmt: skip

    async def unload_everywhere(self, served: ServedName) -> None:
        """Unload a name from every replica it is loaded on (down ones just forget it)."""
        for replica in self.replicas:
            if replica.loaded.pop(served.name, None) is None or not replica.up:
                continue
            async with replica.lock:
                with contextlib.suppress(CloraError):  # a restarted server forgot it anyway
                    await replica.client.unload_lora(served.name)

    def forget(self, replica: Replica, name: str) -> None:
        """The server no longer has `name` (it restarted): load it again on next use."""
        replica.loaded.pop(name, None)

    async def _first_with(self, served: ServedName) -> Replica:
        """The first replica in `served.agent`'s order that is up and has (or makes) room for
        it; when every one is full of names in use, wait for one to go idle."""
        deadline = asyncio.get_running_loop().time() + self._queue_timeout_s
        while True:
            ups = [r for r in self.order(served.agent) if r.up]
            if not ups:
                raise _none_up()
            self._idle.clear()
            for replica in ups:
                if await self._ensure(replica, served):
                    return replica
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                raise OverloadedError(
                    "every vLLM replica is serving as many adapters as it holds; retry shortly",
                    retry_after_s=1.0,
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), remaining)

    async def _ensure(self, replica: Replica, served: ServedName) -> bool:
        """Load `served` on `replica` unless it is there; False when the replica is full or
        went down meanwhile (the caller tries the next one)."""
        if served.name in replica.loaded:
            return True
        async with replica.lock:
            if served.name in replica.loaded:
                return True
            if not replica.up:
                return False
            try:
                if len(replica.loaded) >= replica.max_loras:
                    victim = replica.idle_lru()
                    if victim is None:
                        return False
                    del replica.loaded[victim]
                    await replica.client.unload_lora(victim)
                await replica.client.load_lora(served.name, str(served.path))
            except EngineUnavailableError as exc:
                self.mark_down(replica, exc.message)
                return False
            replica.loaded[served.name] = served
            return True

    # -- health ---------------------------------------------------------------------

    def mark_down(self, replica: Replica, reason: str) -> None:
        """Take a replica out: no new requests, and its in-flight ones fail (`on_down`)."""
        if not replica.up:
            return
        replica.up = False
        replica.loaded.clear()  # unknown until it answers again (reconciled then)
        log.warning("vLLM replica %s is out: %s", replica.url, reason)
        self._on_down(replica)

    async def check(self, replica: Replica, *, suspect: bool = False) -> None:
        """Poll one replica now: take it out after `health_failures` failed polls in a row
        (at the first when `suspect`: a request on it just failed), admit it back if it
        answers. A busy server can miss one `/health` deadline; a dead one misses all."""
        ok = await replica.client.healthy(self._health_timeout_s)
        replica.failed_polls = 0 if ok else replica.failed_polls + 1
        if replica.up and not ok and (suspect or replica.failed_polls >= self._health_failures):
            self.mark_down(replica, "it stopped answering /health")
        elif not replica.up and ok:
            await self._recover(replica)

    async def poll(self) -> None:
        """`check` every replica, concurrently."""
        await asyncio.gather(*(self.check(r) for r in self.replicas))

    async def run(self, interval_s: float) -> None:
        """Poll forever (the engine runs this as a task and cancels it at stop)."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.poll()
            except Exception:  # a bug here must not stop health checking
                log.exception("vLLM replica health poll failed")

    async def bring_up(self, replica: Replica) -> None:
        """Admit a replica that answers `/health`: the checks, then reconcile its names.

        Raises:
            CloraError: a check failed (e.g. `ConfigError`: another model); it stays out.
        """
        async with replica.lock:
            if replica.up:
                return
            await self._admit(replica)
            await self._reconcile(replica)
            replica.up = True

    async def _recover(self, replica: Replica) -> None:
        try:
            await self.bring_up(replica)
        except CloraError as exc:
            log.error("vLLM replica %s answers but is kept out: %s", replica.url, exc.message)
            return
        log.info("vLLM replica %s is up (%d names loaded)", replica.url, len(replica.loaded))

    async def _reconcile(self, replica: Replica) -> None:
        """Adopt the names still loaded there that are wanted; unload our unwanted ones."""
        reported = max_loras_from_metrics(await replica.client.metrics_text())
        if reported is not None and not replica.fixed_max_loras:
            replica.max_loras = reported
        replica.loaded.clear()
        for entry in await replica.client.models():
            name = str(entry.get("id"))
            if not entry.get("parent"):
                continue
            served = self._wanted(name)
            if served is not None and len(replica.loaded) < replica.max_loras:
                replica.loaded[name] = served
            elif self._ours(name):
                await replica.client.unload_lora(name)


def _none_up() -> EngineUnavailableError:
    return EngineUnavailableError("no vLLM replica is answering; retry shortly")
