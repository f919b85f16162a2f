"""The adapter registry's database at start-up: its schema, and its claim on the adapter tree.

`init_schema` creates the tables (`index.SCHEMA` in a SQLite file, `index.PG_SCHEMA`
on PostgreSQL, which starts at the current version and records it as component
`registry` of the shared `clora_schema` table) and upgrades an older database:
version 1 had no trainer leases; version 2 adds `lease.TABLES` (new tables only,
so the upgrade is their `CREATE TABLE IF NOT EXISTS` and the version row); version 3
adds the `versions` columns `pruned_at` and `probe` (`index.MIGRATE_V3`, nullable); the
release states' table (`index.release_schema`) is created if missing on every open, with no
version of its own (a new table older code ignores). `claim_root` ties the version tree
to the database: the `meta` row `store_id` and the tree's `.store-id` file must
agree, so a registry opened on another database's tree refuses rather than
garbage-collect that tree's versions. On PostgreSQL the claim is that row in the
shared database, made by one transaction at a time (processes on other machines
do not share the tree's flock).

Not here: the registry's reads and writes (`registry`), the tree itself (`artifact`).
"""

from __future__ import annotations

import uuid

from clora_feedback.errors import StoreError
from clora_feedback.store import lease
from clora_feedback.store.artifact import VersionDirs
from clora_feedback.store.db import Tx
from clora_feedback.store.registry import index
from clora_feedback.store.registry.index import MIGRATE_V3, PG_SCHEMA, SCHEMA, SCHEMA_VERSION
from clora_feedback.store.sql import (
    LOCK_REGISTRY_CLAIM,
    pg_schema_version,
    run_script,
    serialize_writers,
    set_pg_schema_version,
)

POINTER_CHANNEL = "clora_adapters"
"""PostgreSQL: every move of an agent's active pointer sends `NOTIFY clora_adapters, '<agent>'`
in the moving transaction (delivered only if it commits); deployers LISTEN on it."""

PG_TABLES = (*index.PG_TABLES, *lease.TABLES, *index.RELEASE_TABLES)
"""Every registry table on PostgreSQL, parents first (what `clora store migrate` copies)."""


def init_schema(conn: Tx, url: str) -> None:
    """Create the registry's tables (inside the caller's transaction).

    Raises:
        StoreError: the database was written by a newer schema than this code's.
    """
    if conn.dialect == "postgresql":
        version = pg_schema_version(conn, "registry")
        _check_not_newer(version, url)
        run_script(conn, PG_SCHEMA)
        run_script(conn, lease.schema(conn.dialect))
        run_script(conn, index.release_schema(conn.dialect))
        for column, kind in MIGRATE_V3.items():  # idempotent: a no-op on a new database
            kind = "DOUBLE PRECISION" if kind == "REAL" else kind
            conn.execute(f"ALTER TABLE versions ADD COLUMN IF NOT EXISTS {column} {kind}")
        if version != SCHEMA_VERSION:  # new, or an upgrade from 1 or 2
            set_pg_schema_version(conn, "registry", SCHEMA_VERSION)
    else:
        run_script(conn, SCHEMA)
        version = conn.execute("SELECT max(version) FROM schema_version").fetchone()[0]
        _check_not_newer(version, url)
        run_script(conn, lease.schema(conn.dialect))
        run_script(conn, index.release_schema(conn.dialect))
        present = {row[1] for row in conn.execute("PRAGMA table_info(versions)")}
        for column, kind in MIGRATE_V3.items():
            if column not in present:
                conn.execute(f"ALTER TABLE versions ADD COLUMN {column} {kind}")
        if version != SCHEMA_VERSION:
            conn.execute("DELETE FROM schema_version")
            conn.execute("INSERT INTO schema_version (version) VALUES (?)", (SCHEMA_VERSION,))


def _check_not_newer(version: int | None, url: str) -> None:
    if version is not None and version > SCHEMA_VERSION:
        raise StoreError(
            f"{url}: schema version {version} is newer than this code "
            f"({SCHEMA_VERSION}); upgrade clora-feedback"
        )


def notify_pointer_moved(conn: Tx, agent: str) -> None:
    """Inside a transaction that moves `agent`'s pointer: tell every listener (PostgreSQL)
    once it commits. SQLite has no notifications: deployers poll it."""
    if conn.dialect == "postgresql":
        conn.execute("SELECT pg_notify(?, ?)", (POINTER_CHANNEL, agent))


def claim_root(conn: Tx, dirs: VersionDirs, url: str) -> None:
    """Tie `dirs` to this database (inside the caller's transaction, holding `dirs.lock()`).

    Raises:
        StoreError: the tree belongs to another database, or holds versions this
            database does not index.
    """
    serialize_writers(conn, LOCK_REGISTRY_CLAIM)
    row = conn.execute("SELECT value FROM meta WHERE key = 'store_id'").fetchone()
    known, on_disk = (row[0] if row else None), dirs.store_id()
    if known is not None and on_disk is not None and known != on_disk:
        raise StoreError(
            f"{dirs.root} belongs to another adapter registry (store id {on_disk}; "
            f"{url} has {known}): point adapters_dir and the registry database at the same store"
        )
    if (known is None or on_disk is None) and dirs.has_versions():
        raise StoreError(
            f"{dirs.root} holds version directories that {url} does not index; refusing to "
            "adopt (or garbage-collect) them"
        )
    store_id = known or on_disk or uuid.uuid4().hex
    if known is None:
        conn.execute("INSERT INTO meta (key, value) VALUES ('store_id', ?)", (store_id,))
    if on_disk != store_id:
        dirs.set_store_id(store_id)
