"""`clora train`: the continual trainer as its own process, until SIGTERM.

    clora train --store-url postgresql://user:pw@db:5432/clora [--config settings.yaml]

Run any number against one database: each trains only the agents whose trainer
lease it holds (`clora_feedback.store.lease`), at most its fair share, and a
dead trainer's agents move to the others within `trainer.lease_ttl_s * 4/3`.
It reads rewarded samples from the feedback store, publishes versions into the
registry (the directories under the shared `adapters_dir`) and moves the active
pointers; every gateway's deployer follows them (PostgreSQL NOTIFY, else
polling). The model is the settings' (`engine.model`), loaded as the trainer's
own copy. On the release path (`release.enabled`, the default) its versions
are candidates: a `clora serve` gateway's release loop gates, canaries and
promotes them (docs/release.md).

Run the `clora serve` gateways beside it with `trainer.enabled: false` so that
only trainer processes train.

Exit status: 0 after a clean stop (leases released, so others take over at once).

Not here: building the worker (`clora_feedback.service.build_trainer_worker`), the training
itself (`clora_feedback.train.trainer`), the serving roles (`main`).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from pathlib import Path

log = logging.getLogger(__name__)


def add_train_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `train` to the `clora` parser's subcommands (sets `func`)."""
    p = subparsers.add_parser(
        "train",
        help="Run the continual trainer only (a trainer worker, with leases).",
        description="Train the agents whose leases this process holds, until SIGTERM/SIGINT.",
    )
    p.add_argument("--config", type=Path, help="settings file (JSON/YAML)")
    p.add_argument(
        "--store-url",
        help="PostgreSQL store postgresql://user:password@host:port/database "
        "(default: the settings' store_url, else the SQLite files under data_dir)",
    )
    p.add_argument("--model", help="base model: the default name or a HF model directory")
    p.add_argument("--owner", help="this trainer's lease owner id (default host:pid:random)")
    p.set_defaults(func=run_train)


def run_train(args: argparse.Namespace) -> int:
    """Run one trainer worker until signalled. Returns the exit status."""
    from clora_feedback.cli.common import checked_store_url, until_signalled
    from clora_feedback.config import load_settings
    from clora_feedback.cores import main_thread_alone
    from clora_feedback.errors import CloraError
    from clora_feedback.service import build_trainer_worker

    try:
        settings = load_settings(
            args.config,
            store_url=checked_store_url(args.store_url),
            engine={"model": args.model},
            trainer={"lease_owner": args.owner},
        )
        with main_thread_alone():  # the trainer thread takes every core
            worker = build_trainer_worker(settings)
            asyncio.run(until_signalled(worker.run))
    except CloraError as exc:
        log.error("trainer failed: %s", exc.message)
        return 1
    return 0
