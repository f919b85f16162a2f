"""Durable trajectory store: every served completion, on SQLite (WAL) or PostgreSQL.

A trajectory is what RL training needs from one request: the exact prompt and
completion token ids the engine used (never re-tokenised text), the behaviour
log-probability of every sampled token, and the adapter version that produced
each token. `TrajectoryStore` writes one trajectory per transaction and commits
before `record` returns, so a trajectory a client has seen survives a kill -9 of
the gateway (WAL with `synchronous=NORMAL`; use `FULL` to also survive power
loss). `AsyncTrajectoryStore` runs the same store for the gateway's event loop:
on one background thread, except a small SQLite write that can commit without
waiting, which commits on the loop (a thread hop costs more than the write).

Tables, the schema version and the v1 migration: `trajectory_tables` (SQLite or
PostgreSQL, through `store.db`).

Token ids and adapter versions are stored as little-endian int32 arrays, and
log-probabilities as little-endian float64 arrays (8 bytes per token, so the
floats round-trip bit for bit); this is ~4-6x smaller than JSON text and decodes
with one `array.frombytes` call.

Migrations run on open, in one transaction (SQLite only: a PostgreSQL database
starts at the current version): v1 -> v2 adds the indexed column
`conversation_id` (the request's `metadata.conversation_id` if a string),
backfilled from the stored request JSON. Other stores read this one only
through its methods (`exists`, `get_many`, `by_conversation`, `recorded_since`).

Deletion (`delete`: by agent, conversation or age, in bounded transactions)
removes a completion and its samples for good: a deleted completion is as if
never stored, so feedback joins never find it (an event naming it parks, then
dies after the park TTL) and it never becomes a training sample.

Deliberately not here: rewards and feedback (joined later by the ingest side),
training batches, when to delete (`store.retention`, the admin route).
"""

from __future__ import annotations

import asyncio
import builtins
import json
import logging
import os
import sys
from array import array
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

from clora_feedback.errors import ConflictError, InvalidRequestError, NotFoundError, StoreError
from clora_feedback.lifecycle import AsyncLifecycle, Closing
from clora_feedback.store import trajectory_tables
from clora_feedback.store.db import (
    Tx,
    database_file,
    is_postgres_url,
    open_store,
    redact,
    url_file,
)
from clora_feedback.store.sql import LOCK_TRAJECTORIES, in_chunks, serialize_writers

SCHEMA_VERSION = trajectory_tables.SCHEMA_VERSION
PG_TABLES = trajectory_tables.PG_TABLES
_COMPLETION_COLUMNS = trajectory_tables.COMPLETION_COLUMNS
_SAMPLE_COLUMNS = trajectory_tables.SAMPLE_COLUMNS
COUNTS_SINCE = "SELECT agent || '', count(*) FROM completions WHERE created_at >= ? GROUP BY 1"
"""Trajectories per agent since a time (`counts_since`); a test reads its query plan. Grouping
by an expression keeps SQLite on `completions_by_time`: grouping by the bare column makes it
scan all of `completions_by_agent_time` instead (in agent order, to skip a sort)."""
_T = TypeVar("_T")
_log = logging.getLogger(__name__)


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

    @property
    def metadata(self) -> dict[str, str]:
        """The request's `metadata` (OpenAI's up to 16 string pairs), stored with the request
        JSON; `conversation_id` also has its own indexed column. Empty when none was sent."""
        metadata = self.request.get("metadata")
        if not isinstance(metadata, dict):
            return {}
        return {k: v for k, v in metadata.items() if isinstance(v, str)}


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


_Rows = tuple[tuple[Any, ...], builtins.list[tuple[Any, ...]]]


def _rows(t: TrajectoryRecord) -> _Rows:
    """The `completions` row and the `samples` rows of `t` (serialised before any lock)."""
    completion = (
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
    samples = [
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
    return completion, samples


def _insert(tx: Tx, id: str, rows: _Rows) -> None:
    completion, samples = rows
    # PostgreSQL: writers queue here so `seq` values commit in the order drawn and a
    # `recorded_since` reader's cursor never passes a row that commits later.
    serialize_writers(tx, LOCK_TRAJECTORIES)
    inserted = tx.execute(
        f"INSERT INTO completions ({_COMPLETION_COLUMNS}, conversation_id) "
        "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (id) DO NOTHING",
        completion,
    )
    if inserted.rowcount == 0:
        raise ConflictError(f"trajectory {id!r} is already recorded", code="duplicate_id")
    tx.executemany(
        f"INSERT INTO samples ({_SAMPLE_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?)", samples
    )


class TrajectoryStore(Closing):
    """Synchronous store of `TrajectoryRecord`s on SQLite or PostgreSQL; safe to share across threads.

    SQLite: one connection guarded by a lock (SQLite serialises writers anyway, and
    WAL lets other processes, e.g. a trainer, read while this one writes).
    PostgreSQL: a connection pool; the stores of several processes share the database.

    Args:
        url: a database file (parent directories are created), `sqlite:///abs/path.db`,
            or `postgresql://...` (see `store.db.open_database`).
        synchronous: SQLite: `NORMAL` survives process crashes; `FULL` also power loss.
        auto_checkpoint: SQLite: False leaves WAL checkpoints to `checkpoint()` (the
            owner runs them off its hot path) and lets `record_nowait` write.

    Raises:
        StoreError: The database cannot be opened, is not in WAL mode, or was
            written by a newer schema.
    """

    def __init__(
        self,
        url: str | os.PathLike[str],
        *,
        synchronous: Literal["NORMAL", "FULL"] = "NORMAL",
        auto_checkpoint: bool = True,
    ):
        if synchronous not in ("NORMAL", "FULL"):
            raise ValueError(f"synchronous must be NORMAL or FULL, not {synchronous!r}")
        self._db = open_store(
            url,
            trajectory_tables.init_schema,
            sqlite_synchronous=synchronous,
            sqlite_autocheckpoint=auto_checkpoint,
        )
        self.url = self._db.display_url
        # Positions for `recorded_since`: SQLite's rowid, PostgreSQL's identity column.
        self._position = "rowid" if self._db.dialect == "sqlite" else "seq"

    @property
    def path(self) -> Path:
        """The SQLite file.

        Raises:
            StoreError: the store is on PostgreSQL (no file; see `url`).
        """
        return database_file(self._db, "trajectory store")

    # -- writes -----------------------------------------------------------------

    def record(self, t: TrajectoryRecord) -> None:
        """Insert one trajectory and its samples in one transaction, committed on return.

        Raises:
            ConflictError: A trajectory with the same id already exists.
            StoreError: The database failed (disk full, I/O error, closed store).
            TypeError: `t.request` holds values that are not JSON-serialisable.
        """
        rows = _rows(t)
        with self._db.write() as tx:
            _insert(tx, t.id, rows)

    def record_nowait(self, t: TrajectoryRecord) -> bool:
        """`record(t)` if it can commit without waiting on a lock or the disk; else False and
        nothing is written (see `store.db.Database.write_nowait`: only SQLite with
        `synchronous=NORMAL` and `auto_checkpoint=False`, when no other writer holds the lock).

        Raises:
            As `record`.
        """
        rows = _rows(t)
        with self._db.write_nowait() as tx:
            if tx is None:
                return False
            _insert(tx, t.id, rows)
        return True

    def delete(
        self,
        *,
        agent: str | None = None,
        conversation_id: str | None = None,
        before: float | None = None,
        batch: int = 1000,
    ) -> int:
        """Delete the trajectories matching every filter given, `batch` per transaction.

        Args:
            agent: only this agent's.
            conversation_id: only this conversation's (`metadata.conversation_id`).
            before: only those captured before this time (seconds since the epoch).
            batch: completions deleted per transaction (bounds each write lock).

        Returns:
            How many were deleted.

        Raises:
            InvalidRequestError: no filter given (deleting everything is not offered).
            StoreError: the database failed (transactions already committed stay).
        """
        where, params = self._filters(agent, before)
        if conversation_id is not None:
            where += (" AND " if where else "WHERE ") + "conversation_id = ?"
            params = (*params, conversation_id)
        if not where:
            raise InvalidRequestError(
                "name an agent, a conversation_id or an age to delete", param="agent"
            )
        total = 0
        while True:
            with self._db.write() as tx:
                ids = [
                    row[0]
                    for row in tx.execute(
                        f"SELECT id FROM completions {where} LIMIT ?", (*params, batch)
                    )
                ]
                for chunk, marks in in_chunks(ids):
                    tx.execute(
                        f"DELETE FROM samples WHERE completion_id IN ({marks})", tuple(chunk)
                    )
                    tx.execute(f"DELETE FROM completions WHERE id IN ({marks})", tuple(chunk))
            total += len(ids)
            if len(ids) < batch:
                return total

    def checkpoint(self) -> None:
        """Copy committed WAL pages into the database file (SQLite, PASSIVE; PostgreSQL: no-op).

        Raises:
            StoreError: SQLite failed.
        """
        self._db.checkpoint()

    # -- reads ------------------------------------------------------------------

    def get(self, id: str) -> TrajectoryRecord:
        """Return the trajectory with completion id `id`.

        Raises:
            NotFoundError: No trajectory has that id.
            StoreError: SQLite failed.
        """
        with self._db.read() as tx:
            row = tx.execute(
                f"SELECT {_COMPLETION_COLUMNS} FROM completions WHERE id = ?", (id,)
            ).fetchone()
            if row is None:
                raise NotFoundError(f"no trajectory with id {id!r}", code="trajectory_not_found")
            samples = tx.execute(
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
            f"ORDER BY created_at DESC, {self._position} DESC LIMIT ?"
        )
        with self._db.read() as tx:
            rows = tx.execute(query, (*params, limit)).fetchall()
            by_id = self._samples_of(tx, [r[0] for r in rows])
        return [_to_record(r, by_id[r[0]]) for r in rows]

    def exists(self, ids: Iterable[str]) -> set[str]:
        """The subset of `ids` that are stored.

        Raises:
            StoreError: SQLite failed.
        """
        found: set[str] = set()
        with self._db.read() as tx:
            for chunk, marks in in_chunks(ids):
                query = f"SELECT id FROM completions WHERE id IN ({marks})"
                found.update(r[0] for r in tx.execute(query, chunk))
        return found

    def get_many(self, ids: Iterable[str]) -> dict[str, TrajectoryRecord]:
        """The stored trajectories among `ids`, by id (ids not stored are absent).

        A few queries for any number of ids (chunked `IN`), not one per id.

        Raises:
            StoreError: SQLite failed.
        """
        with self._db.read() as tx:
            rows: builtins.list[tuple[Any, ...]] = []
            for chunk, marks in in_chunks(ids):
                rows += tx.execute(
                    f"SELECT {_COMPLETION_COLUMNS} FROM completions WHERE id IN ({marks})", chunk
                ).fetchall()
            by_id = self._samples_of(tx, [r[0] for r in rows])
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
        with self._db.read() as tx:
            rows = tx.execute(f"{query} ORDER BY created_at, {self._position}", params).fetchall()
        return [r[0] for r in rows]

    def recorded_since(
        self, position: int, limit: int
    ) -> builtins.list[tuple[int, str, str | None]]:
        """(position, id, conversation_id) of up to `limit` completions recorded after `position`.

        Positions are SQLite rowids or PostgreSQL `seq` values: writers commit one at a
        time (`record` serialises them on PostgreSQL), so they grow in commit order and a
        reader's cursor never skips one (the feedback rejoin relies on it).
        """
        column = self._position
        with self._db.read() as tx:
            rows = tx.execute(
                f"SELECT {column}, id, conversation_id FROM completions WHERE {column} > ? "
                f"ORDER BY {column} LIMIT ?",
                (position, limit),
            ).fetchall()
        return [(int(r[0]), r[1], r[2]) for r in rows]

    @staticmethod
    def _samples_of(tx: Tx, ids: builtins.list[str]) -> dict[str, builtins.list[SampleRecord]]:
        """Samples of each completion in `ids`, in index order (inside the caller's read)."""
        by_id: dict[str, builtins.list[SampleRecord]] = {i: [] for i in ids}
        for chunk, marks in in_chunks(ids):
            for s in tx.execute(
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
        with self._db.read() as tx:
            row = tx.execute(f"SELECT count(*) FROM completions {where}", params).fetchone()
        return int(row[0])

    def counts_since(self, since: float) -> dict[str, int]:
        """Trajectories per agent created at or after `since` (seconds since the epoch);
        agents with none are absent. One grouped read on the `completions_by_time` index
        (the console's requests per minute).

        Raises:
            StoreError: the database failed.
        """
        with self._db.read() as tx:
            rows = tx.execute(COUNTS_SINCE, (since,)).fetchall()
        return {agent: int(n) for agent, n in rows}

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
        self._db.close()


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
    """`TrajectoryStore` for asyncio code: reads, and writes that may wait, on one thread.

    The store's calls run on one dedicated worker thread, so the event loop never
    waits on a lock, a network round trip or an fsync. One exception keeps a
    completion's own latency low: on SQLite with `synchronous=NORMAL` (the default)
    a `record` of at most `inline_max_tokens` tokens commits on the event loop
    itself when it can do so without waiting (no other thread or process holds the
    write lock): such a commit is a write into the OS page cache, ~0.2 ms here,
    where the hop to the worker and back costs more than that on a busy core. The
    store then runs no automatic WAL checkpoint (whose fsyncs would land on the
    loop); the worker runs one after every `checkpoint_every` records instead.
    Either way `record` returns only once the transaction is committed, so the
    durability is the same. Writes from concurrent requests may commit in another
    order than they were submitted.

    Use as `async with AsyncTrajectoryStore(path) as store:` or call `start()` /
    `stop()`. A cancelled `await store.record(...)` does not undo a write that has
    begun: the record may still be committed.

    Args:
        url: As for `TrajectoryStore` (a file path, `sqlite:///...` or `postgresql://...`).
        synchronous: As for `TrajectoryStore` (`FULL`: every write goes to the worker).
        inline_max_tokens: The most prompt plus completion tokens a record may have to be
            written on the event loop; 0 sends every write to the worker.
        checkpoint_every: Records between the worker's WAL checkpoints when writes run
            inline (SQLite).
    """

    def __init__(
        self,
        url: str | os.PathLike[str],
        *,
        synchronous: Literal["NORMAL", "FULL"] = "NORMAL",
        inline_max_tokens: int = 4096,
        checkpoint_every: int = 512,
    ):
        if inline_max_tokens < 0 or checkpoint_every < 1:
            raise ValueError("inline_max_tokens must be >= 0 and checkpoint_every >= 1")
        self._url = url
        self.url = redact(os.fspath(url))
        self._synchronous: Literal["NORMAL", "FULL"] = synchronous
        self._inline_max_tokens = inline_max_tokens
        self._inline = (
            inline_max_tokens > 0 and synchronous == "NORMAL" and not is_postgres_url(url)
        )
        self._checkpoint_every = checkpoint_every
        self._since_checkpoint = 0
        self._checkpoint: asyncio.Future[None] | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._store: TrajectoryStore | None = None
        self._lifecycle = asyncio.Lock()  # start/stop racing each other must not double-open

    @property
    def inline_writes(self) -> bool:
        """Whether `record` may commit on the event loop (SQLite, `NORMAL`, a token limit)."""
        return self._inline

    @property
    def path(self) -> Path:
        """The SQLite file.

        Raises:
            StoreError: the store is on PostgreSQL (no file; see `url`).
        """
        return url_file(self._url, "trajectory store")

    @property
    def store(self) -> TrajectoryStore:
        """The underlying synchronous store (for threads that are not the event loop)."""
        if self._store is None:
            raise StoreError(f"trajectory store {self.url} is not started")
        return self._store

    async def start(self) -> None:
        """Open the database on the writer thread (idempotent)."""
        async with self._lifecycle:
            if self._executor is not None:
                return
            executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="clora-trajectories")
            auto_checkpoint = not self.inline_writes
            try:
                self._store = await asyncio.get_running_loop().run_in_executor(
                    executor,
                    lambda: TrajectoryStore(
                        self._url, synchronous=self._synchronous, auto_checkpoint=auto_checkpoint
                    ),
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
            raise StoreError(f"trajectory store {self.url} is not started")
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    async def record(self, t: TrajectoryRecord) -> None:
        """See `TrajectoryStore.record`; returns once the transaction is committed.

        On the event loop when it cannot wait (see the class docstring), else on the worker.
        """
        store = self.store
        if not self.inline_writes:
            await self._run(lambda: store.record(t))
            return
        tokens = len(t.prompt_token_ids) + sum(len(s.completion_token_ids) for s in t.samples)
        if tokens > self._inline_max_tokens or not store.record_nowait(t):
            await self._run(lambda: store.record(t))
        self._since_checkpoint += 1
        executor = self._executor
        if (
            self._since_checkpoint >= self._checkpoint_every
            and self._checkpoint is None
            and executor is not None
        ):
            self._since_checkpoint = 0
            # Queued on the worker now, so a `stop()` that follows closes the store after it.
            self._checkpoint = asyncio.get_running_loop().run_in_executor(
                executor, store.checkpoint
            )
            self._checkpoint.add_done_callback(self._checkpointed)

    def _checkpointed(self, done: asyncio.Future[None]) -> None:
        self._checkpoint = None
        if not done.cancelled() and (exc := done.exception()) is not None:
            # The WAL keeps every commit; the next checkpoint (or the close) copies it.
            _log.warning("trajectory store %s: WAL checkpoint failed: %s", self.url, exc)

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

    async def counts_since(self, since: float) -> dict[str, int]:
        """See `TrajectoryStore.counts_since`."""
        store = self.store
        return await self._run(lambda: store.counts_since(since))

    async def delete(
        self,
        *,
        agent: str | None = None,
        conversation_id: str | None = None,
        before: float | None = None,
    ) -> int:
        """See `TrajectoryStore.delete` (on the store's worker, after pending writes)."""
        store = self.store
        return await self._run(
            lambda: store.delete(agent=agent, conversation_id=conversation_id, before=before)
        )
