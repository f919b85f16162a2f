"""Trajectory store: round trips, WAL, conflicts, ordering, crash durability, async facade."""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from clora_feedback.errors import ConflictError, InvalidRequestError, NotFoundError, StoreError
from clora_feedback.store.trajectories import (
    SCHEMA_VERSION,
    AsyncTrajectoryStore,
    SampleRecord,
    TrajectoryRecord,
    TrajectoryStore,
)


def make_record(
    id: str = "chatcmpl-1", *, agent: str = "support", created_at: float = 1000.0, n: int = 1
) -> TrajectoryRecord:
    samples = [
        SampleRecord(
            index=i,
            text=f"héllo 🤖 {i}",
            completion_token_ids=[5 + i, 49151, 0, 2],
            logprobs=[-0.1234567890123, -2.5e-7, -13.75, -0.0],
            token_versions=[3, 3, 4, 4],
            finish_reason="tool_calls" if i else "stop",
            tool_calls=(
                [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
                if i
                else None
            ),
        )
        for i in range(n)
    ]
    return TrajectoryRecord(
        id=id,
        agent=agent,
        adapter_version=3,
        kind="chat",
        request={"messages": [{"role": "user", "content": "ünïcode"}], "temperature": 0.7},
        prompt_token_ids=[1, 4093, 198, 2147483647],
        samples=samples,
        created_at=created_at,
        timings={"queue_s": 0.001, "ttft_s": 0.25, "total_s": 1.5},
        api_key_agent="support",
    )


@pytest.fixture
def store(store_url: str):
    """The same suite on both backends: a SQLite file, then a fresh PostgreSQL database."""
    with TrajectoryStore(store_url) as s:
        yield s


def test_round_trip_preserves_every_field(store: TrajectoryStore) -> None:
    original = make_record(n=2)
    store.record(original)
    assert store.get(original.id) == original
    minimal = TrajectoryRecord(
        id="cmpl-2",
        agent="base",
        adapter_version=0,
        kind="completion",
        request={"prompt": "x"},
        prompt_token_ids=[],
        samples=[SampleRecord(0, "", [], [], [], None)],
        created_at=1.5,
    )
    store.record(minimal)
    assert store.get("cmpl-2") == minimal


def test_a_nul_in_generated_text_is_stored(store_url: str, store: TrajectoryStore) -> None:
    """A random model can decode a NUL; PostgreSQL text cannot hold one (it was a 500)."""
    record = make_record("cmpl-nul")
    record.samples[0] = dataclasses.replace(record.samples[0], text="a\x00b")
    record.request["messages"][0]["content"] = "x\x00y"
    store.record(record)
    got = store.get("cmpl-nul")
    nul = "\ufffd" if store_url.startswith("postgresql") else "\x00"
    assert got.samples[0].text == f"a{nul}b"
    assert got.samples[0].completion_token_ids == record.samples[0].completion_token_ids


def test_wal_mode_and_schema_version(tmp_path: Path) -> None:
    path = tmp_path / "t.db"
    TrajectoryStore(path, synchronous="FULL").close()
    conn = sqlite3.connect(path)
    try:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert conn.execute("SELECT version FROM schema_version").fetchall() == [(SCHEMA_VERSION,)]
    finally:
        conn.close()


def test_newer_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "t.db"
    TrajectoryStore(path).close()
    conn = sqlite3.connect(path)
    conn.execute("UPDATE schema_version SET version = ?", (SCHEMA_VERSION + 1,))
    conn.commit()
    conn.close()
    with pytest.raises(StoreError, match="newer"):
        TrajectoryStore(path)


def test_duplicate_id_conflicts_and_keeps_the_first(store: TrajectoryStore) -> None:
    store.record(make_record(agent="a"))
    with pytest.raises(ConflictError):
        store.record(make_record(agent="b", n=3))
    assert store.count() == 1
    assert store.get("chatcmpl-1").agent == "a"
    assert len(store.get("chatcmpl-1").samples) == 1


def test_get_unknown_is_not_found(store: TrajectoryStore) -> None:
    with pytest.raises(NotFoundError):
        store.get("chatcmpl-missing")


def test_list_is_newest_first_and_filters(store: TrajectoryStore) -> None:
    for i, (agent, ts) in enumerate([("a", 10.0), ("b", 30.0), ("a", 20.0), ("a", 20.0)]):
        store.record(make_record(f"c{i}", agent=agent, created_at=ts))
    assert [t.id for t in store.list()] == ["c1", "c3", "c2", "c0"]  # ties: later insert first
    assert [t.id for t in store.list("a")] == ["c3", "c2", "c0"]
    assert [t.id for t in store.list("a", limit=2)] == ["c3", "c2"]
    assert [t.id for t in store.list(before=20.0)] == ["c0"]
    assert store.list("nobody") == []
    assert (store.count(), store.count("a"), store.count("b"), store.count("z")) == (4, 3, 1, 0)
    assert store.list("b")[0] == store.get("c1")
    with pytest.raises(InvalidRequestError):
        store.list(limit=0)


def test_inconsistent_records_are_rejected() -> None:
    with pytest.raises(ValueError, match="logprobs"):
        SampleRecord(0, "x", [1, 2], [-0.5], [1, 1], "stop")
    sample = SampleRecord(0, "x", [1], [-0.5], [1], "stop")
    with pytest.raises(ValueError, match="duplicate"):
        dataclasses.replace(make_record(), samples=[sample, sample])


def test_sqlite_errors_become_store_errors(tmp_path: Path) -> None:
    s = TrajectoryStore(tmp_path / "t.db")
    s.close()
    with pytest.raises(StoreError) as info:
        s.record(make_record())
    assert isinstance(info.value.__cause__, sqlite3.Error)
    assert info.value.retriable


def test_postgres_errors_become_store_errors(postgres_url: str) -> None:
    import psycopg

    s = TrajectoryStore(postgres_url)
    assert "postgresql://" in s.url
    with pytest.raises(StoreError, match="PostgreSQL"):
        s.path  # noqa: B018 - the property raises
    s.close()
    with pytest.raises(StoreError) as info:
        s.record(make_record())
    assert isinstance(info.value.__cause__, psycopg.Error)
    assert info.value.retriable
    with pytest.raises(StoreError) as unreachable:
        TrajectoryStore("postgresql://nobody:secret@127.0.0.1:1/none?connect_timeout=1")
    assert "secret" not in unreachable.value.message


def test_recorded_since_pages_in_commit_order(store: TrajectoryStore) -> None:
    for i in range(5):
        store.record(make_record(f"p{i}", created_at=10.0 - i))
    first = store.recorded_since(0, 3)
    rest = store.recorded_since(first[-1][0], 10)
    assert [r[1] for r in first + rest] == [f"p{i}" for i in range(5)]
    assert [r[0] for r in first + rest] == sorted(r[0] for r in first + rest)
    assert store.recorded_since(rest[-1][0], 10) == []


def test_concurrent_threads_and_second_reader(store_url: str, store: TrajectoryStore) -> None:
    def write(k: int) -> None:
        for j in range(10):
            store.record(make_record(f"t{k}-{j}", created_at=float(j)))

    threads = [threading.Thread(target=write, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with TrajectoryStore(store_url) as reader:  # another connection sees committed data
        assert reader.count() == 40
        assert reader.get("t3-9") == store.get("t3-9")


_KILL_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path
    sys.path.insert(0, {tests_dir!r})
    from test_trajectory_store import make_record
    from clora_feedback.store.trajectories import TrajectoryStore

    store = TrajectoryStore(Path({db!r}))
    store.record(make_record("chatcmpl-before-kill", n=2))
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_record_survives_sigkill_right_after_return(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    script = _KILL_SCRIPT.format(tests_dir=str(Path(__file__).parent), db=str(db))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    with TrajectoryStore(db) as reopened:
        assert reopened.get("chatcmpl-before-kill") == make_record("chatcmpl-before-kill", n=2)


async def test_async_store_round_trip_and_order(store_url: str) -> None:
    async with AsyncTrajectoryStore(store_url) as store:
        records = [make_record(f"a{i}", created_at=5.0) for i in range(20)]
        await asyncio.gather(*(store.record(r) for r in records))
        assert await store.count() == 20
        assert await store.get("a7") == records[7]
        # One writer thread commits in submission order, so equal timestamps list reversed.
        assert [t.id for t in await store.list(limit=20)] == [f"a{i}" for i in reversed(range(20))]
        with pytest.raises(ConflictError):
            await store.record(records[0])
        with pytest.raises(NotFoundError):
            await store.get("nope")
        assert store.store.count("support") == 20
    with pytest.raises(StoreError):
        await store.count()
    await store.stop()  # idempotent


async def test_async_store_runs_off_the_event_loop_thread(tmp_path: Path) -> None:
    store = AsyncTrajectoryStore(tmp_path / "t.db")
    with pytest.raises(StoreError, match="not started"):
        await store.record(make_record())
    await store.start()
    await store.start()  # idempotent
    try:
        seen: list[str] = []
        await store._run(lambda: seen.append(threading.current_thread().name))
        assert seen and seen[0] != threading.current_thread().name
        assert seen[0].startswith("clora-trajectories")
    finally:
        await store.stop()


def test_conversation_id_is_a_column_and_the_read_api_batches(store: TrajectoryStore) -> None:
    def with_metadata(id: str, metadata: object, created_at: float) -> TrajectoryRecord:
        record = make_record(id, created_at=created_at)
        return dataclasses.replace(record, request={**record.request, "metadata": metadata})

    store.record(with_metadata("c2", {"conversation_id": "t-1"}, 2.0))
    store.record(with_metadata("c1", {"conversation_id": "t-1"}, 1.0))
    store.record(with_metadata("c3", {"conversation_id": 7}, 3.0))  # not a string: no conversation
    store.record(with_metadata("c4", "not a dict", 4.0))
    assert store.by_conversation("t-1") == ["c1", "c2"]  # oldest first
    assert store.by_conversation("t-1", agent="other") == []
    assert store.get("c3").conversation_id is None and store.get("c1").conversation_id == "t-1"
    ids = [f"c{i}" for i in range(1, 1200)]  # more than one chunk of bound parameters
    assert store.exists(ids) == {"c1", "c2", "c3", "c4"}
    many = store.get_many(ids)
    assert set(many) == {"c1", "c2", "c3", "c4"} and many["c2"] == store.get("c2")


# -- writes on the event loop (AsyncTrajectoryStore.record's inline path) -------------


async def _blocked_worker(store: AsyncTrajectoryStore) -> tuple[threading.Event, asyncio.Task]:
    """Occupy the store's one worker thread until the returned event is set."""
    release = threading.Event()
    task = asyncio.ensure_future(store._run(lambda: release.wait(30)))
    await asyncio.sleep(0.05)  # the worker has picked the blocking call up
    return release, task


async def test_a_small_sqlite_record_commits_on_the_loop_while_the_worker_is_busy(
    tmp_path: Path,
) -> None:
    async with AsyncTrajectoryStore(tmp_path / "t.db") as store:
        assert store.inline_writes
        release, blocker = await _blocked_worker(store)
        try:
            await asyncio.wait_for(store.record(make_record("inline")), timeout=10)
        finally:
            release.set()
            await blocker
        with TrajectoryStore(tmp_path / "t.db") as reader:  # committed, seen by another reader
            assert reader.get("inline") == make_record("inline")
        # The loop's connection leaves WAL checkpoints to the worker (no fsync on the loop).
        conn = store.store._db._conn  # type: ignore[attr-defined]
        assert conn.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == 0


@pytest.mark.parametrize("why", ["too_many_tokens", "full_sync", "inline_off"])
async def test_records_that_could_wait_go_to_the_worker(tmp_path: Path, why: str) -> None:
    options: dict = {
        "too_many_tokens": {"inline_max_tokens": 7},  # make_record has 4 + 4 tokens
        "full_sync": {"synchronous": "FULL"},
        "inline_off": {"inline_max_tokens": 0},
    }[why]
    async with AsyncTrajectoryStore(tmp_path / "t.db", **options) as store:
        release, blocker = await _blocked_worker(store)
        pending = asyncio.ensure_future(store.record(make_record("queued")))
        await asyncio.sleep(0.1)
        assert not pending.done()  # queued behind the busy worker, not written on the loop
        release.set()
        await blocker
        await pending
        assert await store.get("queued") == make_record("queued")


async def test_postgres_records_always_go_to_the_worker(postgres_url: str) -> None:
    async with AsyncTrajectoryStore(postgres_url) as store:
        assert not store.inline_writes
        release, blocker = await _blocked_worker(store)
        pending = asyncio.ensure_future(store.record(make_record("pg-queued")))
        await asyncio.sleep(0.1)
        assert not pending.done()
        release.set()
        await blocker
        await pending
        assert await store.get("pg-queued") == make_record("pg-queued")


async def test_a_record_waits_on_the_worker_while_another_process_holds_the_write_lock(
    tmp_path: Path,
) -> None:
    db = tmp_path / "t.db"
    async with AsyncTrajectoryStore(db) as store:
        other = sqlite3.connect(db, isolation_level=None)
        other.execute("BEGIN IMMEDIATE")  # as another process's writer would
        try:
            assert store.store.record_nowait(make_record("busy")) is False
            pending = asyncio.ensure_future(store.record(make_record("busy")))
            ticks = 0
            for _ in range(5):  # the loop keeps running while the write waits
                await asyncio.sleep(0.02)
                ticks += 1
            assert ticks == 5 and not pending.done()
        finally:
            other.execute("COMMIT")
            other.close()
        await pending
        assert await store.get("busy") == make_record("busy")


def test_record_nowait_only_where_a_commit_cannot_wait(tmp_path: Path) -> None:
    with TrajectoryStore(tmp_path / "auto.db") as auto:  # automatic checkpoints may fsync
        assert auto.record_nowait(make_record("a")) is False
        assert auto.count() == 0
    with TrajectoryStore(tmp_path / "manual.db", auto_checkpoint=False) as manual:
        assert manual.record_nowait(make_record("m")) is True
        with pytest.raises(ConflictError):
            manual.record_nowait(make_record("m"))
        manual.checkpoint()
        assert manual.get("m") == make_record("m")


async def test_the_worker_checkpoints_the_wal_every_n_inline_records(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with AsyncTrajectoryStore(tmp_path / "t.db", checkpoint_every=3) as store:
        calls: list[str] = []
        real = store.store.checkpoint
        monkeypatch.setattr(
            store.store,
            "checkpoint",
            lambda: (calls.append(threading.current_thread().name), real()),
        )

        async def settle() -> None:  # the worker's queue is FIFO: a no-op after the checkpoint
            await store._run(lambda: None)
            await asyncio.sleep(0)

        for i in range(5):
            await store.record(make_record(f"c{i}"))
        await settle()
        assert len(calls) == 1 and calls[0].startswith("clora-trajectories")
        await store.record(make_record("c5"))
        await settle()
        assert len(calls) == 2
        assert await store.count() == 6


_ASYNC_KILL_SCRIPT = textwrap.dedent(
    """
    import asyncio, os, signal, sys
    from pathlib import Path
    sys.path.insert(0, {tests_dir!r})
    from test_trajectory_store import make_record
    from clora_feedback.store.trajectories import AsyncTrajectoryStore

    async def main():
        store = AsyncTrajectoryStore(Path({db!r}), checkpoint_every=1000)
        await store.start()
        assert store.inline_writes
        for i in range(10):
            await store.record(make_record(f"inline-{{i}}", n=2))
        os.kill(os.getpid(), signal.SIGKILL)

    asyncio.run(main())
    """
)


def test_inline_records_survive_sigkill_before_any_checkpoint(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    script = _ASYNC_KILL_SCRIPT.format(tests_dir=str(Path(__file__).parent), db=str(db))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    with TrajectoryStore(db) as reopened:
        assert reopened.count() == 10
        assert reopened.get("inline-9") == make_record("inline-9", n=2)


async def test_a_checkpoint_due_at_stop_runs_before_the_close(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = AsyncTrajectoryStore(tmp_path / "t.db", checkpoint_every=1)
    await store.start()
    await store.record(make_record("last"))  # its checkpoint is queued on the worker
    await store.stop()
    assert "checkpoint failed" not in caplog.text
    with TrajectoryStore(tmp_path / "t.db") as reopened:
        assert reopened.get("last") == make_record("last")
