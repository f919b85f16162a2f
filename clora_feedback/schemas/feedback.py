"""Feedback events: what developers, operators and other systems say about completions.

Three kinds, one envelope. Every event carries an `event_id` (the idempotency
key: an event delivered twice is applied once), the `agent` it judges, what it
refers to (one completion, several, or a conversation), where it came from
and when it happened:

- `Correction`: a developer edited the agent's output. The corrected content
  (or a unified diff against the output) becomes a supervised target; no
  change at all means "accepted as-is".
- `Resolution`: an operator closed the case: resolved, escalated, reopened,
  rejected or abandoned, with an optional satisfaction score.
- `Reward`: an explicit scalar from any other source.

These models are the contract: `python -m clora_feedback.schemas.export`
writes their JSON Schemas into `connectors/schemas/`, and a test fails when
the files drift. Change a field only with a new `schema_version`.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, model_validator

SCHEMA_VERSION = 1
MAX_TEXT = 200_000
AgentName = Annotated[
    str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]*$")
]
Outcome = Literal["resolved", "escalated", "reopened", "rejected", "abandoned"]


class _Event(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: Literal[1] = Field(1, description="Version of this event schema.")
    event_id: str = Field(
        ...,
        min_length=1,
        max_length=200,
        description="Idempotency key: the same id is applied once.",
    )
    agent: AgentName = Field(
        ..., description="The agent (the `model` name at the gateway) being judged."
    )
    completion_id: str | None = Field(
        None, max_length=200, description="The completion `id` returned by the gateway."
    )
    completion_ids: list[Annotated[str, Field(max_length=200)]] = Field(
        default_factory=list,
        max_length=1000,
        description="Several completions judged together (e.g. every step of one agent run).",
    )
    conversation_id: str | None = Field(
        None,
        max_length=200,
        description="Judge every completion whose request carried `metadata.conversation_id` = this value.",
    )
    source: str = Field(
        ...,
        min_length=1,
        max_length=200,
        description="Who or what produced the event (e.g. `github`, `zendesk`).",
    )
    occurred_at: datetime = Field(
        default_factory=lambda: datetime.now(UTC), description="When it happened (RFC 3339)."
    )

    @model_validator(mode="after")
    def _has_target(self) -> _Event:
        if not (self.completion_id or self.completion_ids or self.conversation_id):
            raise ValueError("one of completion_id, completion_ids or conversation_id is required")
        return self

    def targets(self) -> list[str]:
        """Completion ids named directly (a conversation is resolved by the store)."""
        ids = [self.completion_id] if self.completion_id else []
        return ids + [c for c in self.completion_ids if c not in ids]


class Correction(_Event):
    """A developer's edit of the agent's output."""

    kind: Literal["correction"] = "correction"
    corrected_content: str | None = Field(
        None, max_length=MAX_TEXT, description="The output as the developer left it."
    )
    diff: str | None = Field(
        None,
        max_length=MAX_TEXT,
        description="A unified diff from the agent's output to the corrected one.",
    )
    comment: str | None = Field(
        None, max_length=20_000, description="Free-text reason for the edit."
    )

    @model_validator(mode="after")
    def _one_form(self) -> Correction:
        if self.corrected_content is not None and self.diff is not None:
            raise ValueError("give corrected_content or diff, not both")
        return self

    @property
    def accepted_as_is(self) -> bool:
        return self.corrected_content is None and not self.diff


class Resolution(_Event):
    """An operator's resolution of the case the agent worked on."""

    kind: Literal["resolution"] = "resolution"
    outcome: Outcome = Field(..., description="How the case ended.")
    score: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        description="Optional satisfaction score normalised to [0, 1] (e.g. CSAT/5).",
    )
    resolution_text: str | None = Field(
        None, max_length=MAX_TEXT, description="The operator's resolution note."
    )


class Reward(_Event):
    """An explicit scalar reward from any other source."""

    kind: Literal["reward"] = "reward"
    value: float = Field(..., ge=-1e6, le=1e6, allow_inf_nan=False, description="The reward.")
    name: str = Field(
        "reward", min_length=1, max_length=100, description="What the reward measures."
    )


FeedbackEvent = Annotated[Correction | Resolution | Reward, Field(discriminator="kind")]
EVENT_TYPES: dict[str, type[_Event]] = {
    "correction": Correction,
    "resolution": Resolution,
    "reward": Reward,
}
_ADAPTER: TypeAdapter[Correction | Resolution | Reward] = TypeAdapter(FeedbackEvent)
_BATCH: TypeAdapter[list[Correction | Resolution | Reward]] = TypeAdapter(list[FeedbackEvent])


def parse_event(data: bytes | str | dict[str, object]) -> Correction | Resolution | Reward:
    """Validate one event from JSON text/bytes or a decoded object (raises pydantic ValidationError)."""
    if isinstance(data, dict):
        return _ADAPTER.validate_python(data)
    return _ADAPTER.validate_json(data)


def parse_events(data: object) -> list[Correction | Resolution | Reward]:
    """Validate one event or a list of events (already JSON-decoded)."""
    if isinstance(data, list):
        return _BATCH.validate_python(data)
    return [_ADAPTER.validate_python(data)]
