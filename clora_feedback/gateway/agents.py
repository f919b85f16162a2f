"""The agent registry: which `model` names exist and what serves each of them.

A `model` in a request is either the base model's name (`engine.model_name`)
or an agent name. Agents come from two places:
- configuration (`Settings.agents`); an agent's initial PEFT adapter is
  imported into the registry by the composition root before the gateway starts
  (`service.parts.register_initial`), and served like any version;
- `POST /v1/load_lora_adapter`, which creates the agent if it is new.

Choice, documented: an agent without an adapter is served by the base model.
Its requests go to the engine with `agent=None` and report adapter version 0
(`BASE_VERSION`), but the trajectory still records the agent's name, so a new
agent collects training data from its first request.

Unloading an adapter of a configured agent falls back to the base model; an
agent that only existed because an adapter was loaded at runtime disappears.

What serves each agent is the deployer's (`clora_feedback.engine.deployer`):
a load adopts the adapter as a new immutable registry version and activates
it, an unload deactivates the agent's pointer, and every live version reported
here (`Route.adapter_version`, `version`) is `Deployer.serving`. So a version
the trainer published, or a rollback, is seen at once; an agent served from
the registry but not configured (loaded at runtime before a restart, or in
another process) is listed too. While a release's canary runs, `resolve` asks the
release (`canary_route`) whether the request's sticky key goes to the canary arm.

Not here: HTTP (see `handlers`), reading adapter files (see `lora.peft_io`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clora_feedback.config import AgentConfig
from clora_feedback.engine.base import Engine
from clora_feedback.engine.deployer import Deployer
from clora_feedback.engine.types import BASE_VERSION
from clora_feedback.errors import InvalidRequestError, NotFoundError
from clora_feedback.gateway.auth import model_not_found
from clora_feedback.lora.weights import LoRALimits
from clora_feedback.release.canary import sticky_key as release_sticky_key

log = logging.getLogger(__name__)


CanaryRoute = Callable[[str, str], "tuple[str, int] | None"]
"""(agent, sticky key) -> (engine name, version) of its canary arm when the key goes there."""


def sticky_key(body: Any, request_id: str) -> str:
    """What keeps a request on one release arm: `metadata.conversation_id`, else `user`,
    else the request itself (`release.canary.sticky_key`)."""
    metadata = getattr(body, "metadata", None) or {}
    return release_sticky_key(metadata.get("conversation_id"), getattr(body, "user", None),
                              request_id)  # fmt: skip


@dataclass(frozen=True)
class Route:
    """How one request's `model` is served.

    Attributes:
        model: the name the client asked for.
        agent: the agent (recorded in the trajectory); None for the bare base model.
        engine_agent: what goes into `GenerationRequest.agent`: the agent when it
            has an adapter, None when the base model serves it.
        adapter_version: the version served at routing time (0 = base model), from
            `Deployer.serving`.
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
        source: the directory the adapter loaded here at runtime came from, if any.
    """

    name: str
    created: int
    from_config: bool
    source: Path | None = None


class AgentRegistry:
    """Agents, their adapters and the routing of `model` names.

    Args:
        engine: the serving engine (its model name and adapter limits).
        deployer: what serves each agent, and the one way to load or unload an adapter.
    """

    def __init__(self, engine: Engine, deployer: Deployer) -> None:
        self._engine = engine
        self.deployer = deployer
        self._agents: dict[str, AgentInfo] = {}
        self._lock = asyncio.Lock()
        self.created = int(time.time())
        self.canary_route: CanaryRoute | None = None
        """The release's arm choice (`ReleaseController.route`); None: no canaries."""

    @property
    def base_model(self) -> str:
        return self._engine.model_name

    @property
    def limits(self) -> LoRALimits:
        return self._engine.lora_limits

    async def start(self, agents: Iterable[AgentConfig]) -> None:
        """Register configured agents (what serves them is the deployer's).

        Raises:
            InvalidRequestError: an agent is named like the base model.
        """
        for config in agents:
            self._check_name_free_of_base(config.name, param="agents")
            self._agents[config.name] = AgentInfo(config.name, int(time.time()), from_config=True)

    def version(self, name: str) -> int | None:
        """The version served for agent `name` (None: the base model serves it)."""
        return self.deployer.serving(name)

    def names(self) -> list[str]:
        """Agent names: registered ones in order, then others the deployer serves."""
        return [info.name for info in self.agents()]

    def agents(self) -> list[AgentInfo]:
        # A runtime agent exists while something serves it, wherever it was loaded.
        known = [
            info
            for info in self._agents.values()
            if info.from_config or self.version(info.name) is not None
        ]
        served = sorted(set(self.deployer.served()) - set(self._agents))
        return known + [self._adopted(name) for name in served]

    def get(self, name: str) -> AgentInfo | None:
        info = self._agents.get(name)
        if info is not None:
            return info if info.from_config or self.version(name) is not None else None
        return self._adopted(name) if self.version(name) is not None else None

    def _adopted(self, name: str) -> AgentInfo:
        """A served agent this table did not register (restart, another process)."""
        info = self._agents.get(name)
        if info is None:
            info = self._agents[name] = AgentInfo(name, int(time.time()), from_config=False)
        return info

    def resolve(self, model: str, *, sticky: str | None = None) -> Route:
        """Route a request's `model`; with `sticky` (see `sticky_key`), a live canary of the
        agent may serve it (`arm` says which).

        Raises:
            NotFoundError: neither the base model nor a registered agent (param `model`).
        """
        if model == self.base_model:
            return Route(model, agent=None, engine_agent=None, adapter_version=BASE_VERSION)
        if self.get(model) is None:
            raise model_not_found(model)  # the same answer as for another key's model
        if sticky is not None and self.canary_route is not None:
            arm = self.canary_route(model, sticky)
            if arm is not None:
                # The canary's engine name and version (recorded with the trajectory).
                return Route(model, model, engine_agent=arm[0], adapter_version=arm[1])
        live = self.version(model)
        if live is None:
            return Route(model, agent=model, engine_agent=None, adapter_version=BASE_VERSION)
        return Route(model, agent=model, engine_agent=model, adapter_version=live)

    async def load_adapter(self, name: str, path: Path, *, replace: bool = False) -> int:
        """Read a PEFT adapter and serve it for `name` as a new version (`Deployer.adopt`).

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
            if self.version(name) is not None and not replace:
                raise InvalidRequestError(
                    f"The lora adapter '{name}' has already been loaded.",
                    param="lora_name",
                    code="lora_already_loaded",
                )
            version = await self.deployer.adopt(name, Path(path))
            info = self._agents.get(name)
            if info is None:
                info = self._agents[name] = AgentInfo(name, int(time.time()), from_config=False)
            info.source = Path(path)
            return version

    async def unload_adapter(self, name: str) -> None:
        """Stop serving `name`'s adapter (`Deployer.deactivate`): a configured agent falls
        back to the base model, and is not trained until an adapter is loaded again.

        Raises:
            NotFoundError: the agent has no adapter loaded.
        """
        async with self._lock:
            if self.get(name) is None or self.version(name) is None:
                raise NotFoundError(
                    f"The lora adapter '{name}' cannot be found.",
                    param="lora_name",
                    code="lora_not_found",
                )
            await self.deployer.deactivate(name)
            info = self._agents[name]
            info.source = None
            if not info.from_config:
                del self._agents[name]

    def _check_name_free_of_base(self, name: str, *, param: str) -> None:
        if name == self.base_model:
            raise InvalidRequestError(
                f"{name!r} is the base model's name and cannot be an agent",
                param=param,
                code="name_conflict",
            )
