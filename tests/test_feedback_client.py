"""`FeedbackClient` / `AsyncFeedbackClient` and `clora feedback send` against real servers.

Webhook tests run the feedback router under uvicorn (helpers from `test_webhook`);
one test runs the full gateway on the tiny model, so the completion id comes from
a real chat completion; Kafka tests use the real Tansu broker of `kafka_fixtures`.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import socket
import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from kafka_fixtures import KAFKA, kafka_broker, read_topic
from test_webhook import AGENTS, FakeSink, feedback_app, resolution, serve, trajectory

from clora_feedback.cli.feedback import add_feedback_parser
from clora_feedback.client import (
    AsyncFeedbackClient,
    FeedbackClient,
    FeedbackDeliveryError,
    to_events,
)
from clora_feedback.config import EngineConfig, FeedbackConfig, Settings
from clora_feedback.errors import (
    AuthenticationError,
    InvalidRequestError,
    OverloadedError,
    PermissionDeniedError,
    UnavailableError,
)
from clora_feedback.feedback.broker import LocalBroker
from clora_feedback.feedback.ingest import FeedbackIngest, LogDeadLetters
from clora_feedback.feedback.rewards import DefaultRewardPolicy
from clora_feedback.feedback.store import FeedbackStore
from clora_feedback.gateway.feedback import build_feedback_router
from clora_feedback.store.trajectories import TrajectoryStore

__all__ = ["kafka_broker"]  # a fixture, imported for pytest


@pytest.fixture
def store(tmp_path: Path) -> Iterator[FeedbackStore]:
    s = FeedbackStore(
        tmp_path / "feedback.db",
        trajectories=TrajectoryStore(tmp_path / "feedback.db"),
        policy=DefaultRewardPolicy(FeedbackConfig()),
    )
    s.trajectories.record(trajectory("c-support", texts=("hello world",)))
    s.trajectories.record(trajectory("c-sales", agent="sales"))
    yield s
    s.close()


@pytest.fixture
def servers() -> Iterator[ExitStack]:
    with ExitStack() as stack:
        yield stack


def webhook(servers: ExitStack, store: FeedbackStore, sink: Any = None, **settings: Any) -> str:
    """Start a webhook server over `store`; its URL."""
    config = Settings(**{"agents": AGENTS, "admin_api_key": "k-admin", **settings})
    return servers.enter_context(serve(feedback_app(store, config, sink)))


def test_builders_send_and_report(servers: ExitStack, store: FeedbackStore) -> None:
    url = webhook(servers, store, feedback=FeedbackConfig(webhook_secret="s"))
    with FeedbackClient(url + "/v1", api_key="k-support", webhook_secret="s") as client:
        joined = client.resolution("support", "resolved", completion_id="c-support", score=0.5)
        assert joined.delivery == "store" and joined.joined == joined.event_ids
        uuid.UUID(joined.event_ids[0])  # generated
        fix = client.correction("support", completion_id="c-support", corrected_content="hello")
        assert fix.joined == fix.event_ids
        rerouted = client.resolution(
            "support", "resolved", completion_id="c-support", correct_answer="billing"
        )
        assert rerouted.joined == rerouted.event_ids
        dropped = client.correction("support", completion_id="c-support", verdict="rejected")
        assert dropped.joined == dropped.event_ids
        parked = client.reward("support", 0.3, completion_ids=["c-later"], event_id="mine")
        assert parked.parked == ["mine"] and parked.event_ids == ["mine"]
        again = client.reward("support", 0.9, completion_ids=["c-later"], event_id="mine")
        assert again.duplicates == ["mine"]
    values = [r["value"] for r in store.rewards_for("c-support")]
    assert values[0] == pytest.approx(0.5 * 1.0 + 0.5 * 0.5)
    assert values[1:] == [0.0, 0.0, 0.0]  # corrected, not the correct answer, rejected
    targets = [r["target"] for r in store.rewards_for("c-support")]
    assert targets[1:3] == ["hello", "billing"]


def test_send_dicts_and_models(servers: ExitStack, store: FeedbackStore) -> None:
    url = webhook(servers, store)
    events = [
        {
            "kind": "resolution",
            "agent": "support",
            "completion_id": "c-support",
            "outcome": "escalated",
        },
        *to_events(resolution("given", "c-sales", agent="sales")),
    ]
    with FeedbackClient(url, api_key="k-admin", source="unit") as client:
        receipt = client.send(events)
    assert receipt.event_ids[1] == "given" and receipt.joined == receipt.event_ids
    assert store.rewards_for("c-support")[0]["value"] == 0.0


def test_errors_map_to_the_package_hierarchy(servers: ExitStack, store: FeedbackStore) -> None:
    url = webhook(servers, store, feedback=FeedbackConfig(webhook_secret="s"))
    with FeedbackClient(url, api_key="k-sales", webhook_secret="wrong") as client:
        with pytest.raises(AuthenticationError) as auth:
            client.resolution("sales", "resolved", completion_id="c-sales")
        assert auth.value.code == "invalid_signature" and not auth.value.retriable
    with FeedbackClient(url, api_key="k-sales", webhook_secret="s") as client:
        with pytest.raises(PermissionDeniedError) as denied:
            client.send([resolution("a", "c-sales", agent="sales"), resolution("b", "c-support")])
        assert (denied.value.param, denied.value.code) == ("[1].agent", "agent_not_allowed")
        # Refused locally, named like the server names it; nothing was sent.
        with pytest.raises(InvalidRequestError) as invalid:
            client.resolution("sales", "meh", completion_id="c-sales")  # type: ignore[arg-type]
        assert invalid.value.param == "outcome" and invalid.value.code == "invalid_event"
        with pytest.raises(InvalidRequestError) as extra:
            client.resolution("sales", "resolved", completion_id="c-sales", diff="x")  # type: ignore[call-arg]
        assert extra.value.param == "diff"
    assert store.state_counts() == {}
    with FeedbackClient(url, api_key="k-admin", webhook_secret="s") as admin:
        with pytest.raises(InvalidRequestError) as all_rejected:
            admin.resolution("support", "resolved", completion_id="c-sales")
        assert all_rejected.value.code == "feedback_rejected"
        message = all_rejected.value.message
        assert "not a completion of agent 'support'" in message and "agent 'sales'" not in message


def test_retries_resend_the_same_event_ids(servers: ExitStack, store: FeedbackStore) -> None:
    sink = FakeSink(failures=2)
    url = webhook(servers, store, sink=sink)
    with FeedbackClient(url, api_key="k-admin", max_retries=0) as impatient:
        with pytest.raises(FeedbackDeliveryError) as failed:
            impatient.resolution("support", "resolved", completion_id="c-support")
        assert failed.value.retriable
    with FeedbackClient(url, api_key="k-admin", max_retries=2) as client:
        receipt = client.resolution("support", "resolved", completion_id="c-support")
    assert receipt.delivery == "kafka" and [e.event_id for e in sink.events] == receipt.event_ids


def test_unreachable_server_is_a_retriable_delivery_error() -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    client = FeedbackClient(f"http://127.0.0.1:{port}", max_retries=1)
    with client, pytest.raises(FeedbackDeliveryError) as err:
        client.reward("support", 1.0, completion_id="c")
    assert err.value.retriable and err.value.code == "unreachable"


def test_exactly_one_delivery_is_required() -> None:
    with pytest.raises(InvalidRequestError):
        FeedbackClient()
    with pytest.raises(InvalidRequestError):
        AsyncFeedbackClient("http://x", kafka_bootstrap="y:1")


async def test_async_client(servers: ExitStack, store: FeedbackStore) -> None:
    url = webhook(servers, store)
    async with AsyncFeedbackClient(url, api_key="k-support") as client:
        first, second = await asyncio.gather(
            client.resolution("support", "reopened", completion_id="c-support"),
            client.reward("support", -0.25, completion_id="c-support", name="tests_failed"),
        )
        with pytest.raises(PermissionDeniedError):
            await client.reward("support", 1.0, completion_id="c-sales")
    assert first.joined and second.joined
    assert sorted(r["value"] for r in store.rewards_for("c-support")) == [-0.5, -0.25]


# -- the CLI --------------------------------------------------------------------------------


def clora(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="clora")
    add_feedback_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    result: int = args.func(args)
    return result


def test_cli_flags_file_and_stdin(
    servers: ExitStack,
    store: FeedbackStore,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url = webhook(servers, store, feedback=FeedbackConfig(webhook_secret="s"))
    common = ["feedback", "send", "--url", url, "--api-key", "k-admin", "--secret", "s"]
    assert (
        clora(
            *common,
            "--kind",
            "resolution",
            "--agent",
            "support",
            "--completion-id",
            "c-support",
            "--outcome",
            "resolved",
            "--score",
            "1",
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["joined"]
    answer = ["--outcome", "resolved", "--correct-answer", "billing"]
    assert clora(*common, "--kind", "resolution", "--agent", "support", *answer) == 1
    assert "completion_id" in capsys.readouterr().err  # the right answer names one completion
    target = ["--agent", "support", "--completion-id", "c-support"]
    assert clora(*common, "--kind", "resolution", *target, *answer) == 0
    assert clora(*common, "--kind", "correction", *target, "--verdict", "ignored") == 0
    capsys.readouterr()
    rewards = store.rewards_for("c-support")
    assert [(r["value"], r["target"]) for r in rewards[1:]] == [(0.0, "billing"), (0.25, None)]

    lines = tmp_path / "events.jsonl"
    lines.write_text(
        json.dumps(resolution("f1", "c-sales", agent="sales"))
        + "\n\n"
        + json.dumps(resolution("f2", "c-nope", agent="sales"))
        + "\n"
    )
    assert clora(*common, "--file", str(lines)) == 0
    receipt = json.loads(capsys.readouterr().out)
    assert (receipt["joined"], receipt["parked"]) == (["f1"], ["f2"])

    monkeypatch.setattr("sys.stdin", io.StringIO(json.dumps([resolution("f3", "c-sales")])))
    assert clora(*common, "--file", "-") == 1  # rejected by the store: support vs sales
    captured = capsys.readouterr()
    assert (
        "not a completion of agent 'support'" in captured.err
        and "agent 'sales'" not in captured.err
    )
    assert store.event_state("f3") is None

    assert (
        clora(
            *common,
            "--kind",
            "resolution",
            "--agent",
            "support",
            "--completion-id",
            "c-support",
            "--outcome",
            "meh",
        )
        == 1
    )
    assert "outcome" in capsys.readouterr().err
    with pytest.raises(SystemExit) as usage:
        clora(*common, "--kind", "reward")
    assert usage.value.code == 2


def test_sdk_and_cli_signatures_are_accepted(
    servers: ExitStack, store: FeedbackStore, capsys: pytest.CaptureFixture[str]
) -> None:
    url = webhook(servers, store, feedback=FeedbackConfig(webhook_secret="new"))
    # Mid-rotation the sender signs with both secrets; the server's matches one v1 entry.
    with FeedbackClient(url, api_key="k-admin", webhook_secret=["old", "new"]) as client:
        assert client.resolution("support", "resolved", completion_id="c-support").joined
    with FeedbackClient(url, api_key="k-admin", webhook_secret="old") as stale:
        with pytest.raises(AuthenticationError) as refused:
            stale.resolution("support", "resolved", completion_id="c-support")
        assert refused.value.code == "invalid_signature"
    args = ["feedback", "send", "--url", url, "--api-key", "k-admin"]
    args += ["--secret", "old", "--secret", "new", "--kind", "reward", "--agent", "sales"]
    assert clora(*args, "--completion-id", "c-sales", "--value", "0.5") == 0
    assert json.loads(capsys.readouterr().out)["joined"]


def test_parked_limit_reaches_the_sdk_as_overloaded(
    servers: ExitStack, store: FeedbackStore
) -> None:
    url = webhook(servers, store, feedback=FeedbackConfig(max_parked_per_agent=1))
    with FeedbackClient(url, api_key="k-support", max_retries=0) as client:
        assert client.reward("support", 1.0, completion_id="c-later-1").parked
        with pytest.raises(OverloadedError) as full:
            client.reward("support", 1.0, completion_id="c-later-2")
    assert full.value.code == "parked_limit" and full.value.retriable
    assert full.value.retry_after_s >= 1


# -- Kafka (real broker) ----------------------------------------------------------------------


def test_sync_client_produces_to_kafka(kafka_broker: LocalBroker) -> None:
    with FeedbackClient(kafka_bootstrap=kafka_broker.bootstrap) as client:
        receipt = client.resolution("support", "resolved", completion_id="c1", event_id="k1")
        client.correction("sales", completion_ids=["c2", "c3"], corrected_content="fixed")
    assert receipt.delivery == "kafka" and receipt.event_ids == ["k1"]
    (record,) = asyncio.run(read_topic(kafka_broker.bootstrap, KAFKA.resolutions_topic))
    assert record.key == b"support"
    assert json.loads(record.value) | {"occurred_at": None} == {
        **resolution("k1", "c1"),
        "source": "clora-client",
        "occurred_at": None,
        "schema_version": 1,
        "completion_ids": [],
        "conversation_id": None,
        "score": None,
        "resolution_text": None,
        "correct_answer": None,
    }
    (fix,) = asyncio.run(read_topic(kafka_broker.bootstrap, KAFKA.corrections_topic))
    assert fix.key == b"sales" and json.loads(fix.value)["corrected_content"] == "fixed"


async def test_async_client_produces_to_kafka(kafka_broker: LocalBroker) -> None:
    async with AsyncFeedbackClient(kafka_bootstrap=kafka_broker.bootstrap) as client:
        receipt = await client.send([resolution(f"e{i}", "c", agent="a") for i in range(5)])
    assert receipt.accepted == 5
    records = await read_topic(kafka_broker.bootstrap, KAFKA.resolutions_topic)
    assert sorted(json.loads(r.value)["event_id"] for r in records) == [f"e{i}" for i in range(5)]


def test_unreachable_broker_is_retriable() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    client = FeedbackClient(kafka_bootstrap=f"127.0.0.1:{port}")
    with client, pytest.raises(UnavailableError) as err:
        client.reward("support", 1.0, completion_id="c")
    assert err.value.retriable


# -- end to end through the full gateway ------------------------------------------------------


def test_completion_from_the_gateway_gets_its_reward(tiny_model_dir: Path, tmp_path: Path) -> None:
    from clora_feedback.engine.embedded import EmbeddedEngine
    from clora_feedback.gateway.app import create_app
    from clora_feedback.service import gateway_deployer
    from clora_feedback.store.trajectories import AsyncTrajectoryStore

    engine_config = EngineConfig(model=str(tiny_model_dir), max_model_len=512, num_threads=1)
    settings = Settings(
        data_dir=tmp_path, engine=engine_config, agents=[{"name": "support", "api_keys": ["k"]}]
    )
    engine = EmbeddedEngine(tiny_model_dir, engine_config, model_name="tiny-base")
    app = create_app(
        settings,
        engine,
        AsyncTrajectoryStore(settings.trajectory_db),
        deployer=gateway_deployer(settings, engine),
    )
    feedback = FeedbackStore(
        settings.trajectory_db,
        trajectories=TrajectoryStore(settings.trajectory_db),
        policy=DefaultRewardPolicy(settings.feedback),
    )
    ingest = FeedbackIngest(feedback, LogDeadLetters(), park_ttl_s=settings.feedback.park_ttl_s)
    app.include_router(build_feedback_router(ingest, settings))
    try:
        with serve(app, lifespan="on") as url:
            from openai import OpenAI

            with OpenAI(base_url=url + "/v1", api_key="k", max_retries=0) as openai:
                completion = openai.chat.completions.create(
                    model="support", messages=[{"role": "user", "content": "hi"}], max_tokens=4
                )
            with FeedbackClient(url + "/v1", api_key="k") as client:
                receipt = client.resolution("support", "resolved", completion_id=completion.id)
        assert receipt.joined == receipt.event_ids
        (sample,) = feedback.training_samples("support")
        assert sample.completion_id == completion.id and sample.reward == 1.0
        assert len(sample.completion_token_ids) == completion.usage.completion_tokens  # type: ignore[union-attr]
    finally:
        feedback.close()
