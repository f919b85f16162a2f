"""Feedback events: what developers, operators and other systems say about completions.

Three kinds, one envelope. Every event carries an `event_id` (the idempotency
key within its agent: an event delivered twice is applied once, and another
agent's event with the same id is its own), the `agent` it judges, what it
refers to (one completion, several, or a conversation), where it came from
and when it happened:

- `Correction`: a developer's verdict on the agent's output: accepted,
  corrected (the corrected content, or a unified diff against the output,
  becomes a supervised target), edited and kept, rejected or ignored.
- `Resolution`: an operator closed the case: resolved, escalated, reopened,
  rejected or abandoned, with an optional satisfaction score and, optionally,
  the answer the agent should have given (`correct_answer`).
- `Reward`: an explicit scalar from any other source.

Beside the events, this module holds the rest of the feedback wire contract,
imported by both the webhook (`clora_feedback.gateway.feedback`) and the SDK
(`clora_feedback.client`) so sender and receiver cannot drift: the one union
alias `Event`, the receipt `POST /v1/feedback` answers with (`FeedbackReceipt`,
`RejectedEvent`), the request signature (`SIGNATURE_HEADER`, `sign_body`,
`verify_signature`: `t=<unix seconds>,v1=<hex HMAC-SHA256 of "<t>.<body>">`, as
Stripe signs webhooks, so a captured request cannot be replayed later) and the translation of a validation failure into one
`InvalidRequestError` naming the field (`event_validation_error`).

These models are the contract: `python -m clora_feedback.schemas.export`
writes their JSON Schemas into `connectors/schemas/`, and a test fails when
the files drift. Change a field only with a new `schema_version`.

Not here: delivery (`clora_feedback.client`, `clora_feedback.feedback.records`),
what an event is worth (`clora_feedback.feedback.rewards`).
"""

from __future__ import annotations

import hashlib
import hmac
import re
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

from clora_feedback.errors import AuthenticationError, InvalidRequestError
from clora_feedback.schemas.paths import Item, json_path

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
        description="Idempotency key within `agent`: the same agent's same id is applied once "
        "(another agent's event with this id is a different event).",
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
        description="Judge every completion of this event's `agent` whose request carried "
        "`metadata.conversation_id` = this value (other agents' completions in it are not "
        "judged: to this event they are as unknown).",
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


Verdict = Literal["accepted", "corrected", "edited_and_kept", "rejected", "ignored"]
"""What a developer did with an output (`Correction.verdict`; values in `RewardPolicyConfig`)."""


class Correction(_Event):
    """A developer's verdict on the agent's output, with the edit when there is one.

    The five signals (`verdict`; what each is worth is `RewardPolicyConfig.verdict_rewards`):
    `accepted` (taken as it was), `corrected` (replaced by `corrected_content` or `diff`:
    the output earns nothing for being close, the correction is the target), `edited_and_kept`
    (the developer edited it and the edit was still there later: a partial success, the edit
    is the target), `rejected` (thrown away, no better answer given) and `ignored` (never
    used). Without `verdict`: `corrected` when content or a diff is given, else `accepted`.
    """

    kind: Literal["correction"] = "correction"
    verdict: Verdict | None = Field(
        None,
        description="accepted, corrected, edited_and_kept, rejected or ignored; default: "
        "corrected when corrected_content or diff is given, else accepted.",
    )
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
        edited = self.corrected_content is not None or bool(self.diff)
        if self.verdict in ("corrected", "edited_and_kept") and not edited:
            raise ValueError(f"verdict {self.verdict!r} needs corrected_content or diff")
        if self.verdict in ("accepted", "rejected", "ignored") and edited:
            raise ValueError(
                f"verdict {self.verdict!r} takes no corrected_content or diff "
                "(an output with a better answer is 'corrected')"
            )
        return self

    @property
    def signal(self) -> Verdict:
        """The verdict, given or inferred (`corrected` with an edit, else `accepted`)."""
        if self.verdict is not None:
            return self.verdict
        return "accepted" if self.accepted_as_is else "corrected"

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
        None,
        max_length=MAX_TEXT,
        description="The operator's resolution note: stored with the event, never trained on "
        "(put the answer the agent should have given in `correct_answer`).",
    )
    correct_answer: str | None = Field(
        None,
        min_length=1,
        max_length=MAX_TEXT,
        description="What the agent should have answered (e.g. the queue the operator rerouted "
        "the case to, or the reply that resolved it). An output that differs is treated like a "
        "corrected one (no credit for being close; this text is the training target); an equal "
        "one (ignoring surrounding whitespace) earns the outcome's reward. Names exactly one "
        "completion (`completion_id`).",
    )

    @model_validator(mode="after")
    def _one_answer(self) -> Resolution:
        if self.correct_answer is not None and (
            self.completion_id is None or self.completion_ids or self.conversation_id
        ):
            raise ValueError(
                "correct_answer answers one request: name it with completion_id alone "
                "(not completion_ids or conversation_id)"
            )
        return self


class Reward(_Event):
    """An explicit scalar reward from any other source."""

    kind: Literal["reward"] = "reward"
    value: float = Field(..., ge=-1e6, le=1e6, allow_inf_nan=False, description="The reward.")
    name: str = Field(
        "reward", min_length=1, max_length=100, description="What the reward measures."
    )


Event = Correction | Resolution | Reward
"""Any feedback event (the one union alias; `FeedbackEvent` is its discriminated form)."""
FeedbackEvent = Annotated[Event, Field(discriminator="kind")]
EVENT_TYPES: dict[str, type[_Event]] = {
    "correction": Correction,
    "resolution": Resolution,
    "reward": Reward,
}
_ADAPTER: TypeAdapter[Event] = TypeAdapter(FeedbackEvent)
_BATCH: TypeAdapter[list[Event]] = TypeAdapter(list[FeedbackEvent])


def parse_event(data: bytes | str | dict[str, object]) -> Event:
    """Validate one event from JSON text/bytes or a decoded object (raises pydantic ValidationError)."""
    if isinstance(data, dict):
        return _ADAPTER.validate_python(data)
    return _ADAPTER.validate_json(data)


def parse_events(data: object) -> list[Event]:
    """Validate one event or a list of events (already JSON-decoded)."""
    if isinstance(data, list):
        return _BATCH.validate_python(data)
    return [_ADAPTER.validate_python(data)]


def event_param(loc: Sequence[Item], error_type: str = "") -> str | None:
    """A pydantic error location in an event body as the JSON path of the field.

    `(1, "resolution", "outcome")` -> `"[1].outcome"`; `("reward", "completion_ids", 2)`
    -> `"completion_ids[2]"`. The discriminator tag pydantic inserts is not a field;
    a missing or unknown tag names `kind`.
    """
    path = json_path(loc, skip=_is_tag)
    if error_type in ("union_tag_not_found", "union_tag_invalid"):
        path += ".kind" if path else "kind"
    return path or None


def _is_tag(item: str, previous: Item | None) -> bool:
    return item in EVENT_TYPES and (previous is None or isinstance(previous, int))


def event_validation_error(exc: ValidationError) -> InvalidRequestError:
    """One `InvalidRequestError` (400) naming the first bad field, e.g. `param="[0].outcome"`."""
    errors = exc.errors(include_url=False)
    first = errors[0]
    param = event_param(first["loc"], first["type"])
    messages: list[str] = []
    for err in errors:
        if event_param(err["loc"], err["type"]) != param:
            continue
        if err["type"] == "union_tag_not_found":
            text = f"required, one of {', '.join(repr(k) for k in EVENT_TYPES)}"
        else:
            text = str(err["msg"]).removeprefix("Value error, ")
        if text not in messages:
            messages.append(text)
    text = "; ".join(messages[:3])
    return InvalidRequestError(
        f"{param}: {text}" if param else text, param=param, code="invalid_event"
    )


# -- the receipt ----------------------------------------------------------------------------


class RejectedEvent(BaseModel):
    """An event the store refused, and why (nothing of it was stored; fix and resend)."""

    model_config = ConfigDict(frozen=True)

    event_id: str
    reason: str


class FeedbackReceipt(BaseModel):
    """What one send reports (the JSON body `POST /v1/feedback` answers with).

    Attributes:
        delivery: `store` (applied by the gateway itself) or `kafka` (acknowledged by
            the broker; the ingest consumer joins it later).
        accepted: events taken (all for `kafka`; all but the rejected for `store`).
        event_ids: every event of the request, in order.
        joined: events whose rewards are now joined to their trajectories.
        parked: events naming a completion not stored yet; joined when it arrives,
            dead-lettered after the configured TTL.
        duplicates: events already applied before (by `event_id`); nothing changed.
        rejected: events that can never apply (e.g. a diff that does not match).
    """

    model_config = ConfigDict(frozen=True, extra="ignore")

    delivery: Literal["store", "kafka"]
    accepted: int
    event_ids: list[str]
    joined: list[str] = Field(default_factory=list)
    parked: list[str] = Field(default_factory=list)
    duplicates: list[str] = Field(default_factory=list)
    rejected: list[RejectedEvent] = Field(default_factory=list)


# -- the body signature ----------------------------------------------------------------------

SIGNATURE_HEADER = "X-Clora-Signature"
SIGNATURE_SCHEME = "v1"
DEFAULT_TOLERANCE_S = 300.0
_MAX_SIGNATURES = 8  # v1= entries looked at: a rotation needs two; more is noise or abuse
_TIMESTAMP = re.compile(r"^[0-9]{1,12}$")
_FORMAT = "t=<unix seconds>,v1=<hex HMAC-SHA256 of '<t>.<raw body>'>"


def _digest(body: bytes, secret: str, timestamp: int) -> str:
    return hmac.new(secret.encode(), b"%d." % timestamp + body, hashlib.sha256).hexdigest()


def sign_body(body: bytes, secret: str | Sequence[str], *, timestamp: int | None = None) -> str:
    """The `X-Clora-Signature` value for `body`: `t=<unix seconds>,v1=<hex>[,v1=<hex>...]`.

    Each `v1` is the hex HMAC-SHA256 of `"<t>." + body` under one secret; give several
    secrets while rotating (the receiver accepts any entry its own secret matches).

    Args:
        body: the raw request body, exactly as sent.
        secret: the webhook secret, or several during a rotation.
        timestamp: the signing time in unix seconds (default: now).
    """
    t = int(time.time()) if timestamp is None else int(timestamp)
    secrets = [secret] if isinstance(secret, str) else list(secret)
    return ",".join([f"t={t}", *(f"{SIGNATURE_SCHEME}={_digest(body, s, t)}" for s in secrets)])


def _parse_signature(header: str) -> tuple[int, list[bytes]]:
    """(t, the v1 values) of a header; raises `AuthenticationError` when it is not that format."""
    text = header.strip()
    if text.lower().startswith("sha256="):
        raise AuthenticationError(
            f"{SIGNATURE_HEADER}: the body-only format sha256=<hex> is no longer accepted (it "
            f"could be replayed); sign a timestamp with the body: {_FORMAT}",
            code="invalid_signature",
        )
    timestamps: list[str] = []
    signatures: list[bytes] = []
    for part in text.split(","):
        key, _, value = part.strip().partition("=")
        if key == "t":
            timestamps.append(value.strip())
        elif key == SIGNATURE_SCHEME and len(signatures) < _MAX_SIGNATURES:
            # Header values are latin-1 on the wire; encode so any byte compares, never raises.
            signatures.append(value.strip().lower().encode("latin-1", errors="replace"))
    if len(timestamps) != 1 or not _TIMESTAMP.match(timestamps[0]) or not signatures:
        raise AuthenticationError(
            f"{SIGNATURE_HEADER} is malformed: expected {_FORMAT}", code="invalid_signature"
        )
    return int(timestamps[0]), signatures


def verify_signature(
    body: bytes,
    secret: str,
    header: str | None,
    *,
    tolerance_s: float = DEFAULT_TOLERANCE_S,
    now: float | None = None,
) -> None:
    """Check a `X-Clora-Signature` header against `body` and the clock (constant-time compare).

    The timestamp is checked only once some `v1` entry matches, so `signature_expired`
    is said of authentic signatures only; a changed `t` breaks the HMAC instead.

    Raises:
        AuthenticationError: the header is missing (`missing_signature`), malformed,
            in the old body-only format or matches no entry (`invalid_signature`), or
            its `t` is more than `tolerance_s` from now (`signature_expired`).
    """
    if not header:
        raise AuthenticationError(
            f"this webhook requires a {SIGNATURE_HEADER} header: {_FORMAT}",
            code="missing_signature",
        )
    timestamp, given = _parse_signature(header)
    expected = _digest(body, secret, timestamp).encode()
    # Every entry is compared (a list, not a short-circuit), each in constant time.
    if not any([hmac.compare_digest(expected, g) for g in given]):
        raise AuthenticationError(
            f"{SIGNATURE_HEADER} does not match the body and its timestamp",
            code="invalid_signature",
        )
    skew = (time.time() if now is None else now) - timestamp
    if abs(skew) > tolerance_s:
        when = "old" if skew > 0 else "in the future"
        raise AuthenticationError(
            f"{SIGNATURE_HEADER} timestamp t={timestamp} is {abs(skew):.0f} s {when}, outside "
            f"the {tolerance_s:g} s tolerance: sign each request when it is sent "
            "(a replayed or delayed request is refused)",
            code="signature_expired",
        )
