"""Trainer leases: each agent is trained by exactly one trainer at a time, through the registry's database.

Two tables of the registry schema (SQLite or PostgreSQL, see `registry_schema`):

- `trainer_leases (agent, owner, expires_at)`: who trains an agent, until when;
- `trainer_heartbeats (owner, expires_at)`: which trainers are alive.

A lease is taken or renewed by one compare-and-set statement (an upsert whose
update applies only when the row is the caller's own or has expired), so two
trainers can never both hold an agent. `TrainerLeases.refresh` is the whole
protocol, run every `ttl_s / 3` by its holder: renew the heartbeat, count the
live trainers, renew the held leases, take free or expired ones up to the fair
share `ceil(agents / live trainers)`, and release any surplus (so a trainer that
joins gets its share from the others). A trainer that dies stops renewing: its
heartbeat and leases expire after `ttl_s`, and the others take its agents at
their next refresh, so within `ttl_s + ttl_s / 3` (20 s with the default 15 s).

Time is the database's clock on PostgreSQL (every trainer on every machine reads
the same clock) and this machine's on SQLite (which is one machine anyway).
Tests pass `now` explicitly.

A lease is an optimisation of ownership, not the last guard: the registry's
compare-and-set on the parent version still refuses a publish that raced.

Not here: what a trainer does with the agents it holds (`clora_feedback.train.trainer`),
the schema's versioning (`registry_schema`).
"""

from __future__ import annotations

import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterable

from clora_feedback.store.db import Database, Tx

TABLES = ("trainer_leases", "trainer_heartbeats")
"""The lease tables (no foreign keys: an agent may be leased before its first version)."""

SCHEMA = """
CREATE TABLE IF NOT EXISTS trainer_leases (
    agent TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    expires_at {real} NOT NULL
);
CREATE TABLE IF NOT EXISTS trainer_heartbeats (
    owner TEXT PRIMARY KEY,
    expires_at {real} NOT NULL
)
"""


def schema(dialect: str) -> str:
    """The lease tables' DDL for `dialect` (`sqlite` or `postgresql`)."""
    return SCHEMA.format(real="DOUBLE PRECISION" if dialect == "postgresql" else "REAL")


def new_owner_id() -> str:
    """A trainer id unique across machines and restarts: host, pid and a random tag."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def _clock(tx: Tx, now: float | None) -> float:
    if now is not None:
        return now
    if tx.dialect == "postgresql":
        return float(tx.execute("SELECT extract(epoch FROM clock_timestamp())").fetchone()[0])
    return time.time()


class TrainerLeases:
    """One trainer's view of the lease tables. Thread-safe (the trainer's thread and its
    renewal task both call it).

    Args:
        db: the registry's database (`AdapterRegistry.database`).
        owner: this trainer's id (default `new_owner_id()`).
        ttl_s: how long a lease and a heartbeat last without renewal.
    """

    def __init__(self, db: Database, *, owner: str | None = None, ttl_s: float = 15.0) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self._db = db
        self.owner = owner or new_owner_id()
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        self._held: set[str] = set()
        self._refreshed_at: float | None = None  # time.monotonic() of the last refresh

    @property
    def renew_interval_s(self) -> float:
        """How often `refresh` should run: a third of the TTL."""
        return self.ttl_s / 3

    def held(self) -> set[str]:
        """The agents held at the last refresh, if it is recent enough to still be valid
        (within the TTL on this process's monotonic clock); else none."""
        with self._lock:
            at = self._refreshed_at
            if at is None or time.monotonic() - at >= self.ttl_s:
                return set()
            return set(self._held)

    def due(self) -> bool:
        """Whether a refresh is due (never refreshed, or a renewal interval has passed)."""
        at = self._refreshed_at
        return at is None or time.monotonic() - at >= self.renew_interval_s

    def refresh(self, agents: Iterable[str], *, now: float | None = None) -> set[str]:
        """Heartbeat, renew, take up to the fair share of `agents`, release the surplus.

        Args:
            agents: every agent that wants training (the fair share is computed on it).
            now: the time to use (default: the database's clock).

        Returns:
            The agents this trainer holds now.

        Raises:
            StoreError: the database failed (the held set is unchanged).
        """
        wanted = sorted(set(agents))
        started = time.monotonic()
        with self._lock, self._db.write() as tx:
            t = _clock(tx, now)
            expires = t + self.ttl_s
            tx.execute(
                "INSERT INTO trainer_heartbeats (owner, expires_at) VALUES (?, ?) "
                "ON CONFLICT (owner) DO UPDATE SET expires_at = excluded.expires_at",
                (self.owner, expires),
            )
            tx.execute("DELETE FROM trainer_heartbeats WHERE expires_at < ?", (t,))
            live = tx.execute(
                "SELECT count(*) FROM trainer_heartbeats WHERE expires_at >= ?", (t,)
            ).fetchone()[0]
            share = math.ceil(len(wanted) / max(1, int(live)))
            rows = tx.execute("SELECT agent, owner, expires_at FROM trainer_leases").fetchall()
            mine = {r[0] for r in rows if r[1] == self.owner and r[2] >= t}
            taken = {r[0] for r in rows if r[1] != self.owner and r[2] >= t}
            # Keep held ones first, then free ones, up to the share; drop the rest of ours.
            plan = [a for a in wanted if a in mine][:share]
            plan += [a for a in wanted if a not in mine and a not in taken][: share - len(plan)]
            targets = set(plan)
            kept: set[str] = set()
            # One pass in agent order, so two trainers' transactions lock rows in the same
            # order (PostgreSQL: no deadlock); a row taken meanwhile simply fails its CAS.
            for agent in sorted(targets | mine):
                if agent in targets:
                    if self._take(tx, agent, t, expires):
                        kept.add(agent)
                else:  # over the share, or no longer wanted
                    tx.execute(
                        "DELETE FROM trainer_leases WHERE agent = ? AND owner = ?",
                        (agent, self.owner),
                    )
            self._held = kept
            self._refreshed_at = started
            return set(kept)

    def _take(self, tx: Tx, agent: str, t: float, expires: float) -> bool:
        """The compare-and-set: insert, or update a row that is ours or has expired."""
        cursor = tx.execute(
            "INSERT INTO trainer_leases (agent, owner, expires_at) VALUES (?, ?, ?) "
            "ON CONFLICT (agent) DO UPDATE SET owner = excluded.owner, "
            "expires_at = excluded.expires_at "
            "WHERE trainer_leases.owner = excluded.owner OR trainer_leases.expires_at < ?",
            (agent, self.owner, expires, t),
        )
        return cursor.rowcount == 1

    def holds(self, agent: str, *, now: float | None = None) -> bool:
        """Whether the database still says this trainer holds `agent` (checked before a publish)."""
        with self._db.read() as tx:
            t = _clock(tx, now)
            row = tx.execute(
                "SELECT 1 FROM trainer_leases WHERE agent = ? AND owner = ? AND expires_at >= ?",
                (agent, self.owner, t),
            ).fetchone()
        return row is not None

    def owners(self, *, now: float | None = None) -> dict[str, str]:
        """Every unexpired lease: agent -> owner (for operators and tests)."""
        with self._db.read() as tx:
            t = _clock(tx, now)
            rows = tx.execute(
                "SELECT agent, owner FROM trainer_leases WHERE expires_at >= ? ORDER BY agent",
                (t,),
            ).fetchall()
        return {r[0]: r[1] for r in rows}

    def release(self) -> None:
        """Give up every lease and the heartbeat now (a clean stop), so others take over at once."""
        with self._lock, self._db.write() as tx:
            tx.execute("DELETE FROM trainer_leases WHERE owner = ?", (self.owner,))
            tx.execute("DELETE FROM trainer_heartbeats WHERE owner = ?", (self.owner,))
            self._held = set()
            self._refreshed_at = None
