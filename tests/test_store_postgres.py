"""PostgreSQL-only store properties: several processes' stores on one database, racing.

The suites of `test_trajectory_store`, `test_feedback_store` and `test_registry` run on
both backends; this module covers what only a shared server can get wrong: the three
stores in one database (no table collides), schema creation by processes starting at
once, the registry's compare-and-set from separate connection pools (exactly one of two
racers moves the pointer), and the feedback `seq` cursor under concurrent writers (a
reader paging by cursor never skips a join that commits later). Separate `Database`
objects stand in for separate processes: each has its own pool, so its own sessions.

Not here: the SQLite behaviour (the per-store suites), migration (`test_store_migrate`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from clora_feedback.config import DEFAULT_TARGET_MODULES, FeedbackConfig
from clora_feedback.errors import ConflictError, StoreError
from clora_feedback.feedback import tables
from clora_feedback.feedback.rewards import DefaultRewardPolicy
from clora_feedback.feedback.store import FeedbackStore, Incoming
from clora_feedback.lora.weights import LoRALimits, random_lora_weights
from clora_feedback.schemas.feedback import Resolution
from clora_feedback.store import trajectories
from clora_feedback.store.db import is_postgres_url, open_database, redact
from clora_feedback.store.registry import AdapterRegistry, index
from clora_feedback.store.registry import schema as registry_schema
from clora_feedback.store.sql import PG_SCHEMA_TABLE
from clora_feedback.store.trajectories import SampleRecord, TrajectoryRecord, TrajectoryStore

pytestmark = pytest.mark.postgres

_LIMITS = LoRALimits(
    max_rank=8,
    target_modules=DEFAULT_TARGET_MODULES,
    num_layers=1,
    shapes={m: (8, 8) for m in DEFAULT_TARGET_MODULES},
)


def _trajectory(cid: str, agent: str = "support") -> TrajectoryRecord:
    sample = SampleRecord(0, "ok", [1, 2], [-0.5, -0.25], [1, 1], "stop")
    request = {"messages": [{"role": "user", "content": "hi"}]}
    return TrajectoryRecord(cid, agent, 1, "chat", request, [1, 2, 3], [sample], time.time())


def _resolution(eid: str, cid: str) -> Incoming:
    event = Resolution(
        event_id=eid, agent="support", completion_id=cid, source="t", outcome="resolved"
    )
    return Incoming(event, "test")


def _race(*calls: Callable[[], Any]) -> list[BaseException | Any]:
    """Run `calls` on threads released together; each one's result or exception."""
    barrier = threading.Barrier(len(calls))
    results: list[BaseException | Any] = [None] * len(calls)

    def run(i: int) -> None:
        barrier.wait()
        try:
            results[i] = calls[i]()
        except BaseException as exc:  # reported to the test
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def _tables(url: str) -> set[str]:
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT tablename FROM pg_tables WHERE schemaname = current_schema()"
        ).fetchall()
    return {r[0] for r in rows}


def test_urls_and_redaction() -> None:
    assert is_postgres_url("postgresql://a:b@h/db") and is_postgres_url("postgres://h/db")
    assert not is_postgres_url("sqlite:///x.db") and not is_postgres_url(Path("postgresql:"))
    assert redact("postgresql://clora:secret@h:5432/db") == "postgresql://clora:***@h:5432/db"
    assert redact("postgresql://h/db") == "postgresql://h/db"


def test_the_three_stores_share_one_database(postgres_url: str, tmp_path: Path) -> None:
    traj = TrajectoryStore(postgres_url)
    feedback = FeedbackStore(
        postgres_url, trajectories=traj, policy=DefaultRewardPolicy(FeedbackConfig())
    )
    registry = AdapterRegistry(tmp_path / "adapters", db=postgres_url)
    try:
        traj.record(_trajectory("c1"))
        assert feedback.apply([_resolution("e1", "c1")]).joined == ["e1"]
        registry.publish(
            "support",
            random_lora_weights(_LIMITS, rank=2, seed=1),
            optimizer_state=None,
            base_model="tiny",
            parent=None,
            step=1,
            metrics={},
            feedback_window=None,
        )
    finally:
        registry.close()
        feedback.close()
        traj.close()
    registry_tables = registry_schema.PG_TABLES
    declared = {*trajectories.PG_TABLES, *tables.PG_TABLES, *registry_tables, PG_SCHEMA_TABLE}
    assert (
        len(declared)
        == len(trajectories.PG_TABLES) + len(tables.PG_TABLES) + len(registry_tables) + 1
    )  # no two stores declare the same table
    assert _tables(postgres_url) == declared
    with psycopg.connect(postgres_url) as conn:
        versions = dict(conn.execute(f"SELECT component, version FROM {PG_SCHEMA_TABLE}"))
    assert versions == {
        "trajectories": trajectories.SCHEMA_VERSION,
        "feedback": tables.SCHEMA_VERSION,
        "registry": index.SCHEMA_VERSION,
    }
    # Reopening finds the schema in place; a newer one is refused.
    with TrajectoryStore(postgres_url) as again:
        assert again.exists(["c1"]) == {"c1"}
    with psycopg.connect(postgres_url) as conn:
        conn.execute(f"UPDATE {PG_SCHEMA_TABLE} SET version = version + 1")
    with pytest.raises(StoreError, match="newer"):
        TrajectoryStore(postgres_url)
    with pytest.raises(StoreError, match="newer"):
        AdapterRegistry(tmp_path / "adapters", db=postgres_url)


def test_processes_starting_at_once_create_the_schema_once(postgres_url: str) -> None:
    opened = _race(*[lambda: TrajectoryStore(postgres_url) for _ in range(4)])
    assert all(isinstance(s, TrajectoryStore) for s in opened), opened
    opened[0].record(_trajectory("c1"))
    assert all(s.exists(["c1"]) == {"c1"} for s in opened)
    for s in opened:
        s.close()


def test_driver_errors_are_store_errors(postgres_url: str) -> None:
    db = open_database(postgres_url)
    try:
        with pytest.raises(StoreError) as info, db.read() as tx:
            tx.execute("SELECT * FROM no_such_table")
        assert isinstance(info.value.__cause__, psycopg.Error) and info.value.retriable
        with db.write() as tx:  # the failed read did not poison the pooled connection
            assert tx.execute("SELECT 100 % 7, ?", (1,)).fetchone() == (2, 1)
    finally:
        db.close()


@pytest.fixture
def two_registries(postgres_url: str, tmp_path: Path) -> Iterator[tuple[AdapterRegistry, ...]]:
    """Two registries on one database and one adapter tree: two processes' views."""
    first = AdapterRegistry(tmp_path / "adapters", db=postgres_url)
    second = AdapterRegistry(tmp_path / "adapters", db=postgres_url)
    yield first, second
    first.close()
    second.close()


def test_pointer_compare_and_set_has_exactly_one_winner(
    two_registries: tuple[AdapterRegistry, AdapterRegistry],
) -> None:
    first, second = two_registries
    for seed, parent in ((1, None), (2, 1)):
        first.publish(
            "support",
            random_lora_weights(_LIMITS, rank=2, seed=seed),
            optimizer_state=None,
            base_model="tiny",
            parent=parent,
            step=seed,
            metrics={},
            feedback_window=None,
        )
    active = 2

    def move(reg: AdapterRegistry, target: int, expected: int) -> Any:
        return reg.rollback("support", target, reason="race", expected_active=expected)

    for _ in range(12):
        target = 1 if active == 2 else 2
        results = _race(
            *[lambda r=reg, t=target, e=active: move(r, t, e) for reg in two_registries]
        )
        wins = [r for r in results if not isinstance(r, BaseException)]
        losses = [r for r in results if isinstance(r, BaseException)]
        assert len(wins) == 1 and wins[0].version == target, results
        assert len(losses) == 1 and isinstance(losses[0], ConflictError), results
        assert losses[0].code in ("active_changed", "already_active")
        active = target
        for reg in two_registries:
            now = reg.active("support")
            assert now is not None and now.version == target
    # Deactivation is a compare-and-set too.
    results = _race(
        *[
            lambda reg=reg: reg.deactivate("support", expected_active=active)
            for reg in (first, second)
        ]  # type: ignore[misc]
    )
    assert sum(not isinstance(r, BaseException) for r in results) == 1, results
    assert first.active("support") is None


def test_version_numbers_reserved_at_once_are_distinct(
    two_registries: tuple[AdapterRegistry, AdapterRegistry],
) -> None:
    first, second = two_registries
    for _ in range(5):
        got = _race(*[lambda r=reg: r.next_version("fresh") for reg in (first, second)])
        assert all(isinstance(v, int) for v in got), got
    numbers = [first.next_version("fresh")]
    assert numbers[0] == 11  # 10 reserved by the racers, none twice, none lost


def test_join_cursor_never_skips_a_row_under_concurrent_writers(postgres_url: str) -> None:
    writers_n, events_n = 2, 60
    traj = TrajectoryStore(postgres_url)
    policy = DefaultRewardPolicy(FeedbackConfig())
    stores = [
        FeedbackStore(postgres_url, trajectories=traj, policy=policy) for _ in range(writers_n + 1)
    ]
    for w in range(writers_n):
        for i in range(events_n):
            traj.record(_trajectory(f"w{w}-c{i}"))
    done = threading.Event()
    seen: set[tuple[str, int]] = set()

    def write(w: int) -> None:
        for i in range(0, events_n, 3):  # small batches: many commits to interleave
            stores[w].apply([_resolution(f"w{w}-e{j}", f"w{w}-c{j}") for j in range(i, i + 3)])

    def read() -> None:
        cursor = 0
        while True:
            finished = done.is_set()  # read once more after the writers are done
            page = stores[-1].training_samples("support", after_seq=cursor, limit=7)
            seen.update((s.completion_id, s.sample_index) for s in page)
            if page:
                cursor = max(s.last_seq for s in page)
            elif finished:
                return

    reader = threading.Thread(target=read)
    reader.start()
    try:
        _race(*[lambda w=w: write(w) for w in range(writers_n)])
    finally:
        done.set()
        reader.join()
        for s in stores:
            s.close()
        traj.close()
    expected = {(f"w{w}-c{i}", 0) for w in range(writers_n) for i in range(events_n)}
    assert seen == expected, sorted(expected - seen)[:5]
