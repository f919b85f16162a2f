"""`clora train`: the continual trainer (and the regression guard) as its own process, until SIGTERM.

    clora train --store-url postgresql://user:pw@db:5432/clora [--config settings.yaml]

Run any number against one database: each trains only the agents whose trainer
lease it holds (`clora_feedback.store.lease`), at most its fair share, and a
dead trainer's agents move to the others within `trainer.lease_ttl_s * 4/3`.
It reads rewarded samples from the feedback store, publishes versions into the
registry (the directories under the shared `adapters_dir`) and moves the active
pointers; every gateway's deployer follows them (PostgreSQL NOTIFY, else
polling). The model is the settings' (`engine.model`), loaded as the trainer's
own copy. With `trainer.guard.enabled` (default) the guard runs here too: its
rollback is a compare-and-set, so several guards never undo each other.

Run the `clora serve` gateways beside it with `trainer.enabled: false` (and the
guard off) so that only trainer processes train.

Exit status: 0 after a clean stop (leases released, so others take over at once).

Not here: the training itself (`clora_feedback.train.trainer`), the serving roles (`main`).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from pathlib import Path

log = logging.getLogger(__name__)


def add_train_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `train` to the `clora` parser's subcommands (sets `func`)."""
    p = subparsers.add_parser(
        "train",
        help="Run the continual trainer and the guard only (a trainer worker, with leases).",
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
    p.add_argument("--no-guard", action="store_true", help="do not run the regression guard here")
    p.set_defaults(func=run_train)


def run_train(args: argparse.Namespace) -> int:
    """Run one trainer worker until signalled. Returns the exit status."""
    from clora_feedback.cli.ingest import _checked_url
    from clora_feedback.config import load_settings
    from clora_feedback.errors import CloraError

    settings = load_settings(args.config)
    try:
        if args.store_url is not None:
            settings = settings.model_copy(update={"store_url": _checked_url(args.store_url)})
        if args.model:
            settings.engine.model = args.model
        asyncio.run(_serve(settings, owner=args.owner, guard=not args.no_guard))
    except CloraError as exc:
        log.error("trainer failed: %s", exc.message)
        return 1
    return 0


async def _serve(settings: object, *, owner: str | None, guard: bool) -> None:
    from clora_feedback.config import DEFAULT_MODEL, Settings
    from clora_feedback.feedback.rewards import DefaultRewardPolicy
    from clora_feedback.feedback.store import FeedbackStore
    from clora_feedback.lifecycle import AsyncLifecycle
    from clora_feedback.model.resolve import resolve_model_dir
    from clora_feedback.service import build_policy
    from clora_feedback.store.lease import TrainerLeases
    from clora_feedback.store.provenance import base_identity
    from clora_feedback.store.registry import AdapterRegistry
    from clora_feedback.store.trajectories import TrajectoryStore
    from clora_feedback.train.guard import RegressionGuard
    from clora_feedback.train.trainer import ContinualTrainer

    assert isinstance(settings, Settings)
    model_dir = resolve_model_dir(settings.engine.model, settings.model_cache_dir)
    name = DEFAULT_MODEL if settings.engine.model == DEFAULT_MODEL else model_dir.name
    rewards = DefaultRewardPolicy(settings.feedback)
    trajectories = TrajectoryStore(settings.trajectory_db_url)
    feedback = FeedbackStore(settings.trajectory_db_url, trajectories=trajectories, policy=rewards)
    registry = AdapterRegistry(  # versions record (and loads check) the base's digests
        settings.adapters_dir,
        settings.registry_db_url,
        base_identity=base_identity(model_dir, name),
    )
    known = {a.name for a in settings.agents}

    def trainable() -> list[str]:
        return [a for a in feedback.agents_with_rewards() if not known or a in known]

    leases = TrainerLeases(registry.database, owner=owner, ttl_s=settings.trainer.lease_ttl_s)
    trainer = ContinualTrainer(
        build_policy(None, model_dir, settings, name), feedback, registry, settings.trainer,
        agents=trainable, base_model=name, leases=leases,
    )  # fmt: skip
    parts: list[AsyncLifecycle] = [trainer]
    if guard and settings.trainer.guard.enabled:
        checks = RegressionGuard(
            registry, feedback.rewards_by_version, settings.trainer.guard, reward_policy=rewards.id
        )
        parts.append(checks)
    log.info("trainer %s: stores %s, model %s", leases.owner, settings.store_display_url, name)
    try:
        for part in parts:
            await part.start()
        await _until_signalled()
    finally:
        for part in reversed(parts):
            await part.stop()
        feedback.close()
        trajectories.close()
        registry.close()


async def _until_signalled() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
