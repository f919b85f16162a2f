"""Admin wire models: adapter versions and agents on `/v1/adapters`, and rollback bodies.

The response objects are read straight off the registry's value types
(`clora_feedback.store.versions.VersionInfo` / `AgentInfo`) with
`model_validate(info, from_attributes=True)`, so a field added there is one
line here, never a hand-written copy. The vocabulary both sides share
(`VersionStatus`, `Activation`) is defined here and imported by the store,
because schemas sit below the store in the layering.

Both the admin routes (`clora_feedback.gateway.adapters`) and HTTP clients
(`clora adapters`, a remote trainer or deployer) import these.

Not here: the routes and their rules (`clora_feedback.gateway.adapters`), the registry.
"""

from __future__ import annotations

from pathlib import PurePath
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_VERSION = 2**63 - 1
"""Largest version number: SQLite's INTEGER is 64-bit, so a larger one is a 400, never
an overflow deep in the store."""

VersionStatus = Literal["active", "superseded", "rolled_back", "staged", "inactive"]
"""A version's status (see `clora_feedback.store.versions`)."""
Activation = Literal["publish", "rollback"]
"""How an agent's active version became active."""


class RollbackRequest(BaseModel):
    """`POST /v1/adapters/{agent}/rollback`."""

    model_config = ConfigDict(strict=True, extra="ignore")

    version: int = Field(
        ..., ge=1, le=MAX_VERSION, description="The version to serve and train from again."
    )
    reason: str | None = Field(
        None, max_length=2000, description="Recorded on every version the rollback marks."
    )


ReleaseState = Literal[
    "candidate",
    "skipped",
    "passed",
    "failed",
    "inconclusive",
    "invalid",
    "canary",
    "promoted",
    "aborted",
]
"""A version's state on the release path (see `clora_feedback.store.registry.releases`)."""


class ReleaseObject(BaseModel):
    """A version's release record (`ReleaseRecord` on the wire)."""

    model_config = ConfigDict(from_attributes=True)

    state: ReleaseState
    share: float | None = Field(None, description="The canary's share of the agent's requests.")
    serving: int | None = Field(None, description="The serving version it was compared with.")
    evidence: dict[str, Any] = Field(
        default_factory=dict,
        description="Per stage (gate, canary, operator): statistics, counts and the reason.",
    )
    updated_at: float


class ReleaseActionRequest(BaseModel):
    """`POST /v1/adapters/{agent}/gate | promote | abort`."""

    model_config = ConfigDict(strict=True, extra="ignore")

    version: int | None = Field(
        None,
        ge=1,
        le=MAX_VERSION,
        description="gate: the version to judge (required); promote: the version (default "
        "the live canary); abort: ignored (the live canary).",
    )
    reason: str | None = Field(None, max_length=2000, description="Recorded with the verdict.")


class ReleaseActionResult(BaseModel):
    """The answer to a gate, promote or abort."""

    object: Literal["adapter.release"] = "adapter.release"
    agent: str
    version: int
    action: Literal["gate", "promote", "abort"]
    state: ReleaseState
    reason: str
    evidence: dict[str, Any] = Field(default_factory=dict)


class CasesRequest(BaseModel):
    """`POST /v1/adapters/{agent}/cases`: operator evaluation cases (docs/release.md)."""

    cases: list[dict[str, Any]] = Field(
        ...,
        min_length=1,
        max_length=1000,
        description='Each {"messages": [...], "answer": "..."} or {"prompt": "...", "answer": "..."}.',
    )


class CasesResult(BaseModel):
    """The answer to adding operator cases."""

    object: Literal["adapter.cases"] = "adapter.cases"
    agent: str
    added: int


class AdapterVersionObject(BaseModel):
    """One adapter version (`VersionInfo` on the wire)."""

    model_config = ConfigDict(from_attributes=True)

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
    payload_pruned: bool = Field(
        False,
        description="Retention deleted its weights and optimizer state; the manifest and "
        "this row stay, a rollback to it is refused (410).",
    )
    pruned_at: float | None = Field(None, description="When its payload was pruned.")
    noop: bool | None = Field(
        None,
        description="The no-op probe found its greedy outputs on the probe prompts identical "
        "to the base model's (None: not probed yet).",
    )
    probe: dict[str, Any] | None = Field(
        None, description="The probe's result: noop, prompts, tokens, seconds, at."
    )
    manifest: dict[str, Any] | None = Field(
        None, description="The version's manifest.json (only on the single-version route)."
    )
    release: ReleaseObject | None = Field(
        None,
        description="Where it is on the release path (candidate, skipped, passed, failed, "
        "invalid, canary, promoted, aborted) with each verdict's evidence; None: it never "
        "entered it (an initial adapter, a runtime load, the release path off).",
    )

    @field_validator("path", mode="before")
    @classmethod
    def _path_text(cls, value: Any) -> Any:
        return str(value) if isinstance(value, PurePath) else value

    @classmethod
    def of(
        cls, info: Any, manifest: dict[str, Any] | None = None, release: Any = None
    ) -> AdapterVersionObject:
        """The wire form of a `VersionInfo` (any object with its attributes), with its
        manifest and its release record (a `ReleaseRecord`) when given."""
        obj = cls.model_validate(info, from_attributes=True)
        update: dict[str, Any] = {}
        if manifest is not None:
            update["manifest"] = manifest
        if release is not None:
            update["release"] = ReleaseObject.model_validate(release, from_attributes=True)
        return obj.model_copy(update=update) if update else obj


class AgentAdaptersObject(BaseModel):
    """One agent's adapter summary (`AgentInfo` on the wire)."""

    model_config = ConfigDict(from_attributes=True)

    object: Literal["adapter.agent"] = "adapter.agent"
    agent: str
    active_version: int | None
    pinned: bool
    num_versions: int
    latest_version: int | None
    activated_by: Activation | None
    activated_at: float | None

    @classmethod
    def of(cls, info: Any) -> AgentAdaptersObject:
        """The wire form of an `AgentInfo` (any object with its attributes)."""
        return cls.model_validate(info, from_attributes=True)


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
