"""Two SQLite connections on one file, as the feedback and trajectory stores share one:
a writer waiting for the other connection's write lock must not hold its own store's
lock meanwhile (the other writer may read through this store inside its transaction:
the feedback store joins events to trajectories within its write)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from clora_feedback.errors import StoreError
from clora_feedback.store.db import open_database


def _table(path: Path) -> None:
    db = open_database(path)
    with db.write() as tx:
        tx.execute("CREATE TABLE t (x INTEGER)")
    db.close()


def test_a_waiting_writer_lets_its_readers_through(tmp_path: Path) -> None:
    path = tmp_path / "shared.db"
    _table(path)
    feedback = open_database(path, sqlite_timeout_s=3.0)
    trajectories = open_database(path, sqlite_timeout_s=3.0)
    began, read = threading.Event(), threading.Event()

    def join_inside_a_write() -> None:  # the feedback store's apply or rejoin
        with feedback.write() as tx:
            began.set()
            time.sleep(0.3)  # the other thread is now waiting to write through `trajectories`
            with trajectories.read() as other:  # the join reads trajectories
                other.execute("SELECT count(*) FROM t").fetchone()
            read.set()
            tx.execute("INSERT INTO t VALUES (1)")

    joiner = threading.Thread(target=join_inside_a_write)
    joiner.start()
    began.wait(5)
    t0 = time.monotonic()
    with trajectories.write() as tx:  # the gateway records a trajectory meanwhile
        tx.execute("INSERT INTO t VALUES (2)")
    waited = time.monotonic() - t0
    joiner.join(5)
    assert read.is_set()
    assert waited < 2.0, waited  # waited for the other's commit, not for the busy timeout
    with trajectories.read() as tx:
        assert tx.execute("SELECT count(*) FROM t").fetchone()[0] == 2
    feedback.close()
    trajectories.close()


def test_a_writer_still_gives_up_after_the_busy_timeout(tmp_path: Path) -> None:
    path = tmp_path / "shared.db"
    _table(path)
    holder = open_database(path)
    waiter = open_database(path, sqlite_timeout_s=0.3)
    with holder.write():
        t0 = time.monotonic()
        with pytest.raises(StoreError, match="database is locked"), waiter.write():
            pass
        assert 0.25 < time.monotonic() - t0 < 2.0
    with waiter.write() as tx:  # and writes once the lock is free
        tx.execute("INSERT INTO t VALUES (1)")
    holder.close()
    waiter.close()
