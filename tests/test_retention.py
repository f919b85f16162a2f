"""Retention: pruning adapter payloads (and surviving kill -9 doing it), trajectory TTL and deletion.

Pruning keeps the `keep_last` newest versions, the active one and any the caller
names; the others keep their manifest and registry row, are listed as pruned, and
a load or rollback of one is refused (410). A real child process is SIGKILLed at
three points of a prune (tests/crash_prune_child.py): inside its transaction,
after the index commit, and after the first file is deleted; reopening the
registry leaves no half state and every kept version loadable. Trajectory
deletion (by agent, conversation or age) means a completion never becomes a
training sample and feedback naming it parks, then dies.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from feedback_support import rejoin_all

from clora_feedback.config import FeedbackConfig, RetentionConfig, Settings
from clora_feedback.errors import GoneError
from clora_feedback.feedback.rewards import DefaultRewardPolicy
from clora_feedback.feedback.store import FeedbackStore, Incoming
from clora_feedback.gateway.app import create_app
from clora_feedback.schemas.feedback import Reward
from clora_feedback.service import gateway_deployer
from clora_feedback.store.artifact import MANIFEST_NAME, payload_names
from clora_feedback.store.registry import AdapterRegistry
from clora_feedback.store.retention import Retention
from clora_feedback.store.trajectories import (
    AsyncTrajectoryStore,
    SampleRecord,
    TrajectoryRecord,
    TrajectoryStore,
)

CHILD = Path(__file__).with_name("crash_prune_child.py")


@pytest.mark.parametrize("where", ["before_commit", "after_mark", "mid_delete"])
def test_kill_during_prune_leaves_no_half_state(tmp_path: Path, store_url: str, where: str) -> None:
    child = subprocess.run(
        [sys.executable, str(CHILD), str(tmp_path), store_url, where],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert child.returncode == -9, child.stderr[-2000:]
    assert "pruning" in child.stdout
    with AdapterRegistry(tmp_path / "adapters", db=store_url) as registry:  # the sweep runs
        versions = {v.version: v for v in registry.versions("a")}
        assert sorted(versions) == [1, 2, 3, 4, 5, 6]  # history complete
        gone = [] if where == "before_commit" else [1, 2]
        assert [v for v, info in versions.items() if info.payload_pruned] == gone
        for version, info in versions.items():
            files = {p.name for p in info.path.iterdir()}
            assert MANIFEST_NAME in files
            if version in gone:
                assert not files & set(payload_names(True))
                with pytest.raises(GoneError):
                    registry.load("a", version)
                with pytest.raises(GoneError):
                    registry.verify("a", version)
            else:
                registry.verify("a", version)
                registry.load("a", version)
        assert registry.active("a").version == 4 and registry.is_pinned("a")  # type: ignore[union-attr]
        # The prune runs again to completion: the same end state either way.
        assert registry.prune("a", keep_last=2, keep=[3]) == ([1, 2] if not gone else [])
        assert [v.version for v in registry.versions("a") if v.payload_pruned] == [1, 2]
        with pytest.raises(GoneError) as refused:
            registry.rollback("a", 1, reason="back")
        assert refused.value.http_status == 410 and refused.value.code == "version_pruned"
        assert registry.active("a").version == 4  # type: ignore[union-attr]


def _record(store: TrajectoryStore, cid: str, agent: str, conversation: str, at: float) -> None:
    sample = SampleRecord(0, "x", [40, 41], [-1.0, -1.0], [0, 0], "stop")
    request = {"metadata": {"conversation_id": conversation}}
    store.record(TrajectoryRecord(cid, agent, 0, "chat", request, [1, 2], [sample], at))


def _reward(feedback: FeedbackStore, event: str, cid: str, agent: str = "a") -> Incoming:
    return Incoming(
        Reward(event_id=event, agent=agent, completion_id=cid, source="t", value=1.0), "t"
    )


def test_deleted_trajectories_never_train_and_their_feedback_parks_then_dies(
    tmp_path: Path, store_url: str
) -> None:
    trajectories = TrajectoryStore(store_url)
    feedback = FeedbackStore(
        store_url, trajectories=trajectories, policy=DefaultRewardPolicy(FeedbackConfig())
    )
    now = time.time()
    _record(trajectories, "c1", "a", "conv1", now - 1000)
    _record(trajectories, "c2", "a", "conv2", now)
    _record(trajectories, "c3", "b", "conv1", now)
    feedback.apply([_reward(feedback, "e1", "c1"), _reward(feedback, "e2", "c2")])
    assert {s.completion_id for s in feedback.training_samples("a")} == {"c1", "c2"}
    assert trajectories.delete(conversation_id="conv1", agent="a") == 1  # c1 only
    assert trajectories.exists(["c1", "c2", "c3"]) == {"c2", "c3"}
    assert {s.completion_id for s in feedback.training_samples("a")} == {"c2"}
    report = feedback.apply([_reward(feedback, "e3", "c1")])
    assert report.parked == ["e3"]  # as if never stored: parked...
    _, dead = rejoin_all(feedback, ttl_s=0.0, now=now + 1)
    assert [d.event_id for d in dead] == ["e3"]  # ...then dead after the park TTL
    # The TTL, through a retention pass.
    _record(trajectories, "old", "b", "conv9", now - 5000)
    registry = AdapterRegistry(tmp_path / "adapters", db=store_url)
    config = RetentionConfig(trajectory_ttl_s=3600)
    report2 = Retention(registry, config, trajectories=trajectories).run_once(now=now)
    assert report2.trajectories_deleted == 1
    assert trajectories.exists(["old", "c2", "c3"]) == {"c2", "c3"}
    assert trajectories.delete(agent="b") == 1 and trajectories.count() == 1
    registry.close()
    feedback.close()
    trajectories.close()


def test_delete_route_is_admin_only_and_documented(tmp_path: Path, tiny_model_dir: Path) -> None:
    from clora_feedback.config import EngineConfig
    from clora_feedback.engine.embedded import EmbeddedEngine

    config = EngineConfig(model=str(tiny_model_dir), max_model_len=128, num_threads=1)
    settings = Settings(
        data_dir=tmp_path / "data", engine=config, admin_api_key="admin",
        agents=[{"name": "a", "api_keys": ["agent-key"]}],  # type: ignore[list-item]
    )  # fmt: skip
    engine = EmbeddedEngine(tiny_model_dir, config, model_name="tiny-base")
    store = AsyncTrajectoryStore(settings.trajectory_db)
    app = create_app(settings, engine, store, deployer=gateway_deployer(settings, engine))
    with TestClient(app) as client:
        now = time.time()
        for i, conversation in enumerate(["k1", "k1", "k2"]):
            _record(store.store, f"c{i}", "a", conversation, now)
        admin = {"Authorization": "Bearer admin"}
        agent = {"Authorization": "Bearer agent-key"}
        assert client.delete("/v1/trajectories?agent=a", headers=agent).status_code == 403
        assert client.delete("/v1/trajectories", headers=admin).status_code == 400
        done = client.delete("/v1/trajectories?conversation_id=k1", headers=admin)
        assert done.status_code == 200, done.text
        assert done.json() == {
            "object": "trajectory.deleted", "agent": None, "conversation_id": "k1", "deleted": 2,
        }  # fmt: skip
        assert client.get("/v1/trajectories/c0", headers=admin).status_code == 404
        assert client.delete("/v1/trajectories?agent=a", headers=admin).json()["deleted"] == 1
        spec = client.get("/openapi.json").json()["paths"]["/v1/trajectories"]["delete"]
        assert {"200", "400", "401", "403"} <= set(spec["responses"])


def test_retention_keeps_active_newest_and_named_versions(tmp_path: Path) -> None:
    from crash_prune_child import LIMITS

    from clora_feedback.lora.weights import random_lora_weights

    registry = AdapterRegistry(tmp_path / "adapters")
    for version in range(1, 11):
        registry.publish(
            "a", random_lora_weights(LIMITS, rank=2, seed=version, target_modules=["q_proj"]),
            optimizer_state=None, base_model="tiny", parent=version - 1 or None, step=version,
            metrics={}, feedback_window=None,
        )  # fmt: skip
    registry.rollback("a", 2, reason="bad run")
    registry.pin("a")
    retention = Retention(registry, RetentionConfig(keep_last=3), keep=lambda agent: {5})
    started = time.perf_counter()
    report = retention.run_once()
    elapsed = time.perf_counter() - started
    assert report.pruned == {"a": [1, 3, 4, 6, 7]}
    kept = [v.version for v in registry.versions("a") if not v.payload_pruned]
    assert kept == [2, 5, 8, 9, 10]
    assert retention.run_once().pruned == {}
    print(f"prune: 5 versions in {elapsed * 1000:.1f} ms")
    registry.close()


def test_cli_prune_runs_one_pass_on_the_settings_stores(tmp_path: Path) -> None:
    import json
    import os

    from crash_prune_child import LIMITS

    from clora_feedback.lora.weights import random_lora_weights

    settings = Settings(data_dir=tmp_path / "data", adapters_dir=tmp_path / "adapters")
    with AdapterRegistry(settings.adapters_dir, settings.registry_db_url) as registry:
        for version in range(1, 5):
            registry.publish(
                "a", random_lora_weights(LIMITS, rank=2, seed=version, target_modules=["q_proj"]),
                optimizer_state=None, base_model="tiny", parent=version - 1 or None, step=version,
                metrics={}, feedback_window=None,
            )  # fmt: skip
    env = {
        **os.environ,
        "CLORA_DATA_DIR": str(tmp_path / "data"),
        "CLORA_ADAPTERS_DIR": str(tmp_path / "adapters"),
    }
    done = subprocess.run(
        [sys.executable, "-m", "clora_feedback.cli", "adapters", "prune", "--keep-last", "2", "--json"],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["pruned"] == {"a": [1, 2]}
    with AdapterRegistry(settings.adapters_dir, settings.registry_db_url) as registry:
        assert [v.payload_pruned for v in registry.versions("a")] == [True, True, False, False]


async def test_retention_runs_in_the_background_until_stopped(tmp_path: Path) -> None:
    import asyncio

    trajectories = TrajectoryStore(tmp_path / "t.db")
    _record(trajectories, "old", "a", "k", time.time() - 100)
    registry = AdapterRegistry(tmp_path / "adapters")
    config = RetentionConfig(interval_s=0.05, trajectory_ttl_s=10)
    retention = Retention(registry, config, trajectories=trajectories)
    await retention.start()
    for _ in range(200):
        if retention.last is not None:
            break
        await asyncio.sleep(0.02)
    await retention.stop()
    assert retention.last is not None and retention.last.trajectories_deleted == 1
    assert trajectories.count() == 0
    off = Retention(registry, RetentionConfig(enabled=False))
    await off.start()
    assert off._task is None  # disabled: nothing runs
    registry.close()
    trajectories.close()


def test_a_schema_2_registry_upgrades_in_place(tmp_path: Path, store_url: str) -> None:
    from crash_prune_child import LIMITS

    from clora_feedback.lora.weights import random_lora_weights
    from clora_feedback.store.registry.index import SCHEMA_VERSION
    from clora_feedback.store.sql import set_pg_schema_version

    with AdapterRegistry(tmp_path / "adapters", db=store_url) as registry:
        for version in (1, 2):
            registry.publish(
                "a", random_lora_weights(LIMITS, rank=2, seed=version, target_modules=["q_proj"]),
                optimizer_state=None, base_model="tiny", parent=version - 1 or None, step=version,
                metrics={}, feedback_window=None,
            )  # fmt: skip
        with registry.database.write() as tx:  # back to what schema 2 had
            for column in ("pruned_at", "probe"):
                tx.execute(f"ALTER TABLE versions DROP COLUMN {column}")
            if tx.dialect == "postgresql":
                set_pg_schema_version(tx, "registry", 2)
            else:
                tx.execute("UPDATE schema_version SET version = 2")
    with AdapterRegistry(tmp_path / "adapters", db=store_url) as registry:
        assert [v.payload_pruned for v in registry.versions("a")] == [False, False]
        assert registry.prune("a", keep_last=1) == [1]
        assert registry.record_probe("a", 2, {"noop": False})
        assert registry.get("a", 2).noop is False
        with registry.database.read() as tx:
            if tx.dialect == "sqlite":
                version = tx.execute("SELECT max(version) FROM schema_version").fetchone()[0]
                assert version == SCHEMA_VERSION == 3
