"""Admin routes for adapter versions: list, inspect, roll back, pin.

    GET  /v1/adapters                               agents: active version, pinned, counts
    GET  /v1/adapters/{agent}/versions              versions with metrics and status
    GET  /v1/adapters/{agent}/versions/{version}    one version, with its manifest
    POST /v1/adapters/{agent}/rollback              {"version": N, "reason": "..."}
    POST /v1/adapters/{agent}/pin                   freeze training
    POST /v1/adapters/{agent}/unpin                 let training publish again

Every route needs the admin key (`auth.admin_principal`). Failures are
`CloraError`s, mapped to OpenAI error JSON by `gateway.errors`: 404 for an
unknown agent or version, 409 for a rollback to the active version or one that
raced another change, 400 for a bad body.

A rollback switches the engine first (`on_activate`, which validates the
adapter before evicting anything, so a failure leaves serving untouched) and
then moves the registry's pointer with a compare-and-set; if that fails, the
engine is switched back. Engine and registry therefore disagree at most for
the duration of the request, and the engine serves version N from its next
decode step.

Not here: the registry itself (`clora_feedback.store.registry`), vLLM's runtime
`load_lora_adapter` routes (`routes`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Literal

from fastapi import APIRouter, Depends
from pydantic import BaseModel, ConfigDict, Field

from clora_feedback.errors import ConflictError
from clora_feedback.gateway.auth import admin_principal
from clora_feedback.store.versions import (
    Activation,
    AdapterStore,
    AgentInfo,
    VersionInfo,
    VersionStatus,
)

log = logging.getLogger(__name__)

OnActivate = Callable[[str, int], Awaitable[None]]
"""(agent, version) -> None: make the engine serve `version` of `agent` from its next step."""

DEFAULT_ROLLBACK_REASON = "rolled back by an operator through the admin API"


class RollbackRequest(BaseModel):
    """`POST /v1/adapters/{agent}/rollback`."""

    model_config = ConfigDict(strict=True, extra="ignore")

    version: int = Field(..., ge=1, description="The version to serve and train from again.")
    reason: str | None = Field(
        None, max_length=2000, description="Recorded on every version the rollback marks."
    )


class AdapterVersionObject(BaseModel):
    """One adapter version (`VersionInfo` on the wire)."""

    object: Literal["adapter.version"] = "adapter.version"
    agent: str
    version: int
    parent: int | None
    step: int
    status: VersionStatus
    created_at: float
    metrics: dict[str, float | None]
    feedback_window: dict[str, Any] | None
    content_hash: str
    base_model: str
    path: str
    has_optimizer_state: bool
    rolled_back_at: float | None = None
    rolled_back_reason: str | None = None
    manifest: dict[str, Any] | None = Field(
        None, description="The version's manifest.json (only on the single-version route)."
    )

    @classmethod
    def of(cls, info: VersionInfo, manifest: dict[str, Any] | None = None) -> AdapterVersionObject:
        return cls(
            agent=info.agent,
            version=info.version,
            parent=info.parent,
            step=info.step,
            status=info.status,
            created_at=info.created_at,
            metrics=dict(info.metrics),
            feedback_window=None if info.feedback_window is None else dict(info.feedback_window),
            content_hash=info.content_hash,
            base_model=info.base_model,
            path=str(info.path),
            has_optimizer_state=info.has_optimizer_state,
            rolled_back_at=info.rolled_back_at,
            rolled_back_reason=info.rolled_back_reason,
            manifest=manifest,
        )


class AgentAdaptersObject(BaseModel):
    """One agent's adapter summary (`AgentInfo` on the wire)."""

    object: Literal["adapter.agent"] = "adapter.agent"
    agent: str
    active_version: int | None
    pinned: bool
    num_versions: int
    latest_version: int | None
    activated_by: Activation | None
    activated_at: float | None

    @classmethod
    def of(cls, info: AgentInfo) -> AgentAdaptersObject:
        return cls(
            agent=info.agent,
            active_version=info.active_version,
            pinned=info.pinned,
            num_versions=info.num_versions,
            latest_version=info.latest_version,
            activated_by=info.activated_by,
            activated_at=info.activated_at,
        )


class AgentAdaptersList(BaseModel):
    """`GET /v1/adapters`."""

    object: Literal["list"] = "list"
    data: list[AgentAdaptersObject]


class AdapterVersionList(BaseModel):
    """`GET /v1/adapters/{agent}/versions`: oldest first, with the agent's pointer and pin."""

    object: Literal["list"] = "list"
    agent: str
    active_version: int | None
    pinned: bool
    data: list[AdapterVersionObject]


class RollbackResult(BaseModel):
    """The answer to a rollback."""

    object: Literal["adapter.rollback"] = "adapter.rollback"
    agent: str
    previous_version: int | None
    active_version: int
    reason: str
    rolled_back: list[int] = Field(description="Versions now marked rolled back, ascending.")


def build_adapters_router(
    registry: AdapterStore, on_activate: OnActivate | None = None
) -> APIRouter:
    """The admin router over `registry`; mount it with `app.include_router(...)`.

    Args:
        registry: the adapter store (its blocking calls run in worker threads).
        on_activate: awaited on rollback to switch the engine to the target version
            (None: the registry pointer alone moves, e.g. when no engine runs here).

    Returns:
        An `APIRouter` whose routes all require the admin key.
    """
    router = APIRouter(
        prefix="/v1/adapters", tags=["adapters"], dependencies=[Depends(admin_principal)]
    )
    rollback_lock = asyncio.Lock()  # one rollback at a time: each is engine switch + pointer move

    @router.get("")
    async def list_adapters() -> AgentAdaptersList:
        agents = await asyncio.to_thread(registry.agents)
        return AgentAdaptersList(data=[AgentAdaptersObject.of(a) for a in agents])

    @router.get("/{agent}/versions")
    async def list_versions(agent: str) -> AdapterVersionList:
        def read() -> tuple[AgentInfo, list[VersionInfo]]:
            return registry.agent(agent), registry.versions(agent)

        info, versions = await asyncio.to_thread(read)
        return AdapterVersionList(
            agent=agent,
            active_version=info.active_version,
            pinned=info.pinned,
            data=[AdapterVersionObject.of(v) for v in versions],
        )

    @router.get("/{agent}/versions/{version}")
    async def get_version(agent: str, version: int) -> AdapterVersionObject:
        def read() -> AdapterVersionObject:
            return AdapterVersionObject.of(
                registry.get(agent, version), registry.manifest(agent, version)
            )

        return await asyncio.to_thread(read)

    @router.post("/{agent}/rollback")
    async def rollback(agent: str, body: RollbackRequest) -> RollbackResult:
        reason = (body.reason or "").strip() or DEFAULT_ROLLBACK_REASON
        async with rollback_lock:
            target, info = await asyncio.to_thread(
                lambda: (registry.get(agent, body.version), registry.agent(agent))
            )
            previous = info.active_version
            if target.version == previous:
                raise ConflictError(
                    f"version {target.version} is already the active version of agent {agent!r}",
                    param="version",
                    code="already_active",
                )
            if on_activate is not None:
                await on_activate(agent, target.version)
            try:
                await asyncio.to_thread(
                    registry.rollback,
                    agent,
                    target.version,
                    reason=reason,
                    expected_active=previous,
                )
            except BaseException:
                await _switch_back(on_activate, agent, previous)
                raise
            versions = await asyncio.to_thread(registry.versions, agent)
        return RollbackResult(
            agent=agent,
            previous_version=previous,
            active_version=target.version,
            reason=reason,
            rolled_back=[
                v.version
                for v in versions
                if v.version > target.version and v.status == "rolled_back"
            ],
        )

    @router.post("/{agent}/pin")
    async def pin(agent: str) -> AgentAdaptersObject:
        return AgentAdaptersObject.of(await asyncio.to_thread(registry.pin, agent))

    @router.post("/{agent}/unpin")
    async def unpin(agent: str) -> AgentAdaptersObject:
        return AgentAdaptersObject.of(await asyncio.to_thread(registry.unpin, agent))

    return router


async def _switch_back(on_activate: OnActivate | None, agent: str, previous: int | None) -> None:
    """After a failed pointer move, put the engine back on the version the registry still names."""
    if on_activate is None or previous is None:
        return
    try:
        await on_activate(agent, previous)
    except Exception:
        log.exception("agent %s: could not switch the engine back to version %d", agent, previous)
