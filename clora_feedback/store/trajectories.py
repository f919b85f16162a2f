"""Durable trajectory store: every served completion, on SQLite in WAL mode.

A trajectory is what RL training needs from one request: the exact prompt and
completion token ids the engine used (never re-tokenised text), the behaviour
log-probability of every sampled token, and the adapter version that produced
each token. `TrajectoryStore` writes one trajectory per transaction and commits
before `record` returns, so a trajectory a client has seen survives a kill -9 of
the gateway (WAL with `synchronous=NORMAL`; use `FULL` to also survive power
loss). `AsyncTrajectoryStore` runs the same store on one background thread so
the gateway's event loop never waits on disk.

Schema (version `SCHEMA_VERSION`, recorded in table `schema_version`):

    completions(id PK, agent, adapter_version, kind, request JSON,
                prompt_token_ids BLOB, created_at, timings JSON, api_key_agent,
                conversation_id [v2: indexed], logprobs_mode, version_attribution [v2])
    samples(completion_id -> completions.id, idx, text, completion_token_ids BLOB,
            logprobs BLOB, token_versions BLOB, finish_reason, tool_calls JSON)

Token ids and adapter versions are stored as little-endian int32 arrays, and
log-probabilities as little-endian float64 arrays (8 bytes per token, so the
floats round-trip bit for bit); this is ~4-6x smaller than JSON text and decodes
with one `array.frombytes` call.

Migrations run on open, in one transaction: v1 -> v2 adds the indexed column
`conversation_id` (the request's `metadata.conversation_id` if a string),
backfilled from the stored request JSON. Other stores read this one only
through its methods (`exists`, `get_many`, `by_conversation`).

Deliberately not here: rewards and feedback (joined later by the ingest side),
training batches, retention or deletion policies.
"""

from __future__ import annotations

import asyncio
import builtins
import json
import sqlite3
import sys
import threading
from array import array
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, TypeVar

from clora_feedback.errors import ConflictError, InvalidRequestError, NotFoundError, StoreError
from clora_feedback.lifecycle import AsyncLifecycle
from clora_feedback.store.sql import in_chunks

SCHEMA_VERSION = 2
_T = TypeVar("_T")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS completions (
    id TEXT PRIMARY KEY,
    agent TEXT NOT NULL,
    adapter_version INTEGER NOT NULL,
    kind TEXT NOT NULL CHECK (kind IN ('chat', 'completion')),
    request TEXT NOT NULL,
    prompt_token_ids BLOB NOT NULL,
    created_at REAL NOT NULL,
    timings TEXT NOT NULL,
    api_key_agent TEXT,
    conversation_id TEXT,
    logprobs_mode TEXT NOT NULL DEFAULT 'raw',
    version_attribution TEXT NOT NULL DEFAULT 'token'
);
CREATE INDEX IF NOT EXISTS completions_by_time ON completions (created_at);
CREATE INDEX IF NOT EXISTS completions_by_agent_time ON completions (agent, created_at);
CREATE TABLE IF NOT EXISTS samples (
    completion_id TEXT NOT NULL REFERENCES completions (id) ON DELETE CASCADE,
    idx INTEGER NOT NULL,
    text TEXT NOT NULL,
    completion_token_ids BLOB NOT NULL,
    logprobs BLOB NOT NULL,
    token_versions BLOB NOT NULL,
    finish_reason TEXT,
    tool_calls TEXT,
    PRIMARY KEY (completion_id, idx)
) WITHOUT ROWID;
"""

_CONVERSATION_INDEX = (
    "CREATE INDEX IF NOT EXISTS completions_by_conversation "
    "ON completions (conversation_id, created_at)"
)
# v1 -> v2. A non-string id never matched a feedback event (they carry strings): NULL.
_MIGRATE_V1 = (
    "ALTER TABLE completions ADD COLUMN conversation_id TEXT",
    "ALTER TABLE completions ADD COLUMN logprobs_mode TEXT NOT NULL DEFAULT 'raw'",
    "ALTER TABLE completions ADD COLUMN version_attribution TEXT NOT NULL DEFAULT 'token'",
    "UPDATE completions SET conversation_id = json_extract(request, '$.metadata.conversation_id') "
    "WHERE json_type(request, '$.metadata.conversation_id') = 'text'",
)

_COMPLETION_COLUMNS = (
    "id, agent, adapter_version, kind, request, prompt_token_ids, "
    "created_at, timings, api_key_agent, logprobs_mode, version_attribution"
)
_SAMPLE_COLUMNS = (
    "completion_id, idx, text, completion_token_ids, logprobs, token_versions, "
    "finish_reason, tool_calls"
)


@dataclass(frozen=True)
class SampleRecord:
    """One choice of a completion (a request with `n > 1` has several)."""

    index: int
    """Choice index, as in the OpenAI response (`choices[i].index`)."""
    text: str
    """Decoded completion text as returned to the client."""
    completion_token_ids: list[int]
    """Engine token ids of the completion, in order (no prompt tokens)."""
    logprobs: list[float]
    """Behaviour log-probability of each sampled token; `len == len(completion_token_ids)`."""
    token_versions: list[int]
    """Adapter version that produced each token (0 = base model); same length again.
    Versions can change mid-sequence when an adapter is hot-swapped during decode."""
    finish_reason: str | None
    """`stop`, `length`, `tool_calls`, ... (None if the stream was cut off)."""
    tool_calls: list[dict[str, Any]] | None = None
    """Tool calls parsed from the text in OpenAI wire shape, or None."""

    def __post_init__(self) -> None:
        n = len(self.completion_token_ids)
        if len(self.logprobs) != n or len(self.token_versions) != n:
            raise ValueError(
                f"sample {self.index}: {n} tokens but {len(self.logprobs)} logprobs and "
                f"{len(self.token_versions)} token versions"
            )


@dataclass(frozen=True)
class TrajectoryRecord:
    """One served request with everything training needs to replay it."""

    id: str
    """Completion id returned to the client (`chatcmpl-...` or `cmpl-...`); feedback refers to it."""
    agent: str
    """Model name the client requested: the agent, or the base model name when no agent."""
    adapter_version: int
    """Adapter version live for the agent when the request was admitted (0 = base model)."""
    kind: Literal["chat", "completion"]
    """Endpoint family: `chat` (/v1/chat/completions) or `completion` (/v1/completions)."""
    request: dict[str, Any]
    """The request as JSON: messages or prompt, tools, sampling parameters."""
    prompt_token_ids: list[int]
    """Engine token ids of the rendered prompt (chat template applied)."""
    samples: list[SampleRecord]
    """The choices, one per `n`, ordered by index."""
    created_at: float
    """Admission time, seconds since the epoch."""
    timings: dict[str, float] = field(default_factory=dict)
    """Latencies in seconds: `queue_s`, `ttft_s`, `total_s` (others allowed)."""
    api_key_agent: str | None = None
    """Agent that owns the API key used, when authentication is on; None otherwise."""
    logprobs_mode: Literal["raw", "processed"] = "raw"
    """How the engine computed the samples' `logprobs` (`EngineCapabilities.logprobs`): "raw" =
    log-softmax of the raw logits (the temperature-1 policy the trainer evaluates); "processed"
    = of the distribution sampled from (after temperature/top-p)."""
    version_attribution: Literal["token", "request"] = "token"
    """`token`: each `token_versions` entry is the version that produced that token; `request`:
    the engine attributes one version per request (the admitted one), repeated per token."""

    def __post_init__(self) -> None:
        indices = [s.index for s in self.samples]
        if len(set(indices)) != len(indices):
            raise ValueError(f"trajectory {self.id}: duplicate sample indices {indices}")

    @property
    def conversation_id(self) -> str | None:
        """The request's `metadata.conversation_id` (a string), which feedback may name."""
        metadata = self.request.get("metadata")
        value = metadata.get("conversation_id") if isinstance(metadata, dict) else None
        return value if isinstance(value, str) else None


def _pack(values: builtins.list[int] | builtins.list[float], code: Literal["i", "d"]) -> bytes:
    packed = array(code, values)
    if sys.byteorder == "big":  # stored little-endian on every machine
        packed.byteswap()
    return packed.tobytes()


def _unpack(blob: bytes, code: Literal["i", "d"]) -> builtins.list[Any]:
    unpacked = array(code)
    unpacked.frombytes(blob)
    if sys.byteorder == "big":
        unpacked.byteswap()
    return unpacked.tolist()


def _dumps(value: object) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


class TrajectoryStore:
    """Synchronous SQLite store of `TrajectoryRecord`s; safe to share across threads.

    One connection guarded by a lock: SQLite serialises writers anyway, and WAL
    lets other processes (e.g. a trainer) read while this one writes.

    Args:
        path: Database file; parent directories are created.
        synchronous: `NORMAL` survives process crashes; `FULL` also power loss.

    Raises:
        StoreError: The database cannot be opened, is not in WAL mode, or was
            written by a newer schema.
    """

    def __init__(self, path: Path, *, synchronous: Literal["NORMAL", "FULL"] = "NORMAL"):
        if synchronous not in ("NORMAL", "FULL"):
            raise ValueError(f"synchronous must be NORMAL or FULL, not {synchronous!r}")
        self.path = Path(path)
        self._lock = threading.Lock()
        with self._translate("open"):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # isolation_level=None: transactions are explicit (BEGIN IMMEDIATE ... COMMIT).
            self._conn = sqlite3.connect(
                self.path, check_same_thread=False, isolation_level=None, timeout=10.0
            )
            try:
                self._init_db(synchronous)
            except BaseException:
                self._conn.close()
                raise

    def _init_db(self, synchronous: str) -> None:
        conn = self._conn
        mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise StoreError(f"{self.path}: could not enable WAL mode (got {mode!r})")
        conn.execute(f"PRAGMA synchronous={synchronous}")
        conn.execute("PRAGMA foreign_keys=ON")
        conn.execute("BEGIN IMMEDIATE")
        try:
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    conn.execute(statement)
            row = conn.execute("SELECT max(version) FROM schema_version").fetchone()
            if row[0] is None:
                conn.execute("INSERT INTO schema_version (version) VALUES (?)", (SCHEMA_VERSION,))
            elif row[0] > SCHEMA_VERSION:
                raise StoreError(
                    f"{self.path}: schema version {row[0]} is newer than this code "
                    f"({SCHEMA_VERSION}); upgrade clora-feedback"
                )
            elif row[0] < 2:
                for statement in _MIGRATE_V1:
                    conn.execute(statement)
                conn.execute("UPDATE schema_version SET version = ?", (SCHEMA_VERSION,))
            # After the migration: on a v1 file the column exists only now.
            conn.execute(_CONVERSATION_INDEX)
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise

    @contextmanager
    def _translate(self, action: str) -> Iterator[None]:
        """Translate sqlite3 errors once, at this boundary, into `StoreError`."""
        try:
            yield
        except sqlite3.Error as exc:
            raise StoreError(f"trajectory store {action} failed ({self.path}): {exc}") from exc

    # -- writes -----------------------------------------------------------------

    def record(self, t: TrajectoryRecord) -> None:
        """Insert one trajectory and its samples in one transaction, committed on return.

        Raises:
            ConflictError: A trajectory with the same id already exists.
            StoreError: SQLite failed (disk full, I/O error, closed store).
            TypeError: `t.request` holds values that are not JSON-serialisable.
        """
        completion_row = (
            t.id,
            t.agent,
            t.adapter_version,
            t.kind,
            _dumps(t.request),
            _pack(t.prompt_token_ids, "i"),
            t.created_at,
            _dumps(t.timings),
            t.api_key_agent,
            t.logprobs_mode,
            t.version_attribution,
            t.conversation_id,
        )
        sample_rows = [
            (
                t.id,
                s.index,
                s.text,
                _pack(s.completion_token_ids, "i"),
                _pack(s.logprobs, "d"),
                _pack(s.token_versions, "i"),
                s.finish_reason,
                None if s.tool_calls is None else _dumps(s.tool_calls),
            )
            for s in t.samples
        ]
        with self._lock, self._translate("record"):
            conn = self._conn
            conn.execute("BEGIN IMMEDIATE")
            try:
                try:
                    conn.execute(
                        f"INSERT INTO completions ({_COMPLETION_COLUMNS}, conversation_id) "
                        "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                        completion_row,
                    )
                except sqlite3.IntegrityError as exc:
                    # The only constraint a valid record can break here is the id key.
                    raise ConflictError(
                        f"trajectory {t.id!r} is already recorded", code="duplicate_id"
                    ) from exc
                conn.executemany(
                    f"INSERT INTO samples ({_SAMPLE_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    sample_rows,
                )
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise

    # -- reads ------------------------------------------------------------------

    def get(self, id: str) -> TrajectoryRecord:
        """Return the trajectory with completion id `id`.

        Raises:
            NotFoundError: No trajectory has that id.
            StoreError: SQLite failed.
        """
        with self._lock, self._translate("get"):
            row = self._conn.execute(
                f"SELECT {_COMPLETION_COLUMNS} FROM completions WHERE id = ?", (id,)
            ).fetchone()
            if row is None:
                raise NotFoundError(f"no trajectory with id {id!r}", code="trajectory_not_found")
            samples = self._conn.execute(
                f"SELECT {_SAMPLE_COLUMNS} FROM samples WHERE completion_id = ? ORDER BY idx",
                (id,),
            ).fetchall()
        return _to_record(row, [_to_sample(s) for s in samples])

    def list(
        self, agent: str | None = None, *, limit: int = 100, before: float | None = None
    ) -> builtins.list[TrajectoryRecord]:
        """Return trajectories newest first (by `created_at`, then insertion order).

        Args:
            agent: Only this agent's trajectories; None for all.
            limit: Most records returned (>= 1).
            before: Only trajectories with `created_at < before` (for paging: pass
                the `created_at` of the last record of the previous page).

        Raises:
            InvalidRequestError: `limit` < 1.
            StoreError: SQLite failed.
        """
        if limit < 1:
            raise InvalidRequestError(f"limit must be >= 1, got {limit}", param="limit")
        where, params = self._filters(agent, before)
        query = (
            f"SELECT {_COMPLETION_COLUMNS} FROM completions {where} "
            "ORDER BY created_at DESC, rowid DESC LIMIT ?"
        )
        with self._lock, self._translate("list"):
            rows = self._conn.execute(query, (*params, limit)).fetchall()
            by_id = self._samples_of([r[0] for r in rows])
        return [_to_record(r, by_id[r[0]]) for r in rows]

    def exists(self, ids: Iterable[str]) -> set[str]:
        """The subset of `ids` that are stored.

        Raises:
            StoreError: SQLite failed.
        """
        found: set[str] = set()
        with self._lock, self._translate("exists"):
            for chunk, marks in in_chunks(ids):
                query = f"SELECT id FROM completions WHERE id IN ({marks})"
                found.update(r[0] for r in self._conn.execute(query, chunk))
        return found

    def get_many(self, ids: Iterable[str]) -> dict[str, TrajectoryRecord]:
        """The stored trajectories among `ids`, by id (ids not stored are absent).

        A few queries for any number of ids (chunked `IN`), not one per id.

        Raises:
            StoreError: SQLite failed.
        """
        with self._lock, self._translate("get_many"):
            rows: builtins.list[tuple[Any, ...]] = []
            for chunk, marks in in_chunks(ids):
                rows += self._conn.execute(
                    f"SELECT {_COMPLETION_COLUMNS} FROM completions WHERE id IN ({marks})", chunk
                ).fetchall()
            by_id = self._samples_of([r[0] for r in rows])
        return {r[0]: _to_record(r, by_id[r[0]]) for r in rows}

    def by_conversation(self, conversation_id: str, agent: str | None = None) -> builtins.list[str]:
        """Ids of the completions recorded under `conversation_id`, oldest first.

        Args:
            conversation_id: the request's `metadata.conversation_id`.
            agent: only this agent's completions; None for every agent's.

        Raises:
            StoreError: SQLite failed.
        """
        query = "SELECT id FROM completions WHERE conversation_id = ?"
        params: tuple[str, ...] = (conversation_id,)
        if agent is not None:
            query, params = query + " AND agent = ?", (*params, agent)
        with self._lock, self._translate("by_conversation"):
            rows = self._conn.execute(query + " ORDER BY created_at, rowid", params).fetchall()
        return [r[0] for r in rows]

    def _samples_of(self, ids: builtins.list[str]) -> dict[str, builtins.list[SampleRecord]]:
        """Samples of each completion in `ids`, in index order (caller holds the lock)."""
        by_id: dict[str, builtins.list[SampleRecord]] = {i: [] for i in ids}
        for chunk, marks in in_chunks(ids):
            for s in self._conn.execute(
                f"SELECT {_SAMPLE_COLUMNS} FROM samples WHERE completion_id IN ({marks}) "
                "ORDER BY completion_id, idx",
                chunk,
            ):
                by_id[s[0]].append(_to_sample(s))
        return by_id

    def count(self, agent: str | None = None) -> int:
        """Number of trajectories, for one agent or all.

        Raises:
            StoreError: SQLite failed.
        """
        where, params = self._filters(agent, None)
        with self._lock, self._translate("count"):
            row = self._conn.execute(f"SELECT count(*) FROM completions {where}", params).fetchone()
        return int(row[0])

    @staticmethod
    def _filters(agent: str | None, before: float | None) -> tuple[str, tuple[object, ...]]:
        clauses: builtins.list[str] = []
        params: builtins.list[object] = []
        if agent is not None:
            clauses.append("agent = ?")
            params.append(agent)
        if before is not None:
            clauses.append("created_at < ?")
            params.append(before)
        where = f"WHERE {' AND '.join(clauses)}" if clauses else ""
        return where, tuple(params)

    # -- lifecycle --------------------------------------------------------------

    def close(self) -> None:
        """Close the connection (idempotent); later calls raise `StoreError`."""
        with self._lock, self._translate("close"):
            self._conn.close()

    def __enter__(self) -> TrajectoryStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _to_sample(row: tuple[Any, ...]) -> SampleRecord:
    return SampleRecord(
        index=row[1],
        text=row[2],
        completion_token_ids=_unpack(row[3], "i"),
        logprobs=_unpack(row[4], "d"),
        token_versions=_unpack(row[5], "i"),
        finish_reason=row[6],
        tool_calls=None if row[7] is None else json.loads(row[7]),
    )


def _to_record(row: tuple[Any, ...], samples: builtins.list[SampleRecord]) -> TrajectoryRecord:
    return TrajectoryRecord(
        id=row[0],
        agent=row[1],
        adapter_version=row[2],
        kind=row[3],
        request=json.loads(row[4]),
        prompt_token_ids=_unpack(row[5], "i"),
        samples=samples,
        created_at=row[6],
        timings=json.loads(row[7]),
        api_key_agent=row[8],
        logprobs_mode=row[9],
        version_attribution=row[10],
    )


class AsyncTrajectoryStore(AsyncLifecycle):
    """`TrajectoryStore` for asyncio code: every call runs on one dedicated thread.

    One worker thread keeps writes in submission order and keeps fsync off the
    event loop. Use as `async with AsyncTrajectoryStore(path) as store:` or call
    `start()` / `stop()`. A cancelled `await store.record(...)` does not undo a
    write the thread has already begun: the record may still be committed.

    Args:
        path: Database file.
        synchronous: As for `TrajectoryStore`.
    """

    def __init__(self, path: Path, *, synchronous: Literal["NORMAL", "FULL"] = "NORMAL"):
        self.path = Path(path)
        self._synchronous: Literal["NORMAL", "FULL"] = synchronous
        self._executor: ThreadPoolExecutor | None = None
        self._store: TrajectoryStore | None = None
        self._lifecycle = asyncio.Lock()  # start/stop racing each other must not double-open

    @property
    def store(self) -> TrajectoryStore:
        """The underlying synchronous store (for threads that are not the event loop)."""
        if self._store is None:
            raise StoreError(f"trajectory store {self.path} is not started")
        return self._store

    async def start(self) -> None:
        """Open the database on the writer thread (idempotent)."""
        async with self._lifecycle:
            if self._executor is not None:
                return
            executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="clora-trajectories")
            try:
                self._store = await asyncio.get_running_loop().run_in_executor(
                    executor, lambda: TrajectoryStore(self.path, synchronous=self._synchronous)
                )
            except BaseException:
                executor.shutdown(wait=False)
                raise
            self._executor = executor

    async def stop(self) -> None:
        """Finish queued operations, close the database and end the thread (idempotent)."""
        async with self._lifecycle:
            executor, store = self._executor, self._store
            if executor is None or store is None:
                return
            self._executor = None
            try:
                # Queued behind every pending write on the single worker: nothing is lost.
                await asyncio.get_running_loop().run_in_executor(executor, store.close)
            finally:
                self._store = None
                executor.shutdown(wait=False)

    async def _run(self, fn: Callable[[], _T]) -> _T:
        if self._executor is None:
            raise StoreError(f"trajectory store {self.path} is not started")
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    async def record(self, t: TrajectoryRecord) -> None:
        """See `TrajectoryStore.record`; returns once the transaction is committed."""
        store = self.store
        await self._run(lambda: store.record(t))

    async def get(self, id: str) -> TrajectoryRecord:
        """See `TrajectoryStore.get`."""
        store = self.store
        return await self._run(lambda: store.get(id))

    async def list(
        self, agent: str | None = None, *, limit: int = 100, before: float | None = None
    ) -> builtins.list[TrajectoryRecord]:
        """See `TrajectoryStore.list`."""
        store = self.store
        return await self._run(lambda: store.list(agent, limit=limit, before=before))

    async def count(self, agent: str | None = None) -> int:
        """See `TrajectoryStore.count`."""
        store = self.store
        return await self._run(lambda: store.count(agent))
