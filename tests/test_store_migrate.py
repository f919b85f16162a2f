"""`clora store migrate`: SQLite store files copied into PostgreSQL read back the same.

The SQLite stores are filled through their public APIs (trajectories; feedback with
joins, a conversation event, a parked event and a dead letter; a registry with two
versions, a rollback and a pin), migrated with the `clora` command into a fresh
PostgreSQL database, and opened there by the same store classes: every read the
trainer, the ingest side and the gateway make returns what it returned on SQLite,
and the next write continues the ids and cursors instead of reusing them.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
from feedback_support import rejoin_all

from clora_feedback.cli.main import main
from clora_feedback.config import DEFAULT_TARGET_MODULES, FeedbackConfig, Settings
from clora_feedback.errors import ConfigError, ConflictError
from clora_feedback.feedback.rewards import DefaultRewardPolicy
from clora_feedback.feedback.store import FeedbackStore, Incoming
from clora_feedback.lora.weights import LoRALimits, random_lora_weights
from clora_feedback.schemas.feedback import Correction, Resolution
from clora_feedback.store.migrate import migrate_to_postgres
from clora_feedback.store.registry import AdapterRegistry
from clora_feedback.store.trajectories import SampleRecord, TrajectoryRecord, TrajectoryStore

LIMITS = LoRALimits(
    max_rank=8,
    target_modules=DEFAULT_TARGET_MODULES,
    num_layers=2,
    shapes={
        "q_proj": (64, 64),
        "k_proj": (64, 32),
        "v_proj": (64, 32),
        "o_proj": (64, 64),
        "gate_proj": (64, 128),
        "up_proj": (64, 128),
        "down_proj": (128, 64),
    },
)


@dataclass
class Stores:
    trajectories: TrajectoryStore
    feedback: FeedbackStore
    registry: AdapterRegistry


@contextmanager
def open_stores(
    trajectory_db: str | Path, registry_db: str | Path, adapters: Path
) -> Iterator[Stores]:
    trajectories = TrajectoryStore(trajectory_db)
    feedback = FeedbackStore(
        trajectory_db, trajectories=trajectories, policy=DefaultRewardPolicy(FeedbackConfig())
    )
    registry = AdapterRegistry(adapters, registry_db)
    try:
        yield Stores(trajectories, feedback, registry)
    finally:
        registry.close()
        feedback.close()
        trajectories.close()


def _trajectory(cid: str, agent: str = "support", conv: str | None = None) -> TrajectoryRecord:
    samples = [
        SampleRecord(i, f"answer {i}", [5, 6, 7 + i], [-0.1, -0.25, -0.5], [1, 1, 2], "stop")
        for i in range(2)
    ]
    request = {"messages": [{"role": "user", "content": cid}], "metadata": {}}
    if conv is not None:
        request["metadata"] = {"conversation_id": conv}
    return TrajectoryRecord(cid, agent, 1, "chat", request, [1, 2, 3], samples, time.time())


def _resolution(eid: str, cid: str, outcome: str = "resolved", agent: str = "support") -> Incoming:
    event = Resolution(event_id=eid, agent=agent, completion_id=cid, source="t", outcome=outcome)
    return Incoming(event, "test")  # type: ignore[arg-type]


def _publish(registry: AdapterRegistry, seed: int, parent: int | None) -> int:
    info = registry.publish(
        "support",
        random_lora_weights(LIMITS, rank=4, alpha=8.0, seed=seed),
        optimizer_state=None,
        base_model="tiny-base",
        parent=parent,
        step=seed,
        metrics={"loss": 1.0 / seed},
        feedback_window={"after_seq": seed},
    )
    return info.version


def _fill(stores: Stores) -> None:
    """Real content through the public APIs, as a running `clora serve` leaves it."""
    t, f = stores.trajectories, stores.feedback
    for cid, agent, conv in [
        ("c1", "support", "t-1"),
        ("c2", "support", "t-1"),
        ("c3", "coder", None),
    ]:
        t.record(_trajectory(cid, agent, conv))
    assert f.apply([_resolution("e1", "c1"), _resolution("e2", "c3", "rejected", "coder")]).joined
    correction = Correction(
        event_id="k1",
        agent="support",
        completion_id="c2",
        source="t",
        corrected_content="better answer 0",
    )
    conversation = Resolution(
        event_id="r1", agent="support", conversation_id="t-1", source="t", outcome="escalated"
    )
    assert f.apply([Incoming(correction, "test"), Incoming(conversation, "test")]).joined
    # Parked at 100: `c9` arrives later and joins on rejoin, `c404` never does (dead letter).
    assert f.apply([_resolution("p1", "c9"), _resolution("p2", "c404")], now=100.0).parked
    t.record(_trajectory("c9"))
    assert rejoin_all(f, ttl_s=50.0, now=120.0)[0] == ["p1"]
    assert [d.event_id for d in rejoin_all(f, ttl_s=50.0, now=200.0)[1]] == ["p2"]
    assert f.apply([_resolution("p3", "c10")], now=time.time()).parked == ["p3"]  # stays parked
    registry = stores.registry
    v1 = _publish(registry, 1, None)
    assert _publish(registry, 2, v1) == 2
    registry.rollback("support", v1, reason="v2 regressed")
    registry.pin("support")


def _reads(stores: Stores) -> dict[str, Any]:
    """Everything the trainer, the ingest side and the gateway read, as plain values."""
    f, r = stores.feedback, stores.registry
    first = f.training_samples("support", limit=2)
    rest = f.training_samples("support", after_seq=first[-1].last_seq)
    return {
        "rewards": {c: f.rewards_for(c) for c in ("c1", "c2", "c3", "c9", "c10")},
        "samples": [(s.completion_id, s.sample_index, s.last_seq, s.reward) for s in first + rest],
        "rewards_by_version": f.rewards_by_version("support", 1),
        "agents_with_rewards": f.agents_with_rewards(),
        "states": {e: f.event_state(e) for e in ("e1", "k1", "r1", "p1", "p2", "p3")},
        "counts": f.state_counts(),
        "positions": stores.trajectories.recorded_since(0, 100),
        "trajectory": stores.trajectories.get_many(["c1"])["c1"],
        "active": r.active("support"),
        "versions": r.versions("support"),
        "agent": r.agent("support"),
    }


@pytest.fixture
def sqlite_data(tmp_path: Path) -> tuple[Settings, dict[str, Any]]:
    """Settings over filled SQLite stores, and the reads they answer."""
    settings = Settings(data_dir=tmp_path / "var", adapters_dir=tmp_path / "adapters")
    with open_stores(settings.trajectory_db, settings.registry_db, settings.adapters_dir) as s:
        _fill(s)
        before = _reads(s)
    return settings, before


def _migrate(settings: Settings, url: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    argv = ["store", "migrate", "--to", url, "--data-dir", str(settings.data_dir)]
    code = main([*argv, "--adapters-dir", str(settings.adapters_dir)])
    return code, capsys.readouterr().out


def test_migrated_stores_read_the_same(
    sqlite_data: tuple[Settings, dict[str, Any]],
    postgres_url: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    settings, before = sqlite_data
    code, out = _migrate(settings, postgres_url, capsys)
    assert code == 0
    report = json.loads(out)
    assert report["rows"]["completions"] == 4 and report["rows"]["versions"] == 2
    assert "***" in report["target"] and ":clora@" not in report["target"]
    with open_stores(postgres_url, postgres_url, settings.adapters_dir) as pg:
        after = _reads(pg)
        assert after == before
        assert after["active"].version == 1 and after["agent"].pinned
        assert [(v.version, v.status) for v in after["versions"]] == [
            (1, "active"),
            (2, "rolled_back"),
        ]
        pg.registry.verify("support", 2)  # the version directories stayed where they were


def test_writes_after_migration_continue_ids_and_cursors(
    sqlite_data: tuple[Settings, dict[str, Any]],
    postgres_url: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    settings, before = sqlite_data
    assert _migrate(settings, postgres_url, capsys)[0] == 0
    last_position = before["positions"][-1][0]
    last_seq = before["samples"][-1][2]
    with open_stores(postgres_url, postgres_url, settings.adapters_dir) as pg:
        pg.trajectories.record(_trajectory("c11"))
        assert pg.feedback.apply([_resolution("n1", "c11")]).joined == ["n1"]
        ((position, cid, _),) = pg.trajectories.recorded_since(last_position, 10)
        assert cid == "c11" and position > last_position
        new = pg.feedback.training_samples("support", after_seq=last_seq)
        assert {s.completion_id for s in new} == {"c11"} and min(s.last_seq for s in new) > last_seq
        # The parked event joins when its trajectory arrives: the rejoin cursor carried over.
        pg.trajectories.record(_trajectory("c10"))
        assert rejoin_all(pg.feedback, ttl_s=3600.0)[0] == ["p3"]
        pg.registry.unpin("support")
        assert _publish(pg.registry, 3, 1) == 3  # after the rolled-back 2: never reused
        assert pg.registry.active("support").version == 3  # type: ignore[union-attr]


def test_refuses_a_non_empty_target(
    sqlite_data: tuple[Settings, dict[str, Any]],
    postgres_url: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    settings, _ = sqlite_data
    assert _migrate(settings, postgres_url, capsys)[0] == 0
    with psycopg.connect(postgres_url) as conn:
        before = conn.execute("SELECT count(*) FROM event_targets").fetchone()
    assert _migrate(settings, postgres_url, capsys)[0] == 1
    with pytest.raises(ConflictError) as refused:
        from clora_feedback.service.maintenance import store_parts

        migrate_to_postgres(store_parts(settings), postgres_url)
    assert refused.value.code == "target_not_empty"
    with psycopg.connect(postgres_url) as conn:  # nothing was touched by the refused runs
        assert conn.execute("SELECT count(*) FROM event_targets").fetchone() == before


def test_failed_copy_rolls_back_to_empty_tables(
    sqlite_data: tuple[Settings, dict[str, Any]],
    postgres_url: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings, before = sqlite_data
    from clora_feedback.store import migrate

    def short_count(src: Any, dst: Any, table: str, copied: int) -> None:
        if table == "versions":  # the last table: everything else was already inserted
            raise migrate.StoreError("injected count mismatch")

    monkeypatch.setattr(migrate, "_verify_count", short_count)
    assert _migrate(settings, postgres_url, capsys)[0] == 1
    with psycopg.connect(postgres_url) as conn:
        for table in ("completions", "event_targets", "feedback_events", "versions"):
            assert conn.execute(f"SELECT count(*) FROM {table}").fetchone() == (0,)
    monkeypatch.undo()  # the tables left behind are empty: the command can run again
    assert _migrate(settings, postgres_url, capsys)[0] == 0
    with open_stores(postgres_url, postgres_url, settings.adapters_dir) as pg:
        assert _reads(pg) == before


def test_refuses_an_adapters_dir_without_the_versions(
    sqlite_data: tuple[Settings, dict[str, Any]],
    postgres_url: str,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    settings, _ = sqlite_data
    wrong = settings.model_copy(update={"adapters_dir": tmp_path / "elsewhere"})
    assert _migrate(wrong, postgres_url, capsys)[0] == 1
    assert not (tmp_path / "elsewhere").exists()  # refused before any store opened
    with psycopg.connect(postgres_url) as conn:
        assert conn.execute("SELECT to_regclass('versions')").fetchone() == (None,)


def test_target_must_be_postgres(
    sqlite_data: tuple[Settings, dict[str, Any]], tmp_path: Path
) -> None:
    from clora_feedback.service.maintenance import store_parts

    with pytest.raises(ConfigError, match="postgresql://"):
        migrate_to_postgres(store_parts(sqlite_data[0]), str(tmp_path / "x.db"))
