"""Admin routes for adapter versions: list, inspect, roll back, pin.

    GET  /v1/adapters                               agents: active version, pinned, counts
    GET  /v1/adapters/{agent}/versions              versions with metrics and status
    GET  /v1/adapters/{agent}/versions/{version}    one version, with its manifest
    POST /v1/adapters/{agent}/rollback              {"version": N, "reason": "..."}
    POST /v1/adapters/{agent}/pin                   freeze training
    POST /v1/adapters/{agent}/unpin                 let training publish again
    POST /v1/adapters/{agent}/gate                  {"version": N}: run the offline gate now
    POST /v1/adapters/{agent}/promote               {"version": N?}: serve it (default the canary)
    POST /v1/adapters/{agent}/abort                 stop the live canary (share 0 at once)
    POST /v1/adapters/{agent}/cases                 {"cases": [...]}: add operator eval cases

The release routes answer 409 `release_off` when the release path is off; the
versions list carries each version's release record (state and evidence).

An agent declared in the config before its first version (served by the base
model, listed by `/v1/models` at adapter version 0) is listed here too, with no
active version and an empty version list: the routes read the gateway's agents
(`app.state.gateway.agents`, when the router is mounted on a gateway) beside
the registry, so every route gives one answer about which agents exist.

Every route needs the admin key (`auth.admin_principal`). Failures are
`CloraError`s, mapped to OpenAI error JSON by `gateway.errors`: 404 for an
unknown agent or version, 409 for a rollback to the active version or one that
raced another change, 400 for a bad body or a version outside 1..2**63-1 (the
registry's 64-bit integers), naming `version`.

A rollback is the deployer's (`Deployer.activate`, see
`clora_feedback.engine.deployer` for the one order every move follows): the
engine loads and validates version N first, so a version that fails to load
never becomes active and the previous one keeps serving; then the registry's
pointer moves with a compare-and-set; if that fails, the engine is brought
back to what the pointer still names. Engine and registry therefore disagree
at most for the duration of the request, and the engine serves version N from
its next decode step.

`rollback_adapter` and `set_pinned` are the actions themselves, shared with the
operator console (`gateway.console`), so both take the same path.

Not here: the wire models (`clora_feedback.schemas.admin`), the registry itself
(`clora_feedback.store.registry`), vLLM's runtime
`load_lora_adapter` routes (`routes`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi import Path as PathParam

from clora_feedback.engine.deployer import Deployer
from clora_feedback.errors import ConflictError, InvalidRequestError, NotFoundError
from clora_feedback.gateway.auth import admin_principal
from clora_feedback.release.controller import ReleaseController
from clora_feedback.schemas.admin import (
    MAX_VERSION,
    AdapterVersionList,
    AdapterVersionObject,
    AgentAdaptersList,
    AgentAdaptersObject,
    CasesRequest,
    CasesResult,
    ReleaseActionRequest,
    ReleaseActionResult,
    RollbackRequest,
    RollbackResult,
)
from clora_feedback.store.versions import AdapterStore, AgentInfo, VersionInfo, check_pointer_move

log = logging.getLogger(__name__)


DEFAULT_ROLLBACK_REASON = "rolled back by an operator through the admin API"
VersionNumber = Annotated[int, PathParam(ge=1, le=MAX_VERSION)]
"""A version in a path: bounded like `RollbackRequest.version` (400 beyond, naming it)."""


def build_adapters_router(
    registry: AdapterStore,
    deployer: Deployer | None = None,
    release: ReleaseController | None = None,
) -> APIRouter:
    """The admin router over `registry`; mount it with `app.include_router(...)`.

    Args:
        registry: the adapter store (its blocking calls run in worker threads).
        deployer: moves the pointer on rollback and brings its engine along (None: the
            registry pointer alone moves, e.g. when no engine runs here; a deployer
            elsewhere follows it).
        release: the release path (None: off; its routes answer 409 `release_off`).

    Returns:
        An `APIRouter` whose routes all require the admin key.
    """
    router = APIRouter(
        prefix="/v1/adapters", tags=["adapters"], dependencies=[Depends(admin_principal)]
    )

    @router.get("")
    async def list_adapters(request: Request) -> AgentAdaptersList:
        agents = await asyncio.to_thread(registry.agents)
        known = {a.agent for a in agents}
        agents += [_unversioned(name) for name in _declared(request) if name not in known]
        return AgentAdaptersList(data=[AgentAdaptersObject.of(a) for a in agents])

    @router.get("/{agent}/versions")
    async def list_versions(agent: str, request: Request) -> AdapterVersionList:
        def read() -> tuple[AgentInfo, list[VersionInfo]]:
            try:
                return registry.agent(agent), registry.versions(agent)
            except NotFoundError:
                if agent in _declared(request):
                    return _unversioned(agent), []
                raise

        info, versions = await asyncio.to_thread(read)
        records = {} if release is None else await asyncio.to_thread(release.book.of_agent, agent)
        return AdapterVersionList(
            agent=agent,
            active_version=info.active_version,
            pinned=info.pinned,
            data=[AdapterVersionObject.of(v, release=records.get(v.version)) for v in versions],
        )

    @router.get("/{agent}/versions/{version}")
    async def get_version(agent: str, version: VersionNumber) -> AdapterVersionObject:
        def read() -> AdapterVersionObject:
            record = None if release is None else release.book.get(agent, version)
            return AdapterVersionObject.of(
                registry.get(agent, version), registry.manifest(agent, version), record
            )

        return await asyncio.to_thread(read)

    @router.post("/{agent}/rollback")
    async def rollback(agent: str, body: RollbackRequest) -> RollbackResult:
        return await rollback_adapter(registry, deployer, agent, body)

    @router.post("/{agent}/pin")
    async def pin(agent: str) -> AgentAdaptersObject:
        return await set_pinned(registry, agent, True)

    @router.post("/{agent}/unpin")
    async def unpin(agent: str) -> AgentAdaptersObject:
        return await set_pinned(registry, agent, False)

    @router.post("/{agent}/gate")
    async def gate(agent: str, body: ReleaseActionRequest) -> ReleaseActionResult:
        return await release_action(release, agent, "gate", body)

    @router.post("/{agent}/promote")
    async def promote(agent: str, body: ReleaseActionRequest) -> ReleaseActionResult:
        return await release_action(release, agent, "promote", body)

    @router.post("/{agent}/abort")
    async def abort(agent: str, body: ReleaseActionRequest) -> ReleaseActionResult:
        return await release_action(release, agent, "abort", body)

    @router.post("/{agent}/cases")
    async def cases(agent: str, body: CasesRequest) -> CasesResult:
        evalset = None if release is None else release.evalset
        if evalset is None:
            raise ConflictError("the offline gate is off: no evaluation cases", code="release_off")
        added = await asyncio.to_thread(evalset.add_operator_cases, agent, body.cases)
        return CasesResult(agent=agent, added=added)

    return router


async def release_action(
    release: ReleaseController | None, agent: str, action: str, body: ReleaseActionRequest
) -> ReleaseActionResult:
    """An operator's gate, promote or abort (the routes above; the CLI calls them).

    Raises:
        ConflictError: the release path is off (`release_off`), the version is rejected or
            serving, or no canary runs (404 `no_canary` for promote/abort without one).
        InvalidRequestError: `gate` without a version.
        NotFoundError: unknown agent or version.
    """
    if release is None:
        raise ConflictError("the release path is off (release.enabled)", code="release_off")
    reason = (body.reason or "").strip() or f"{action} by an operator through the admin API"
    if action == "gate":
        if body.version is None:
            raise InvalidRequestError("name the version to gate", param="version")
        verdict = await release.gate_now(agent, body.version)
        return ReleaseActionResult(agent=agent, version=body.version, action="gate",
                                   state=verdict.verdict, reason=verdict.reason,
                                   evidence=verdict.evidence)  # fmt: skip
    if action == "promote":
        version = await release.promote(agent, body.version, reason=reason)
        state = "promoted"
    else:
        version = await release.abort(agent, reason=reason)
        state = "aborted"
    log.warning("agent %s: v%d %s by an operator: %s", agent, version, state, reason)
    return ReleaseActionResult(agent=agent, version=version, action=action,
                               state=state, reason=reason)  # fmt: skip


def _declared(request: Request) -> list[str]:
    """The agents the gateway serves (configured ones included), when mounted on one."""
    state = getattr(request.app.state, "gateway", None)
    return state.agents.names() if state is not None else []


def _unversioned(agent: str) -> AgentInfo:
    """A declared agent the registry does not know yet: the base model serves it."""
    return AgentInfo(
        agent=agent,
        active_version=None,
        pinned=False,
        num_versions=0,
        latest_version=None,
        activated_by=None,
        activated_at=None,
    )


async def rollback_adapter(
    registry: AdapterStore, deployer: Deployer | None, agent: str, body: RollbackRequest
) -> RollbackResult:
    """Make `body.version` serve `agent` again: the one rollback path (these routes, the console).

    Raises:
        NotFoundError: unknown agent or version.
        ConflictError: the version is already active, or the pointer moved meanwhile.
        AdapterError: the engine could not load the version (the previous one keeps serving).
    """
    reason = (body.reason or "").strip() or DEFAULT_ROLLBACK_REASON
    target, info = await asyncio.to_thread(
        lambda: (registry.get(agent, body.version), registry.agent(agent))
    )
    previous = info.active_version
    check_pointer_move(agent, previous, target.version, expected_active=None)
    if deployer is not None:
        await deployer.activate(agent, target.version, expected_active=previous, reason=reason)
    else:
        await asyncio.to_thread(
            registry.rollback, agent, target.version, reason=reason, expected_active=previous
        )
    versions = await asyncio.to_thread(registry.versions, agent)
    return RollbackResult(
        agent=agent,
        previous_version=previous,
        active_version=target.version,
        reason=reason,
        rolled_back=[
            v.version for v in versions if v.version > target.version and v.status == "rolled_back"
        ],
    )


async def set_pinned(registry: AdapterStore, agent: str, pinned: bool) -> AgentAdaptersObject:
    """Pin (freeze training of) or unpin `agent`: the one path (these routes, the console).

    Raises:
        NotFoundError: unknown agent.
    """
    change = registry.pin if pinned else registry.unpin
    return AgentAdaptersObject.of(await asyncio.to_thread(change, agent))
