"""Feedback events as Kafka records: the wire format both ways, and the producer.

One event per record: the value is the event as UTF-8 JSON, the key is its
agent (so one agent's feedback stays ordered within one partition), and the
topic follows its kind (any topic accepts any kind when consuming). Records
that cannot be applied go to the dead-letter topic with the `HEADER_*`
headers below; `connectors/topics.json` documents the same names and a test
keeps the two in step.

- `decode_record`: a record's key and value -> a validated event, or
  `InvalidRequestError` whose message is the dead-letter reason.
- `FeedbackProducer`: writes events (the webhook and `FeedbackClient` use it; the
  SDK imports it from here, never from the consumer).
- `kafka_client_options`: the security keyword arguments (TLS, SASL) every aiokafka
  client we build gets from `KafkaConfig`; `dead_letter_options` adds the
  dead-letter size limit.
- `fit_dead_letter`: a record too large for the dead-letter topic becomes a
  bounded JSON envelope (its position, key, size, reason and a value prefix).

aiokafka errors are translated here and in `kafka` into `UnavailableError`
(retriable, code `kafka_error`). Not here: consuming (`kafka`), the broker.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError
from aiokafka.helpers import create_ssl_context
from pydantic import ValidationError

from clora_feedback.config import DEAD_LETTER_HEADROOM, KafkaConfig
from clora_feedback.errors import CloraError, ConfigError, InvalidRequestError, UnavailableError
from clora_feedback.lifecycle import AsyncLifecycle
from clora_feedback.schemas.feedback import Event, parse_event
from clora_feedback.schemas.paths import json_path

__all__ = [
    "HEADER_REASON",
    "HEADER_SOURCE_OFFSET",
    "HEADER_SOURCE_PARTITION",
    "HEADER_SOURCE_TOPIC",
    "Delivery",
    "FeedbackProducer",
    "build_producer",
    "dead_letter_options",
    "decode_record",
    "fit_dead_letter",
    "kafka_client_options",
]

HEADER_REASON = "clora.reason"
HEADER_SOURCE_TOPIC = "clora.source.topic"
HEADER_SOURCE_PARTITION = "clora.source.partition"
HEADER_SOURCE_OFFSET = "clora.source.offset"
MAX_REASON_CHARS = 2000
MAX_ENVELOPE_KEY_BYTES = 1024
_DEFAULTS = KafkaConfig()

log = logging.getLogger(__name__)


def kafka_error(action: str, exc: BaseException) -> UnavailableError:
    """The one translation of aiokafka errors: the feedback log is unavailable (retriable)."""
    return UnavailableError(f"kafka {action} failed: {exc!r}", code="kafka_error")


async def close_quietly(aw: Any) -> None:
    """Await a client's `stop()`; closing after a failure must not hide the failure."""
    try:
        await aw
    except Exception as exc:
        log.debug("ignored while closing: %r", exc)


async def start_producer(bootstrap_servers: str, **options: Any) -> AIOKafkaProducer:
    """A connected `acks=all` aiokafka producer. Raises `UnavailableError` if unreachable."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap_servers, acks="all", **options)
    try:
        await producer.start()
    except KafkaError as exc:
        await close_quietly(producer.stop())
        raise kafka_error(f"connect to {bootstrap_servers}", exc) from exc
    return producer


def kafka_client_options(config: KafkaConfig) -> dict[str, Any]:
    """Keyword arguments every aiokafka client we build gets: the cluster's security.

    TLS (`SSL`, `SASL_SSL`) gets an `ssl.SSLContext` from aiokafka's
    `create_ssl_context` (server certificate and host name checked against
    `ssl_cafile` or the system CAs; `ssl_certfile`/`ssl_keyfile` for mutual TLS).
    SASL gets the mechanism and the credentials. The result carries the password
    in clear: hand it to a client, never to a log line.

    Raises:
        ConfigError: a TLS file cannot be read or is not what it should be.
    """
    options: dict[str, Any] = {"security_protocol": config.security_protocol}
    if config.security_protocol in ("SSL", "SASL_SSL"):
        try:
            options["ssl_context"] = create_ssl_context(
                cafile=config.ssl_cafile,
                certfile=config.ssl_certfile,
                keyfile=config.ssl_keyfile,
                # An encrypted key would make OpenSSL prompt on the terminal of a server.
                password=_no_key_password,
            )
        except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
            files = {
                "ssl_cafile": config.ssl_cafile,
                "ssl_certfile": config.ssl_certfile,
                "ssl_keyfile": config.ssl_keyfile,
            }
            named = ", ".join(f"{k}={v}" for k, v in files.items() if v is not None)
            raise ConfigError(
                f"cannot set up TLS for Kafka ({named or 'system CAs'}): {exc}",
                param="feedback.kafka.ssl",
                code="kafka_tls",
            ) from exc
    if config.security_protocol.startswith("SASL_"):
        password = config.sasl_plain_password
        options["sasl_mechanism"] = config.sasl_mechanism
        options["sasl_plain_username"] = config.sasl_plain_username
        options["sasl_plain_password"] = None if password is None else password.get_secret_value()
    return options


def dead_letter_options(config: KafkaConfig) -> dict[str, Any]:
    """`kafka_client_options` for the dead-letter producer: records up to the dead-letter limit."""
    return {**kafka_client_options(config), "max_request_size": config.dead_letter_max_bytes}


def _no_key_password() -> str:
    return ""


# -- decoding ---------------------------------------------------------------------------


def decode_record(
    key: bytes | None, value: bytes | None, known_agents: Collection[str] | None = None
) -> Event:
    """The feedback event carried by one record.

    Args:
        key: record key; when present it must be the event's agent (UTF-8).
        value: record value: one event as UTF-8 JSON.
        known_agents: accepted agent names; None accepts every agent.

    Raises:
        InvalidRequestError: the record is malformed; the message is the
            dead-letter reason and `param` names the offending part.
    """
    if value is None:
        raise InvalidRequestError("empty record (no value)", param="value")
    try:
        text = value.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequestError(f"invalid UTF-8 in value: {exc}", param="value") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(f"invalid JSON: {exc}", param="value") from exc
    if not isinstance(data, dict):
        raise InvalidRequestError(
            f"expected one JSON object, got {type(data).__name__}", param="value"
        )
    try:
        event = parse_event(data)
    except ValidationError as exc:
        raise InvalidRequestError(f"schema violation: {_errors_text(exc)}", param="value") from exc
    if key is not None:
        agent_key = key.decode("utf-8", errors="replace")
        if agent_key != event.agent:
            raise InvalidRequestError(
                f"record key {agent_key!r} is not the event's agent {event.agent!r}", param="key"
            )
    if known_agents is not None and event.agent not in known_agents:
        raise InvalidRequestError(f"unknown agent {event.agent!r}", param="agent")
    return event


def _errors_text(exc: ValidationError, most: int = 5) -> str:
    parts = []
    for err in exc.errors()[:most]:
        # The kind tag stays in: the reason should say which kind failed (`reward.value`).
        where = json_path(err["loc"]) or "event"
        parts.append(f"{where}: {err['msg']}")
    more = exc.error_count() - most
    return "; ".join(parts) + (f"; and {more} more" if more > 0 else "")


def fit_dead_letter(
    key: bytes | None,
    value: bytes | None,
    reason: str,
    *,
    source: tuple[str, int, int],
    max_bytes: int,
) -> tuple[bytes | None, bytes | None]:
    """The key and value to dead-letter a record with, so the record fits `max_bytes`.

    A record that fits with `DEAD_LETTER_HEADROOM` to spare (headers, framing)
    keeps its own key and bytes. A larger one becomes a UTF-8 JSON envelope

        {"clora_truncated": true, "topic", "partition", "offset", "key", "size",
         "reason", "value_prefix"}

    where `key` is the original key as text, `size` the original key + value
    bytes and `value_prefix` the longest prefix of the value (as text,
    undecodable bytes replaced) that keeps the record within `max_bytes`. Keys
    are cut to `MAX_ENVELOPE_KEY_BYTES`, in the envelope and as the record key.

    Args:
        key, value: the original record.
        reason: why it is dead-lettered (the envelope keeps `MAX_REASON_CHARS`).
        source: (topic, partition, offset) it was read from.
        max_bytes: the dead-letter producer's `max_request_size` (>= 65,536,
            so an envelope with an empty prefix always fits).
    """
    size = len(key or b"") + len(value or b"")
    if size + DEAD_LETTER_HEADROOM <= max_bytes:
        return key, value
    short_key = None if key is None else key[:MAX_ENVELOPE_KEY_BYTES]
    topic, partition, offset = source
    fields: dict[str, Any] = {
        "clora_truncated": True,
        "topic": topic,
        "partition": partition,
        "offset": offset,
        "key": None if short_key is None else short_key.decode("utf-8", errors="replace"),
        "size": size,
        "reason": reason[:MAX_REASON_CHARS],
    }
    room = max_bytes - DEAD_LETTER_HEADROOM - len(short_key or b"")
    data = value or b""
    n = min(len(data), room)
    while True:
        fields["value_prefix"] = data[:n].decode("utf-8", errors="replace")
        body = json.dumps(fields, ensure_ascii=False).encode()
        if len(body) <= room or n == 0:
            return short_key, body
        # JSON escapes and replacement characters make the text longer than its bytes.
        n = min(n - 1, n * room // len(body))


@dataclass(frozen=True)
class Delivery:
    """Where a produced event landed."""

    topic: str
    partition: int
    offset: int


# -- the producer -------------------------------------------------------------------------


class FeedbackProducer(AsyncLifecycle):
    """Writes feedback events to the topic of their kind, keyed by agent (acks from all replicas).

    Args:
        bootstrap_servers: `host:port[,host:port]`.
        corrections_topic, resolutions_topic, rewards_topic: Topic per kind.
        enable_idempotence: Broker-side dedupe of producer retries; Apache Kafka
            supports it, the embedded Tansu does not (hence off by default;
            consumers dedupe by `event_id` anyway).
        client_id: Client id shown by the broker.
        linger_ms: How long to wait to fill a batch (0 = send at once).
        client_options: More aiokafka producer arguments: the cluster's security
            (`kafka_client_options`); `build_producer` passes the configured ones.
    """

    def __init__(
        self,
        bootstrap_servers: str,
        *,
        corrections_topic: str = _DEFAULTS.corrections_topic,
        resolutions_topic: str = _DEFAULTS.resolutions_topic,
        rewards_topic: str = _DEFAULTS.rewards_topic,
        enable_idempotence: bool = False,
        client_id: str = "clora-feedback",
        linger_ms: int = 0,
        client_options: Mapping[str, Any] | None = None,
    ):
        self.bootstrap_servers = bootstrap_servers
        self._topics = {
            "correction": corrections_topic,
            "resolution": resolutions_topic,
            "reward": rewards_topic,
        }
        self._args: dict[str, Any] = {
            "enable_idempotence": enable_idempotence,
            "client_id": client_id,
            "linger_ms": linger_ms,
            **(client_options or {}),
        }
        self._producer: Any = None

    def topic_for(self, event: Event) -> str:
        return self._topics[event.kind]

    async def start(self) -> None:
        """Connect. Raises `UnavailableError` when the cluster cannot be reached."""
        self._producer = await start_producer(self.bootstrap_servers, **self._args)

    async def stop(self) -> None:
        """Flush pending sends and disconnect; idempotent."""
        producer, self._producer = self._producer, None
        if producer is not None:
            await close_quietly(producer.stop())

    async def send(self, event: Event) -> Delivery:
        """Produce one event and wait for its ack. Raises `UnavailableError` on failure."""
        return (await self.send_many([event]))[0]

    async def send_many(self, events: Sequence[Event]) -> list[Delivery]:
        """Produce events (pipelined) and wait for every ack, in order."""
        if self._producer is None:
            raise CloraError("the feedback producer is not started", code="not_started")
        try:
            pending = [
                await self._producer.send(
                    self.topic_for(e), value=e.model_dump_json().encode(), key=e.agent.encode()
                )
                for e in events
            ]
            acks = await asyncio.gather(*pending)
        except KafkaError as exc:
            raise kafka_error("produce", exc) from exc
        return [Delivery(m.topic, m.partition, m.offset) for m in acks]


def build_producer(config: KafkaConfig, bootstrap_servers: str, **options: Any) -> FeedbackProducer:
    """A producer on the configured topics, with the configured security."""
    return FeedbackProducer(
        bootstrap_servers,
        corrections_topic=config.corrections_topic,
        resolutions_topic=config.resolutions_topic,
        rewards_topic=config.rewards_topic,
        client_options=kafka_client_options(config),
        **options,
    )
