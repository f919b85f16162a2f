"""The composition root: every part of `clora serve` built from `Settings` and wired together.

    engine + trajectory store  ->  gateway (OpenAI routes)
    feedback store             <-  webhook (POST /v1/feedback)
                               <-  Kafka consumer group  <-  topics  <-  webhook producer, outside systems
    adapter registry           <-> trainer (publishes in place), guard (rolls back), admin routes

Feedback: one `FeedbackIngest` applies webhook and Kafka events, rejoins
parked ones and dead-letters the rest; `FeedbackPipeline`
(`clora_feedback.feedback.pipeline`) says when the webhook produces to Kafka
and when it writes straight to the store.

`build_service` returns a typed `Service` record: the app to serve, and the
parts callers (the demo, benchmarks, tests) read, instead of `app.state`.

Versions: a configured agent's `adapter_path` is imported once as its
version 1; after that (and after every restart) the deployer makes the engine
serve each agent's active registry version, so training survives restarts and
an unloaded adapter stays unloaded. Publish, rollback (operator or guard) and
load/unload only move the pointer, through the deployer.

Provenance and retention: the base model's identity (`store.provenance`) is
computed once here and handed to the registry, which records it in every
version and checks it on every load; the no-op probe (`engine.probe`) hears of
each newly served version from the deployer; `Retention` prunes old adapter
payloads and expires trajectories in the background.

Several processes: the trainer takes trainer leases in the registry's database
(one trainer per agent; `clora train` runs more of them, see `cli.train`), and on
PostgreSQL the deployer also LISTENs for pointer moves made by other processes.

Not here: HTTP handlers (see `gateway`), training math (see `train`), the
Kafka lifecycle (see `feedback.pipeline`), running uvicorn (`serve`, below, is
the only entry; `clora serve` calls it).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from fastapi import FastAPI

from clora_feedback.config import DEFAULT_MODEL, Settings
from clora_feedback.engine.base import Engine
from clora_feedback.engine.deployer import Deployer
from clora_feedback.engine.embedded import EmbeddedEngine, resolve_device
from clora_feedback.engine.factory import build_engine
from clora_feedback.engine.probe import NoopProbe
from clora_feedback.errors import ConflictError
from clora_feedback.feedback.ingest import FeedbackIngest
from clora_feedback.feedback.pipeline import FeedbackPipeline
from clora_feedback.feedback.rewards import DefaultRewardPolicy
from clora_feedback.feedback.store import FeedbackStore
from clora_feedback.gateway.adapters import build_adapters_router
from clora_feedback.gateway.agents import AgentRegistry
from clora_feedback.gateway.app import Component, create_app
from clora_feedback.gateway.console import build_console_router
from clora_feedback.gateway.feedback import build_feedback_router
from clora_feedback.gateway.metrics import Family
from clora_feedback.lora.weights import LoRALimits
from clora_feedback.model.resolve import resolve_model_dir
from clora_feedback.store.db import is_postgres_url
from clora_feedback.store.lease import TrainerLeases
from clora_feedback.store.provenance import base_identity
from clora_feedback.store.registry import AdapterRegistry
from clora_feedback.store.retention import Retention
from clora_feedback.store.trajectories import AsyncTrajectoryStore, TrajectoryStore
from clora_feedback.train.guard import RegressionGuard
from clora_feedback.train.policy import DecoderPolicy, PolicyModel
from clora_feedback.train.trainer import ContinualTrainer

log = logging.getLogger(__name__)


_TRAINER_HELP = {
    "steps": ("counter", "Optimizer steps taken."),
    "version": ("gauge", "Adapter version the trainer trains from."),
    "pending_samples": ("gauge", "Rewarded samples waiting for admission."),
    "admitted_samples": ("counter", "Samples admitted into mini-batches."),
    "dropped_stale_samples": ("counter", "Samples dropped for exceeding max_staleness."),
    "staleness_mean": ("gauge", "Mean staleness (versions) of the last admitted samples."),
    "staleness_max": ("gauge", "Max staleness (versions) of the last admitted samples."),
    "loss": ("gauge", "Loss of the last step."),
    "reward_mean": ("gauge", "Mean reward of the last step's samples."),
    "swap_seconds": ("gauge", "Host<->device state swap time of the last step."),
    "step_seconds": ("gauge", "Duration of the last step, swaps included."),
}


def _trainer_families(trainer: ContinualTrainer) -> list[Family]:
    per_agent = trainer.metrics()
    families = []
    for key, (kind, text) in _TRAINER_HELP.items():
        rows = {agent: values[key] for agent, values in per_agent.items() if key in values}
        suffix = "_total" if kind == "counter" else ""
        families.append(Family(f"clora_trainer_{key}{suffix}", kind, text, ("agent",), rows))
    return families


def _consumer_families(pipeline: FeedbackPipeline) -> list[Family]:
    if pipeline.consumer is None:
        return []
    values = pipeline.consumer.metrics.as_dict()
    return [
        Family(
            "clora_feedback_consumer", "gauge", "Feedback consumer counters (records, applied, duplicates, ...).",
            ("counter",), {k: float(v) for k, v in values.items() if v is not None},
        )
    ]  # fmt: skip


def _retention_families(retention: Retention, probe: NoopProbe | None) -> list[Family]:
    totals = retention.totals
    families = [
        Family("clora_retention_pruned_versions_total", "counter",
               "Adapter versions whose payload retention pruned.", (), {"": totals["pruned_versions"]}),
        Family("clora_retention_trajectories_deleted_total", "counter",
               "Trajectories deleted by retention.trajectory_ttl_s.", (),
               {"": totals["trajectories_deleted"]}),
    ]  # fmt: skip
    if probe is not None:
        families.append(
            Family("clora_probe_versions_total", "counter",
                   "Adapter versions the no-op probe ran on, by result (noop, changed).",
                   ("result",), {k: float(v) for k, v in probe.counts.items()})
        )  # fmt: skip
    return families


@dataclass(frozen=True)
class Service:
    """Everything `build_service` built; `app` serves it, the rest is for callers to read.

    The app's lifespan starts and stops the parts (engine, stores, components);
    holding a part here does not start it.
    """

    app: FastAPI
    """The gateway app to run (uvicorn, `TestClient`, the demo's `LocalServer`)."""
    engine: Engine
    """The serving engine (`engine.kind`; `build_engine`)."""
    trajectories: AsyncTrajectoryStore
    """The trajectory store the gateway records into."""
    feedback: FeedbackStore
    """The feedback store (rewards joined to trajectories)."""
    registry: AdapterRegistry
    """The adapter registry: versions and the active pointer."""
    agents: AgentRegistry
    """The gateway's agent table."""
    pipeline: FeedbackPipeline
    """The feedback ingest and, when configured, its Kafka side."""
    trainer: ContinualTrainer | None
    """The continual trainer; None when training is off in this process."""
    guard: RegressionGuard | None
    """The regression guard; None when disabled."""
    deployer: Deployer | None = None
    """What makes the engine serve the registry's active pointer (when wired)."""
    settings: Settings | None = None
    """The settings it was built from (`build_service` sets them)."""

    @property
    def ingest(self) -> FeedbackIngest:
        """The one feedback ingest (webhook and Kafka)."""
        return self.pipeline.ingest


def serve(settings: Settings) -> None:
    """Build the service from `settings` and serve it with uvicorn until interrupted."""
    import uvicorn

    from clora_feedback.gateway.server import uvicorn_config

    service = build_service(settings)
    # Body bounds, header and keep-alive timeouts, access log: `settings.server`.
    uvicorn.Server(uvicorn_config(service.app, settings)).run()


def build_policy(engine: object, model_dir: Path, settings: Settings, name: str) -> PolicyModel:
    """The trainer's model: the embedded engine's own base tensors, else its own copy.

    Sharing is the one-box memory win (the trainer only reads the base); any
    other engine (or a trainer in another process) gets a copy from `model_dir`.
    """
    compute = getattr(torch, settings.trainer.compute_dtype)
    if isinstance(engine, EmbeddedEngine):
        return DecoderPolicy.shared_with(engine, compute_dtype=compute)
    return DecoderPolicy.from_dir(
        model_dir,
        max_lora_rank=settings.engine.max_lora_rank,
        target_modules=tuple(settings.engine.lora_target_modules),
        model_name=name,
        max_model_len=settings.engine.max_model_len,
        dtype=compute,
        device=resolve_device(settings.engine.device),
    )


def pointer_listen_url(settings: Settings) -> str | None:
    """The registry's URL when the deployer LISTENs on it (PostgreSQL and `engine.adapter_notify`),
    else None (polling only; always so on SQLite)."""
    url = settings.registry_db_url
    return str(url) if settings.engine.adapter_notify and is_postgres_url(url) else None


def _register_initial(
    registry: AdapterRegistry, agent: str, path: Path, base_model: str, limits: LoRALimits
) -> None:
    """Import a configured agent's adapter as its version 1, once; an agent an operator
    unloaded (versions, no active pointer) stays on the base model across restarts."""
    try:
        registry.register_initial(agent, path, base_model=base_model, limits=limits)
    except ConflictError as exc:
        if exc.code != "no_active_version":
            raise
        log.info("agent %s: unloaded earlier; the base model serves it", agent)


def build_service(settings: Settings) -> Service:
    """Resolve the model and build the engine, stores, registry, trainer, guard and feedback paths."""
    model_dir = resolve_model_dir(settings.engine.model, settings.model_cache_dir)
    name = DEFAULT_MODEL if settings.engine.model == DEFAULT_MODEL else model_dir.name
    engine = build_engine(settings.engine, model_dir, name)
    # store_url set: all three stores in one PostgreSQL database; else SQLite under data_dir.
    log.info("stores: %s", settings.store_display_url)
    store = AsyncTrajectoryStore(settings.trajectory_db_url)
    # The one reward mapping: applied when samples are read, by this process only.
    policy = DefaultRewardPolicy(settings.feedback)
    # The feedback store joins through a read connection of the trajectory store's own.
    feedback = FeedbackStore(
        settings.trajectory_db_url,
        trajectories=TrajectoryStore(settings.trajectory_db_url),
        policy=policy,
    )
    # Computed once: every version published here records it, every load checks it.
    identity = base_identity(model_dir, name)
    registry = AdapterRegistry(
        settings.adapters_dir, settings.registry_db_url, base_identity=identity
    )
    for agent in settings.agents:  # initial adapters become version 1, once
        if agent.adapter_path is not None:
            _register_initial(registry, agent.name, agent.adapter_path, name, engine.lora_limits)
    serving = settings.model_copy(
        update={"agents": [a.model_copy(update={"adapter_path": None}) for a in settings.agents]}
    )
    probe = NoopProbe(engine, registry) if settings.retention.probe else None
    deployer = Deployer(
        engine,
        registry,
        poll_interval_s=settings.engine.adapter_poll_interval_s,
        base_model=name,
        listen_url=pointer_listen_url(settings),
        on_installed=None if probe is None else probe.schedule,
    )
    agents = AgentRegistry(engine, deployer)  # create_app starts the deployer first

    def trainable() -> list[str]:
        known = set(agents.names())
        return [a for a in feedback.agents_with_rewards() if a in known]

    trainer = None
    if settings.trainer.enabled:  # the deployer installs versions: no trainer needed for that
        trainer = ContinualTrainer(
            build_policy(engine, model_dir, settings, name), feedback, registry, settings.trainer,
            agents=trainable, base_model=name, deployer=deployer,
            leases=TrainerLeases(registry.database, ttl_s=settings.trainer.lease_ttl_s),
        )  # fmt: skip
    components: list[Component] = []
    pipeline = FeedbackPipeline(
        settings.feedback, feedback, agents.names, broker_dir=settings.data_dir / "kafka"
    )
    components.append(pipeline)
    if probe is not None:
        components.append(probe)
    # Prunes old adapter payloads and (with a TTL) old trajectories, every interval.
    retention = Retention(registry, settings.retention, trajectories=feedback.trajectories)
    components.append(retention)
    if trainer is not None:
        components.append(trainer)
    guard = None
    if settings.trainer.guard.enabled:
        guard = RegressionGuard(
            registry,
            feedback.rewards_by_version,
            settings.trainer.guard,
            deployer=deployer,
            reward_policy=policy.id,
        )
        components.append(guard)
    routers = [
        build_feedback_router(
            pipeline.ingest, settings, pipeline if pipeline.durable_log else None
        ),
        build_adapters_router(registry, deployer),
    ]
    if settings.console.enabled:
        routers.append(
            build_console_router(
                settings.console,
                registry,
                feedback,
                store,
                agents.names,
                deployer,
                replica_of=engine.replica_of,
            )
        )
    app = create_app(serving, engine, store, agents=agents, routers=routers, components=components)
    if trainer is not None:
        app.state.gateway.metrics.add_source(functools.partial(_trainer_families, trainer))
    app.state.gateway.metrics.add_source(lambda: _consumer_families(pipeline))
    app.state.gateway.feedback_bootstrap = lambda: pipeline.bootstrap  # /health, admin key
    app.state.gateway.metrics.add_source(functools.partial(_retention_families, retention, probe))
    return Service(
        app=app,
        engine=engine,
        trajectories=store,
        feedback=feedback,
        registry=registry,
        agents=agents,
        pipeline=pipeline,
        trainer=trainer,
        guard=guard,
        deployer=deployer,
        settings=settings,
    )
