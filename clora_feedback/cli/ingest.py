"""`clora ingest`: one Kafka feedback consumer as its own process, until SIGTERM/SIGINT.

    clora ingest --db var/trajectories.db --bootstrap kafka:9092 [--config settings.yaml]
    clora ingest --store-url postgresql://user:pw@db:5432/clora --bootstrap kafka:9092

Run several (same `--group-id`) to share the partitions; on a SQLite file they
must share one machine, on PostgreSQL (`--store-url`, or the settings'
`store_url`) any number of machines. With neither flag the store is the
settings' (`store_url`, else `<data_dir>/trajectories.db`). Topics, the group,
the batch size, the parked-event TTL and the reward mapping come from the
settings (file and `CLORA_*` environment); the flags here override them. The
consumer dead-letters to the settings' dead-letter topic. On exit it prints its
counters as one JSON line on stdout.

Exit status: 0 after a clean stop, 1 when the consumer failed for good.

Not here: building the worker (`clora_feedback.service.build_ingest_worker`), the
consumer's semantics (`clora_feedback.feedback.kafka`), the ingest component
(`clora_feedback.feedback.ingest`), the other commands (`main`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # settings load only when the command runs
    from clora_feedback.config import Settings

log = logging.getLogger(__name__)


def add_ingest_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `ingest` to the `clora` parser's subcommands (sets `func`)."""
    p = subparsers.add_parser(
        "ingest",
        help="Consume the feedback topics into the feedback store (a Kafka consumer worker).",
        description="Consume feedback topics into the feedback store until SIGTERM/SIGINT.",
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument("--db", type=Path, help="SQLite database (trajectory_db_path)")
    where.add_argument(
        "--store-url",
        help="PostgreSQL store postgresql://user:password@host:port/database "
        "(default: the settings' store_url, else <data_dir>/trajectories.db)",
    )
    p.add_argument(
        "--bootstrap", help="Kafka bootstrap servers host:port[,...] (default: settings)"
    )
    p.add_argument("--config", type=Path, help="settings file (JSON/YAML) for topics and rewards")
    p.add_argument("--group-id", help="consumer group (default from settings)")
    p.add_argument("--max-batch", type=int, help="records per transaction (default from settings)")
    p.add_argument("--agents", help="comma-separated accepted agents (default: settings, or any)")
    p.add_argument("--park-ttl-s", type=float, help="parked-event TTL (default from settings)")
    p.add_argument("--rejoin-interval-s", type=float, help="feedback.rejoin_interval_s")
    p.add_argument("--session-timeout-ms", type=int, help="feedback.kafka.session_timeout_ms")
    p.add_argument("--heartbeat-interval-ms", type=int, help="feedback.kafka.heartbeat_interval_ms")
    p.add_argument("--commit-delay-s", type=float, help="feedback.kafka.commit_delay_s (tests)")
    p.set_defaults(func=run_ingest)


def run_ingest(args: argparse.Namespace) -> int:
    """Run one consumer; prints its metrics as JSON on exit. Returns the exit status."""
    from clora_feedback.cli.common import until_signalled
    from clora_feedback.errors import CloraError
    from clora_feedback.service import build_ingest_worker

    try:
        worker = build_ingest_worker(ingest_settings(args))
        asyncio.run(until_signalled(worker.run))
    except CloraError as exc:
        log.error("feedback consumer failed: %s", exc.message)
        return 1
    print(json.dumps(worker.consumer.metrics.as_dict()), flush=True)
    return 0


def ingest_settings(args: argparse.Namespace) -> Settings:
    """The settings (file, environment) with this command's flags laid over them."""
    from clora_feedback.cli.common import checked_store_url
    from clora_feedback.config import load_settings

    kafka = {
        "bootstrap_servers": args.bootstrap,
        "group_id": args.group_id,
        "max_batch": args.max_batch,
        "session_timeout_ms": args.session_timeout_ms,
        "heartbeat_interval_ms": args.heartbeat_interval_ms,
        "commit_delay_s": args.commit_delay_s,
    }
    feedback = {"kafka": kafka, "park_ttl_s": args.park_ttl_s, "rejoin_interval_s": args.rejoin_interval_s}  # fmt: skip
    agents = [{"name": a} for a in args.agents.split(",") if a] if args.agents else None
    return load_settings(
        args.config,
        store_url=checked_store_url(args.store_url),
        trajectory_db_path=args.db,
        feedback=feedback,
        agents=agents,
    )
