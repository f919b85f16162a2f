"""The store seam: one database handle, SQLite (embedded default) or PostgreSQL, behind a URL.

`open_database(url)` returns a `Database`. Stores write their SQL once, with `?`
placeholders, and run it in transactions:

    with db.write() as tx:                 # one transaction: commit on exit,
        tx.execute("INSERT ...", (a, b))   # rollback when the body raises
    with db.read() as tx:
        rows = tx.execute("SELECT ...", (a,)).fetchall()

Where the dialects differ (DDL, upserts, identity columns), a store picks its
statement by `tx.dialect`; `store.sql` holds the small shared helpers (writer
serialisation, the schema version of a component).

- SQLite (a filesystem path or `sqlite:///abs/path.db`): one connection guarded
  by a lock, as every store had before this seam: WAL journal, the caller's
  `synchronous`, foreign keys on; `write()` is `BEGIN IMMEDIATE ... COMMIT`, so
  writers are serialised by SQLite itself and readers never wait for them. A
  writer waits for another connection's write lock outside its own lock, so the
  two stores on one file (feedback and trajectories: the feedback store reads
  trajectories inside its writes) cannot hold each other up until the timeout.
  `write_nowait()` is the same transaction for an event loop: begun only if no
  lock is held, on a database whose commits never fsync (`NORMAL`, checkpoints
  left to the owner's `checkpoint()`).
- PostgreSQL (`postgresql://...`): psycopg 3 with a `psycopg_pool.ConnectionPool`
  (1 to `pool_size` connections, autocommit off); every `read()` / `write()` is one
  transaction on one pooled connection (READ COMMITTED). psycopg is imported only
  here and only for such a URL, so the SQLite default does not need it installed.

Every driver error leaving `read()` / `write()` is a `StoreError` (retriable: a
serialization failure, a deadlock or a lost connection is worth a retry by the
caller's existing retry path); no psycopg or sqlite3 exception crosses this seam.

Not here: any table, schema or SQL of a store (each store owns its own), retries,
the asyncio wrapping (`AsyncTrajectoryStore` runs a store on its own thread).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol
from urllib.parse import urlsplit, urlunsplit

from clora_feedback.errors import ConfigError, StoreError

if TYPE_CHECKING:
    import psycopg_pool

Dialect = Literal["sqlite", "postgresql"]
_POSTGRES_SCHEMES = ("postgresql://", "postgres://")
_SQLITE_SCHEME = "sqlite://"


class Rows(Protocol):
    """The result of one statement (a DB-API cursor)."""

    @property
    def rowcount(self) -> int: ...

    def fetchone(self) -> Any: ...

    def fetchall(self) -> list[Any]: ...

    def __iter__(self) -> Iterator[Any]: ...


class Tx(Protocol):
    """One open transaction (or read) of a `Database`; valid only inside its `with` block."""

    dialect: Dialect

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Rows:
        """Run one statement written with `?` placeholders."""
        ...

    def executemany(self, sql: str, seq: Sequence[Sequence[Any]]) -> None:
        """Run one statement once per parameter row."""
        ...


class Database(Protocol):
    """A store's database. Thread-safe; `read()` and `write()` may be entered from any thread."""

    dialect: Dialect
    display_url: str
    """The URL with any password replaced by `***` (for logs and error messages)."""
    file: Path | None
    """The SQLite file; None on PostgreSQL."""

    def read(self) -> AbstractContextManager[Tx]:
        """A read: no writes are committed (SQLite: the shared connection, no transaction)."""
        ...

    def write(self) -> AbstractContextManager[Tx]:
        """One write transaction: committed when the block exits, rolled back if it raises."""
        ...

    def write_nowait(self) -> AbstractContextManager[Tx | None]:
        """`write()` if it can run start to end without waiting, else None (nothing begun).

        "Without waiting": no lock held by another thread or connection, and a commit that
        reaches the OS but not the disk (SQLite WAL with `synchronous=NORMAL` and no automatic
        checkpoint). Always None on PostgreSQL (every statement is a network round trip) and on
        SQLite with `synchronous=FULL` (every commit is an fsync). For a caller on an event
        loop that falls back to `write()` on a thread when it gets None.
        """
        ...

    def checkpoint(self) -> None:
        """SQLite: copy the WAL's committed pages into the database file (PASSIVE: never waits
        for readers), for a database opened with `sqlite_autocheckpoint=False`. PostgreSQL:
        nothing to do."""
        ...

    def close(self) -> None:
        """Close the connection(s) (idempotent); later `read()` / `write()` raise `StoreError`."""
        ...


def is_postgres_url(url: str | os.PathLike[str]) -> bool:
    """Whether `url` names a PostgreSQL database (`postgresql://` or `postgres://`)."""
    return isinstance(url, str) and url.startswith(_POSTGRES_SCHEMES)


def redact(url: str) -> str:
    """`url` with its password (if any) replaced by `***`."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    netloc = f"{parts.username or ''}:***@{host}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def sqlite_path(url: str | os.PathLike[str]) -> Path:
    """The file a SQLite URL (`sqlite:///abs/path.db`) or plain path names.

    Raises:
        ConfigError: a URL of another scheme (only `sqlite://` and `postgresql://` exist).
    """
    text = os.fspath(url)
    if text.startswith(_SQLITE_SCHEME):
        return Path(text[len(_SQLITE_SCHEME) :])
    if "://" in text:
        raise ConfigError(
            f"unsupported store URL {redact(text)!r}: use a file path, sqlite:///abs/path.db "
            "or postgresql://user:password@host:port/database"
        )
    return Path(text)


def open_database(
    url: str | os.PathLike[str],
    *,
    sqlite_synchronous: Literal["NORMAL", "FULL"] = "NORMAL",
    pool_size: int = 4,
    sqlite_timeout_s: float = 10.0,
    sqlite_foreign_keys: bool = True,
    sqlite_autocheckpoint: bool = True,
) -> Database:
    """Open the database `url` names (see the module docstring).

    Args:
        url: a filesystem path or `sqlite:///abs/path.db` (SQLite), or `postgresql://...`.
        sqlite_synchronous: SQLite `synchronous`: `NORMAL` survives process crashes,
            `FULL` also power loss. PostgreSQL commits are durable as the server is set.
        pool_size: PostgreSQL: the most pooled connections.
        sqlite_timeout_s: SQLite: how long a statement waits for another writer's lock.
        sqlite_foreign_keys: SQLite: enforce foreign keys (PostgreSQL always does).

    Raises:
        StoreError: the database cannot be opened (or SQLite cannot use WAL).
        ConfigError: an unknown URL scheme, or a PostgreSQL URL without psycopg installed.
    """
    if is_postgres_url(url):
        if pool_size < 1:
            raise ValueError(f"pool_size must be >= 1, got {pool_size}")
        return _PostgresDatabase(str(url), pool_size=pool_size)
    if sqlite_synchronous not in ("NORMAL", "FULL"):
        raise ValueError(f"synchronous must be NORMAL or FULL, not {sqlite_synchronous!r}")
    return _SQLiteDatabase(
        sqlite_path(url),
        synchronous=sqlite_synchronous,
        timeout_s=sqlite_timeout_s,
        foreign_keys=sqlite_foreign_keys,
        autocheckpoint=sqlite_autocheckpoint,
    )


def open_store(
    url: str | os.PathLike[str], init_schema: Callable[[Tx, str], None], **options: Any
) -> Database:
    """`open_database(url, **options)`, then `init_schema(tx, display_url)` in one write
    transaction.

    The database is closed again if the schema step fails, so a store whose constructor
    raises leaves no connection or pool behind.
    """
    db = open_database(url, **options)
    try:
        with db.write() as tx:
            init_schema(tx, db.display_url)
    except BaseException:
        db.close()
        raise
    return db


def database_file(db: Database, what: str) -> Path:
    """The SQLite file behind `db`, for a store's `path` property.

    Raises:
        StoreError: `db` is on PostgreSQL (there is no file; name the store by its URL).
    """
    if db.file is None:
        raise StoreError(f"{what} {db.display_url} is on PostgreSQL, not in a file")
    return db.file


def url_file(url: str | os.PathLike[str], what: str) -> Path:
    """The SQLite file a store URL names, before the store is opened.

    Raises:
        StoreError: `url` names a PostgreSQL database.
    """
    if is_postgres_url(url):
        raise StoreError(f"{what} {redact(os.fspath(url))} is on PostgreSQL, not in a file")
    return sqlite_path(url)


# -- SQLite ---------------------------------------------------------------------------


class _SQLiteTx:
    dialect: Dialect = "sqlite"

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Rows:
        return self._conn.execute(sql, params)

    def executemany(self, sql: str, seq: Sequence[Sequence[Any]]) -> None:
        self._conn.executemany(sql, seq)


class _SQLiteDatabase:
    """One connection behind a lock: SQLite serialises writers anyway, and WAL lets other
    processes read while this one writes."""

    dialect: Dialect = "sqlite"

    def __init__(
        self,
        path: Path,
        *,
        synchronous: str,
        timeout_s: float,
        foreign_keys: bool,
        autocheckpoint: bool = True,
    ):
        self.file: Path | None = path
        self.display_url = str(path)
        self._busy_timeout_ms = int(timeout_s * 1000)
        # A commit that cannot wait: it reaches the OS (WAL, NORMAL) and never checkpoints.
        self._nowait = synchronous == "NORMAL" and not autocheckpoint
        # Reentrant: a store may read (e.g. a version row) while it holds its own write.
        self._lock = threading.RLock()
        with self._translate("open"):
            path.parent.mkdir(parents=True, exist_ok=True)
            # isolation_level=None: transactions are explicit (BEGIN IMMEDIATE ... COMMIT).
            self._conn = sqlite3.connect(
                path, check_same_thread=False, isolation_level=None, timeout=timeout_s
            )
            try:
                mode = self._conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
                if str(mode).lower() != "wal":
                    raise StoreError(f"{path}: could not enable WAL mode (got {mode!r})")
                self._conn.execute(f"PRAGMA synchronous={synchronous}")
                if not autocheckpoint:
                    self._conn.execute("PRAGMA wal_autocheckpoint=0")
                if foreign_keys:
                    self._conn.execute("PRAGMA foreign_keys=ON")
            except BaseException:
                self._conn.close()
                raise
        self._tx = _SQLiteTx(self._conn)

    @contextlib.contextmanager
    def _translate(self, action: str) -> Iterator[None]:
        try:
            yield
        except (sqlite3.Error, OSError) as exc:
            raise StoreError(f"sqlite {action} failed ({self.display_url}): {exc}") from exc

    @contextlib.contextmanager
    def read(self) -> Iterator[Tx]:
        with self._lock, self._translate("read"):
            yield self._tx

    @contextlib.contextmanager
    def write(self) -> Iterator[Tx]:
        self._begin_waiting()
        try:
            with self._translate("write"), self._begun() as tx:
                yield tx
        finally:
            self._lock.release()

    def _begin_waiting(self) -> None:
        """`BEGIN IMMEDIATE`, waiting up to the busy timeout for another connection's write
        lock; returns holding `_lock`. The wait happens *outside* `_lock`, so this
        connection's readers go on meanwhile: the writer we wait for may be a thread
        that reads through this very store inside its own transaction (the feedback
        store joins events to trajectories within its write), and SQLite's own busy
        wait under `_lock` would stall both until the timeout ("database is locked")."""
        deadline = time.monotonic() + self._busy_timeout_ms / 1000
        pause = 0.001
        while True:
            self._lock.acquire()
            try:
                with self._translate("write"):
                    if self._try_begin():
                        return
            except BaseException:
                self._lock.release()
                raise
            self._lock.release()
            left = deadline - time.monotonic()
            if left <= 0:
                raise StoreError(
                    f"sqlite write failed ({self.display_url}): database is locked "
                    f"(another connection held its write lock for {self._busy_timeout_ms} ms)"
                )
            time.sleep(min(pause, left))
            pause = min(pause * 2, 0.05)

    @contextlib.contextmanager
    def write_nowait(self) -> Iterator[Tx | None]:
        if not self._nowait or not self._lock.acquire(blocking=False):
            yield None
            return
        try:
            with self._translate("write"):
                if not self._try_begin():
                    yield None
                    return
                with self._begun() as tx:
                    yield tx
        finally:
            self._lock.release()

    def _try_begin(self) -> bool:
        """`BEGIN IMMEDIATE` unless another connection holds SQLite's write lock (then False
        at once, instead of waiting out the busy timeout)."""
        conn = self._conn
        conn.execute("PRAGMA busy_timeout=0")
        try:
            conn.execute("BEGIN IMMEDIATE")
            return True
        except sqlite3.OperationalError as exc:
            if exc.sqlite_errorcode not in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED):
                raise
            return False
        finally:
            conn.execute(f"PRAGMA busy_timeout={self._busy_timeout_ms}")

    @contextlib.contextmanager
    def _begun(self) -> Iterator[Tx]:
        """The transaction just begun: committed when the block exits, rolled back if it raises."""
        conn = self._conn
        try:
            yield self._tx
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise

    def checkpoint(self) -> None:
        with self._lock, self._translate("checkpoint"):
            self._conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()

    def close(self) -> None:
        with self._lock, self._translate("close"):
            self._conn.close()


# -- PostgreSQL -----------------------------------------------------------------------


@functools.lru_cache(maxsize=1024)
def _to_pyformat(sql: str) -> str:
    """`?` placeholders as psycopg's `%s` (a literal `%` doubled); the stores' SQL has no
    `?` or `%` inside string literals."""
    return sql.replace("%", "%%").replace("?", "%s")


def _connect_timeout(url: str) -> dict[str, Any]:
    """`connect_timeout=10` unless the URL sets its own (libpq waits forever by default)."""
    return {} if "connect_timeout=" in url else {"connect_timeout": 10}


class _PostgresTx:
    dialect: Dialect = "postgresql"

    def __init__(self, conn: Any) -> None:
        self._conn = conn

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Rows:
        cursor: Rows = self._conn.execute(_to_pyformat(sql), _storable(params))
        return cursor

    def executemany(self, sql: str, seq: Sequence[Sequence[Any]]) -> None:
        rows = [_storable(r) for r in seq]
        if rows:
            with self._conn.cursor() as cursor:
                cursor.executemany(_to_pyformat(sql), rows)


def _storable(params: Sequence[Any]) -> tuple[Any, ...]:
    """`params` with every NUL in a string replaced by U+FFFD.

    PostgreSQL text cannot hold NUL (SQLite can): a model may generate it and a
    client may send it, and refusing the write would lose a completion or a feedback
    event. The token ids stay exact; only the text of a NUL changes, on PostgreSQL.
    """
    return tuple(
        p.replace("\x00", "\ufffd") if isinstance(p, str) and "\x00" in p else p for p in params
    )


class _PostgresDatabase:
    """A psycopg 3 connection pool; each `read()` / `write()` is one transaction on one
    connection, returned to the pool after it."""

    dialect: Dialect = "postgresql"

    def __init__(self, url: str, *, pool_size: int, open_timeout_s: float = 30.0) -> None:
        self.display_url = redact(url)
        self.file: Path | None = None
        try:
            import psycopg
            import psycopg_pool
        except ImportError as exc:
            raise ConfigError(
                "a postgresql:// store needs psycopg 3: pip install 'clora-feedback[postgres]'"
            ) from exc
        self._driver_errors: tuple[type[BaseException], ...] = (
            psycopg.Error,
            psycopg_pool.PoolTimeout,
            psycopg_pool.PoolClosed,
        )
        self._pool: psycopg_pool.ConnectionPool[Any] = psycopg_pool.ConnectionPool(
            url,
            min_size=1,
            max_size=pool_size,
            kwargs={"autocommit": False, **_connect_timeout(url)},
            open=False,
            name="clora-store",
        )
        with self._translate("open"):
            # One direct connection first: an unreachable server or a wrong password fails
            # now with the server's own message, not after the pool's retries time out.
            psycopg.connect(url, **_connect_timeout(url)).close()
            try:
                self._pool.open(wait=True, timeout=open_timeout_s)
            except BaseException:
                self._pool.close()
                raise

    @contextlib.contextmanager
    def _translate(self, action: str) -> Iterator[None]:
        try:
            yield
        except self._driver_errors as exc:
            raise StoreError(f"postgresql {action} failed ({self.display_url}): {exc}") from exc

    @contextlib.contextmanager
    def _transaction(self, action: str) -> Iterator[Tx]:
        # conn.transaction(): BEGIN here, COMMIT on a clean exit, ROLLBACK on an error.
        with self._translate(action), self._pool.connection() as conn, conn.transaction():
            yield _PostgresTx(conn)

    def read(self) -> AbstractContextManager[Tx]:
        return self._transaction("read")

    def write(self) -> AbstractContextManager[Tx]:
        return self._transaction("write")

    @contextlib.contextmanager
    def write_nowait(self) -> Iterator[Tx | None]:
        yield None

    def checkpoint(self) -> None:
        pass

    def close(self) -> None:
        self._pool.close()
