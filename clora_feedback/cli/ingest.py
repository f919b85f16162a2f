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

Not here: the consumer's semantics (`clora_feedback.feedback.kafka`), the
ingest component (`clora_feedback.feedback.ingest`), the other commands (`main`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the Kafka client and stores load only when the command runs
    from clora_feedback.config import FeedbackConfig, Settings
    from clora_feedback.feedback.kafka import ConsumerMetrics, FeedbackConsumer

log = logging.getLogger(__name__)


def add_ingest_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `ingest` to the `clora` parser's subcommands (sets `func`)."""
    p = subparsers.add_parser(
        "ingest",
        help="Consume the feedback topics into the feedback store (a Kafka consumer worker).",
        description="Consume feedback topics into the feedback store until SIGTERM/SIGINT.",
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument("--db", type=Path, help="SQLite database (trajectories.db)")
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
    p.add_argument("--rejoin-interval-s", type=float, default=2.0)
    p.add_argument("--session-timeout-ms", type=int, default=10_000)
    p.add_argument("--heartbeat-interval-ms", type=int, default=3_000)
    p.add_argument("--commit-delay-s", type=float, default=0.0, help="fault injection (tests)")
    p.set_defaults(func=run_ingest)


def run_ingest(args: argparse.Namespace) -> int:
    """Run one consumer; prints its metrics as JSON on exit. Returns the exit status."""
    from clora_feedback.errors import CloraError

    try:
        metrics = asyncio.run(_serve(args))
    except CloraError as exc:
        log.error("feedback consumer failed: %s", exc.message)
        return 1
    print(json.dumps(metrics.as_dict()), flush=True)
    return 0


def feedback_settings(args: argparse.Namespace, settings: Settings) -> FeedbackConfig:
    """The settings' feedback section with the command-line overrides applied."""
    feedback = settings.feedback
    kafka_updates = {
        k: v
        for k, v in (
            ("group_id", args.group_id),
            ("max_batch", args.max_batch),
            ("bootstrap_servers", args.bootstrap),
        )
        if v is not None
    }
    updates: dict[str, object] = {"kafka": feedback.kafka.model_copy(update=kafka_updates)}
    if args.park_ttl_s is not None:
        updates["park_ttl_s"] = args.park_ttl_s
    return feedback.model_copy(update=updates)


async def _serve(args: argparse.Namespace) -> ConsumerMetrics:
    from clora_feedback.config import load_settings
    from clora_feedback.errors import InvalidRequestError
    from clora_feedback.feedback.kafka import build_consumer
    from clora_feedback.feedback.rewards import DefaultRewardPolicy
    from clora_feedback.feedback.store import FeedbackStore
    from clora_feedback.store.trajectories import TrajectoryStore

    settings = load_settings(args.config)
    feedback = feedback_settings(args, settings)
    bootstrap = feedback.kafka.bootstrap_servers
    if bootstrap is None:
        raise InvalidRequestError("no Kafka cluster: give --bootstrap", param="bootstrap")
    names = (
        {a for a in args.agents.split(",") if a}
        if args.agents
        else {a.name for a in settings.agents}
    )
    if args.store_url is not None:  # validated (scheme) like the setting itself
        settings = settings.model_copy(update={"store_url": _checked_url(args.store_url)})
    db = args.db if args.db is not None else settings.trajectory_db_url
    trajectories = TrajectoryStore(db)
    store = FeedbackStore(db, trajectories=trajectories, policy=DefaultRewardPolicy(feedback))
    consumer = build_consumer(
        store,
        feedback,
        bootstrap,
        known_agents=(lambda: names) if names else None,
        rejoin_interval_s=args.rejoin_interval_s,
        session_timeout_ms=args.session_timeout_ms,
        heartbeat_interval_ms=args.heartbeat_interval_ms,
        commit_delay_s=args.commit_delay_s,
    )
    try:
        await _run_until_signalled(consumer)
    finally:
        store.close()
        trajectories.close()
    return consumer.metrics


def _checked_url(url: str) -> str:
    """`url` if it is a PostgreSQL URL, by the settings' own rule."""
    from pydantic import ValidationError

    from clora_feedback.config import Settings
    from clora_feedback.errors import InvalidRequestError

    try:
        checked = Settings(store_url=url).store_url
    except ValidationError as exc:
        message = exc.errors()[0]["msg"]
        raise InvalidRequestError(f"--store-url: {message}", param="store_url") from exc
    if checked is None:  # blank text: the setting's "unset"
        raise InvalidRequestError("--store-url is empty", param="store_url")
    return checked


async def _run_until_signalled(consumer: FeedbackConsumer) -> None:
    stop_requested = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop_requested.set)
    async with consumer:
        log.info("consuming %s as group %s", ", ".join(consumer.topics), consumer.group_id)
        run = asyncio.create_task(consumer.run())
        stopper = asyncio.create_task(stop_requested.wait())
        await asyncio.wait({run, stopper}, return_when=asyncio.FIRST_COMPLETED)
        stopper.cancel()
    await run  # re-raises what ended the loop, if it was not a stop
