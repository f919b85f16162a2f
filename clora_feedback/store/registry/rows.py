"""The adapter registry's row reads inside a transaction, and the checks a publish makes on them.

`AdapterRegistry` (see `registry`) owns the transactions; these functions run
inside one (`Tx`): read an agent's row (locked `FOR UPDATE` on PostgreSQL when
the caller is about to compare-and-set on it), read a version's row, and refuse
a publish whose agent is pinned or whose parent is not the active version, and
mark the versions retention prunes (`mark_pruned`).

Not here: the tables (`index`), the writes and the files (`registry`).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from clora_feedback.errors import ConflictError, GoneError, NotFoundError
from clora_feedback.store.db import Tx
from clora_feedback.store.registry.index import AGENT_COLUMNS, VERSION_COLUMNS


def version_not_found(agent: str, version: int, *, param: str = "version") -> NotFoundError:
    """The error for an unknown version (`param` names the request field)."""
    return NotFoundError(
        f"agent {agent!r} has no adapter version {version}", param=param, code="version_not_found"
    )


def version_pruned(agent: str, version: int) -> GoneError:
    """The error for a version whose payload retention pruned (410, `version_pruned`)."""
    return GoneError(
        f"agent {agent!r} version {version}: retention pruned its weights (its manifest and "
        "history are kept); it cannot be loaded or rolled back to",
        param="version",
        code="version_pruned",
    )


def mark_pruned(
    conn: Tx, agent: str, keep_last: int, keep: Collection[int], now: float
) -> list[int]:
    """Mark pruned every version of `agent` retention does not keep: not among the
    `keep_last` newest, not active, not in `keep`. Locks the agent's row (a rollback
    cannot interleave). Returns the versions marked now, ascending.

    Raises:
        NotFoundError: unknown agent.
    """
    active = require_agent(conn, agent, lock=True)[1]
    rows = conn.execute(
        "SELECT version, pruned_at FROM versions WHERE agent = ? ORDER BY version DESC", (agent,)
    ).fetchall()
    kept = {v for v, _ in rows[:keep_last]} | set(keep) | {active}
    doomed = sorted(v for v, pruned_at in rows if pruned_at is None and v not in kept)
    for version in doomed:
        conn.execute(
            "UPDATE versions SET pruned_at = ? WHERE agent = ? AND version = ?",
            (now, agent, version),
        )
    return doomed


def agent_row(conn: Tx, agent: str, *, lock: bool = False) -> tuple[Any, ...] | None:
    """(agent, active_version, last_version, pinned, activated_by, activated_at) or None.

    `lock` (inside a write): on PostgreSQL the row stays locked until the transaction
    ends, so a compare-and-set on it cannot interleave with another process's; SQLite's
    `BEGIN IMMEDIATE` already holds the only write lock.
    """
    sql = f"SELECT {AGENT_COLUMNS} FROM agents WHERE agent = ?"
    if lock and conn.dialect == "postgresql":
        sql += " FOR UPDATE"
    row: tuple[Any, ...] | None = conn.execute(sql, (agent,)).fetchone()
    return row


def require_agent(conn: Tx, agent: str, *, lock: bool = False) -> tuple[Any, ...]:
    """`agent_row`, or `NotFoundError` (`agent_not_found`) for an agent never seen."""
    row = agent_row(conn, agent, lock=lock)
    if row is None:
        raise NotFoundError(
            f"no adapter versions for agent {agent!r}", param="agent", code="agent_not_found"
        )
    return row


def version_row(conn: Tx, agent: str, version: int) -> tuple[Any, ...] | None:
    """The `versions` row (`VERSION_COLUMNS` order), or None."""
    row: tuple[Any, ...] | None = conn.execute(
        f"SELECT {VERSION_COLUMNS} FROM versions WHERE agent = ? AND version = ?",
        (agent, version),
    ).fetchone()
    return row


def check_publishable(
    conn: Tx, agent: str, parent: int | None, activate: bool, *, lock: bool = False
) -> None:
    """Refuse a publish on a pinned agent, an unknown parent, or (with `activate`) a parent
    that is not the active version.

    Raises:
        ConflictError: `agent_pinned` or `parent_not_active`.
        NotFoundError: `parent` is not a version of `agent`.
    """
    row = agent_row(conn, agent, lock=lock)
    active = None if row is None else row[1]
    if row is not None and row[3]:
        raise ConflictError(
            f"agent {agent!r} is pinned: training is frozen until it is unpinned",
            code="agent_pinned",
        )
    if parent is not None and version_row(conn, agent, parent) is None:
        raise version_not_found(agent, parent, param="parent")
    if activate and parent != active:
        raise ConflictError(
            f"agent {agent!r}: parent version {parent} is not the active version {active} "
            "(rolled back meanwhile?); reload the active version and train from it",
            code="parent_not_active",
        )
