"""The vocabulary of adapter versions: value types and the `AdapterStore` Protocol.

The trainer, the release path and the gateway's admin routes depend on
these names only; `clora_feedback.store.registry.AdapterRegistry` is the
implementation (SQLite index + version directories), and re-exports them.

Status of a version: `active` (the agent's active pointer), `rolled_back`
(marked by a rollback past it, with the reason), `superseded` (older than the
active one), `staged` (published with `activate=False`, never activated) or
`inactive` (an unload pointed the agent at no version; a rollback to it
activates it again). `clora_feedback.store.registry.index` computes it.

Not here: any I/O.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from clora_feedback.errors import ConflictError, InvalidRequestError
from clora_feedback.schemas.admin import Activation, VersionStatus

if TYPE_CHECKING:
    import torch

    from clora_feedback.lora.weights import LoRALimits, LoRAWeights

AGENT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
"""Valid agent names: the pattern of `AgentConfig.name`, checked again because names become paths."""


@dataclass(frozen=True)
class AdapterRef:
    """An immutable adapter version, as an engine is asked to serve it.

    Attributes:
        agent: the public agent name.
        version: the registry's version number (>= 1; never reused for the agent).
        path: the version's PEFT directory (`adapter_config.json` +
            `adapter_model.safetensors`); every engine can load from it.
        weights: the same tensors already in memory, an optional fast path for an
            engine that lives in this process (`engine.types.EngineCapabilities.in_memory_adapters`);
            other engines ignore it.
    """

    agent: str
    version: int
    path: Path | None
    weights: LoRAWeights | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class VersionInfo:
    """One published adapter version, as the registry records it."""

    agent: str
    """The agent this adapter serves."""
    version: int
    """Version number: monotonic per agent, never reused (0 is the base model, never stored)."""
    parent: int | None
    """Version this one was trained from; None for an initial adapter."""
    step: int
    """The agent's optimizer step count when this version was published."""
    status: VersionStatus
    """`active`, `superseded`, `rolled_back`, `staged` or `inactive` (see the module docstring)."""
    created_at: float
    """Publish time, seconds since the epoch."""
    metrics: Mapping[str, float | None]
    """Loss and reward statistics of the step that produced it (non-finite values become None)."""
    feedback_window: Mapping[str, Any] | None
    """Which feedback trained it (e.g. reward sequence range, sample count), as the trainer gave it."""
    content_hash: str
    """sha256 over the sha256 sums of the PEFT and optimizer files (see `artifact.content_hash`)."""
    base_model: str
    """Base model the adapter was trained on (`base_model_name_or_path` in its PEFT config)."""
    path: Path
    """The version's directory: a PEFT adapter directory plus optimizer state and manifest."""
    has_optimizer_state: bool
    """Whether `optimizer.safetensors` is present (initial adapters have none)."""
    rolled_back_at: float | None = None
    """When a rollback marked this version, if one did."""
    rolled_back_reason: str | None = None
    """Why it was rolled back (the reason given with the rollback)."""
    pruned_at: float | None = None
    """When retention deleted its payload (PEFT files, optimizer state); its manifest and
    this row stay. A pruned version cannot be loaded or rolled back to (410)."""
    probe: Mapping[str, Any] | None = None
    """The no-op probe's result once run (`noop`, `prompts`, `tokens`, `seconds`, `at`)."""

    @property
    def payload_pruned(self) -> bool:
        """Whether retention deleted the payload (see `pruned_at`)."""
        return self.pruned_at is not None

    @property
    def noop(self) -> bool | None:
        """The probe found its greedy outputs identical to the base model's; None: not probed."""
        return None if self.probe is None else bool(self.probe.get("noop"))


@dataclass(frozen=True)
class AgentInfo:
    """One agent known to the registry (it has published or reserved a version number)."""

    agent: str
    """The agent name."""
    active_version: int | None
    """The version served and trained from; None until one is activated, or after an
    unload (`deactivate`): then the base model serves the agent and it is not trained."""
    pinned: bool
    """Training is frozen: `publish` refuses new versions while set."""
    num_versions: int
    """How many versions are published (any status)."""
    latest_version: int | None
    """The highest published version number, or None."""
    activated_by: Activation | None
    """How the active version became active: `publish` (a trainer's publish, or the release
    path's promotion) or `rollback`; None when none is active."""
    activated_at: float | None
    """When the active pointer last moved (a deactivation included), seconds since the epoch."""

    @property
    def deactivated(self) -> bool:
        """An unload pointed the agent at the base model: versions exist, none is active, and
        the pointer moved (candidates of an agent that never had a serving version are not an
        unload: `activated_at` is None until the pointer first moves)."""
        return (
            self.num_versions > 0 and self.active_version is None and self.activated_at is not None
        )


class AdapterStore(Protocol):
    """The seam the trainer, the release path and the gateway depend on.

    `AdapterRegistry` documents each method.
    """

    def publish(
        self,
        agent: str,
        weights: LoRAWeights,
        *,
        optimizer_state: Mapping[str, torch.Tensor] | None,
        base_model: str,
        parent: int | None,
        step: int,
        metrics: Mapping[str, float],
        feedback_window: Mapping[str, Any] | None,
        activate: bool = True,
        version: int | None = None,
    ) -> VersionInfo: ...

    def register_initial(
        self,
        agent: str,
        path: Path,
        *,
        base_model: str | None = None,
        limits: LoRALimits | None = None,
    ) -> VersionInfo: ...

    def next_version(self, agent: str) -> int: ...

    def active(self, agent: str) -> VersionInfo | None: ...

    def get(self, agent: str, version: int) -> VersionInfo: ...

    def versions(self, agent: str) -> list[VersionInfo]: ...

    def agent(self, agent: str) -> AgentInfo: ...

    def agents(self) -> list[AgentInfo]: ...

    def manifest(self, agent: str, version: int) -> dict[str, Any]: ...

    def load(
        self, agent: str, version: int, *, limits: LoRALimits | None = None
    ) -> tuple[LoRAWeights, dict[str, torch.Tensor] | None]: ...

    def rollback(
        self, agent: str, version: int, *, reason: str, expected_active: int | None = None
    ) -> VersionInfo: ...

    def deactivate(self, agent: str, *, expected_active: int) -> AgentInfo: ...

    def pin(self, agent: str) -> AgentInfo: ...

    def unpin(self, agent: str) -> AgentInfo: ...

    def is_pinned(self, agent: str) -> bool: ...

    def check_loadable(self, agent: str, version: int) -> VersionInfo: ...

    def check_source(self, path: Path) -> dict[str, Any]: ...

    def record_probe(self, agent: str, version: int, result: Mapping[str, Any]) -> bool: ...


def check_agent_name(agent: str) -> None:
    """Raise `InvalidRequestError` unless `agent` is a valid agent name (it becomes a path)."""
    if not isinstance(agent, str) or not AGENT_NAME.match(agent):
        raise InvalidRequestError(
            f"invalid agent name {agent!r}: 1-128 letters, digits or ._:- "
            "starting with a letter or digit",
            param="agent",
        )


def check_pointer_move(
    agent: str, active: int | None, version: int | None, expected_active: int | None
) -> None:
    """Refuse a pointer move that raced another one or would change nothing.

    Shared by the registry's compare-and-set and by every caller that checks
    before it touches an engine, so the refusals read the same everywhere.

    Raises:
        ConflictError: the active version is not `expected_active` (`active_changed`,
            when an expectation is given), or `version` is already active (`already_active`).
    """
    if expected_active is not None and active != expected_active:
        raise ConflictError(
            f"agent {agent!r}: the active version is {active}, not {expected_active}",
            code="active_changed",
        )
    if version is not None and version == active:
        raise ConflictError(
            f"version {version} is already the active version of agent {agent!r}",
            param="version",
            code="already_active",
        )
