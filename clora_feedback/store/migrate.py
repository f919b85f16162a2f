"""Copy the SQLite store files into an empty PostgreSQL database, table by table.

    report = migrate_to_postgres(parts, "postgresql://user:pw@db:5432/clora")

Each `StorePart` is one store's share of the copy: its SQLite file, its tables
(the store module's `PG_TABLES`, parents first) and a way to open the store
(`open_store`), which the copy uses twice: on the source, so an older file is
first migrated to the current schema by the store's own code; and on the
target, so the PostgreSQL tables and the `clora_schema` rows are created by the
same code that later serves from them. The copy itself then:

1. refuses a target where any of the parts' tables already holds a row, other
   than the rows a fresh open seeds (checked before anything is created, and
   again under the copy's table locks);
2. runs in ONE PostgreSQL transaction with every target table locked: the seeded
   rows (a registry's store id, the rejoin cursor) are replaced by the source's,
   then every table is copied parents first, in source order;
3. keeps every id and cursor: explicit values are inserted into identity columns
   (`OVERRIDING SYSTEM VALUE`), a PostgreSQL-only identity column (`seq`, the
   position SQLite's rowid gives) is filled from the rowid, and each identity
   sequence is set past the largest copied value (and past `sqlite_sequence`, so a
   number SQLite's AUTOINCREMENT already handed out is never reused);
4. compares every table's row count with the source before it commits, and the
   source's schema versions with the target's `clora_schema`.

A failure anywhere rolls the copy back: the target keeps only empty tables, and
the command can run again. The SQLite files are read, never changed (other than
the schema upgrade opening them performs, as `clora serve` would). Adapter
version directories are not touched: the registry's rows name them under the
same `adapters_dir`, which every process must mount.

Not here: the stores' tables and DDL (each store module), which stores exist
(`cli/store.py` lists them), copying PostgreSQL back to SQLite.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from clora_feedback.errors import ConfigError, ConflictError, StoreError
from clora_feedback.store.db import Tx, is_postgres_url, open_database, redact
from clora_feedback.store.sql import PG_SCHEMA_TABLE

log = logging.getLogger(__name__)

BATCH_ROWS = 1000
"""Rows per `executemany` (bounded memory for any table size)."""


class _Closable(Protocol):
    def close(self) -> None: ...


@dataclass(frozen=True)
class StorePart:
    """One store's share of a migration.

    Attributes:
        component: the store's name in PostgreSQL's `clora_schema` (e.g. `trajectories`).
        source: its SQLite file.
        tables: its tables, parents before the tables that reference them (`PG_TABLES`).
        version_table: the SQLite file's table holding this store's schema version.
        seeded: those of `tables` a fresh open writes a row into (a cursor, a store id):
            their target rows are replaced by the source's; every other table must be empty.
        open_store: opens the store on a URL or path (creating or upgrading its schema);
            the copy closes what it returns at once.
    """

    component: str
    source: Path
    tables: tuple[str, ...]
    version_table: str
    open_store: Callable[[str | Path], _Closable]
    seeded: tuple[str, ...] = ()


@dataclass
class MigrationReport:
    """What a migration copied: rows per table (equal on both sides), identity positions."""

    target: str
    rows: dict[str, int] = field(default_factory=dict)
    sequences: dict[str, int] = field(default_factory=dict)
    """`table.column` -> the last value the identity sequence is set to."""
    schema_versions: dict[str, int] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    """Parts whose SQLite file does not exist (nothing to copy)."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "rows": self.rows,
            "sequences": self.sequences,
            "schema_versions": self.schema_versions,
            "skipped": self.skipped,
        }


@dataclass(frozen=True)
class _Column:
    name: str
    data_type: str
    identity: bool


def migrate_to_postgres(parts: Sequence[StorePart], target_url: str) -> MigrationReport:
    """Copy every part's SQLite tables into the empty PostgreSQL database `target_url`.

    Raises:
        ConfigError: `target_url` is not a PostgreSQL URL (or psycopg is missing).
        ConflictError: the target already holds rows in one of the tables (`code`
            `target_not_empty`); nothing was changed.
        StoreError: the copy failed or the counts differ; it was rolled back.
    """
    if not is_postgres_url(target_url):
        raise ConfigError(f"the target must be a postgresql:// URL, not {redact(target_url)!r}")
    report = MigrationReport(target=redact(target_url))
    present = []
    for part in parts:
        if part.source.is_file():
            present.append(part)
        else:
            report.skipped.append(part.component)
    tables = [t for part in present for t in part.tables]
    seeded = {t for part in present for t in part.seeded}
    payload = [t for t in tables if t not in seeded]
    target = open_database(target_url, pool_size=1)
    try:
        with target.read() as tx:
            _refuse_rows(tx, payload, report.target)
        for part in present:  # the stores' own code creates (source: upgrades) the schemas
            part.open_store(part.source).close()
            part.open_store(target_url).close()
        with target.write() as tx:
            # Under the locks no other process can write until the copy commits or rolls back.
            tx.execute(f"LOCK TABLE {', '.join(tables)} IN ACCESS EXCLUSIVE MODE")
            _refuse_rows(tx, payload, report.target)
            for table in reversed(tables):  # children first
                if table in seeded:
                    tx.execute(f"DELETE FROM {table}")
            for source_path, group in _by_file(present):
                _copy_file(source_path, group, tx, report)
    finally:
        target.close()
    sources = sorted({str(p.source) for p in present})  # several stores share a file
    log.info("migrated %s into %s: %s", sources, report.target, report.rows)
    return report


def _by_file(parts: Sequence[StorePart]) -> Iterator[tuple[Path, list[StorePart]]]:
    """Parts grouped by SQLite file, in first-seen order (several stores share a file)."""
    files: dict[Path, list[StorePart]] = {}
    for part in parts:
        files.setdefault(part.source.resolve(), []).append(part)
    yield from files.items()


def _refuse_rows(tx: Tx, tables: Sequence[str], target: str) -> None:
    for table in tables:
        exists = tx.execute("SELECT to_regclass(?)", (table,)).fetchone()[0]
        if exists is not None and tx.execute(f"SELECT 1 FROM {table} LIMIT 1").fetchone():
            raise ConflictError(
                f"{target} is not empty (table {table} holds rows): migrate into a new, "
                "empty database, before any clora process has written to it",
                code="target_not_empty",
            )


def _copy_file(path: Path, parts: Sequence[StorePart], tx: Tx, report: MigrationReport) -> None:
    source = open_database(path)
    try:
        with source.read() as src:
            _check_undeclared(src, path, parts)
            for part in parts:
                for table in part.tables:
                    report.rows[table] = _copy_table(src, tx, table, report)
                report.schema_versions[part.component] = _check_version(src, tx, part)
    finally:
        source.close()


def _check_undeclared(src: Tx, path: Path, parts: Sequence[StorePart]) -> None:
    """Every source table must be copied or be a version table: data is never left behind."""
    known = {t for part in parts for t in part.tables} | {p.version_table for p in parts}
    names = [r[0] for r in src.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
    extra = sorted(n for n in names if n not in known and not n.startswith("sqlite_"))
    if extra:
        raise StoreError(f"{path}: tables {extra} are not declared by any store; not migrating")


def _copy_table(src: Tx, dst: Tx, table: str, report: MigrationReport) -> int:
    """Copy one table; returns its row count (verified equal on both sides)."""
    source_columns = [r[1] for r in src.execute(f"PRAGMA table_info({table})")]
    if not source_columns:
        raise StoreError(f"the source has no table {table}")
    target = _target_columns(dst, table)
    missing = [c for c in source_columns if c not in target]
    if missing:
        raise StoreError(f"table {table}: the target lacks columns {missing}")
    # A PostgreSQL-only identity column stands for SQLite's rowid (the same positions).
    from_rowid = [c.name for c in target.values() if c.identity and c.name not in source_columns]
    if len(from_rowid) > 1 or (from_rowid and not _has_rowid(src, table)):
        raise StoreError(f"table {table}: no source for the target columns {from_rowid}")
    columns = source_columns + from_rowid
    select = ", ".join([*source_columns, *(["rowid"] if from_rowid else [])])
    convert = [_converter(target[c].data_type) for c in columns]
    overriding = " OVERRIDING SYSTEM VALUE" if any(target[c].identity for c in columns) else ""
    insert = (
        f"INSERT INTO {table} ({', '.join(columns)}){overriding} "
        f"VALUES ({', '.join('?' * len(columns))})"
    )
    copied = 0
    batch: list[list[Any]] = []
    for row in src.execute(f"SELECT {select} FROM {table}"):
        batch.append([f(v) for f, v in zip(convert, row, strict=True)])
        if len(batch) == BATCH_ROWS:
            dst.executemany(insert, batch)
            copied, batch = copied + len(batch), []
    if batch:
        dst.executemany(insert, batch)
        copied += len(batch)
    _verify_count(src, dst, table, copied)
    for column in (c for c in columns if target[c].identity):
        report.sequences[f"{table}.{column}"] = _reset_sequence(src, dst, table, column)
    return copied


def _target_columns(dst: Tx, table: str) -> dict[str, _Column]:
    rows = dst.execute(
        "SELECT column_name, data_type, is_identity FROM information_schema.columns "
        "WHERE table_schema = current_schema() AND table_name = ? ORDER BY ordinal_position",
        (table,),
    ).fetchall()
    if not rows:
        raise StoreError(f"the target has no table {table} (its store did not create it)")
    return {r[0]: _Column(r[0], r[1], r[2] == "YES") for r in rows}


def _has_rowid(src: Tx, table: str) -> bool:
    row = src.execute("SELECT sql FROM sqlite_master WHERE name = ?", (table,)).fetchone()
    return row is not None and "WITHOUT ROWID" not in " ".join(str(row[0]).upper().split())


def _converter(data_type: str) -> Callable[[Any], Any]:
    """SQLite keeps booleans as integers; PostgreSQL's boolean refuses them."""
    if data_type == "boolean":
        return lambda v: None if v is None else bool(v)
    if data_type == "bytea":
        return lambda v: None if v is None else bytes(v)
    return lambda v: v


def _verify_count(src: Tx, dst: Tx, table: str, copied: int) -> None:
    expected = src.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
    got = dst.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
    if not expected == got == copied:
        raise StoreError(
            f"table {table}: {expected} rows in the source, {copied} copied, {got} in the "
            "target; rolled back"
        )


def _reset_sequence(src: Tx, dst: Tx, table: str, column: str) -> int:
    """Set `table.column`'s sequence past every copied value and every value SQLite issued."""
    last = dst.execute(f"SELECT max({column}) FROM {table}").fetchone()[0] or 0
    issued = (
        src.execute("SELECT seq FROM sqlite_sequence WHERE name = ?", (table,)).fetchone()
        if _has_sqlite_sequence(src)
        else None
    )
    last = max(int(last), int(issued[0]) if issued else 0)
    if last > 0:
        dst.execute("SELECT setval(pg_get_serial_sequence(?, ?), ?)", (table, column, last))
    return last


def _has_sqlite_sequence(src: Tx) -> bool:
    row = src.execute("SELECT 1 FROM sqlite_master WHERE name = 'sqlite_sequence'").fetchone()
    return row is not None


def _check_version(src: Tx, dst: Tx, part: StorePart) -> int:
    """The source file's schema version of this store must be the target's (both current)."""
    (source_version,) = src.execute(f"SELECT max(version) FROM {part.version_table}").fetchone()
    row = dst.execute(
        f"SELECT version FROM {PG_SCHEMA_TABLE} WHERE component = ?", (part.component,)
    ).fetchone()
    if row is None or source_version is None or int(row[0]) != int(source_version):
        raise StoreError(
            f"{part.component}: schema version {source_version} in {part.source}, "
            f"{None if row is None else row[0]} in the target; rolled back"
        )
    return int(source_version)
