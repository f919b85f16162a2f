"""The stores as the operator tools open them: `clora store migrate` and `clora adapters prune`.

`migrate_stores` copies the SQLite files of a `clora serve` into an empty
PostgreSQL database (each store opened on the source and the target to create
or upgrade its tables); `prune_once` runs one retention pass on the settings'
registry (and, with a trajectory TTL, the trajectories).

Not here: the copy itself (`clora_feedback.store.migrate`), retention's rules
(`clora_feedback.store.retention`), the roles (`gateway`, `workers`).
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from clora_feedback.config import Settings
from clora_feedback.store.migrate import MigrationReport, StorePart, migrate_to_postgres
from clora_feedback.store.retention import Retention, RetentionReport


def migrate_stores(settings: Settings, url: str) -> MigrationReport:
    """Copy the stores of `settings` (SQLite under `data_dir`) into the empty database `url`.

    Raises:
        ConflictError: versions missing from `adapters_dir`, or a non-empty target.
    """
    check_version_dirs(settings)
    return migrate_to_postgres(store_parts(settings), url)


def prune_once(settings: Settings, keep_last: int | None = None) -> RetentionReport:
    """One retention pass on the stores of `settings` (`keep_last` overrides the setting)."""
    from clora_feedback.store.registry import AdapterRegistry
    from clora_feedback.store.trajectories import TrajectoryStore

    config = settings.retention
    if keep_last is not None:
        config = config.model_copy(update={"keep_last": keep_last})
    with AdapterRegistry(settings.adapters_dir, settings.registry_db_url) as registry:
        trajectories = None
        if config.trajectory_ttl_s is not None:
            trajectories = TrajectoryStore(settings.trajectory_db_url)
        try:
            return Retention(registry, config, trajectories=trajectories).run_once()
        finally:
            if trajectories is not None:
                trajectories.close()


def store_parts(settings: Settings) -> list[StorePart]:
    """The three stores of a `clora serve` with these settings, as migration parts."""
    from clora_feedback.feedback import tables as feedback_tables
    from clora_feedback.service.parts import open_stores
    from clora_feedback.store import trajectories
    from clora_feedback.store.migrate import StorePart
    from clora_feedback.store.registry import schema as registry_schema

    return [
        StorePart(
            component="trajectories",
            source=settings.trajectory_db,
            tables=tuple(trajectories.PG_TABLES),
            version_table="schema_version",
            open_store=lambda url: trajectories.TrajectoryStore(url),
        ),
        StorePart(
            component="feedback",
            source=settings.trajectory_db,
            tables=tuple(feedback_tables.PG_TABLES),
            version_table="feedback_schema",
            open_store=lambda url: open_stores(settings, url),
            seeded=("rejoin_cursor",),
        ),
        StorePart(
            component="registry",
            source=settings.registry_db,
            tables=tuple(registry_schema.PG_TABLES),
            version_table="schema_version",
            open_store=lambda url: _open_registry(url, settings.adapters_dir),
            seeded=("meta",),  # the store id claiming adapters_dir
        ),
    ]


def check_version_dirs(settings: Settings) -> None:
    """Refuse to migrate a registry whose version directories are not under `adapters_dir`.

    Read from the file before any store opens it: a wrong `--adapters-dir` would
    otherwise give the PostgreSQL registry versions that no process can load.

    Raises:
        ConflictError: some indexed versions have no directory (`version_dirs_missing`).
    """
    from clora_feedback.errors import ConflictError
    from clora_feedback.store.artifact import VersionDirs
    from clora_feedback.store.db import open_database

    if not settings.registry_db.is_file():
        return
    db = open_database(settings.registry_db)
    try:
        with db.read() as tx:
            rows = tx.execute("SELECT agent, version FROM versions").fetchall()
    finally:
        db.close()
    root = settings.adapters_dir
    # VersionDirs creates its root: a mistyped directory must not appear on disk.
    dirs = VersionDirs(root) if root.is_dir() else None
    missing = [f"{a}/{v}" for a, v in rows if dirs is None or not dirs.path(a, v).is_dir()]
    if missing:
        raise ConflictError(
            f"{settings.registry_db} indexes versions {missing[:5]} that {settings.adapters_dir} "
            "does not hold: pass the registry's adapters directory as --adapters-dir",
            code="version_dirs_missing",
        )


class _Closing:
    def __init__(self, close: Any) -> None:
        self.close = close


def _open_registry(url: str | Path, adapters_dir: Path) -> _Closing:
    """The registry on its SQLite file (over the real adapters_dir, so it upgrades and
    checks its claim), or its empty PostgreSQL tables.

    On the target, the registry is opened over a throwaway directory: the real
    `adapters_dir` holds versions the new database does not index yet, which the
    registry rightly refuses to adopt; the copy then replaces the throwaway claim
    (its store id) with the source's, so `adapters_dir` is claimed by the same id.
    """
    from clora_feedback.store.db import is_postgres_url
    from clora_feedback.store.registry import AdapterRegistry

    if not is_postgres_url(url):
        registry = AdapterRegistry(adapters_dir, Path(url), collect_on_open=False)
        return _Closing(registry.close)
    with _scratch_dir() as root:
        AdapterRegistry(root, url, collect_on_open=False).close()
    return _Closing(lambda: None)


@contextlib.contextmanager
def _scratch_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="clora-migrate-") as tmp:
        yield Path(tmp)
