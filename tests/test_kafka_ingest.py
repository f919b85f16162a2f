"""Kafka ingestion against a real Tansu broker: joins, parking, TTL, malformed input, rebalances.

The SIGKILL scenario lives in `test_kafka_kill.py`.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
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

from clora_feedback.config import FeedbackConfig
from clora_feedback.errors import InvalidRequestError
from clora_feedback.feedback.broker import LocalBroker
from clora_feedback.feedback.kafka import (
    HEADER_REASON,
    HEADER_SOURCE_OFFSET,
    HEADER_SOURCE_PARTITION,
    HEADER_SOURCE_TOPIC,
    FeedbackConsumer,
    FeedbackProducer,
    build_consumer,
    decode_record,
)
from clora_feedback.feedback.rewards import DefaultRewardPolicy
from clora_feedback.feedback.store import FeedbackStore
from clora_feedback.schemas.feedback import Correction, Resolution, Reward

__all__ = ["feedback_store", "kafka_broker"]  # fixtures, imported for pytest

TOPIC_OF = {
    "correction": KAFKA.corrections_topic,
    "resolution": KAFKA.resolutions_topic,
    "reward": KAFKA.rewards_topic,
}


def record_of(event: Correction | Resolution | Reward) -> tuple[str, bytes, bytes]:
    return TOPIC_OF[event.kind], event.agent.encode(), event.model_dump_json().encode()


def headers(record: Any) -> dict[str, str]:
    return {k: v.decode() for k, v in record.headers}


# -- decoding (no broker) -----------------------------------------------------------------

GOOD = {"kind": "reward", "event_id": "e1", "agent": "a", "completion_id": "c", "source": "t"}


@pytest.mark.parametrize(
    ("key", "value", "param", "reason"),
    [
        (b"a", None, "value", "empty record"),
        (b"a", b"\xff\xfe{}", "value", "invalid UTF-8"),
        (b"a", b"{not json", "value", "invalid JSON"),
        (b"a", b"[1, 2]", "value", "expected one JSON object, got list"),
        (
            b"a",
            json.dumps({**GOOD, "value": "x"}).encode(),
            "value",
            "schema violation: reward.value",
        ),
        (b"a", json.dumps({**GOOD, "value": 1, "extra": 1}).encode(), "value", "extra"),
        (b"b", json.dumps({**GOOD, "value": 1}).encode(), "key", "record key 'b' is not"),
        (b"a", json.dumps({**GOOD, "agent": "z", "value": 1}).encode(), "key", "not the event's"),
        (None, json.dumps({**GOOD, "agent": "z", "value": 1}).encode(), "agent", "unknown agent"),
    ],
)
def test_decode_record_names_the_reason(
    key: bytes | None, value: bytes | None, param: str, reason: str
) -> None:
    with pytest.raises(InvalidRequestError) as info:
        decode_record(key, value, known_agents={"a"})
    assert reason in info.value.message
    assert info.value.param == param


def test_decode_record_accepts_valid_records() -> None:
    value = json.dumps({**GOOD, "value": 0.5}).encode()
    event = decode_record(b"a", value, known_agents={"a"})
    assert isinstance(event, Reward) and event.value == 0.5
    assert decode_record(None, value).event_id == "e1"  # no key, any agent


def test_dead_letter_headers_match_the_connectors_contract() -> None:
    topics = json.loads((Path(__file__).parents[1] / "connectors" / "topics.json").read_text())
    (dlq,) = [t for t in topics["topics"] if t["name"] == KAFKA.dead_letter_topic]
    ours = {HEADER_REASON, HEADER_SOURCE_TOPIC, HEADER_SOURCE_PARTITION, HEADER_SOURCE_OFFSET}
    assert set(dlq["headers"]) == ours


# -- end to end -------------------------------------------------------------------------------


def consumer_for(store: FeedbackStore, broker: LocalBroker, **kwargs: Any) -> FeedbackConsumer:
    options = {**FAST_GROUP, "rejoin_interval_s": 0.2, **kwargs}
    return FeedbackConsumer(store, broker.bootstrap, **options)


async def test_rewards_join_the_right_trajectories(
    kafka_broker: LocalBroker, feedback_store: FeedbackStore
) -> None:
    trajectories = feedback_store.trajectories
    store_trajectory(trajectories, "chatcmpl-a1", "agent-a", ["def f(): return 1"])
    store_trajectory(trajectories, "chatcmpl-a2", "agent-a", ["first", "second"])
    store_trajectory(trajectories, "chatcmpl-b1", "agent-b", ["hello"])
    events: list[Correction | Resolution | Reward] = [
        Correction(
            event_id="c1",
            agent="agent-a",
            completion_id="chatcmpl-a1",
            source="github",
            corrected_content="def f(): return 2",
        ),
        Resolution(
            event_id="r1",
            agent="agent-a",
            completion_id="chatcmpl-a2",
            source="zendesk",
            outcome="resolved",
            score=0.6,
        ),
        Reward(
            event_id="w1", agent="agent-b", completion_id="chatcmpl-b1", source="ci", value=-0.25
        ),
        Correction(event_id="c2", agent="agent-b", completion_id="chatcmpl-b1", source="github"),
    ]
    await produce(kafka_broker.bootstrap, [record_of(e) for e in events])

    async with running(consumer_for(feedback_store, kafka_broker)) as consumer:
        await wait_until(lambda: consumer.metrics.applied == 4, what="4 events joined")

    # Each reward reaches the completion it names, with the value the policy gives.
    a1 = feedback_store.rewards_for("chatcmpl-a1")
    assert [(r["event_id"], r["sample_index"], r["target"]) for r in a1] == [
        ("c1", 0, "def f(): return 2")
    ]
    expected_c1 = DefaultRewardPolicy(FeedbackConfig()).signal(events[0], "def f(): return 1").value
    assert a1[0]["value"] == pytest.approx(expected_c1) == 0.0  # corrected: the target, no credit
    a2 = feedback_store.rewards_for("chatcmpl-a2")
    assert [(r["event_id"], r["sample_index"]) for r in a2] == [("r1", 0), ("r1", 1)]
    assert all(r["value"] == pytest.approx(0.5 * 1.0 + 0.5 * 0.6) for r in a2)
    b1 = feedback_store.rewards_for("chatcmpl-b1")
    # Different topics: no order between them.
    assert sorted((r["event_id"], r["value"], r["target"]) for r in b1) == [
        ("c2", 1.0, None),  # accepted as-is: full reward, nothing to imitate
        ("w1", -0.25, None),
    ]
    assert consumer.metrics.dead_lettered == 0 and consumer.metrics.lag == 0
    assert await read_topic(kafka_broker.bootstrap, KAFKA.dead_letter_topic) == []


async def test_parked_event_joins_when_its_trajectory_arrives(
    kafka_broker: LocalBroker, feedback_store: FeedbackStore
) -> None:
    event = Reward(
        event_id="late", agent="agent-a", completion_id="chatcmpl-late", source="ci", value=0.7
    )
    await produce(kafka_broker.bootstrap, [record_of(event)])
    async with running(consumer_for(feedback_store, kafka_broker)) as consumer:
        await wait_until(lambda: consumer.metrics.parked == 1, what="the event parked")
        assert feedback_store.rewards_for("chatcmpl-late") == []
        store_trajectory(feedback_store.trajectories, "chatcmpl-late", "agent-a")
        await wait_until(lambda: consumer.metrics.rejoined == 1, what="the parked event joined")
    assert feedback_store.event_state("late") == ("joined", None)
    assert [(r["event_id"], r["value"]) for r in feedback_store.rewards_for("chatcmpl-late")] == [
        ("late", 0.7)
    ]


async def test_parked_event_past_its_ttl_goes_to_the_dead_letter_topic(
    kafka_broker: LocalBroker, feedback_store: FeedbackStore
) -> None:
    event = Reward(
        event_id="lost", agent="agent-a", completion_id="chatcmpl-never", source="ci", value=1
    )
    await produce(kafka_broker.bootstrap, [record_of(event)])
    async with running(consumer_for(feedback_store, kafka_broker, park_ttl_s=0.5)) as consumer:
        await wait_until(lambda: consumer.metrics.expired == 1, what="the parked event expired")
    state, reason = feedback_store.event_state("lost") or ("?", None)
    assert state == "dead" and reason is not None and "chatcmpl-never" in reason
    (dead,) = await read_topic(kafka_broker.bootstrap, KAFKA.dead_letter_topic)
    assert headers(dead)[HEADER_REASON] == reason
    assert dead.key == b"agent-a" and json.loads(dead.value)["event_id"] == "lost"


async def test_feedback_producer_routes_by_kind_and_keys_by_agent(
    kafka_broker: LocalBroker,
) -> None:
    events = [
        Correction(event_id="p1", agent="agent-a", completion_id="x", source="s"),
        Resolution(
            event_id="p2", agent="agent-b", completion_id="y", source="s", outcome="escalated"
        ),
        Reward(event_id="p3", agent="agent-c", completion_id="z", source="s", value=2.0),
    ]
    async with FeedbackProducer(kafka_broker.bootstrap) as producer:
        deliveries = await producer.send_many(events[:2])
        deliveries.append(await producer.send(events[2]))
    for event, delivery in zip(events, deliveries, strict=True):
        assert delivery.topic == TOPIC_OF[event.kind]
        (record,) = await read_topic(kafka_broker.bootstrap, delivery.topic)
        assert (record.partition, record.offset) == (delivery.partition, delivery.offset)
        assert record.key == event.agent.encode()
        assert decode_record(record.key, record.value) == event


# -- 1,000 records: 5% malformed, 5% duplicated ------------------------------------------------


def _bad_records(rng: random.Random) -> list[tuple[str, bytes | None, bytes | None, str]]:
    """50 records that must all be dead-lettered: (topic, key, value, expected reason fragment)."""

    def reward(i: int, **over: Any) -> dict[str, Any]:
        base = {"kind": "reward", "event_id": f"bad-{i}", "agent": "agent-a",
                "completion_id": "chatcmpl-0", "source": "ci", "value": 1.0}  # fmt: skip
        return {**base, **over}

    out: list[tuple[str, bytes | None, bytes | None, str]] = []
    topics = list(TOPIC_OF.values())
    for i in range(50):
        topic, sort = topics[i % 3], i % 7
        if sort == 0:
            out.append((topic, b"agent-a", b"\xc3\x28 not utf-8", "invalid UTF-8"))
        elif sort == 1:
            out.append((topic, b"agent-a", b'{"kind": "reward", ', "invalid JSON"))
        elif sort == 2:
            out.append(
                (topic, b"agent-a", json.dumps(reward(i, value="hi")).encode(), "schema violation")
            )
        elif sort == 3:
            bad = {k: v for k, v in reward(i).items() if k != "source"}
            out.append(
                (topic, b"agent-a", json.dumps(bad).encode(), "schema violation: reward.source")
            )
        elif sort == 4:
            out.append(
                (topic, b"agent-b", json.dumps(reward(i)).encode(), "is not the event's agent")
            )
        elif sort == 5:
            body = reward(i, agent="agent-x")
            out.append((topic, b"agent-x", json.dumps(body).encode(), "unknown agent 'agent-x'"))
        else:  # well-formed, but names another agent's completion: the store refuses it
            body = reward(i, completion_id=f"chatcmpl-{rng.randrange(50, 100)}")
            out.append((topic, b"agent-a", json.dumps(body).encode(), "refused by the store"))
    return out


async def test_thousand_records_with_malformed_and_duplicates(
    kafka_broker: LocalBroker, feedback_store: FeedbackStore
) -> None:
    rng = random.Random(3)
    for i in range(100):  # completions 0-49 belong to agent-a, 50-99 to agent-b
        store_trajectory(
            feedback_store.trajectories, f"chatcmpl-{i}", "agent-a" if i < 50 else "agent-b"
        )
    valid = [
        Reward(
            event_id=f"ev-{i}",
            agent="agent-a" if c < 50 else "agent-b",
            completion_id=f"chatcmpl-{c}",
            source="bench",
            value=round(rng.uniform(-1, 1), 6),
        )
        for i, c in enumerate(rng.randrange(100) for _ in range(900))
    ]
    good = [record_of(e) for e in valid]
    duplicates = [good[i] for i in rng.sample(range(900), 50)]
    bad = _bad_records(rng)
    records = [*good, *duplicates, *((t, k, v) for t, k, v, _ in bad)]
    order = list(range(len(records)))
    rng.shuffle(order)
    metadata = await produce(kafka_broker.bootstrap, [records[i] for i in order])
    assert len(metadata) == 1000
    where = {(m.topic, m.partition, m.offset): order[n] for n, m in enumerate(metadata)}

    consumer = consumer_for(
        feedback_store, kafka_broker, max_batch=100, known_agents=lambda: {"agent-a", "agent-b"}
    )
    async with running(consumer):
        await wait_until(lambda: consumer.metrics.records == 1000, what="1,000 records consumed")
        await wait_until(lambda: consumer.metrics.lag == 0, what="offsets committed")

    # Exactly the 900 unique valid events applied, each once, with its own value.
    assert feedback_store.state_counts() == {"joined": 900}
    for event in valid[::37]:
        assert (event.event_id, event.value) in {
            (r["event_id"], r["value"])
            for r in feedback_store.rewards_for(event.completion_id or "")
        }
    assert consumer.metrics.duplicates == 50 and consumer.metrics.applied == 900
    # Every bad record, and nothing else, in the dead-letter topic: same bytes, reason, source.
    dead = await read_topic(kafka_broker.bootstrap, KAFKA.dead_letter_topic)
    assert len(dead) == 50 == consumer.metrics.dead_lettered
    seen = set()
    for record in dead:
        h = headers(record)
        source = (
            h[HEADER_SOURCE_TOPIC],
            int(h[HEADER_SOURCE_PARTITION]),
            int(h[HEADER_SOURCE_OFFSET]),
        )
        index = where[source] - 950  # bad records were appended after the 950 good ones
        assert index >= 0, f"a valid record was dead-lettered: {h}"
        topic, key, value, reason = bad[index]
        assert (record.key, record.value, source[0]) == (key, value, topic)
        assert reason in h[HEADER_REASON]
        seen.add(index)
    assert seen == set(range(50))


# -- rebalances ---------------------------------------------------------------------------------


@pytest.mark.slow
async def test_rebalance_commits_the_in_flight_batch_first(
    kafka_broker: LocalBroker, feedback_store: FeedbackStore
) -> None:
    """A member joins while a batch is in flight: it is committed before the partitions move.

    Without that, the new owner re-reads the uncommitted batch (or the late commit
    fails): here either shows up as a duplicate or a commit failure.
    """
    agents = [f"agent-{i}" for i in range(9)]  # keys spread over every partition
    for agent in agents:
        store_trajectory(feedback_store.trajectories, f"chatcmpl-{agent}", agent)
    kinds = (
        lambda i, a: Reward(event_id=f"rb-{i}", agent=a, completion_id=f"chatcmpl-{a}", source="s", value=i),
        lambda i, a: Resolution(event_id=f"rb-{i}", agent=a, completion_id=f"chatcmpl-{a}", source="s", outcome="resolved"),
        lambda i, a: Correction(event_id=f"rb-{i}", agent=a, completion_id=f"chatcmpl-{a}", source="s"),
    )  # fmt: skip
    events = [kinds[i % 3](i, agents[i % 9]) for i in range(300)]
    await produce(kafka_broker.bootstrap, [record_of(e) for e in events])
    # A batch takes 2.5 s; the group settles ~1 s after the newcomer's join.
    first = consumer_for(feedback_store, kafka_broker, max_batch=50, commit_delay_s=2.5)
    second = consumer_for(feedback_store, kafka_broker, max_batch=50)

    async with running(first):
        # The first batch just committed: the second one is now in flight.
        await wait_until(lambda: first.metrics.batches == 1, what="the first batch")
        async with running(second):
            await wait_until(lambda: second.metrics.applied > 0, what="the newcomer applying")
            first.commit_delay_s = 0.0
        await wait_until(
            lambda: first.metrics.applied + second.metrics.applied == 300, what="every event"
        )
    assert feedback_store.state_counts() == {"joined": 300}
    assert first.metrics.duplicates + second.metrics.duplicates == 0
    assert first.metrics.commit_failures + second.metrics.commit_failures == 0


def test_build_consumer_takes_the_parked_cap_from_config(feedback_store: FeedbackStore) -> None:
    """`clora ingest` alone builds its ingest here: the configured cap must reach it."""
    config = FeedbackConfig(max_parked_per_agent=7)
    consumer = build_consumer(feedback_store, config, "127.0.0.1:9")
    assert consumer.ingest.max_parked_per_agent == 7
