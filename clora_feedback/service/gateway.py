"""The gateway role (`clora serve`): engine, gateway, deployer, and (by default) the trainer,
the release path (gate, canary, promote or abort) and the feedback ingest, in one process.

Not here: the parts it shares with the workers (`parts`), running uvicorn for
anything but `serve`, flags (`clora_feedback.cli.main`).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

from fastapi import FastAPI

from clora_feedback.config import Settings
from clora_feedback.cores import main_thread_alone
from clora_feedback.engine.base import Engine
from clora_feedback.engine.deployer import Deployer
from clora_feedback.engine.factory import build_engine
from clora_feedback.engine.probe import NoopProbe
from clora_feedback.feedback.ingest import FeedbackIngest
from clora_feedback.feedback.pipeline import FeedbackPipeline
from clora_feedback.feedback.store import FeedbackStore
from clora_feedback.gateway.adapters import build_adapters_router
from clora_feedback.gateway.agents import AgentRegistry
from clora_feedback.gateway.app import Component, create_app
from clora_feedback.gateway.console import build_console_router
from clora_feedback.gateway.feedback import build_feedback_router
from clora_feedback.gateway.metrics import Family
from clora_feedback.heap import TRAINING_MMAP_THRESHOLD, release_freed_memory
from clora_feedback.release.controller import ReleaseController
from clora_feedback.service.parts import (
    engine_settings,
    open_registry,
    open_stores,
    pointer_listen_url,
    policy_model,
    register_configured,
    resolve_model,
    trainable,
)
from clora_feedback.service.release import build_release, release_families, trainer_parts
from clora_feedback.store.lease import TrainerLeases
from clora_feedback.store.registry import AdapterRegistry
from clora_feedback.store.retention import Retention
from clora_feedback.store.trajectories import AsyncTrajectoryStore
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
    release: ReleaseController | None
    """The release path (gate, canary, promote or abort); None when `release.enabled` is off."""
    deployer: Deployer | None = None
    """What makes the engine serve the registry's active pointer (when wired)."""
    settings: Settings | None = None
    """The settings it was built from (`build_service` sets them)."""

    @property
    def ingest(self) -> FeedbackIngest:
        """The one feedback ingest (webhook and Kafka)."""
        return self.pipeline.ingest


def serve(settings: Settings) -> None:
    """Build the gateway from `settings` and serve it with uvicorn until interrupted."""
    import uvicorn

    from clora_feedback.gateway.server import uvicorn_config

    with main_thread_alone():  # the engine thread's pool is the process's only one
        service = build_gateway(settings)
        # Body bounds, header and keep-alive timeouts, access log: `settings.server`.
        uvicorn.Server(uvicorn_config(service.app, settings)).run()


def gateway_deployer(settings: Settings, engine: Engine) -> Deployer:
    """The deployer of a gateway over a ready-made engine (tests, embedders): a registry of
    its own under `settings.data_dir` (with a `store_url`: the shared registry and its
    `adapters_dir`), the configured agents' initial adapters imported into it; closed when
    it stops. `build_gateway` builds its own engine and registry instead."""
    # A shared registry names versions under one root every process mounts: adapters_dir.
    root = settings.adapters_dir if settings.store_url else settings.data_dir / "adapters"
    registry = AdapterRegistry(root, settings.registry_db_url)
    register_configured(settings, registry, engine.model_name, engine.lora_limits)
    return Deployer(engine, registry, on_stop=registry.close, base_model=engine.model_name)


def build_gateway(settings: Settings) -> Service:
    """Resolve the model and build the engine, stores, registry, deployer, trainer, release,
    feedback paths and console: everything `clora serve` runs."""
    settings = engine_settings(settings)
    model = resolve_model(settings)
    engine = build_engine(settings.engine, model.directory, model.name)
    log.info("stores: %s", settings.store_display_url)
    store = AsyncTrajectoryStore(settings.trajectory_db_url)
    stores = open_stores(settings)
    feedback = stores.feedback
    registry = open_registry(settings, model)
    register_configured(settings, registry, model.name, engine.lora_limits)
    probe = NoopProbe(engine, registry) if settings.retention.probe else None
    deployer = Deployer(
        engine,
        registry,
        poll_interval_s=settings.engine.adapter_poll_interval_s,
        base_model=model.name,
        listen_url=pointer_listen_url(settings),
        on_installed=None if probe is None else probe.schedule,
    )
    agents = AgentRegistry(engine, deployer)  # create_app starts the deployer first
    samples, releases = trainer_parts(settings, feedback, registry)  # the held-out reserve
    trainer = None
    if settings.trainer.enabled:  # the deployer installs versions: no trainer needed for that
        release_freed_memory(TRAINING_MMAP_THRESHOLD)  # a step's activations leave on free
        trainer = ContinualTrainer(
            policy_model(settings, model, engine), samples, registry, settings.trainer,
            agents=trainable(feedback, agents.names), base_model=model.name, deployer=deployer,
            leases=TrainerLeases(registry.database, owner=settings.trainer.lease_owner,
                                 ttl_s=settings.trainer.lease_ttl_s),
            releases=releases,
        )  # fmt: skip
    components: list[Component] = []
    pipeline = FeedbackPipeline(
        settings.feedback, feedback, agents.names, broker_dir=settings.data_dir / "kafka"
    )
    components.append(pipeline)
    if probe is not None:
        components.append(probe)
    # Prunes old adapter payloads and (with a TTL) old trajectories, every interval.
    retention = Retention(
        registry, settings.retention, trajectories=feedback.trajectories,
        keep=None if releases is None else releases.kept,  # candidates, passed, canaries
    )  # fmt: skip
    components.append(retention)
    if trainer is not None:
        components.append(trainer)
    release = build_release(settings, engine, registry, deployer, feedback, samples, agents)
    if release is not None:
        components.append(release)
    routers = [
        build_feedback_router(
            pipeline.ingest, settings, pipeline if pipeline.durable_log else None
        ),
        build_adapters_router(registry, deployer, release),
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
                releases=None if release is None else release.book.of_agent,
            )
        )
    app = create_app(
        settings, engine, store, deployer=deployer, agents=agents, routers=routers,
        components=components,
    )  # fmt: skip
    if trainer is not None:
        app.state.gateway.metrics.add_source(functools.partial(_trainer_families, trainer))
    app.state.gateway.metrics.add_source(lambda: _consumer_families(pipeline))
    app.state.gateway.feedback_bootstrap = lambda: pipeline.bootstrap  # /health, admin key
    app.state.gateway.metrics.add_source(functools.partial(_retention_families, retention, probe))
    if release is not None:
        app.state.gateway.metrics.add_source(functools.partial(release_families, release))
    return Service(
        app=app,
        engine=engine,
        trajectories=store,
        feedback=feedback,
        registry=registry,
        agents=agents,
        pipeline=pipeline,
        trainer=trainer,
        release=release,
        deployer=deployer,
        settings=settings,
    )


build_service = build_gateway
"""The gateway's builder under its earlier name (the demo, the benchmarks and users call it)."""
