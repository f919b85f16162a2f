"""kill -9 of `clora serve` mid-canary: after a restart on the same data the canary goes on.

A real `clora serve` process (the tiny model, SQLite stores under tmp_path, feedback over HTTP)
takes traffic and corrections until the release path canaries a trainer candidate; rewards are
posted on completions of both arms. The process is then SIGKILLed and started again on the same
data directory. Proved: the same version is still `canary` with the same share and `started_at`
(the start the controller reads its live rewards from), the same conversations are routed to the
same arms, the rewards posted before the kill still count in what the controller reads
(`FeedbackStore.rewards_by_version` since `started_at`) and new ones add to them, the serving
version is unchanged, and an operator promote works after the restart.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import httpx
import pytest

from clora_feedback.client import FeedbackClient
from clora_feedback.config import load_settings
from clora_feedback.service.parts import open_stores

AGENT = "support"
CONVERSATIONS = 16


def _config(model_dir: Path, tmp_path: Path) -> Path:
    """The settings of `tests/test_release_service.py`, as a `clora serve --config` file."""
    config = {
        "data_dir": str(tmp_path / "var"),
        "adapters_dir": str(tmp_path / "adapters"),
        "engine": {
            "model": str(model_dir), "max_model_len": 512, "num_threads": 1, "max_num_seqs": 4,
        },
        "agents": [{"name": AGENT}],
        "feedback": {"kafka": {"embedded_broker": False}},
        "trainer": {"admission": {"min_batch": 2, "max_batch": 4}, "poll_interval_s": 0.1},
        "release": {
            "interval_s": 0.2,
            "gate": {"holdout_fraction": 0.5, "min_cases": 2, "max_tokens": 4},
            "canary": {"share": 0.5, "min_feedback": 1000},  # stays live: an operator promotes
        },
    }  # fmt: skip
    path = tmp_path / "clora.json"
    path.write_text(json.dumps(config))
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(predicate: Callable[[], bool], what: str, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


class _Server:
    """One `clora serve` child in its own process group (so a kill reaches its children too)."""

    def __init__(self, config: Path, log: Path) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [sys.executable, "-m", "clora_feedback.cli", "serve", "--config", str(config)]
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(
                [*argv, "--port", str(self.port)],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        self.log = log

    def up(self) -> bool:
        assert self.proc.poll() is None, f"clora serve exited:\n{self.log.read_text()[-4000:]}"
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    def kill(self) -> None:
        """SIGKILL the whole process group (children that outlived it too); idempotent."""
        with suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)


@contextmanager
def _serve(config: Path, log: Path) -> Iterator[_Server]:
    server = _Server(config, log)
    try:
        _wait(server.up, "clora serve to answer /health")
        yield server
    finally:
        server.kill()  # always: a leaked server holds a core and the port


def _chat(http: httpx.Client, content: str, conversation: str | None = None) -> tuple[str, int]:
    """(completion id, the version that served it)."""
    body: dict[str, Any] = {
        "model": AGENT, "messages": [{"role": "user", "content": content}], "max_tokens": 2,
    }  # fmt: skip
    if conversation is not None:
        body["metadata"] = {"conversation_id": conversation}
    reply = http.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    data = reply.json()
    return data["id"], int(data["clora"]["adapter_version"])


def _versions(http: httpx.Client) -> dict[str, Any]:
    answer = http.get(f"/v1/adapters/{AGENT}/versions")
    assert answer.status_code == 200, answer.text
    return dict(answer.json())


def _canary(http: httpx.Client) -> dict[str, Any] | None:
    rows = [v for v in _versions(http)["data"] if (v["release"] or {}).get("state") == "canary"]
    assert len(rows) <= 1, rows
    return rows[0] if rows else None


def _routed_canaries(http: httpx.Client) -> float | None:
    """`clora_release_canaries`: the canaries this process routes."""
    for line in http.get("/metrics").text.splitlines():
        if line.startswith("clora_release_canaries "):
            return float(line.split()[1])
    return None


def _reward_all(url: str, completions: list[str], value: float) -> None:
    with FeedbackClient(url) as feedback:
        for cid in completions:
            receipt = feedback.reward(AGENT, value, completion_id=cid)
            assert receipt.joined == receipt.event_ids, receipt  # counted at once, not parked


def _live_rewards(config: Path, version: int, since: float) -> list[float]:
    """What the release loop reads for an arm (`RewardSource`), from the store on disk."""
    stores = open_stores(load_settings(config))
    try:
        return list(stores.feedback.rewards_by_version(AGENT, version, since))
    finally:
        stores.feedback.close()
        stores.trajectories.close()


def _sticky_traffic(http: httpx.Client) -> dict[str, tuple[int, list[str]]]:
    """Two requests per conversation: conversation -> (the version that served it, ids)."""
    served: dict[str, tuple[int, list[str]]] = {}
    for c in range(CONVERSATIONS):
        conversation = f"conv-{c}"
        for _ in range(2):
            cid, version = _chat(http, "hi", conversation)
            before = served.setdefault(conversation, (version, []))
            assert before[0] == version, (conversation, before[0], version)  # sticky
            before[1].append(cid)
    return served


@pytest.mark.slow
def test_sigkill_mid_canary_then_restart_continues_the_same_canary(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    config, log = _config(tiny_model_dir, tmp_path), tmp_path / "serve.log"

    with _serve(config, log) as first, httpx.Client(base_url=first.url, timeout=120) as http:
        ids = [_chat(http, f"ticket {i}")[0] for i in range(12)]
        with FeedbackClient(first.url) as feedback:
            for i, cid in enumerate(ids):
                feedback.correction(AGENT, completion_id=cid, corrected_content=f"team {i % 3}")
        _wait(lambda: _canary(http) is not None, "a canary", timeout=400)
        before = _canary(http)
        assert before is not None
        version = int(before["version"])
        serving_before = _versions(http)["active_version"]
        assert serving_before != version
        _wait(lambda: _routed_canaries(http) == 1.0, "the canary routed here")
        served = _sticky_traffic(http)
        arms = {conv: v for conv, (v, _) in served.items()}
        canary_ids = [cid for v, cids in served.values() if v == version for cid in cids]
        serving_ids = [cid for v, cids in served.values() if v != version for cid in cids]
        assert canary_ids and serving_ids, arms  # both arms served
        # The canary better than serving: nothing aborts it, and min_feedback keeps it live.
        _reward_all(first.url, canary_ids, 1.0)
        _reward_all(first.url, serving_ids, 0.0)
        first.kill()  # kill -9, mid-canary

    record = before["release"]
    started = float(record["evidence"]["canary"]["started_at"])
    counted = _live_rewards(config, version, started)
    assert len(counted) == len(canary_ids) and set(counted) == {1.0}
    baseline = _live_rewards(config, serving_before or 0, started)  # the serving arm's
    assert len(baseline) == len(serving_ids) and set(baseline) == {0.0}

    with _serve(config, log) as second, httpx.Client(base_url=second.url, timeout=120) as http:
        after = _canary(http)
        assert after is not None, _versions(http)
        assert after["version"] == version
        assert after["release"]["share"] == record["share"] == 0.5
        assert float(after["release"]["evidence"]["canary"]["started_at"]) == started
        assert _versions(http)["active_version"] == serving_before  # serving unchanged
        _wait(lambda: _routed_canaries(http) == 1.0, "the canary restored here")
        again = _sticky_traffic(http)
        assert {conv: v for conv, (v, _) in again.items()} == arms  # same arm per conversation
        more = [cids[0] for v, cids in again.values() if v == version][:2]
        _reward_all(second.url, more, 1.0)
        # The controller's count continues: the rewards before the kill, then the new ones.
        assert len(_live_rewards(config, version, started)) == len(canary_ids) + len(more)
        assert _live_rewards(config, serving_before or 0, started) == baseline

        promoted = http.post(f"/v1/adapters/{AGENT}/promote", json={"reason": "after restart"})
        assert promoted.status_code == 200, promoted.text
        _wait(lambda: _versions(http)["active_version"] == version, "the promotion")
        states = {v["version"]: (v["release"] or {}).get("state") for v in _versions(http)["data"]}
        assert states[version] == "promoted", states
        _wait(lambda: _routed_canaries(http) == 0.0, "the arm dropped")
        cid, served_by = _chat(http, "hi", "conv-0")
        assert served_by == version  # everyone on the promoted version now
