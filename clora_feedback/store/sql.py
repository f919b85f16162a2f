"""Small SQL helpers shared by the stores (trajectories, feedback, registry) on either dialect.

Not here: any table of a store (each store owns its own) or connection (`db`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from clora_feedback.store.db import Tx

CHUNK = 500
"""Bound parameters per `IN (...)`: well under SQLite's limit (999 on old builds)."""

PG_SCHEMA_TABLE = "clora_schema"
"""PostgreSQL: one row per store component with its schema version. The stores share one
database there, so no store may keep its own `schema_version` table (SQLite files keep
theirs, unchanged)."""

# pg_advisory_xact_lock keys: one per thing whose writers must queue (any fixed int8 works;
# these spell "clora" plus a small number so they are easy to spot in pg_locks).
LOCK_SCHEMA = 0x636C6F7261_01
LOCK_TRAJECTORIES = 0x636C6F7261_02
LOCK_FEEDBACK = 0x636C6F7261_03
LOCK_REGISTRY_CLAIM = 0x636C6F7261_04


def in_chunks(values: Iterable[str]) -> Iterator[tuple[list[str], str]]:
    """Distinct `values`, first-seen order, in chunks of `CHUNK`, each with its `?,?,...` marks."""
    unique = list(dict.fromkeys(values))
    for start in range(0, len(unique), CHUNK):
        chunk = unique[start : start + CHUNK]
        yield chunk, ",".join("?" * len(chunk))


def run_script(tx: Tx, script: str) -> None:
    """Run `;`-separated statements (DDL without `;` inside them) one by one."""
    for statement in script.split(";"):
        if statement.strip():
            tx.execute(statement)


def serialize_writers(tx: Tx, key: int) -> None:
    """Queue this transaction behind every other one holding `key`, until it ends.

    SQLite needs nothing: `BEGIN IMMEDIATE` already admits one writer at a time. On
    PostgreSQL a transaction-level advisory lock does the same for the writers of one
    store, so numbers drawn from a sequence inside it commit in the order drawn.
    """
    if tx.dialect == "postgresql":
        tx.execute("SELECT pg_advisory_xact_lock(?)", (key,))


def pg_schema_version(tx: Tx, component: str) -> int | None:
    """PostgreSQL: the recorded schema version of `component`, None for a new database.

    Takes the schema lock first, so two processes starting at once create tables one
    after the other (concurrent `CREATE TABLE IF NOT EXISTS` can fail on PostgreSQL).
    """
    serialize_writers(tx, LOCK_SCHEMA)
    tx.execute(
        f"CREATE TABLE IF NOT EXISTS {PG_SCHEMA_TABLE} "
        "(component TEXT PRIMARY KEY, version INTEGER NOT NULL)"
    )
    row = tx.execute(
        f"SELECT version FROM {PG_SCHEMA_TABLE} WHERE component = ?", (component,)
    ).fetchone()
    return None if row is None else int(row[0])


def set_pg_schema_version(tx: Tx, component: str, version: int) -> None:
    """PostgreSQL: record `component` at schema `version`."""
    tx.execute(
        f"INSERT INTO {PG_SCHEMA_TABLE} (component, version) VALUES (?, ?) "
        "ON CONFLICT (component) DO UPDATE SET version = excluded.version",
        (component, version),
    )
