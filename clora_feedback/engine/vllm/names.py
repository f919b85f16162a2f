"""Versioned adapter names on a vLLM server: which name new requests get, and when a name may go.

Each load of an adapter version gets a name never used before on the server,
`<agent>@v<version>+<engine tag>.<load serial>`: the engine tag is random per
engine instance (two gateways, or a restarted one, never share a name), the
serial counts loads (a rollback to an earlier version loads it under a fresh
name). vLLM keys its prefix cache and its adapter slots by name, so a fresh name
per load means no KV block computed under one version is ever reused under
another (vllm#42125), and `load_inplace` is never needed (vllm#33791).

A request takes a `Lease` on the agent's live name when it is admitted and
keeps it to its end, so every token of it comes from that version. A name that
stops being live (a newer version was loaded, or the agent was unloaded) is
*retired*; it is unloaded from the server once its last lease is released.

Plain bookkeeping on one event loop: no I/O, no locks.

Not here: the HTTP calls (see `client`), when to load (the deployer).
"""

from __future__ import annotations

import itertools
import secrets
from dataclasses import dataclass
from pathlib import Path


@dataclass(eq=False)
class ServedName:
    """One adapter version loaded on the server under one name.

    Attributes:
        agent: the public agent name.
        version: the registry version it serves.
        name: the server-side adapter name (the request's `model`).
        path: the PEFT directory it was loaded from.
        leases: requests in flight on it.
        retired: no longer what new requests get; unloaded when `leases` reaches 0.
    """

    agent: str
    version: int
    name: str
    path: Path
    leases: int = 0
    retired: bool = False

    @property
    def drained(self) -> bool:
        return self.retired and self.leases == 0


@dataclass(frozen=True)
class Lease:
    """A request's hold on a name: `name` is sent, `version` recorded on every token."""

    served: ServedName | None  # None: the base model

    @property
    def version(self) -> int:
        return 0 if self.served is None else self.served.version


class AdapterNames:
    """The live name per agent and the retired names still draining."""

    def __init__(self, tag: str | None = None) -> None:
        self.tag = tag or secrets.token_hex(3)
        self._serial = itertools.count(1)
        self._live: dict[str, ServedName] = {}
        self._draining: list[ServedName] = []

    def new_name(self, agent: str, version: int) -> str:
        """A name no earlier load used (on any engine instance)."""
        return f"{agent}@v{version}+{self.tag}.{next(self._serial)}"

    def live(self, agent: str) -> ServedName | None:
        return self._live.get(agent)

    def versions(self) -> dict[str, int]:
        return {agent: s.version for agent, s in self._live.items()}

    def publish(self, served: ServedName) -> ServedName | None:
        """Make `served` what new requests for its agent get; returns the retired name,
        if it is drained already (the caller unloads it now)."""
        old = self._live.get(served.agent)
        self._live[served.agent] = served
        return self._retire(old)

    def withdraw(self, agent: str) -> ServedName | None:
        """No name serves `agent` any more; returns the retired name if already drained."""
        return self._retire(self._live.pop(agent, None))

    def _retire(self, old: ServedName | None) -> ServedName | None:
        if old is None:
            return None
        old.retired = True
        if old.drained:
            return old
        self._draining.append(old)
        return None

    def acquire(self, agent: str | None) -> Lease | None:
        """A lease on `agent`'s live name (None agent: the base model); None if it has none."""
        if agent is None:
            return Lease(None)
        served = self._live.get(agent)
        if served is None:
            return None
        served.leases += 1
        return Lease(served)

    def release(self, lease: Lease) -> ServedName | None:
        """End a lease; returns its name when that was the last lease of a retired name."""
        served = lease.served
        if served is None:
            return None
        served.leases -= 1
        if served.drained and served in self._draining:
            self._draining.remove(served)
            return served
        return None

    def find(self, name: str) -> ServedName | None:
        """The live or draining name `name` (a server-side adapter name), if any."""
        return next((s for s in self.everything() if s.name == name), None)

    def is_ours(self, name: str) -> bool:
        """Whether `name` was made by this instance (`new_name`)."""
        return name.rpartition("+")[2].startswith(f"{self.tag}.")

    def everything(self) -> list[ServedName]:
        """Every name still on the server (live and draining), e.g. to unload at stop."""
        return [*self._live.values(), *self._draining]

    def clear(self) -> None:
        self._live.clear()
        self._draining.clear()
