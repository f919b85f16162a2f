"""The composition root: every part of `clora serve` built from `Settings` and wired together.

    engine + trajectory store  ->  gateway (OpenAI routes)
    feedback store             <-  webhook (POST /v1/feedback)
                               <-  Kafka consumer group  <-  topics  <-  webhook producer, outside systems
    adapter registry           <-> trainer (publishes in place), guard (rolls back), admin routes

Kafka: with `feedback.kafka.bootstrap_servers` set, the gateway produces
webhook events to the topics and a consumer group applies them, so every
piece of feedback flows through the log. With none, the embedded default
starts a local Tansu broker for outside producers (unless `embedded_broker`
is false) and the webhook writes straight to the SQLite store: this Tansu
build keeps its log in memory only, so an event acknowledged through it
could be lost with the process, while the store's commit is durable.

Versions: a configured agent's `adapter_path` is imported once as its
version 1; after that (and after every restart) the engine serves each
agent's active registry version, so training survives restarts.

Not here: HTTP handlers (see `gateway`), training math (see `train`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path

from fastapi import FastAPI

from clora_feedback.config import DEFAULT_MODEL, Settings
from clora_feedback.engine.embedded import EmbeddedEngine
from clora_feedback.errors import StoreError
from clora_feedback.feedback.broker import LocalBroker
from clora_feedback.feedback.kafka import (
    FeedbackConsumer,
    FeedbackProducer,
    build_consumer,
    build_producer,
)
from clora_feedback.feedback.rewards import RewardPolicy
from clora_feedback.feedback.store import FeedbackStore
from clora_feedback.gateway.adapters import build_adapters_router
from clora_feedback.gateway.agents import AgentRegistry
from clora_feedback.gateway.app import Component, create_app
from clora_feedback.gateway.feedback import ParkedRejoiner, build_feedback_router
from clora_feedback.gateway.metrics import Family
from clora_feedback.lora.weights import LoRAWeights
from clora_feedback.models.resolve import resolve_model_dir
from clora_feedback.schemas.feedback import Correction, Resolution, Reward
from clora_feedback.store.registry import AdapterRegistry
from clora_feedback.store.trajectories import AsyncTrajectoryStore
from clora_feedback.train.guard import RegressionGuard
from clora_feedback.train.trainer import ContinualTrainer

log = logging.getLogger(__name__)


class RegistryVersions:
    """The gateway's `VersionSource` backed by the registry: a runtime-loaded adapter
    becomes an immutable version (its parent the active one)."""

    def __init__(self, registry: AdapterRegistry, base_model: str):
        self.registry = registry
        self.base_model = base_model

    def adopt(self, agent: str, path: Path, weights: LoRAWeights) -> int:
        active = self.registry.active(agent) if self._known(agent) else None
        info = self.registry.publish(
            agent,
            weights,
            optimizer_state=None,
            base_model=self.base_model,
            parent=active.version if active else None,
            step=0,
            metrics={},
            feedback_window={"source": str(Path(path).resolve())},
        )
        return info.version

    def _known(self, agent: str) -> bool:
        return any(a.agent == agent for a in self.registry.agents())


class ActiveVersions:
    """At start-up, install every agent's active registry version in the engine."""

    def __init__(self, registry: AdapterRegistry, engine: EmbeddedEngine, agents: AgentRegistry):
        self.registry, self.engine, self.agents = registry, engine, agents

    async def start(self) -> None:
        for info in await asyncio.to_thread(self.registry.agents):
            if info.active_version is None:
                continue
            weights, _ = await asyncio.to_thread(
                self.registry.load, info.agent, info.active_version, limits=self.engine.lora_limits
            )
            self.engine.set_adapter(info.agent, info.active_version, weights)
            self.agents.restore(info.agent, info.active_version)
            log.info("agent %s: serving active version %d", info.agent, info.active_version)

    async def stop(self) -> None:
        return None


class FeedbackPipeline:
    """The Kafka side: a local broker when needed, the webhook's producer, the consumer group."""

    def __init__(self, settings: Settings, store: FeedbackStore, agents: AgentRegistry):
        self.settings = settings
        self.store = store
        self.agents = agents
        self.broker: LocalBroker | None = None
        self.producer: FeedbackProducer | None = None
        self.consumer: FeedbackConsumer | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def enabled(self) -> bool:
        kafka = self.settings.feedback.kafka
        return kafka.bootstrap_servers is not None or kafka.embedded_broker

    @property
    def durable_log(self) -> bool:
        """Whether producing to the log is as durable as writing the store (a real cluster)."""
        return self.settings.feedback.kafka.bootstrap_servers is not None

    async def start(self) -> None:
        kafka = self.settings.feedback.kafka
        bootstrap = kafka.bootstrap_servers
        if bootstrap is None:
            broker = LocalBroker(
                self.settings.data_dir / "kafka",
                topics=(*kafka.topics, kafka.dead_letter_topic),
                partitions=3,
            )
            await broker.astart()
            self.broker = broker
            bootstrap = broker.bootstrap
            log.info("embedded Kafka-protocol broker (Tansu) on %s", bootstrap)
        producer = build_producer(kafka, bootstrap)
        await producer.start()
        self.producer = producer
        consumer = build_consumer(
            self.store, self.settings.feedback, bootstrap, known_agents=self._known
        )
        await consumer.start()
        self.consumer = consumer
        self._task = asyncio.create_task(self._consume(consumer), name="clora-feedback-consumer")

    async def _consume(self, consumer: FeedbackConsumer) -> None:
        """Keep the consumer running: a failed batch was not committed, so it replays."""
        while True:
            try:
                await consumer.run()
                return
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception(
                    "feedback consumer failed; retrying in 1 s (uncommitted records replay)"
                )
                await asyncio.sleep(1.0)

    def _known(self) -> set[str]:
        return set(self.agents.names())

    async def send(self, event: Correction | Resolution | Reward) -> object:
        """`FeedbackSink` for the webhook: produce to the event's topic, acked by the cluster."""
        if self.producer is None:
            raise StoreError("the feedback pipeline is not started", code="not_started")
        return await self.producer.send(event)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task  # the consumer's own errors were logged by it
        if self.consumer is not None:
            await self.consumer.stop()
        if self.producer is not None:
            await self.producer.stop()
        if self.broker is not None:
            await self.broker.astop()


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


def build_service(settings: Settings) -> FastAPI:
    """Resolve the model and build the engine, stores, registry, trainer, guard and feedback paths."""
    model_dir = resolve_model_dir(settings.engine.model, settings.model_cache_dir)
    name = DEFAULT_MODEL if settings.engine.model == DEFAULT_MODEL else model_dir.name
    engine = EmbeddedEngine(model_dir, settings.engine, model_name=name)
    store = AsyncTrajectoryStore(settings.trajectory_db)
    feedback = FeedbackStore(settings.trajectory_db, RewardPolicy(settings.feedback))
    registry = AdapterRegistry(settings.adapters_dir, settings.registry_db)
    for agent in settings.agents:  # initial adapters become version 1, once
        if agent.adapter_path is not None:
            registry.register_initial(
                agent.name, agent.adapter_path, base_model=name, limits=engine.lora_limits
            )
    serving = settings.model_copy(
        update={"agents": [a.model_copy(update={"adapter_path": None}) for a in settings.agents]}
    )
    agents = AgentRegistry(engine, versions=RegistryVersions(registry, name))

    def trainable() -> list[str]:
        known = set(agents.names())
        return [a for a in feedback.agents_with_rewards() if a in known]

    trainer = ContinualTrainer(
        engine, feedback, registry, settings.trainer, agents=trainable, base_model=name
    )
    components: list[Component] = [ActiveVersions(registry, engine, agents)]
    pipeline = FeedbackPipeline(settings, feedback, agents)
    if pipeline.enabled:
        components.append(pipeline)
    else:
        components.append(ParkedRejoiner(feedback, ttl_s=settings.feedback.park_ttl_s))
    if settings.trainer.enabled:
        components.append(trainer)
    if settings.trainer.guard.enabled:
        components.append(
            RegressionGuard(
                registry,
                feedback.rewards_by_version,
                settings.trainer.guard,
                on_rollback=trainer.activate_async,
            )
        )
    routers = [
        build_feedback_router(feedback, settings, pipeline if pipeline.durable_log else None),
        build_adapters_router(registry, trainer.activate_async),
    ]
    app = create_app(serving, engine, store, agents=agents, routers=routers, components=components)
    app.state.gateway.metrics.add_source(lambda: _trainer_families(trainer))
    app.state.gateway.metrics.add_source(lambda: _consumer_families(pipeline))
    app.state.trainer = trainer
    app.state.registry = registry
    app.state.feedback = feedback
    return app
