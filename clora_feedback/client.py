"""Sending feedback: `FeedbackClient` (sync) and `AsyncFeedbackClient`, by webhook or Kafka.

Two deliveries, chosen at construction:

- **webhook** (`base_url=`): `POST {base_url}/v1/feedback` with the API key as a
  bearer token and, when `webhook_secret` is given, the request signed in
  `X-Clora-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256 of "<t>.<body>">`,
  afresh for every attempt (the server refuses a `t` outside its tolerance, so a
  captured request cannot be replayed; several secrets give one `v1=` each, for a
  rotation). Returns the server's
  `FeedbackReceipt` (joined / parked / duplicates / rejected, or `kafka` when
  the gateway forwards to a broker).
- **Kafka** (`kafka_bootstrap=`): the ingest's own `FeedbackProducer` writes each
  event to its kind's topic (`clora.corrections`, `clora.resolutions`,
  `clora.rewards` by default), keyed by agent, with `acks=all`. The receipt says
  `delivery="kafka"` once every record is acknowledged; joining happens later
  in the ingest consumer. The sync client runs the producer on a private
  event-loop thread, so both clients support both deliveries.

Every event gets an `event_id` (uuid4) when it has none, before the first
attempt, so a retry (automatic on the webhook for retriable failures:
connection errors, 429, 5xx; `max_retries`) can never count an event twice.
Undeliverable feedback raises a retriable error (`FeedbackDeliveryError` from the
webhook, `StoreError` from Kafka): resending the same events is always safe.

Server errors come back as the package's exceptions (`clora_feedback.errors`),
chosen by HTTP status, never by message text.

The wire contract both sides of the webhook share (`sign_body`,
`FeedbackReceipt`, `event_validation_error`) lives in
`clora_feedback.schemas.feedback`, imported by the gateway too; the names are
re-exported here for SDK users.

Not here: the wire contract (`clora_feedback.schemas.feedback`), the webhook
route (`clora_feedback.gateway.feedback`), the ingest consumer, the LangChain
recorder (`clora_feedback.integrations.langchain`).
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Coroutine, Mapping, Sequence
from datetime import datetime
from types import TracebackType
from typing import Any, TypedDict, TypeVar, Unpack

import httpx
from pydantic import ValidationError

from clora_feedback.config import KafkaConfig
from clora_feedback.errors import (
    AuthenticationError,
    CloraError,
    ConflictError,
    InvalidRequestError,
    NotFoundError,
    OverloadedError,
    PermissionDeniedError,
    UnavailableError,
)
from clora_feedback.lifecycle import Closing
from clora_feedback.schemas.feedback import (
    SIGNATURE_HEADER,
    Correction,
    Event,
    FeedbackReceipt,
    Outcome,
    RejectedEvent,
    Resolution,
    Reward,
    Verdict,
    event_validation_error,
    parse_events,
    sign_body,
)

__all__ = [
    "SIGNATURE_HEADER",
    "AsyncFeedbackClient",
    "Event",
    "EventFields",
    "EventLike",
    "FeedbackClient",
    "FeedbackDeliveryError",
    "FeedbackReceipt",
    "RejectedEvent",
    "error_from_response",
    "event_validation_error",
    "new_event_id",
    "sign_body",
    "to_events",
]

EventLike = Event | Mapping[str, Any]
"""An event model, or its JSON object (validated; `event_id` and `source` filled in when absent)."""

FEEDBACK_PATH = "/v1/feedback"
DEFAULT_SOURCE = "clora-client"
_T = TypeVar("_T")


FeedbackDeliveryError = UnavailableError
"""Feedback could not be delivered (network, broker or server unavailable); safe to resend."""


def to_events(
    data: EventLike | Sequence[EventLike], *, source: str = DEFAULT_SOURCE
) -> list[Event]:
    """Validate one event or several; JSON objects get a fresh `event_id` and `source` if absent.

    Raises:
        InvalidRequestError: an object is not a valid event (`param` names the field).
    """
    single = isinstance(data, Mapping | Correction | Resolution | Reward)
    items: list[Any] = [data] if single else list(data)
    if not items:
        raise InvalidRequestError("no events to send", code="empty_batch")
    filled = [
        {"event_id": new_event_id(), "source": source, **item}
        if isinstance(item, Mapping)
        else item.model_dump()
        for item in items
    ]
    try:
        return parse_events(filled[0] if single else filled)
    except ValidationError as exc:
        raise event_validation_error(exc) from exc


def new_event_id() -> str:
    """A fresh idempotency key."""
    return str(uuid.uuid4())


def error_from_response(response: httpx.Response) -> CloraError:
    """The package exception for an error answer (chosen by status, never by text)."""
    status = response.status_code
    message, param, code = f"HTTP {status} from {response.request.url}", None, None
    try:
        error = response.json()["error"]
        message, param, code = str(error["message"]), error.get("param"), error.get("code")
    except (ValueError, KeyError, TypeError):
        if response.text:
            message += f": {response.text[:500]}"
    if status == 429:
        return OverloadedError(
            message, retry_after_s=_retry_after(response), code=code or "overloaded"
        )
    if status >= 500:
        return FeedbackDeliveryError(message, code=code)
    by_status: dict[int, type[CloraError]] = {
        401: AuthenticationError,
        403: PermissionDeniedError,
        404: NotFoundError,
        409: ConflictError,
    }
    return by_status.get(status, InvalidRequestError)(message, param=param, code=code)


def _retry_after(response: httpx.Response) -> float:
    try:
        return max(0.0, float(response.headers.get("retry-after", "1")))
    except ValueError:
        return 1.0


def _backoff(attempt: int, error: CloraError) -> float:
    if isinstance(error, OverloadedError):
        return min(error.retry_after_s, 30.0)
    return min(0.25 * 2**attempt, 5.0)


def _receipt(response: httpx.Response) -> FeedbackReceipt:
    try:
        return FeedbackReceipt.model_validate_json(response.content)
    except ValidationError as exc:
        raise CloraError(
            f"unexpected answer from {response.request.url}: {response.text[:200]}"
        ) from exc


def _build(kind: str, agent: str, default_source: str, fields: dict[str, Any]) -> Event:
    """Validate keyword arguments into one event (None means "not given")."""
    data = {k: v for k, v in fields.items() if v is not None}
    if "completion_ids" in data:
        data["completion_ids"] = list(data["completion_ids"])
    data.setdefault("source", default_source)
    data.setdefault("event_id", new_event_id())
    try:
        return parse_events({"kind": kind, "agent": agent, **data})[0]
    except ValidationError as exc:
        raise event_validation_error(exc) from exc


# -- the two deliveries ------------------------------------------------------------------


class _Webhook:
    """URL, headers and body of a webhook send (shared by both clients)."""

    def __init__(
        self, base_url: str, api_key: str | None, webhook_secret: str | Sequence[str] | None
    ) -> None:
        base = base_url.rstrip("/")
        # Accept the gateway root or the OpenAI-style `/v1` base URL agents already use.
        self.url = base + FEEDBACK_PATH.removeprefix("/v1" if base.endswith("/v1") else "")
        self._api_key = api_key
        self._secret = webhook_secret

    def body(self, events: Sequence[Event]) -> bytes:
        return b"[" + b",".join(e.model_dump_json().encode() for e in events) + b"]"

    def headers(self, body: bytes) -> dict[str, str]:
        """Headers of one attempt: the signature's timestamp is this attempt's."""
        headers = {"content-type": "application/json"}
        if self._api_key:
            headers["authorization"] = f"Bearer {self._api_key}"
        if self._secret is not None:
            headers[SIGNATURE_HEADER] = sign_body(body, self._secret)
        return headers

    def answer(self, response: httpx.Response) -> FeedbackReceipt:
        if response.status_code >= 300:
            raise error_from_response(response)
        return _receipt(response)

    def unreachable(self, exc: httpx.TransportError) -> FeedbackDeliveryError:
        return FeedbackDeliveryError(
            f"could not deliver feedback to {self.url}: {exc!r}", code="unreachable"
        )


class _KafkaDelivery:
    """The ingest's `FeedbackProducer`, started on first use (on the loop that sends)."""

    def __init__(self, bootstrap_servers: str, topics: KafkaConfig | None) -> None:
        # Lazy: aiokafka loads only for Kafka delivery.
        from clora_feedback.feedback.records import build_producer

        self._producer = build_producer(topics or KafkaConfig(), bootstrap_servers)
        self._started = False

    async def send(self, events: Sequence[Event]) -> FeedbackReceipt:
        if not self._started:
            await self._producer.start()
            self._started = True
        await self._producer.send_many(events)  # returns once every record is acknowledged
        ids = [e.event_id for e in events]
        return FeedbackReceipt(delivery="kafka", accepted=len(ids), event_ids=ids)

    async def stop(self) -> None:
        await self._producer.stop()


def _check_delivery(base_url: str | None, kafka_bootstrap: str | None) -> None:
    if (base_url is None) == (kafka_bootstrap is None):
        raise InvalidRequestError(
            "give exactly one of base_url (webhook) or kafka_bootstrap (Kafka)", param="base_url"
        )


# -- the clients ------------------------------------------------------------------------------


class EventFields(TypedDict, total=False):
    """What every event may say besides its kind's own fields (see `schemas.feedback`)."""

    completion_id: str
    completion_ids: Sequence[str]
    conversation_id: str
    event_id: str
    source: str
    occurred_at: datetime


class _Builders:
    """The event builders behind both clients' `correction` / `resolution` / `reward`."""

    source: str

    def _correction(
        self,
        agent: str,
        content: str | None,
        diff: str | None,
        comment: str | None,
        verdict: Verdict | None,
        fields: EventFields,
    ) -> Event:
        kind_fields = {
            "corrected_content": content,
            "diff": diff,
            "comment": comment,
            "verdict": verdict,
        }
        return _build("correction", agent, self.source, {**kind_fields, **fields})

    def _resolution(
        self,
        agent: str,
        outcome: Outcome,
        score: float | None,
        text: str | None,
        correct_answer: str | None,
        fields: EventFields,
    ) -> Event:
        kind_fields = {
            "outcome": outcome,
            "score": score,
            "resolution_text": text,
            "correct_answer": correct_answer,
        }
        return _build("resolution", agent, self.source, {**kind_fields, **fields})

    def _reward(self, agent: str, value: float, name: str | None, fields: EventFields) -> Event:
        return _build("reward", agent, self.source, {"value": value, "name": name, **fields})


class AsyncFeedbackClient(_Builders):
    """Sends feedback from asyncio code; `async with` or `aclose()` when done.

    Args:
        base_url: the gateway (`http://host:8000` or its `/v1` URL): webhook delivery.
        api_key: bearer key (an agent's key may send feedback about that agent only).
        webhook_secret: when set, requests are signed (`X-Clora-Signature`, timestamped);
            several secrets while rotating: one `v1=` entry each.
        kafka_bootstrap: `host:port[,...]`: Kafka delivery instead of the webhook.
        kafka_topics: topic names for Kafka delivery (default `KafkaConfig()`'s).
        source: `source` of events built here (and of JSON objects without one).
        timeout_s: per-request timeout.
        max_retries: extra attempts after a retriable failure (the same event ids).
    """

    def __init__(
        self,
        base_url: str | None = None,
        *,
        api_key: str | None = None,
        webhook_secret: str | Sequence[str] | None = None,
        kafka_bootstrap: str | None = None,
        kafka_topics: KafkaConfig | None = None,
        source: str = DEFAULT_SOURCE,
        timeout_s: float = 30.0,
        max_retries: int = 2,
    ) -> None:
        _check_delivery(base_url, kafka_bootstrap)
        self.source = source
        self._max_retries = max_retries
        self._webhook = _Webhook(base_url, api_key, webhook_secret) if base_url else None
        self._http = httpx.AsyncClient(timeout=timeout_s) if base_url else None
        self._kafka = _KafkaDelivery(kafka_bootstrap, kafka_topics) if kafka_bootstrap else None

    async def send(self, events: EventLike | Sequence[EventLike]) -> FeedbackReceipt:
        """Send one event or a batch (validated here first); returns the receipt.

        Raises:
            InvalidRequestError: an event is invalid (here, or per the server); also
                `code="feedback_rejected"` when the store refused every event.
            AuthenticationError, PermissionDeniedError: the key may not send this.
            FeedbackDeliveryError: the webhook is still unreachable after the retries.
            StoreError: Kafka did not acknowledge the records (retriable).
        """
        batch = to_events(events, source=self.source)
        if self._kafka is not None:
            return await self._kafka.send(batch)
        assert self._webhook is not None and self._http is not None
        body = self._webhook.body(batch)
        for attempt in range(self._max_retries + 1):
            try:
                headers = self._webhook.headers(body)
                response = await self._http.post(self._webhook.url, content=body, headers=headers)
                return self._webhook.answer(response)
            except httpx.TransportError as exc:
                error: CloraError = self._webhook.unreachable(exc)
                cause: BaseException | None = exc
            except CloraError as exc:
                error, cause = exc, None
            if not error.retriable or attempt == self._max_retries:
                raise error from cause
            await asyncio.sleep(_backoff(attempt, error))
        raise AssertionError("unreachable")

    async def correction(
        self,
        agent: str,
        *,
        corrected_content: str | None = None,
        diff: str | None = None,
        comment: str | None = None,
        verdict: Verdict | None = None,
        **fields: Unpack[EventFields],
    ) -> FeedbackReceipt:
        """A developer's verdict: an edit (`corrected_content` or a unified `diff`), or
        `verdict` alone (`accepted`, `rejected`, `ignored`; `edited_and_kept` with the edit);
        nothing at all = accepted as-is."""
        return await self.send(
            self._correction(agent, corrected_content, diff, comment, verdict, fields)
        )

    async def resolution(
        self,
        agent: str,
        outcome: Outcome,
        *,
        score: float | None = None,
        resolution_text: str | None = None,
        correct_answer: str | None = None,
        **fields: Unpack[EventFields],
    ) -> FeedbackReceipt:
        """How the case ended (`resolved`, `escalated`, ...), with an optional score in [0, 1]
        and the answer the agent should have given (`correct_answer`, for one completion)."""
        return await self.send(
            self._resolution(agent, outcome, score, resolution_text, correct_answer, fields)
        )

    async def reward(
        self, agent: str, value: float, *, name: str | None = None, **fields: Unpack[EventFields]
    ) -> FeedbackReceipt:
        """An explicit scalar reward (`name` says what it measures)."""
        return await self.send(self._reward(agent, value, name, fields))

    async def aclose(self) -> None:
        """Close the HTTP connections, or flush and stop the Kafka producer."""
        if self._http is not None:
            await self._http.aclose()
        if self._kafka is not None:
            await self._kafka.stop()

    async def __aenter__(self) -> AsyncFeedbackClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


class _LoopThread:
    """A private event loop on a daemon thread, for the sync client's Kafka producer."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="clora-feedback-client", daemon=True
        )
        self._thread.start()

    def run(self, work: Coroutine[Any, Any, _T]) -> _T:
        return asyncio.run_coroutine_threadsafe(work, self._loop).result()

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()


class FeedbackClient(_Builders, Closing):
    """Sends feedback from synchronous code; `with` or `close()` when done.

    Arguments and methods as for `AsyncFeedbackClient`. Webhook sends use a
    blocking HTTP client; Kafka sends run the aiokafka producer on a private
    event-loop thread owned by this client.
    """

    def __init__(
        self,
        base_url: str | None = None,
        *,
        api_key: str | None = None,
        webhook_secret: str | Sequence[str] | None = None,
        kafka_bootstrap: str | None = None,
        kafka_topics: KafkaConfig | None = None,
        source: str = DEFAULT_SOURCE,
        timeout_s: float = 30.0,
        max_retries: int = 2,
    ) -> None:
        _check_delivery(base_url, kafka_bootstrap)
        self.source = source
        self._max_retries = max_retries
        self._webhook = _Webhook(base_url, api_key, webhook_secret) if base_url else None
        self._http = httpx.Client(timeout=timeout_s) if base_url else None
        self._kafka: _KafkaDelivery | None = None
        self._loop: _LoopThread | None = None
        if kafka_bootstrap:
            self._kafka = _KafkaDelivery(kafka_bootstrap, kafka_topics)
            self._loop = _LoopThread()

    def send(self, events: EventLike | Sequence[EventLike]) -> FeedbackReceipt:
        """Send one event or a batch; see `AsyncFeedbackClient.send`."""
        batch = to_events(events, source=self.source)
        if self._kafka is not None and self._loop is not None:
            return self._loop.run(self._kafka.send(batch))
        assert self._webhook is not None and self._http is not None
        body = self._webhook.body(batch)
        for attempt in range(self._max_retries + 1):
            try:
                headers = self._webhook.headers(body)
                response = self._http.post(self._webhook.url, content=body, headers=headers)
                return self._webhook.answer(response)
            except httpx.TransportError as exc:
                error: CloraError = self._webhook.unreachable(exc)
                cause: BaseException | None = exc
            except CloraError as exc:
                error, cause = exc, None
            if not error.retriable or attempt == self._max_retries:
                raise error from cause
            time.sleep(_backoff(attempt, error))
        raise AssertionError("unreachable")

    def correction(
        self,
        agent: str,
        *,
        corrected_content: str | None = None,
        diff: str | None = None,
        comment: str | None = None,
        verdict: Verdict | None = None,
        **fields: Unpack[EventFields],
    ) -> FeedbackReceipt:
        """See `AsyncFeedbackClient.correction`."""
        return self.send(self._correction(agent, corrected_content, diff, comment, verdict, fields))

    def resolution(
        self,
        agent: str,
        outcome: Outcome,
        *,
        score: float | None = None,
        resolution_text: str | None = None,
        correct_answer: str | None = None,
        **fields: Unpack[EventFields],
    ) -> FeedbackReceipt:
        """See `AsyncFeedbackClient.resolution`."""
        return self.send(
            self._resolution(agent, outcome, score, resolution_text, correct_answer, fields)
        )

    def reward(
        self, agent: str, value: float, *, name: str | None = None, **fields: Unpack[EventFields]
    ) -> FeedbackReceipt:
        """See `AsyncFeedbackClient.reward`."""
        return self.send(self._reward(agent, value, name, fields))

    def close(self) -> None:
        """Close the HTTP connections, or flush and stop the Kafka producer and its thread."""
        if self._http is not None:
            self._http.close()
        if self._kafka is not None and self._loop is not None:
            self._loop.run(self._kafka.stop())
            self._loop.close()
            self._kafka = self._loop = None
