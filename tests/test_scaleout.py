"""Scale-out end to end (issue 11): PostgreSQL + Tansu + 2 gateways + 2 ingest consumers + 2 trainers.

Every role is a real `clora` process on loopback, sharing one PostgreSQL database,
one Tansu broker and one adapter directory; the model is a tiny random-weight one.
Completions and rewards go through both gateways for several agents (each reward
through the other gateway than its completion); one trainer and one gateway are
killed with SIGKILL mid-run and restarted. At the end:

- every accepted feedback event is applied exactly once (one event row, one join);
- each agent's versions form one chain with no gap (each version's parent is the
  previous version);
- every live gateway serves each agent's active version (read from the `clora`
  field of a completion it serves);
- no sample was trained twice: the versions' feedback windows are contiguous and
  disjoint, and no completion appears in two of them.

The waits below are bounded so a broken build fails instead of hanging; nothing
asserts how long anything took.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from kafka_fixtures import kafka_broker

from clora_feedback.bench.roles import RoleProcess, free_port, wait_healthy, write_settings
from clora_feedback.feedback.broker import LocalBroker

__all__ = ["kafka_broker"]  # a fixture, imported for pytest

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

AGENTS = ["alpha", "beta", "gamma"]
ADMIN = {"authorization": "Bearer k-admin"}


def _settings(tmp: Path, model: Path, url: str, bootstrap: str, **trainer: Any) -> dict[str, Any]:
    return {
        "data_dir": str(tmp / "data"),
        "adapters_dir": str(tmp / "adapters"),
        "store_url": url,
        "admin_api_key": "k-admin",
        "agents": [{"name": a, "api_keys": [f"k-{a}"]} for a in AGENTS],
        "engine": {
            "model": str(model), "device": "cpu", "max_model_len": 256, "num_threads": 1,
            "max_num_seqs": 4, "prefix_cache_mb": 0, "adapter_poll_interval_s": 1.0,
        },
        "feedback": {"kafka": {"bootstrap_servers": bootstrap, "group_id": "scaleout"}},
        "trainer": {
            "lease_ttl_s": 3.0, "trigger_interval_s": 1.0, "poll_interval_s": 0.2, "nice": 0,
            "admission": {"min_batch": 2, "max_batch": 8}, **trainer,
        },
        "release": {"enabled": False},  # published versions serve at once (ownership, not release)
    }  # fmt: skip


class Cluster:
    def __init__(self, tmp: Path, model: Path, url: str, broker: LocalBroker) -> None:
        self.url = url
        logs = tmp / "logs"
        serve_cfg = write_settings(
            tmp / "serve.json", _settings(tmp, model, url, broker.bootstrap, enabled=False)
        )
        train_cfg = write_settings(tmp / "train.json", _settings(tmp, model, url, broker.bootstrap))
        self.ports = [free_port(), free_port()]
        self.gateways = [
            RoleProcess(
                f"gateway{i}", ["serve", "--config", str(serve_cfg), "--port", str(p)], logs
            )
            for i, p in enumerate(self.ports)
        ]
        ingest = ["ingest", "--config", str(serve_cfg), "--session-timeout-ms", "2000"]
        ingest += ["--heartbeat-interval-ms", "300"]
        self.ingest = [RoleProcess(f"ingest{i}", ingest, logs) for i in range(2)]
        self.trainers = [
            RoleProcess(
                f"train{i}", ["train", "--config", str(train_cfg), "--owner", f"t{i}"], logs
            )
            for i in range(2)
        ]
        self.accepted: set[tuple[str, str]] = set()
        self.n = 0

    def all(self) -> list[RoleProcess]:
        return [*self.gateways, *self.ingest, *self.trainers]

    def base(self, i: int) -> str:
        return f"http://127.0.0.1:{self.ports[i]}"

    def start_gateway(self, i: int) -> None:
        wait_healthy(self.base(i), self.gateways[i].start())

    def chat(self, i: int, agent: str) -> tuple[str, int]:
        self.n += 1
        response = httpx.post(
            f"{self.base(i)}/v1/chat/completions",
            json={"model": agent, "max_tokens": 4,
                  "messages": [{"role": "user", "content": f"question {self.n}"}]},
            headers={"authorization": f"Bearer k-{agent}"},
            timeout=60,
        )  # fmt: skip
        response.raise_for_status()
        body = response.json()
        return body["id"], int(body["clora"]["adapter_version"])

    def reward(self, i: int, agent: str, completion_id: str) -> None:
        event_id = f"e{self.n}-{agent}"
        response = httpx.post(
            f"{self.base(i)}/v1/feedback",
            json={"kind": "reward", "event_id": event_id, "agent": agent,
                  "completion_id": completion_id, "source": "test", "value": self.n % 3 - 1.0},
            headers={"authorization": f"Bearer k-{agent}"},
            timeout=60,
        )  # fmt: skip
        assert response.status_code < 300, response.text  # acked by the broker
        self.accepted.add((agent, event_id))

    def traffic(self, rounds: int, gateways: tuple[int, ...] = (0, 1)) -> None:
        """Per round, per agent, per gateway: a completion there, its reward through another."""
        for _ in range(rounds):
            for agent in AGENTS:
                for i in gateways:
                    completion_id, _ = self.chat(i, agent)
                    self.reward(gateways[(gateways.index(i) + 1) % len(gateways)], agent,
                                completion_id)  # fmt: skip

    def query(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.url) as conn:
            return conn.execute(sql, params).fetchall()


def _wait(condition: Callable[[], bool], what: str, cluster: Cluster, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {p.name}\n{p.tail(1500)}" for p in cluster.all())
            pytest.fail(f"timed out waiting for {what}\n{logs}")
        time.sleep(0.25)


@pytest.fixture
def cluster(
    tmp_path: Path, tiny_model_dir: Path, postgres_url: str, kafka_broker: LocalBroker
) -> Iterator[Cluster]:
    cluster = Cluster(tmp_path, tiny_model_dir, postgres_url, kafka_broker)
    try:
        cluster.start_gateway(0)  # creates the schemas first, then the others start at once
        for proc in [cluster.gateways[1], *cluster.ingest, *cluster.trainers]:
            proc.start()
        wait_healthy(cluster.base(1), cluster.gateways[1])
        yield cluster
    finally:
        for proc in cluster.all():
            proc.stop()


def _trained_up_to(cluster: Cluster) -> bool:
    """Every joined sample of every agent is covered by a published version's window."""
    joined = dict(cluster.query("SELECT agent, max(seq) FROM event_targets GROUP BY agent"))
    covered: dict[str, int] = {}
    for agent, window in cluster.query("SELECT agent, feedback_window FROM versions"):
        if window:
            covered[agent] = max(covered.get(agent, 0), int(_json(window)["to_seq"]))
    return all(covered.get(a, 0) >= joined.get(a, 1) for a in AGENTS)


def _json(text: str) -> dict[str, Any]:
    value: dict[str, Any] = json.loads(text)
    return value


def _all_applied(cluster: Cluster) -> bool:
    rows = cluster.query("SELECT count(*) FROM event_targets")
    return int(rows[0][0]) >= len(cluster.accepted)


def test_two_of_every_role_survive_sigkill_and_agree(cluster: Cluster) -> None:
    cluster.traffic(2)
    _wait(lambda: _trained_up_to(cluster), "a first version of every agent", cluster, 120)
    owners = {o for (o,) in cluster.query("SELECT DISTINCT owner FROM trainer_leases")}
    assert owners <= {"t0", "t1"} and owners

    # Crash one trainer and one gateway mid-run; traffic goes on through the other gateway.
    cluster.trainers[0].kill()
    cluster.gateways[0].kill()
    cluster.traffic(2, gateways=(1,))
    # Within the lease TTL + a renewal, the surviving trainer holds every agent.
    _wait(
        lambda: (
            {r[0]: r[1] for r in cluster.query("SELECT agent, owner FROM trainer_leases")}
            == dict.fromkeys(AGENTS, "t1")
        ),
        "the surviving trainer to take every agent",
        cluster,
        60,
    )
    cluster.trainers[0].start()
    cluster.start_gateway(0)
    cluster.traffic(2)

    _wait(lambda: _all_applied(cluster), "every accepted event to be applied", cluster, 90)
    _wait(lambda: _trained_up_to(cluster), "training to cover every sample", cluster, 120)

    # Every accepted feedback event applied exactly once.
    events = cluster.query("SELECT agent, event_id, state FROM feedback_events")
    assert {(a, e) for a, e, _ in events} == cluster.accepted
    assert {s for _, _, s in events} == {"joined"}
    joins = cluster.query("SELECT agent, event_id, count(*) FROM event_targets GROUP BY 1, 2")
    assert len(joins) == len(cluster.accepted) and {c for _, _, c in joins} == {1}

    for agent in AGENTS:
        versions = cluster.query(
            "SELECT version, parent, feedback_window FROM versions WHERE agent = %s "
            "ORDER BY version",
            (agent,),
        )
        # One chain, no gap: each version's parent is the previous version.
        assert [p for _, p, _ in versions] == [None, *[v for v, _, _ in versions[:-1]]]
        # No sample trained twice: contiguous, disjoint windows; no completion in two.
        windows = [_json(w) for _, _, w in versions]
        assert windows[0]["from_seq"] == 0
        assert all(b["from_seq"] == a["to_seq"] for a, b in itertools.pairwise(windows))
        ids = [c for w in windows for c in w["completion_ids"]]
        assert len(ids) == len(set(ids))
        # Every live gateway serves the active version.
        (active,) = cluster.query("SELECT active_version FROM agents WHERE agent = %s", (agent,))[0]
        for i in (0, 1):
            _wait(
                lambda i=i, agent=agent, active=active: cluster.chat(i, agent)[1] == active,
                f"gateway {i} to serve {agent} v{active}",
                cluster,
                30,
            )
