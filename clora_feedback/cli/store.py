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

Not here: which stores and how each opens (`clora_feedback.service.maintenance`), the copy
(`clora_feedback.store.migrate`), the stores' tables (each store).
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

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
    from clora_feedback.service.maintenance import migrate_stores

    try:
        settings = load_settings(
            args.config, data_dir=args.data_dir, adapters_dir=args.adapters_dir
        )
        report = migrate_stores(settings, args.to)
    except CloraError as exc:
        log.error("store migration failed: %s", exc.message)
        return 1
    print(json.dumps(report.as_dict()), flush=True)
    return 0
