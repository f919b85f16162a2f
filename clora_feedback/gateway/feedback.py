"""`POST /v1/feedback`: the webhook that turns HTTP feedback into stored rewards.

The body is one event object or a JSON list of them (`clora_feedback.schemas.feedback`).
It is checked in this order, each failure an OpenAI-style error naming what is wrong:

    API key (gateway auth)       401 missing/unknown key (before the body is read)
    size  > max_body_bytes       413 payload_too_large
    signature (if a secret)      401 missing_signature / invalid_signature / signature_expired
    UTF-8, then JSON             400 invalid_utf8 / invalid_json
    schema                       400 invalid_event, `param` = the field, e.g. "[0].outcome"
    agent of each event          403 agent_not_allowed: an agent key judges only its agents
    owner of each completion     403 completion_not_allowed: ... and only their completions
    parked events of an agent    429 parked_limit (+ Retry-After): the batch would park more
                                 than `feedback.max_parked_per_agent`; nothing was applied

The signature covers a timestamp and the raw body, as Stripe signs webhooks:
`X-Clora-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256 of "<t>.<raw body>">`
under `feedback.webhook_secret` (several `v1=` entries are allowed, one per
secret, while a sender rotates secrets). Every entry is compared in constant
time; an authentic signature whose `t` is more than
`feedback.signature_tolerance_s` from the server's clock is refused as
`signature_expired`, so a captured request cannot be replayed later. The old
body-only form (`sha256=<hex>`) is refused with a message naming the new one:
it was replayable forever. With no secret configured the header is ignored.
Permission checks are all-or-nothing: a batch with one forbidden event is
refused whole, so nothing is half-applied.

Event ids are idempotency keys per agent (the event's `agent`, which the key
must be allowed to judge and which must own every completion it joins): the
same id from another agent is a different event, never a duplicate.

Delivery, once the batch is valid:

- **Kafka** (a `FeedbackSink` is given): every event is produced to its topic
  and acknowledged (`acks=all`) before the answer, `202 {"delivery": "kafka",
  "accepted": n, "event_ids": [...]}`; the ingest consumer joins them later.
  A failed produce answers 5xx and the sender resends: duplicates are dropped by
  `event_id` downstream, so this is at-least-once delivery, applied once.
- **Store** (no sink): the batch is applied in one transaction on a worker
  thread and the answer reports each event: `{"delivery": "store", "accepted",
  "event_ids", "joined", "parked", "duplicates", "rejected": [{"event_id", "reason"}]}`.
  Status: 200 when everything joined (or was a duplicate); 202 when some event
  is parked, i.e. names a completion that is not stored yet (feedback may beat
  its trajectory; the ingest's rejoin loop joins it once the trajectory arrives,
  or dead-letters it after `feedback.park_ttl_s`, as for Kafka); 422 `feedback_rejected` when the store refused
  every event (the body then carries both the error object and the report);
  a batch with only some refused is still 200/202, the refusals listed in `rejected`.

The completion-owner check looks up completions that are already stored; one
that arrives later is checked by the store when it joins (another agent's
completion is then dead-lettered, never rewarded).

The wire contract (receipt, signature, validation translator) comes from
`clora_feedback.schemas.feedback`, which the SDK imports too.

Not here: key handling (`auth`), the error JSON (`errors`), applying, rejoining
and dead-lettering (`clora_feedback.feedback.ingest`), Kafka (`clora_feedback.feedback.kafka`).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Sequence
from typing import Annotated, Any, Protocol

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from clora_feedback.config import Settings
from clora_feedback.errors import (
    InvalidRequestError,
    PayloadTooLargeError,
    PermissionDeniedError,
)
from clora_feedback.feedback.ingest import FeedbackIngest
from clora_feedback.feedback.store import ApplyReport, Incoming
from clora_feedback.gateway.auth import Principal, current_principal
from clora_feedback.gateway.errors import error_payload
from clora_feedback.schemas.feedback import (
    DEFAULT_TOLERANCE_S,
    SIGNATURE_HEADER,
    Event,
    FeedbackReceipt,
    RejectedEvent,
    event_validation_error,
    parse_events,
    verify_signature,
)

__all__ = ["Event", "FeedbackHandler", "FeedbackSink", "build_feedback_router"]

log = logging.getLogger(__name__)

_DRAIN_FACTOR = 16
"""A body over the limit is read to its end (and discarded) up to this many times the
limit, so the client can read the 413 instead of a reset connection."""


class FeedbackSink(Protocol):
    """Where webhook events go when Kafka is configured: `feedback.kafka.FeedbackProducer`."""

    async def send(self, event: Event) -> object:
        """Deliver `event` durably (acknowledged by the broker) or raise a `CloraError`."""
        ...


class FeedbackHandler:
    """Validates, authorises and delivers webhook feedback (see the module docstring).

    Args:
        ingest: applies events when there is no sink (its store is always
            used to look up who owns a completion).
        webhook_secret: HMAC key; None = bodies are not signed.
        max_body_bytes: largest body accepted.
        sink: the Kafka producer, or None to apply to `store` directly.
        signature_tolerance_s: largest age (or clock skew) of a signature's `t`.
    """

    def __init__(
        self,
        ingest: FeedbackIngest,
        *,
        webhook_secret: str | None,
        max_body_bytes: int,
        sink: FeedbackSink | None = None,
        signature_tolerance_s: float = DEFAULT_TOLERANCE_S,
    ) -> None:
        self._ingest = ingest
        self._secret = webhook_secret
        self._tolerance_s = signature_tolerance_s
        self._max_body_bytes = max_body_bytes
        self._sink = sink

    async def handle(self, request: Request, principal: Principal) -> JSONResponse:
        """Answer one `POST /v1/feedback`."""
        body = await self.read_body(request)
        self.verify_signature(body, request.headers.get(SIGNATURE_HEADER))
        events, batch = self.parse(body)
        self.check_agents(events, principal, batch=batch)
        if not principal.admin:
            await asyncio.to_thread(self.check_owners, events, batch=batch)
        if self._sink is not None:
            return await self._produce(events)
        return await self._apply(events)

    # -- the body ----------------------------------------------------------------

    async def read_body(self, request: Request) -> bytes:
        """The raw body, refusing (413) more than `max_body_bytes` without buffering it."""
        limit = self._max_body_bytes
        declared = request.headers.get("content-length", "")
        too_large = declared.isdigit() and int(declared) > limit
        if too_large and int(declared) > limit * _DRAIN_FACTOR:
            raise self._too_large(int(declared))
        body = bytearray()
        received = 0
        async for chunk in request.stream():
            received += len(chunk)
            if received <= limit:
                body += chunk
            elif received > limit * _DRAIN_FACTOR:
                break
        if too_large or received > limit:
            raise self._too_large(received)
        return bytes(body)

    def _too_large(self, size: int) -> PayloadTooLargeError:
        return PayloadTooLargeError(
            f"the request body ({size} bytes or more) exceeds the limit of "
            f"{self._max_body_bytes} bytes; send smaller batches",
            code="payload_too_large",
        )

    def verify_signature(self, body: bytes, header: str | None) -> None:
        """Check `X-Clora-Signature` when a secret is configured (constant-time compare).

        Raises:
            AuthenticationError: the header is missing, malformed, in the old body-only
                form or does not match (401), or its timestamp is outside the tolerance.
        """
        if self._secret is not None:
            verify_signature(body, self._secret, header, tolerance_s=self._tolerance_s)

    def parse(self, body: bytes) -> tuple[list[Event], bool]:
        """Decode and validate the events of a body: (events, whether it was a list).

        Raises:
            InvalidRequestError: not UTF-8, not JSON, empty, or an invalid event
                (`param` names the field, e.g. `[0].outcome`).
        """
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidRequestError(
                f"the request body is not valid UTF-8 (byte {exc.start})", code="invalid_utf8"
            ) from exc
        try:
            data = json.loads(text, parse_constant=_reject_constant)
        except (ValueError, RecursionError) as exc:
            where = (
                f" at line {exc.lineno} column {exc.colno}"
                if isinstance(exc, json.JSONDecodeError)
                else ""
            )
            raise InvalidRequestError(
                f"the request body is not valid JSON{where}: send one event object "
                "or a list of them",
                code="invalid_json",
            ) from exc
        if data == []:
            raise InvalidRequestError("the list of events is empty", code="empty_batch")
        try:
            return parse_events(data), isinstance(data, list)
        except ValidationError as exc:
            raise event_validation_error(exc) from exc

    # -- permissions -------------------------------------------------------------

    @staticmethod
    def check_agents(events: Sequence[Event], principal: Principal, *, batch: bool) -> None:
        """An agent key may judge only its own agents (403, naming the first other one)."""
        for i, event in enumerate(events):
            if not principal.can_use_agent(event.agent):
                raise PermissionDeniedError(
                    f"this API key may not send feedback about agent {event.agent!r}",
                    param=_path(i, "agent", batch),
                    code="agent_not_allowed",
                )

    def check_owners(self, events: Sequence[Event], *, batch: bool) -> None:
        """An agent key may judge only its agents' completions (blocking: run on a thread).

        Completions not stored yet pass here; the store checks them when they join.
        Another agent's completion is refused as "not yours", never naming its owner.
        """
        for i, event in enumerate(events):
            owners = self._ingest.store.owners(event.targets())
            for completion_id in event.targets():
                owner = owners.get(completion_id)
                if owner is None or owner == event.agent:
                    continue
                field = (
                    "completion_id"
                    if completion_id == event.completion_id
                    else f"completion_ids[{event.completion_ids.index(completion_id)}]"
                )
                raise PermissionDeniedError(
                    f"completion {completion_id!r} is not a completion of agent {event.agent!r}",
                    param=_path(i, field, batch),
                    code="completion_not_allowed",
                )

    # -- delivery ----------------------------------------------------------------

    async def _produce(self, events: Sequence[Event]) -> JSONResponse:
        assert self._sink is not None
        await asyncio.gather(*(self._sink.send(e) for e in events))
        ids = [e.event_id for e in events]
        receipt = FeedbackReceipt(delivery="kafka", accepted=len(ids), event_ids=ids)
        return JSONResponse(receipt.model_dump(mode="json"), status_code=202)

    async def _apply(self, events: Sequence[Event]) -> JSONResponse:
        # Over the parked cap the whole batch is refused (429): the sender retries it as is.
        report: ApplyReport = await self._ingest.apply(
            [Incoming(e, "webhook") for e in events], refuse_over_limit=True
        )
        receipt = FeedbackReceipt(
            delivery="store",
            accepted=len(events) - len(report.rejected),
            event_ids=[e.event_id for e in events],
            joined=report.joined,
            parked=report.parked,
            duplicates=report.duplicates,
            rejected=[RejectedEvent(event_id=r.event_id, reason=r.reason) for r in report.rejected],
        )
        content: dict[str, Any] = receipt.model_dump(mode="json")
        if receipt.accepted == 0:
            reasons = "; ".join(f"{r.event_id}: {r.reason}" for r in receipt.rejected[:5])
            error = error_payload(
                f"every event was rejected: {reasons}",
                error_type="invalid_request_error",
                code="feedback_rejected",
            )
            return JSONResponse({**error, **content}, status_code=422)
        return JSONResponse(content, status_code=202 if receipt.parked else 200)


def _path(index: int, field: str, batch: bool) -> str:
    """The JSON path of `field` of event `index` in the body (as schema errors name it)."""
    return f"[{index}].{field}" if batch else field


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


def build_feedback_router(
    ingest: FeedbackIngest, settings: Settings, sink: FeedbackSink | None = None
) -> APIRouter:
    """The router of `POST /v1/feedback`.

    Needs `app.state.authenticator` (as `create_app` sets it) and the gateway's
    error handlers (`install_error_handlers`).

    Args:
        ingest: the feedback ingest (over the gateway's trajectory database); its
            owner starts it, which runs the rejoin loop for parked events.
        settings: `feedback.webhook_secret`, `feedback.signature_tolerance_s` and
            `feedback.max_body_bytes` are read.
        sink: the Kafka producer when a bootstrap is configured, else None.
    """
    handler = FeedbackHandler(
        ingest,
        webhook_secret=settings.feedback.webhook_secret,
        max_body_bytes=settings.feedback.max_body_bytes,
        sink=sink,
        signature_tolerance_s=settings.feedback.signature_tolerance_s,
    )
    router = APIRouter()

    @router.post("/v1/feedback", status_code=200, response_model=FeedbackReceipt)
    async def post_feedback(
        request: Request, principal: Annotated[Principal, Depends(current_principal)]
    ) -> JSONResponse:
        return await handler.handle(request, principal)

    return router
