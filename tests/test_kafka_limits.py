"""Record sizes: an oversized record is dead-lettered (truncated if need be), never a wedge.

Tansu accepts records far over Kafka's 1 MiB default (3 MB and 6 MB were
checked by hand), so the 3 MB record of the report is produced as it was.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from kafka_fixtures import (
    FAST_GROUP,
    KAFKA,
    feedback_store,
    kafka_broker,
    produce,
    read_topic,
    running,
    store_trajectory,
    wait_until,
)
from pydantic import ValidationError

from clora_feedback.config import DEAD_LETTER_HEADROOM, FeedbackConfig, KafkaConfig
from clora_feedback.feedback.broker import LocalBroker
from clora_feedback.feedback.kafka import HEADER_REASON, FeedbackConsumer, build_consumer
from clora_feedback.feedback.records import MAX_ENVELOPE_KEY_BYTES, fit_dead_letter
from clora_feedback.feedback.store import FeedbackStore
from clora_feedback.schemas.feedback import Resolution, Reward

__all__ = ["feedback_store", "kafka_broker"]  # fixtures, imported for pytest

SOURCE = ("clora.resolutions", 2, 41)
BIG = 8_000_000  # our test producer's own limit, so 3 MB records go out


# -- the envelope (no broker) ---------------------------------------------------------------


def test_a_record_that_fits_is_dead_lettered_unchanged() -> None:
    key, value = b"agent-a", b"x" * 1000
    assert fit_dead_letter(key, value, "bad", source=SOURCE, max_bytes=65_536) == (key, value)
    assert fit_dead_letter(None, None, "empty", source=SOURCE, max_bytes=65_536) == (None, None)


@pytest.mark.parametrize(
    "value",
    [
        b"a" * 3_000_000,  # plain text
        b"\xff" * 300_000,  # not UTF-8: each byte becomes a 3-byte replacement character
        b"\x01" * 300_000,  # control characters: each byte becomes a 6-byte JSON escape
        "é😀".encode() * 100_000,  # multi-byte characters
    ],
)
def test_a_record_too_large_becomes_an_envelope_that_fits(value: bytes) -> None:
    limit = 65_536
    reason = "schema violation: " + "r" * 5000  # cut to the header's 2,000 characters
    key, body = fit_dead_letter(b"agent-a", value, reason, source=SOURCE, max_bytes=limit)
    assert key == b"agent-a" and body is not None
    assert len(key) + len(body) + DEAD_LETTER_HEADROOM <= limit
    envelope = json.loads(body)
    prefix = envelope.pop("value_prefix")
    assert envelope == {
        "clora_truncated": True,
        "topic": "clora.resolutions",
        "partition": 2,
        "offset": 41,
        "key": "agent-a",
        "size": len(b"agent-a") + len(value),
        "reason": reason[:2000],
    }
    assert len(prefix) > 1000  # a useful prefix, as long as the room allows
    assert value.decode("utf-8", errors="replace").startswith(prefix.rstrip("\ufffd"))


def test_a_huge_key_is_cut_in_the_envelope_and_as_the_record_key() -> None:
    key, body = fit_dead_letter(b"k" * 200_000, b"v", "too_large", source=SOURCE, max_bytes=65_536)
    assert key == b"k" * MAX_ENVELOPE_KEY_BYTES and body is not None
    assert json.loads(body)["key"] == "k" * MAX_ENVELOPE_KEY_BYTES
    assert json.loads(body)["size"] == 200_001


def test_the_limits_are_config_and_consistent() -> None:
    kafka = KafkaConfig()
    assert (kafka.max_record_bytes, kafka.dead_letter_max_bytes) == (1_000_000, 1_048_576)
    with pytest.raises(ValidationError, match="max_record_bytes"):
        KafkaConfig(max_record_bytes=1_040_000)  # within the dead-letter headroom
    consumer = build_consumer(
        None,  # type: ignore[arg-type]  # never started
        FeedbackConfig(kafka=KafkaConfig(max_record_bytes=50_000, dead_letter_max_bytes=70_000)),
        "127.0.0.1:1",
    )
    assert (consumer.max_record_bytes, consumer.dead_letter_max_bytes) == (50_000, 70_000)


# -- with the broker ------------------------------------------------------------------------


def three_megabyte_resolution(agent: str, completion_id: str) -> bytes:
    """A schema-valid resolution of about 3 MB: 200k characters, most sent as JSON escapes."""
    event = Resolution(
        event_id="huge",
        agent=agent,
        completion_id=completion_id,
        source="zendesk",
        outcome="resolved",
        resolution_text="\x01" * 200_000,
    )
    text = event.model_dump_json()
    assert len(text) > 1_000_000  # `\u0001` per character
    return (text + " " * (3_000_000 - len(text))).encode()  # JSON allows trailing space


def small_reward(event_id: str, completion_id: str) -> tuple[str, bytes, bytes]:
    event = Reward(
        event_id=event_id, agent="agent-a", completion_id=completion_id, source="ci", value=1
    )
    return KAFKA.rewards_topic, b"agent-a", event.model_dump_json().encode()


def envelopes(dead: list[Any]) -> dict[int, dict[str, Any]]:
    """The truncated dead letters, by source offset; every dead letter fits the limit."""
    out = {}
    for record in dead:
        assert len(record.key or b"") + len(record.value) + DEAD_LETTER_HEADROOM <= 1_048_576
        envelope = json.loads(record.value)
        assert envelope["clora_truncated"] is True
        assert envelope["reason"] == dict(record.headers)[HEADER_REASON].decode()
        out[envelope["offset"]] = envelope
    return out


async def test_an_oversized_refused_record_is_dead_lettered_truncated(
    kafka_broker: LocalBroker, feedback_store: FeedbackStore
) -> None:
    """The report's case: a 3 MB valid event the store refuses; the DLQ producer's limit is 1 MiB."""
    store_trajectory(feedback_store.trajectories, "chatcmpl-a", "agent-a")
    store_trajectory(feedback_store.trajectories, "chatcmpl-b", "agent-b")
    huge = three_megabyte_resolution("agent-a", "chatcmpl-b")  # another agent's completion
    junk = b"\xff" * 2_000_000  # not UTF-8
    records = [
        (KAFKA.resolutions_topic, b"agent-a", huge),
        (KAFKA.resolutions_topic, b"agent-a", junk),
        small_reward("after", "chatcmpl-a"),
    ]
    sent = await produce(kafka_broker.bootstrap, records, max_request_size=BIG)
    consumer = FeedbackConsumer(
        feedback_store,
        kafka_broker.bootstrap,
        max_record_bytes=4_000_000,  # parsed, so the store is the one refusing
        rejoin_interval_s=0.2,
        **FAST_GROUP,
    )
    async with running(consumer):
        await wait_until(lambda: consumer.metrics.records == 3, what="all three records")
        await wait_until(lambda: consumer.metrics.lag == 0, what="offsets committed")
    assert feedback_store.state_counts() == {"joined": 1}  # the one after them
    assert consumer.metrics.dead_lettered == 2 == consumer.metrics.truncated
    assert consumer.metrics.batch_retries == 0

    by_offset = envelopes(await read_topic(kafka_broker.bootstrap, KAFKA.dead_letter_topic))
    refused, malformed = by_offset[sent[0].offset], by_offset[sent[1].offset]
    assert refused["reason"].startswith("refused by the store") and refused["size"] == len(huge) + 7
    assert (refused["key"], refused["topic"], refused["partition"]) == (
        "agent-a",
        KAFKA.resolutions_topic,
        sent[0].partition,
    )
    assert huge.decode().startswith(refused["value_prefix"]) and len(refused["value_prefix"]) > 1e5
    assert malformed["reason"].startswith("invalid UTF-8") and malformed["size"] == 2_000_007


async def test_a_record_over_the_accepted_size_is_not_parsed(
    kafka_broker: LocalBroker, feedback_store: FeedbackStore
) -> None:
    """With the default limits the same 3 MB record is `too_large`, and what follows applies."""
    store_trajectory(feedback_store.trajectories, "chatcmpl-a", "agent-a")
    huge = three_megabyte_resolution("agent-a", "chatcmpl-a")  # would even be valid
    records = [(KAFKA.resolutions_topic, b"agent-a", huge), small_reward("next", "chatcmpl-a")]
    sent = await produce(kafka_broker.bootstrap, records, max_request_size=BIG)
    consumer = FeedbackConsumer(
        feedback_store, kafka_broker.bootstrap, rejoin_interval_s=0.2, **FAST_GROUP
    )
    async with running(consumer):
        await wait_until(lambda: consumer.metrics.records == 2, what="both records")
        await wait_until(lambda: consumer.metrics.lag == 0, what="offsets committed")
    assert feedback_store.state_counts() == {"joined": 1}
    assert feedback_store.event_state("huge") is None  # never applied
    assert consumer.metrics.too_large == 1 == consumer.metrics.dead_lettered

    by_offset = envelopes(await read_topic(kafka_broker.bootstrap, KAFKA.dead_letter_topic))
    assert list(by_offset) == [sent[0].offset]
    envelope = by_offset[sent[0].offset]
    assert envelope["reason"] == f"too_large: {len(huge) + 7} bytes, over max_record_bytes 1000000"
    assert envelope["size"] == len(huge) + 7 and huge.decode().startswith(envelope["value_prefix"])


async def test_dead_letters_fit_a_small_producer_limit(
    kafka_broker: LocalBroker, feedback_store: FeedbackStore
) -> None:
    """The dead-letter producer runs with `max_request_size = dead_letter_max_bytes`."""
    junk = b"{" * 200_000  # invalid JSON, over a 64 KiB dead-letter limit, under the record limit
    small = b"{" * 1000
    await produce(
        kafka_broker.bootstrap,
        [(KAFKA.rewards_topic, b"agent-a", junk), (KAFKA.rewards_topic, b"agent-a", small)],
    )
    consumer = FeedbackConsumer(
        feedback_store,
        kafka_broker.bootstrap,
        dead_letter_max_bytes=65_536,
        rejoin_interval_s=0.2,
        **FAST_GROUP,
    )
    async with running(consumer):
        await wait_until(lambda: consumer.metrics.dead_lettered == 2, what="both dead-lettered")
    assert consumer.metrics.truncated == 1 and consumer.metrics.batch_retries == 0
    dead = await read_topic(kafka_broker.bootstrap, KAFKA.dead_letter_topic)
    values = sorted((r.value for r in dead), key=len)
    assert values[0] == small  # fits: the original bytes
    envelope = json.loads(values[1])
    assert envelope["size"] == len(junk) + 7 and envelope["value_prefix"].startswith("{{{")
    assert len(values[1]) + DEAD_LETTER_HEADROOM <= 65_536
