"""Handlers behind the non-generation routes: models, adapters, trajectories, health.

- `ModelsHandler`: `GET /v1/models` lists the base model and every agent the
  caller may use, as `openai.types.Model` objects plus vLLM's `root`/`parent`
  and a `clora` extension (`agent`, `adapter_version`).
- `AdapterAdminHandler`: vLLM's runtime adapter routes. Success is 200 with a
  plain-text message (as vLLM answers); failures are OpenAI error JSON (400
  already loaded / bad adapter, 404 unloading an unknown adapter).
- `TrajectoryHandler`: read captured trajectories, scoped by API key; delete
  them by agent or conversation (admin key).
- `health`: engine statistics for `GET /health` (agent names for the admin key only).

Not here: authentication (see `auth`), routing (see `routes`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from openai.types import Model

from clora_feedback.engine.base import Engine
from clora_feedback.engine.types import BASE_VERSION
from clora_feedback.errors import AdapterError, InvalidRequestError, PermissionDeniedError
from clora_feedback.gateway.agents import AgentRegistry
from clora_feedback.gateway.auth import Principal
from clora_feedback.schemas.openai import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from clora_feedback.store.trajectories import AsyncTrajectoryStore, TrajectoryRecord

OWNER = "clora-feedback"
MAX_TRAJECTORY_PAGE = 1000


class ModelsHandler:
    def __init__(self, engine: Engine, agents: AgentRegistry) -> None:
        self._engine = engine
        self._agents = agents

    def list(self, principal: Principal) -> dict[str, Any]:
        """`{"object": "list", "data": [Model, ...]}` for what `principal` may use."""
        base = self._engine.model_name
        data: list[dict[str, Any]] = []
        if principal.can_use_agent(None):
            data.append(
                self._model(
                    base, self._agents.created, root=base, parent=None, agent=None, version=0
                )
            )
        for info in self._agents.agents():
            if not principal.can_use_agent(info.name):
                continue
            version = self._agents.version(info.name)  # the deployer's: the one source
            root = str(info.source) if info.source is not None else base
            data.append(
                self._model(
                    info.name,
                    info.created,
                    root=root,
                    parent=base,
                    agent=info.name,
                    version=version if version is not None else BASE_VERSION,
                )
            )
        return {"object": "list", "data": data}

    @staticmethod
    def _model(
        name: str, created: int, *, root: str, parent: str | None, agent: str | None, version: int
    ) -> dict[str, Any]:
        payload = {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": OWNER,
            "root": root,
            "parent": parent,
            "clora": {"agent": agent, "adapter_version": version},
        }
        return Model.model_validate(payload).model_dump(mode="json", exclude_unset=True)


class AdapterAdminHandler:
    """vLLM-compatible `load_lora_adapter` / `unload_lora_adapter`."""

    def __init__(self, agents: AgentRegistry) -> None:
        self._agents = agents

    async def load(self, body: LoadLoRAAdapterRequest) -> str:
        """Load (or with `load_inplace`, replace) an adapter; returns vLLM's success text."""
        assert body.lora_name is not None and body.lora_path is not None  # checked by the model
        try:
            await self._agents.load_adapter(
                body.lora_name, Path(body.lora_path), replace=body.load_inplace
            )
        except AdapterError as exc:
            # Whatever is wrong with the files (missing, malformed, too deep, too big),
            # it is what `lora_path` names.
            exc.param = exc.param or "lora_path"
            raise
        return f"Success: LoRA adapter '{body.lora_name}' added successfully."

    async def unload(self, body: UnloadLoRAAdapterRequest) -> str:
        assert body.lora_name is not None
        await self._agents.unload_adapter(body.lora_name)
        return f"Success: LoRA adapter '{body.lora_name}' removed successfully."


def trajectory_json(record: TrajectoryRecord) -> dict[str, Any]:
    """A trajectory as JSON: the record's fields plus `"object": "trajectory"`."""
    return {"object": "trajectory", **dataclasses.asdict(record)}


class TrajectoryHandler:
    """Captured trajectories: an agent key sees only its agents', the admin key all."""

    def __init__(self, store: AsyncTrajectoryStore) -> None:
        self._store = store

    async def get(self, completion_id: str, principal: Principal) -> dict[str, Any]:
        """One trajectory; 404 when it does not exist or belongs to another key's agent."""
        record = await self._store.get(completion_id)
        principal.check_trajectory(record.agent, completion_id)
        return trajectory_json(record)

    async def list(
        self, principal: Principal, *, agent: str | None, limit: int, before: float | None
    ) -> dict[str, Any]:
        """Newest first; page with `before` = the last record's `created_at`."""
        if not 1 <= limit <= MAX_TRAJECTORY_PAGE:
            raise InvalidRequestError(f"limit must be in 1..{MAX_TRAJECTORY_PAGE}", param="limit")
        if agent is not None and not principal.can_use_agent(agent):
            raise PermissionDeniedError(
                f"this API key may not read trajectories of agent {agent!r}", param="agent"
            )
        if agent is not None or principal.admin:
            records = await self._store.list(agent, limit=limit, before=before)
        else:
            records = []
            for name in sorted(principal.agents):
                records += await self._store.list(name, limit=limit, before=before)
            records.sort(key=lambda r: r.created_at, reverse=True)
            records = records[:limit]
        return {"object": "list", "data": [trajectory_json(r) for r in records]}

    async def delete(self, *, agent: str | None, conversation_id: str | None) -> dict[str, Any]:
        """Delete by agent and/or conversation (admin); 400 when neither is given."""
        if not agent and not conversation_id:
            raise InvalidRequestError(
                "name the trajectories to delete: agent, conversation_id or both", param="agent"
            )
        deleted = await self._store.delete(agent=agent or None,
                                           conversation_id=conversation_id or None)  # fmt: skip
        return {
            "object": "trajectory.deleted",
            "agent": agent or None,
            "conversation_id": conversation_id or None,
            "deleted": deleted,
        }


def health(
    engine: Engine,
    agents: AgentRegistry,
    *,
    admin: bool,
    feedback_bootstrap: str | None = None,
) -> dict[str, Any]:
    """`GET /health`: liveness plus the engine's numbers, for anyone.

    Agent names are the admin key's: the others (no key, an agent key) get no adapter
    list and no agent count, as they cannot list other agents' models either.

    Args:
        engine: whose numbers to report.
        agents: the agents served (counted for the admin key).
        admin: the caller holds the admin key (or the gateway is open).
        feedback_bootstrap: where outside producers send feedback (the embedded
            broker's address or the configured cluster), shown to the admin key.
    """
    stats = dataclasses.asdict(engine.stats())
    body: dict[str, Any] = {
        "status": "ok",
        "model": engine.model_name,
        "max_model_len": engine.max_model_len,
    }
    if not admin:
        del stats["adapters"]  # agent name -> version
        return {**body, "engine": stats}
    body |= {"agents": len(agents.names()), "engine": stats}
    if feedback_bootstrap is not None:
        body["feedback"] = {"kafka_bootstrap": feedback_bootstrap}
    return body
