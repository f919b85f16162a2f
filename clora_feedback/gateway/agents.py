"""The agent registry: which `model` names exist and what serves each of them.

A `model` in a request is either the base model's name (`engine.model_name`)
or an agent name. Agents come from two places:
- configuration (`Settings.agents`), optionally with an initial PEFT adapter
  loaded at startup as version 1 (or the next version the `VersionSource` hands out);
- `POST /v1/load_lora_adapter`, which creates the agent if it is new.

Choice, documented: an agent without an adapter is served by the base model.
Its requests go to the engine with `agent=None` and report adapter version 0
(`BASE_VERSION`), but the trajectory still records the agent's name, so a new
agent collects training data from its first request.

Unloading an adapter of a configured agent falls back to the base model; an
agent that only existed because an adapter was loaded at runtime disappears.

Version numbers come from a `VersionSource`: monotonic per agent, in memory for
now (`InMemoryVersions`); the persistent adapter registry plugs in behind the
same small Protocol.

Not here: HTTP (see `admin`), reading adapter files (see `lora.peft_io`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from clora_feedback.config import AgentConfig
from clora_feedback.engine.base import Engine
from clora_feedback.engine.types import BASE_VERSION
from clora_feedback.errors import InvalidRequestError, NotFoundError
from clora_feedback.lora.peft_io import load_peft_adapter
from clora_feedback.lora.weights import LoRALimits, LoRAWeights

log = logging.getLogger(__name__)


class VersionSource(Protocol):
    """Numbers (and, with a registry, records) the adapters loaded at runtime.

    The seam for the persistent version registry: `clora_feedback.service`
    plugs in one that publishes every loaded adapter as an immutable version.
    """

    def adopt(self, agent: str, path: Path, weights: LoRAWeights) -> int:
        """Record an adapter loaded from `path` for `agent`; returns its new version number,
        greater than every one handed out before for `agent`. Blocking (may write files)."""
        ...


class InMemoryVersions:
    """Monotonic per-agent counters that live as long as the process."""

    def __init__(self) -> None:
        self._last: dict[str, int] = {}

    def adopt(self, agent: str, path: Path, weights: LoRAWeights) -> int:
        version = self._last.get(agent, BASE_VERSION) + 1
        self._last[agent] = version
        return version


@dataclass(frozen=True)
class Route:
    """How one request's `model` is served.

    Attributes:
        model: the name the client asked for.
        agent: the agent (recorded in the trajectory); None for the bare base model.
        engine_agent: what goes into `GenerationRequest.agent`: the agent when it
            has an adapter, None when the base model serves it.
        adapter_version: the live adapter version at routing time (0 = base model).
    """

    model: str
    agent: str | None
    engine_agent: str | None
    adapter_version: int


@dataclass
class AgentInfo:
    """One registered agent.

    Attributes:
        name: the public agent name (= `model` in requests).
        created: unix time the agent was registered.
        from_config: declared in settings (survives unloading its adapter).
        adapter_path: the directory the live adapter came from, if any.
        adapter_version: the live adapter version, or None when the base model serves it.
    """

    name: str
    created: int
    from_config: bool
    adapter_path: Path | None = None
    adapter_version: int | None = None


class AgentRegistry:
    """Agents, their adapters and the routing of `model` names.

    Args:
        engine: the engine that holds the adapters.
        versions: where version numbers come from (default: in memory).
    """

    def __init__(self, engine: Engine, *, versions: VersionSource | None = None) -> None:
        self._engine = engine
        self._versions: VersionSource = versions or InMemoryVersions()
        self._agents: dict[str, AgentInfo] = {}
        self._lock = asyncio.Lock()
        self.created = int(time.time())

    @property
    def base_model(self) -> str:
        return self._engine.model_name

    @property
    def limits(self) -> LoRALimits:
        return self._engine.lora_limits

    async def start(self, agents: Iterable[AgentConfig]) -> None:
        """Register configured agents and load their initial adapters.

        Raises:
            InvalidRequestError: an agent is named like the base model.
            AdapterError: an initial adapter is missing, malformed or too large.
        """
        for config in agents:
            self._check_name_free_of_base(config.name, param="agents")
            self._agents[config.name] = AgentInfo(config.name, int(time.time()), from_config=True)
            if config.adapter_path is not None:
                version = await self.load_adapter(config.name, config.adapter_path, replace=True)
                log.info(
                    "agent %s: adapter %s loaded as version %d",
                    config.name,
                    config.adapter_path,
                    version,
                )

    def names(self) -> list[str]:
        """Agent names in registration order."""
        return list(self._agents)

    def agents(self) -> list[AgentInfo]:
        return list(self._agents.values())

    def get(self, name: str) -> AgentInfo | None:
        return self._agents.get(name)

    def resolve(self, model: str) -> Route:
        """Route a request's `model`.

        Raises:
            NotFoundError: neither the base model nor a registered agent (param `model`).
        """
        if model == self.base_model:
            return Route(model, agent=None, engine_agent=None, adapter_version=BASE_VERSION)
        info = self._agents.get(model)
        if info is None:
            raise NotFoundError(
                f"The model `{model}` does not exist. GET /v1/models lists the agents served here.",
                param="model",
                code="model_not_found",
            )
        # The engine is the source of truth: a trainer may publish newer versions directly.
        live = self._engine.adapter_version(model)
        if live is None:
            return Route(model, agent=model, engine_agent=None, adapter_version=BASE_VERSION)
        return Route(model, agent=model, engine_agent=model, adapter_version=live)

    async def load_adapter(self, name: str, path: Path, *, replace: bool = False) -> int:
        """Read a PEFT adapter and install it for `name` as a new version.

        The files are read and validated off the event loop before the engine is
        touched, so a bad adapter never disturbs the one being served.

        Args:
            name: agent name; created when new.
            path: PEFT adapter directory.
            replace: install over a loaded adapter (vLLM's `load_inplace`) instead of refusing.

        Returns:
            The new adapter version.

        Raises:
            InvalidRequestError: the agent already has an adapter and `replace` is false,
                or the name is the base model's.
            AdapterError: the adapter is missing, malformed or exceeds the engine's limits.
        """
        self._check_name_free_of_base(name, param="lora_name")
        async with self._lock:
            info = self._agents.get(name)
            if info is not None and info.adapter_version is not None and not replace:
                raise InvalidRequestError(
                    f"The lora adapter '{name}' has already been loaded.",
                    param="lora_name",
                    code="lora_already_loaded",
                )
            weights: LoRAWeights = await asyncio.to_thread(
                load_peft_adapter, Path(path), limits=self.limits
            )
            version = await asyncio.to_thread(self._versions.adopt, name, Path(path), weights)
            self._engine.set_adapter(name, version, weights)
            if info is None:
                info = AgentInfo(name, int(time.time()), from_config=False)
                self._agents[name] = info
            info.adapter_path = Path(path)
            info.adapter_version = version
            return version

    def restore(self, name: str, version: int) -> None:
        """Register an agent whose adapter the caller already installed in the engine
        (e.g. its active version from the registry after a restart)."""
        info = self._agents.get(name)
        if info is None:
            info = AgentInfo(name, int(time.time()), from_config=False)
            self._agents[name] = info
        info.adapter_version = version

    async def unload_adapter(self, name: str) -> None:
        """Remove `name`'s adapter; a configured agent falls back to the base model.

        Raises:
            NotFoundError: the agent has no adapter loaded.
        """
        async with self._lock:
            info = self._agents.get(name)
            if info is None or info.adapter_version is None:
                raise NotFoundError(
                    f"The lora adapter '{name}' cannot be found.",
                    param="lora_name",
                    code="lora_not_found",
                )
            self._engine.remove_adapter(name)
            info.adapter_version = None
            info.adapter_path = None
            if not info.from_config:
                del self._agents[name]

    def _check_name_free_of_base(self, name: str, *, param: str) -> None:
        if name == self.base_model:
            raise InvalidRequestError(
                f"{name!r} is the base model's name and cannot be an agent",
                param=param,
                code="name_conflict",
            )
