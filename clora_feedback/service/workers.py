"""The worker roles: `clora train` (the trainer, with leases) and `clora ingest`
(one Kafka consumer into the feedback store), each a process of its own.

Not here: the gateway role (`gateway`), the shared parts (`parts`), signals and
flags (`clora_feedback.cli`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

from clora_feedback.config import Settings
from clora_feedback.errors import InvalidRequestError
from clora_feedback.feedback.kafka import FeedbackConsumer, build_consumer
from clora_feedback.heap import TRAINING_MMAP_THRESHOLD, release_freed_memory
from clora_feedback.lifecycle import AsyncLifecycle
from clora_feedback.service.parts import (
    Stores,
    open_registry,
    open_stores,
    policy_model,
    resolve_model,
    trainable,
)
from clora_feedback.service.release import trainer_parts
from clora_feedback.store.lease import TrainerLeases
from clora_feedback.store.registry import AdapterRegistry
from clora_feedback.train.trainer import ContinualTrainer

log = logging.getLogger(__name__)


@dataclass
class TrainerWorker:
    """A trainer as a process of its own.

    It trains the agents whose trainer lease it holds, at most its fair share, on
    its own copy of the base model. On the release path (the default) it publishes
    candidates that a gateway's release loop gates, canaries and promotes; with it
    off, every gateway's deployer follows the pointers it moves (PostgreSQL NOTIFY,
    else polling).
    """

    trainer: ContinualTrainer
    registry: AdapterRegistry
    stores: Stores
    model_name: str

    @property
    def owner(self) -> str:
        """This worker's id in the leases it holds."""
        return self.trainer.leases.owner if self.trainer.leases is not None else ""

    async def run(self, stop: asyncio.Event) -> None:
        """Start the trainer, run until `stop` is set, stop it, close the stores;
        the leases are released on the way out, so others take over at once."""
        parts: list[AsyncLifecycle] = [self.trainer]
        try:
            async with contextlib.AsyncExitStack() as running:
                for part in parts:
                    await running.enter_async_context(part)
                await stop.wait()
        finally:
            self.stores.close()
            self.registry.close()


def build_trainer_worker(settings: Settings) -> TrainerWorker:
    """The trainer worker: the stores and registry of `settings` (shared with the gateways:
    `store_url`, `adapters_dir`), the model's own copy, leases owned as
    `trainer.lease_owner`."""
    model = resolve_model(settings)
    stores = open_stores(settings)
    registry = open_registry(settings, model)
    configured = [a.name for a in settings.agents]
    leases = TrainerLeases(
        registry.database, owner=settings.trainer.lease_owner, ttl_s=settings.trainer.lease_ttl_s
    )
    samples, releases = trainer_parts(settings, stores.feedback, registry)
    release_freed_memory(TRAINING_MMAP_THRESHOLD)  # a step's activations leave on free
    trainer = ContinualTrainer(
        policy_model(settings, model, None), samples, registry, settings.trainer,
        agents=trainable(stores.feedback, (lambda: configured) if configured else None),
        base_model=model.name, leases=leases, releases=releases,
    )  # fmt: skip
    log.info(
        "trainer %s: stores %s, model %s", leases.owner, settings.store_display_url, model.name
    )
    return TrainerWorker(trainer, registry, stores, model.name)


@dataclass
class IngestWorker:
    """One Kafka feedback consumer into the feedback store, as a process of its own."""

    consumer: FeedbackConsumer
    stores: Stores

    async def run(self, stop: asyncio.Event) -> None:
        """Consume until `stop` is set (or the consumer fails for good, re-raised), then
        close the stores."""
        try:
            async with self.consumer as consumer:
                log.info("consuming %s as group %s", ", ".join(consumer.topics), consumer.group_id)
                run = asyncio.create_task(consumer.run())
                stopper = asyncio.create_task(stop.wait())
                await asyncio.wait({run, stopper}, return_when=asyncio.FIRST_COMPLETED)
                stopper.cancel()
            await run  # re-raises what ended the loop, if it was not a stop
        finally:
            self.stores.close()


def build_ingest_worker(settings: Settings) -> IngestWorker:
    """The ingest worker: `feedback.kafka` (a real cluster: `bootstrap_servers`), the stores
    of `settings`, the configured agents as the accepted ones (none configured: any).

    Raises:
        InvalidRequestError: no `feedback.kafka.bootstrap_servers`.
    """
    bootstrap = settings.feedback.kafka.bootstrap_servers
    if bootstrap is None:
        raise InvalidRequestError(
            "no Kafka cluster: set feedback.kafka.bootstrap_servers (--bootstrap)",
            param="bootstrap",
        )
    stores = open_stores(settings)
    names = {a.name for a in settings.agents}
    consumer = build_consumer(
        stores.feedback,
        settings.feedback,
        bootstrap,
        known_agents=(lambda: names) if names else None,
    )
    return IngestWorker(consumer, stores)
