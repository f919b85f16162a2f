"""`POST /v1/feedback` over a real uvicorn server: signatures, keys, limits, bad bodies, delivery.

The app here is the feedback router mounted exactly as the gateway mounts it
(gateway error handlers, key authenticator on `app.state`) over a SQLite
feedback store with a few stored trajectories; no engine is needed. The
end-to-end path through the full gateway is in `test_feedback_client.py`.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from feedback_support import rejoin_all

from clora_feedback.client import SIGNATURE_HEADER, FeedbackDeliveryError, sign_body
from clora_feedback.config import FeedbackConfig, Settings
from clora_feedback.feedback.ingest import FeedbackIngest, LogDeadLetters
from clora_feedback.feedback.rewards import DefaultRewardPolicy
from clora_feedback.feedback.store import FeedbackStore
from clora_feedback.gateway.auth import KeyAuthenticator
from clora_feedback.gateway.errors import install_error_handlers
from clora_feedback.gateway.feedback import Event, build_feedback_router
from clora_feedback.store.trajectories import SampleRecord, TrajectoryRecord, TrajectoryStore

AGENTS = [
    {"name": "support", "api_keys": ["k-support"]},
    {"name": "sales", "api_keys": ["k-sales"]},
]
ADMIN = {"authorization": "Bearer k-admin"}
SUPPORT = {"authorization": "Bearer k-support"}
SALES = {"authorization": "Bearer k-sales"}


def trajectory(
    cid: str, agent: str = "support", texts: tuple[str, ...] = ("hello world",)
) -> TrajectoryRecord:
    samples = [
        SampleRecord(i, t, [5, 6, 7], [-0.1, -0.2, -0.3], [1, 1, 1], "stop")
        for i, t in enumerate(texts)
    ]
    request = {"messages": [{"role": "user", "content": "hi"}]}
    return TrajectoryRecord(cid, agent, 1, "chat", request, [1, 2, 3], samples, time.time())


def resolution(
    eid: str, cid: str, *, agent: str = "support", outcome: str = "resolved"
) -> dict[str, Any]:
    return {
        "kind": "resolution",
        "event_id": eid,
        "agent": agent,
        "completion_id": cid,
        "source": "test",
        "outcome": outcome,
    }


@contextmanager
def serve(app: FastAPI, lifespan: Literal["on", "off"] = "off") -> Iterator[str]:
    """Run `app` under uvicorn on a free loopback port; yields its URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(
        uvicorn.Config(app, log_level="warning", ws="none", http="h11", lifespan=lifespan)
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def feedback_app(store: FeedbackStore, settings: Settings, sink: Any = None) -> FastAPI:
    """The router as `create_app` mounts it: error handlers, authenticator, router."""
    app = FastAPI()
    app.state.authenticator = KeyAuthenticator(settings)
    install_error_handlers(app)
    ingest = FeedbackIngest(
        store,
        LogDeadLetters(),
        park_ttl_s=settings.feedback.park_ttl_s,
        max_parked_per_agent=settings.feedback.max_parked_per_agent,
    )
    app.include_router(build_feedback_router(ingest, settings, sink))
    return app


class FakeSink:
    """A `FeedbackSink` that keeps what it was sent; fails the first `failures` sends."""

    def __init__(self, failures: int = 0) -> None:
        self.events: list[Event] = []
        self.failures = failures

    async def send(self, event: Event) -> None:
        await asyncio.sleep(0)
        if self.failures:
            self.failures -= 1
            raise FeedbackDeliveryError("broker unavailable", code="kafka_error")
        self.events.append(event)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[FeedbackStore]:
    s = FeedbackStore(
        tmp_path / "feedback.db",
        trajectories=TrajectoryStore(tmp_path / "feedback.db"),
        policy=DefaultRewardPolicy(FeedbackConfig()),
    )
    s.trajectories.record(trajectory("c-support", texts=("hello world", "hi there")))
    s.trajectories.record(trajectory("c-support-2"))
    s.trajectories.record(trajectory("c-sales", agent="sales"))
    yield s
    s.close()


Start = Callable[..., httpx.Client]


@pytest.fixture
def start(store: FeedbackStore) -> Iterator[Start]:
    """`start(sink=None, **settings)` -> an httpx client on a running webhook server."""
    stack: list[Any] = []

    def run(sink: Any = None, **settings: Any) -> httpx.Client:
        config = Settings(**{"agents": AGENTS, "admin_api_key": "k-admin", **settings})
        ctx = serve(feedback_app(store, config, sink))
        url = ctx.__enter__()
        client = httpx.Client(base_url=url, timeout=10)
        stack.extend([ctx, client])
        return client

    yield run
    for item in reversed(stack):
        if isinstance(item, httpx.Client):
            item.close()
        else:
            item.__exit__(None, None, None)


def error_of(response: httpx.Response) -> dict[str, Any]:
    error: dict[str, Any] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_single_event_joined(start: Start, store: FeedbackStore) -> None:
    http = start()
    response = http.post("/v1/feedback", json=resolution("e1", "c-support"), headers=SUPPORT)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["delivery"] == "store" and body["joined"] == ["e1"] and body["event_ids"] == ["e1"]
    assert body["parked"] == body["duplicates"] == body["rejected"] == []
    assert [(r["sample_index"], r["value"]) for r in store.rewards_for("c-support")] == [
        (0, 1.0),
        (1, 1.0),
    ]


def test_batch_of_kinds(start: Start, store: FeedbackStore) -> None:
    http = start()
    batch = [
        resolution("r1", "c-support-2", outcome="rejected"),
        {
            "kind": "correction",
            "event_id": "k1",
            "agent": "support",
            "completion_id": "c-support",
            "source": "test",
            "corrected_content": "hello world!",
        },
        {
            "kind": "reward",
            "event_id": "w1",
            "agent": "sales",
            "completion_ids": ["c-sales"],
            "source": "test",
            "value": 0.25,
        },
    ]
    response = http.post("/v1/feedback", json=batch, headers=ADMIN)
    assert response.status_code == 200, response.text
    assert response.json()["joined"] == ["r1", "k1", "w1"]
    assert [r["value"] for r in store.rewards_for("c-support-2")] == [-1.0]
    (fix,) = store.rewards_for("c-support")
    assert (
        fix["target"] == "hello world!" and fix["value"] == 0.0
    )  # corrected: no credit for closeness
    assert [r["value"] for r in store.rewards_for("c-sales")] == [0.25]


def test_signature_required_and_checked(start: Start, store: FeedbackStore) -> None:
    http = start(feedback=FeedbackConfig(webhook_secret="s3cret"))
    body = json.dumps(resolution("e1", "c-support")).encode()

    missing = http.post("/v1/feedback", content=body, headers=ADMIN)
    assert missing.status_code == 401 and error_of(missing)["code"] == "missing_signature"
    for bad in (sign_body(body, "wrong"), sign_body(body + b" ", "s3cret"), "sha256=zz", "md5=00"):
        response = http.post("/v1/feedback", content=body, headers={**ADMIN, SIGNATURE_HEADER: bad})
        assert response.status_code == 401 and error_of(response)["code"] == "invalid_signature"
    assert store.event_state("e1") is None

    good = http.post(
        "/v1/feedback", content=body, headers={**ADMIN, SIGNATURE_HEADER: sign_body(body, "s3cret")}
    )
    assert good.status_code == 200 and good.json()["joined"] == ["e1"]


def test_keys_limit_agents_and_their_completions(start: Start, store: FeedbackStore) -> None:
    http = start()
    assert (
        error_of(http.post("/v1/feedback", json=resolution("e", "c-support")))["code"]
        == "missing_api_key"
    )

    other_agent = http.post("/v1/feedback", json=resolution("e1", "c-support"), headers=SALES)
    assert other_agent.status_code == 403
    assert error_of(other_agent) | {"message": ""} == {
        "message": "",
        "type": "permission_error",
        "param": "agent",
        "code": "agent_not_allowed",
    }

    # Own agent named, but the completion is another agent's: the whole batch is refused.
    sneaky = {
        **resolution("e3", "c-sales", agent="support"),
        "completion_id": None,
        "completion_ids": ["c-support-2", "c-sales"],
    }
    response = http.post(
        "/v1/feedback", json=[resolution("e2", "c-support"), sneaky], headers=SUPPORT
    )
    assert response.status_code == 403
    error = error_of(response)
    assert (error["param"], error["code"]) == ("[1].completion_ids[1]", "completion_not_allowed")
    assert "agent 'sales'" not in error["message"]  # the owner stays private
    assert store.event_state("e2") is None and store.event_state("e3") is None

    ok = http.post("/v1/feedback", json=resolution("e4", "c-sales", agent="sales"), headers=SALES)
    assert ok.status_code == 200 and ok.json()["joined"] == ["e4"]


def test_admin_mismatch_is_rejected_by_the_store(start: Start, store: FeedbackStore) -> None:
    http = start()
    wrong = resolution("bad", "c-sales", agent="support")
    all_bad = http.post("/v1/feedback", json=wrong, headers=ADMIN)
    assert all_bad.status_code == 422
    body = all_bad.json()
    assert error_of(all_bad)["code"] == "feedback_rejected"
    assert body["accepted"] == 0 and [r["event_id"] for r in body["rejected"]] == ["bad"]
    reason = body["rejected"][0]["reason"]
    assert "is not a completion of agent 'support'" in reason and "agent 'sales'" not in reason

    mixed = http.post("/v1/feedback", json=[wrong, resolution("good", "c-support")], headers=ADMIN)
    assert mixed.status_code == 200
    assert mixed.json()["joined"] == ["good"] and mixed.json()["rejected"][0]["event_id"] == "bad"
    assert store.event_state("bad") is None and store.rewards_for("c-sales") == []


def test_open_gateway_needs_no_key(start: Start) -> None:
    http = start(agents=[], admin_api_key=None)
    assert http.post("/v1/feedback", json=resolution("e1", "c-sales", agent="sales")).json()[
        "joined"
    ] == ["e1"]


def test_oversized_body_is_refused(start: Start, store: FeedbackStore) -> None:
    http = start(feedback=FeedbackConfig(max_body_bytes=4096))
    big = [resolution(f"e{i}", "c-support") for i in range(100)]
    response = http.post("/v1/feedback", json=big, headers=ADMIN)
    assert response.status_code == 413 and error_of(response)["code"] == "payload_too_large"

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted while streaming
        yield b"["
        for i in range(100):
            yield json.dumps(resolution(f"s{i}", "c-support")).encode() + b","
        yield b"{}]"

    streamed = http.post("/v1/feedback", content=chunks(), headers=ADMIN)
    assert streamed.status_code == 413
    huge = http.post("/v1/feedback", content=b"[" + b" " * 2_000_000 + b"]", headers=ADMIN)
    assert huge.status_code == 413  # far over the limit: refused before reading it all
    assert store.state_counts() == {}
    assert (
        http.post("/v1/feedback", json=big[:3], headers=ADMIN).status_code == 200
    )  # still serving


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        (b'{"kind": "resolution", "agent": "\xff"}', "invalid_utf8", None),
        (b'{"kind": "resolution",', "invalid_json", None),
        (b'{"kind": "reward", "value": NaN}', "invalid_json", None),
        (b"[]", "empty_batch", None),
        (b"42", "invalid_event", None),
    ],
)
def test_undecodable_bodies(start: Start, body: bytes, code: str, param: str | None) -> None:
    response = start().post("/v1/feedback", content=body, headers=ADMIN)
    assert response.status_code == 400
    error = error_of(response)
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", code, param)


@pytest.mark.parametrize(
    ("payload", "param", "says"),
    [
        (
            [resolution("a", "c-support"), resolution("b", "c-support", outcome="meh")],
            "[1].outcome",
            "'resolved'",
        ),
        ({**resolution("a", "c-support"), "kind": None}, "kind", "'correction'"),
        ({"event_id": "a", "agent": "support", "source": "t"}, "kind", "required"),
        ({**resolution("a", "c-support"), "agent": "no spaces"}, "agent", "pattern"),
        ({**resolution("a", "c-support"), "extra": 1}, "extra", "not permitted"),
        ([{**resolution("a", "x"), "completion_id": None}], "[0]", "completion_id"),
        ({**resolution("a", "c"), "completion_ids": ["ok", 5]}, "completion_ids[1]", "string"),
    ],
)
def test_schema_errors_name_the_field(start: Start, payload: Any, param: str, says: str) -> None:
    response = start().post("/v1/feedback", json=payload, headers=ADMIN)
    assert response.status_code == 400
    error = error_of(response)
    assert (error["param"], error["code"]) == (param, "invalid_event")
    assert error["message"].startswith(f"{param}: ") and says in error["message"]


def test_unknown_completion_is_parked_then_joined(start: Start, store: FeedbackStore) -> None:
    http = start()
    response = http.post("/v1/feedback", json=resolution("early", "c-later"), headers=SUPPORT)
    assert response.status_code == 202
    assert response.json()["parked"] == ["early"] and response.json()["joined"] == []
    store.trajectories.record(trajectory("c-later"))
    joined, dead = rejoin_all(store, ttl_s=60)
    assert joined == ["early"] and dead == []
    assert [r["value"] for r in store.rewards_for("c-later")] == [1.0]


def test_duplicates_applied_once(start: Start, store: FeedbackStore) -> None:
    http = start()
    event = resolution("once", "c-support-2")
    first = http.post("/v1/feedback", json=[event, event], headers=ADMIN).json()
    assert first["joined"] == ["once"] and first["duplicates"] == ["once"]
    again = http.post("/v1/feedback", json={**event, "outcome": "rejected"}, headers=ADMIN)
    assert again.status_code == 200 and again.json()["duplicates"] == ["once"]
    assert [r["value"] for r in store.rewards_for("c-support-2")] == [1.0]


def test_kafka_delivery_through_a_sink(start: Start, store: FeedbackStore) -> None:
    sink = FakeSink()
    http = start(sink=sink)
    batch = [resolution("k1", "c-support"), resolution("k2", "c-unknown")]
    response = http.post("/v1/feedback", json=batch, headers=SUPPORT)
    assert response.status_code == 202
    assert response.json() | {"joined": None} == {
        "delivery": "kafka",
        "accepted": 2,
        "event_ids": ["k1", "k2"],
        "joined": None,
        "parked": [],
        "duplicates": [],
        "rejected": [],
    }
    assert [e.event_id for e in sink.events] == ["k1", "k2"]
    assert sink.events[0].outcome == "resolved"  # type: ignore[union-attr]
    assert store.state_counts() == {}  # the consumer applies it, not the webhook
    # Permission checks still come first: nothing is produced for a forbidden batch.
    assert (
        http.post("/v1/feedback", json=resolution("k3", "c-sales"), headers=SUPPORT).status_code
        == 403
    )
    assert len(sink.events) == 2


def test_kafka_failure_is_retriable(start: Start) -> None:
    http = start(sink=FakeSink(failures=1))
    response = http.post("/v1/feedback", json=resolution("k1", "c-support"), headers=ADMIN)
    assert response.status_code == 503 and error_of(response)["type"] == "server_error"
    assert (
        http.post("/v1/feedback", json=resolution("k1", "c-support"), headers=ADMIN).status_code
        == 202
    )


async def test_rejoiner_joins_parked_webhook_feedback(store: FeedbackStore) -> None:
    settings = Settings(agents=AGENTS, admin_api_key="k-admin")
    with serve(feedback_app(store, settings)) as url:
        async with httpx.AsyncClient(base_url=url) as http:
            late = await http.post("/v1/feedback", json=resolution("late", "c-soon"), headers=ADMIN)
            never = await http.post("/v1/feedback", json=resolution("never", "c-x"), headers=ADMIN)
    assert late.status_code == never.status_code == 202
    store.trajectories.record(trajectory("c-soon"))
    assert store.event_state("late") == ("parked", None)
    async with FeedbackIngest(store, LogDeadLetters(), park_ttl_s=1.0, rejoin_interval_s=0.05):
        deadline = time.monotonic() + 10
        while store.event_state("never") == ("parked", None) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
    assert store.event_state("late") == ("joined", None)
    assert [r["value"] for r in store.rewards_for("c-soon")] == [1.0]
    state, reason = store.event_state("never") or ("?", None)
    assert state == "dead" and reason is not None and "c-x" in reason


# -- tenancy, parking limits, timestamped signatures (issue 12, items 3, 5, 6) -------------


def test_same_event_id_from_two_agents_both_apply(start: Start, store: FeedbackStore) -> None:
    http = start()
    a = http.post("/v1/feedback", json=resolution("ticket-be18d9", "c-support"), headers=SUPPORT)
    assert a.status_code == 200 and a.json()["joined"] == ["ticket-be18d9"]
    b = http.post(
        "/v1/feedback", json=resolution("ticket-be18d9", "c-sales", agent="sales"), headers=SALES
    )
    assert b.status_code == 200, b.text
    assert b.json()["joined"] == ["ticket-be18d9"] and b.json()["duplicates"] == []
    assert [r["value"] for r in store.rewards_for("c-sales")] == [1.0]
    again = http.post(
        "/v1/feedback", json=resolution("ticket-be18d9", "c-sales", agent="sales"), headers=SALES
    )
    assert again.status_code == 200 and again.json()["duplicates"] == ["ticket-be18d9"]


def test_parked_limit_answers_429_with_retry_after(start: Start, store: FeedbackStore) -> None:
    http = start(feedback=FeedbackConfig(max_parked_per_agent=2))
    parked = http.post(
        "/v1/feedback", json=[resolution("p1", "c-a"), resolution("p2", "c-b")], headers=SUPPORT
    )
    assert parked.status_code == 202 and parked.json()["parked"] == ["p1", "p2"]
    over = http.post(
        "/v1/feedback",
        json=[resolution("ok", "c-support-2"), resolution("p3", "c-c")],
        headers=SUPPORT,
    )
    assert over.status_code == 429, over.text
    assert int(over.headers["retry-after"]) >= 1
    error = error_of(over)
    assert (error["type"], error["code"]) == ("rate_limit_error", "parked_limit")
    assert "max_parked_per_agent" in error["message"]
    # Nothing of the refused batch was applied: the sender resends it as is.
    assert store.event_state("ok") is None and store.event_state("p3") is None
    # The other tenant parks on its own budget.
    other = http.post("/v1/feedback", json=resolution("s1", "c-x", agent="sales"), headers=SALES)
    assert other.status_code == 202
    # Once a parked event joins, a place is free again.
    store.trajectories.record(trajectory("c-a"))
    assert rejoin_all(store, ttl_s=60)[0] == ["p1"]
    retried = http.post(
        "/v1/feedback",
        json=[resolution("ok", "c-support-2"), resolution("p3", "c-c")],
        headers=SUPPORT,
    )
    assert retried.status_code == 202 and retried.json()["parked"] == ["p3"]


def signed(body: bytes, secret: str = "s3cret", age_s: float = 0.0) -> dict[str, str]:
    return {**ADMIN, SIGNATURE_HEADER: sign_body(body, secret, timestamp=int(time.time() - age_s))}


def test_signatures_carry_a_timestamp(start: Start, store: FeedbackStore) -> None:
    http = start(feedback=FeedbackConfig(webhook_secret="s3cret"))
    body = json.dumps(resolution("e1", "c-support")).encode()

    def post(headers: dict[str, str]) -> httpx.Response:
        return http.post("/v1/feedback", content=body, headers=headers)

    # A request captured and replayed outside the window, or dated ahead of it: refused.
    for age in (301.0, -301.0):
        replay = post(signed(body, age_s=age))
        assert replay.status_code == 401 and error_of(replay)["code"] == "signature_expired"
    # A changed timestamp breaks the HMAC, whatever its value.
    good = signed(body)[SIGNATURE_HEADER]
    t = int(good.split(",")[0].removeprefix("t="))
    for forged in (t + 1, t - 1000):
        tampered = post({**ADMIN, SIGNATURE_HEADER: good.replace(f"t={t}", f"t={forged}")})
        assert tampered.status_code == 401 and error_of(tampered)["code"] == "invalid_signature"
    # The old body-only form, even correctly computed, is refused with the new form named.
    legacy_mac = hmac.new(b"s3cret", body, hashlib.sha256).hexdigest()
    legacy = post({**ADMIN, SIGNATURE_HEADER: f"sha256={legacy_mac}"})
    assert legacy.status_code == 401 and error_of(legacy)["code"] == "invalid_signature"
    assert "t=<unix seconds>,v1=" in error_of(legacy)["message"]
    for malformed in (
        f"t={t}",
        f"v1={legacy_mac}",
        f"t=soon,v1={legacy_mac}",
        f"t={t},t={t},{good}",
    ):
        response = post({**ADMIN, SIGNATURE_HEADER: malformed})
        assert response.status_code == 401 and error_of(response)["code"] == "invalid_signature"
    assert store.event_state("e1") is None

    # Rotation: one v1 per secret; the entry for the server's secret is enough.
    rotating = sign_body(body, ["the-next-secret", "s3cret"])
    assert rotating.count("v1=") == 2
    accepted = post({**ADMIN, SIGNATURE_HEADER: rotating})
    assert accepted.status_code == 200 and accepted.json()["joined"] == ["e1"]
    assert post(signed(body, age_s=250)).json()["duplicates"] == ["e1"]  # inside the window


def test_signature_tolerance_is_configurable(start: Start) -> None:
    http = start(feedback=FeedbackConfig(webhook_secret="k", signature_tolerance_s=30))
    body = json.dumps(resolution("e1", "c-support")).encode()
    late = http.post("/v1/feedback", content=body, headers=signed(body, "k", age_s=60))
    assert late.status_code == 401 and error_of(late)["code"] == "signature_expired"
    assert http.post("/v1/feedback", content=body, headers=signed(body, "k")).status_code == 200
