"""The adapter registry's index (SQLite or PostgreSQL): its tables, and what a row means.

`AdapterRegistry` owns the connection, the transactions and every write (see
`registry`); this module holds the plain parts it reads them with: the table
definitions (`SCHEMA`, version `SCHEMA_VERSION`), the version columns in the
order `version_info` decodes them, the JSON encoding of metrics and feedback
windows, and the status rule.

A version's status is computed from the agent's pointer and the version's
rollback mark, never stored:

- `active`: the pointer names it;
- `rolled_back`: a rollback past it marked it (the mark wins over the rest);
- `superseded`: older than the active version;
- `staged`: newer than the active version, or published while no version was
  active, and never activated since (e.g. `publish(activate=False)`);
- `inactive`: it existed when an unload pointed the agent at no version (the
  base model serves the agent); a rollback to it activates it again.

Not here: connections, transactions, files (see `registry`, `artifact`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clora_feedback.errors import InvalidRequestError
from clora_feedback.store.versions import VersionInfo, VersionStatus

SCHEMA_VERSION = 3  # 1: these tables; 2: + the trainer leases (`lease.TABLES`);
# 3: + versions.pruned_at, versions.probe (`MIGRATE_V3`)
# The same tables in both dialects: `{real}` is REAL in SQLite, DOUBLE PRECISION on
# PostgreSQL; SQLite keeps `versions` WITHOUT ROWID.
_TABLES = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS agents (
    agent TEXT PRIMARY KEY,
    active_version INTEGER,
    last_version INTEGER NOT NULL DEFAULT 0,
    pinned INTEGER NOT NULL DEFAULT 0,
    activated_by TEXT CHECK (activated_by IN ('publish', 'rollback')),
    activated_at {real},
    created_at {real} NOT NULL
);
CREATE TABLE IF NOT EXISTS versions (
    agent TEXT NOT NULL REFERENCES agents (agent),
    version INTEGER NOT NULL,
    parent INTEGER,
    step INTEGER NOT NULL,
    base_model TEXT NOT NULL,
    content_hash TEXT NOT NULL,
    metrics TEXT NOT NULL,
    feedback_window TEXT,
    has_optimizer_state INTEGER NOT NULL,
    created_at {real} NOT NULL,
    rolled_back_at {real},
    rolled_back_reason TEXT,
    pruned_at {real},
    probe TEXT,
    PRIMARY KEY (agent, version)
){end}
"""
SCHEMA = "\nCREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL);" + _TABLES.format(
    real="REAL", end=" WITHOUT ROWID;"
)
# On PostgreSQL the schema version is component `registry` of the shared `clora_schema`
# table (the trajectory store also has a table named `schema_version` in SQLite, and on
# PostgreSQL every store shares one database).
PG_SCHEMA = _TABLES.format(real="DOUBLE PRECISION", end="")
MIGRATE_V3 = {"pruned_at": "REAL", "probe": "TEXT"}
"""Columns version 3 adds to `versions` (PostgreSQL: `DOUBLE PRECISION` for REAL):
when the version's payload was pruned (retention), and the no-op probe's result (JSON)."""
PG_TABLES = ("meta", "agents", "versions")
"""The registry's tables on PostgreSQL, parents first (its schema version: `clora_schema`)."""
RELEASE_TABLES = ("releases",)
"""The release states' table (`releases.ReleaseBook`), created if missing on every open."""


def release_schema(dialect: str) -> str:
    """The `releases` table and its index by state (the release loop's reads) in `dialect`
    (`CREATE ... IF NOT EXISTS`: run on every open)."""
    real = "DOUBLE PRECISION" if dialect == "postgresql" else "REAL"
    return f"""
CREATE TABLE IF NOT EXISTS releases (
    agent TEXT NOT NULL,
    version INTEGER NOT NULL,
    state TEXT NOT NULL,
    share {real},
    serving INTEGER,
    evidence TEXT NOT NULL,
    updated_at {real} NOT NULL,
    PRIMARY KEY (agent, version)
);
CREATE INDEX IF NOT EXISTS releases_by_state ON releases (state)"""


AGENT_COLUMNS = "agent, active_version, last_version, pinned, activated_by, activated_at"
"""The `agents` columns, in the order `Pointer.of` and the registry read a row."""
VERSION_COLUMNS = (
    "agent, version, parent, step, base_model, content_hash, metrics, feedback_window, "
    "has_optimizer_state, created_at, rolled_back_at, rolled_back_reason, pruned_at, probe"
)
"""The `versions` columns, in the order `version_info` reads a row."""


@dataclass(frozen=True)
class Pointer:
    """An agent's active pointer, as a version's status needs it.

    Attributes:
        active: the active version; None when none is.
        moved_at: when the pointer last moved (`agents.activated_at`); with `active`
            None, a set time means an unload pointed the agent at no version then.
    """

    active: int | None
    moved_at: float | None

    @classmethod
    def of(cls, agent_row: tuple[Any, ...]) -> Pointer:
        """From `(agent, active_version, last_version, pinned, activated_by, activated_at)`."""
        return cls(active=agent_row[1], moved_at=agent_row[5])


def version_status(
    version: int, created_at: float, rolled_back_at: float | None, pointer: Pointer
) -> VersionStatus:
    """The status rule of the module docstring."""
    if version == pointer.active:
        return "active"
    if rolled_back_at is not None:
        return "rolled_back"
    if pointer.active is not None:
        return "superseded" if version < pointer.active else "staged"
    if pointer.moved_at is not None and created_at <= pointer.moved_at:
        return "inactive"
    return "staged"


def version_info(row: tuple[Any, ...], pointer: Pointer, path: Path) -> VersionInfo:
    """Decode a `versions` row (`VERSION_COLUMNS` order) stored under `path`."""
    agent, version, parent, step, base_model, digest, metrics, window = row[:8]
    has_optimizer_state, created_at, rolled_back_at, reason, pruned_at, probe = row[8:]
    return VersionInfo(
        agent=agent,
        version=version,
        parent=parent,
        step=step,
        status=version_status(version, created_at, rolled_back_at, pointer),
        created_at=created_at,
        metrics=json.loads(metrics),
        feedback_window=None if window is None else json.loads(window),
        content_hash=digest,
        base_model=base_model,
        path=path,
        has_optimizer_state=bool(has_optimizer_state),
        rolled_back_at=rolled_back_at,
        rolled_back_reason=reason,
        pruned_at=pruned_at,
        probe=None if probe is None else json.loads(probe),
    )


def finite_metrics(metrics: Mapping[str, float]) -> dict[str, float | None]:
    """`metrics` as JSON can hold them."""
    # JSON (and so the admin API) has no NaN or infinity: a diverged loss is recorded as null.
    out: dict[str, float | None] = {}
    for key, value in metrics.items():
        number = float(value)
        out[str(key)] = number if math.isfinite(number) else None
    return out


def json_object(value: Mapping[str, Any] | None, *, param: str) -> str | None:
    """`value` as canonical JSON text (None stays None).

    Raises:
        InvalidRequestError: `value` is not JSON-serialisable (`param` names it).
    """
    if value is None:
        return None
    try:
        return json.dumps(dict(value), allow_nan=False, sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise InvalidRequestError(f"{param} must be JSON-serialisable: {exc}", param=param) from exc
