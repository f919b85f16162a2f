"""`clora store migrate`: move the SQLite store files into PostgreSQL, once, offline.

    clora store migrate --to postgresql://user:pw@db:5432/clora [--data-dir var]
                        [--adapters-dir adapters] [--config settings.yaml]

Copies `<data_dir>/trajectories.db` (trajectories and feedback: events, joins,
parked events, dead letters, the rejoin cursor) and `<data_dir>/registry.db`
(agents, versions, active pointers, pins, the adapter directory's store id) into
an empty PostgreSQL database, keeping every id, position and schema version, and
prints what it copied as one JSON line. Stop `clora serve` and `clora ingest`
first; afterwards set `store_url` to the same URL. The adapter version
directories stay in `adapters_dir`, which every process then mounts.

Exit status: 0 after a verified copy; 1 when it was refused (a non-empty target,
or versions missing from `--adapters-dir`) or failed (rolled back: the target
keeps only empty tables).

Not here: the copy (`clora_feedback.store.migrate`), the stores' tables (each store).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the stores load only when the command runs
    from clora_feedback.config import Settings
    from clora_feedback.store.migrate import StorePart

log = logging.getLogger(__name__)


def add_store_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `store` and its actions to the `clora` parser's subcommands (sets `func`)."""
    parser = subparsers.add_parser(
        "store", help="Manage the durable stores (migrate to PostgreSQL)."
    )
    actions = parser.add_subparsers(dest="store_action", required=True)
    migrate = actions.add_parser(
        "migrate",
        help="Copy the SQLite store files into an empty PostgreSQL database.",
        description="Copy trajectories, feedback and the adapter registry from the SQLite "
        "files under --data-dir into an empty PostgreSQL database (ids, cursors and schema "
        "versions kept; verified by row counts). Stop every clora process first.",
    )
    migrate.add_argument("--to", required=True, help="postgresql://user:password@host:port/db")
    migrate.add_argument("--config", type=Path, help="settings file (JSON/YAML)")
    migrate.add_argument("--data-dir", type=Path, help="the SQLite files (default: settings)")
    migrate.add_argument(
        "--adapters-dir", type=Path, help="the adapter version directories (default: settings)"
    )
    migrate.set_defaults(func=run_store)


def run_store(args: argparse.Namespace) -> int:
    """Run `clora store <action>`; returns the exit status."""
    from clora_feedback.config import load_settings
    from clora_feedback.errors import CloraError
    from clora_feedback.store.migrate import migrate_to_postgres

    try:
        settings = load_settings(
            args.config, data_dir=args.data_dir, adapters_dir=args.adapters_dir
        )
        check_version_dirs(settings)
        report = migrate_to_postgres(store_parts(settings), args.to)
    except CloraError as exc:
        log.error("store migration failed: %s", exc.message)
        return 1
    print(json.dumps(report.as_dict()), flush=True)
    return 0


def store_parts(settings: Settings) -> list[StorePart]:
    """The three stores of a `clora serve` with these settings, as migration parts."""
    from clora_feedback.feedback import tables as feedback_tables
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
            open_store=lambda url: _FeedbackStores(url, settings),
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


class _FeedbackStores:
    """A feedback store with the trajectory store it joins through; closes both."""

    def __init__(self, url: str | Path, settings: Settings) -> None:
        from clora_feedback.feedback.rewards import DefaultRewardPolicy
        from clora_feedback.feedback.store import FeedbackStore
        from clora_feedback.store.trajectories import TrajectoryStore

        self._trajectories = TrajectoryStore(url)
        try:
            self._feedback = FeedbackStore(
                url,
                trajectories=self._trajectories,
                policy=DefaultRewardPolicy(settings.feedback),
            )
        except BaseException:
            self._trajectories.close()
            raise

    def close(self) -> None:
        self._feedback.close()
        self._trajectories.close()


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
