"""The composition root: one builder per role, every part built from `Settings` here only.

    build_gateway(settings)         -> Service          `clora serve`: engine, gateway, deployer,
                                                        and (by default) trainer, release, ingest
    build_trainer_worker(settings)  -> TrainerWorker    `clora train`: trainer, leases
    build_ingest_worker(settings)   -> IngestWorker     `clora ingest`: one Kafka consumer

The roles share the parts of `service.parts`: `resolve_model` (the model
directory and its public name), `open_stores` (the feedback store over its
trajectory reader, with the one reward policy, applied when samples are read),
`open_registry` (the adapter versions, recording and checking the base model's
identity) and `trainable` (which agents a trainer trains). Nothing else in the
package constructs a store, a registry or a reward policy for a role (`cli/`
turns flags into settings and calls a builder); `service.maintenance` opens
them for the operator tools (migration, pruning).

In the gateway:

    engine + trajectory store  ->  gateway (OpenAI routes)
    feedback store             <-  webhook (POST /v1/feedback)
                               <-  Kafka consumer group  <-  topics  <-  webhook producer, outside systems
    adapter registry           <-> trainer (publishes candidates), release (gate, canary,
                                   promote | abort: `service.release`), admin routes

Feedback: one `FeedbackIngest` applies webhook and Kafka events, rejoins
parked ones and dead-letters the rest; `FeedbackPipeline`
(`clora_feedback.feedback.pipeline`) says when the webhook produces to Kafka
and when it writes straight to the store.

Versions: a configured agent's `adapter_path` is imported once as its
version 1 (`parts.register_initial`, the only path for initial adapters); after
that (and after every restart) the deployer makes the engine serve each
agent's active registry version, so training survives restarts and an
unloaded adapter stays unloaded. Promotion, rollback, publish (with the release
path off) and load/unload only move the pointer, through the deployer.

Provenance and retention: the base model's identity (`store.provenance`) is
computed once per process and handed to the registry, which records it in
every version and checks it on every load; the no-op probe (`engine.probe`)
hears of each newly served version from the deployer; `Retention` prunes old
adapter payloads and expires trajectories in the background.

Several processes: trainers take trainer leases in the registry's database
(one trainer per agent), and on PostgreSQL the deployer also LISTENs for
pointer moves made by other processes.

Not here: HTTP handlers (see `gateway`), training math (see `train`), the
Kafka lifecycle (see `feedback.pipeline`), flags (see `cli`).
"""

from clora_feedback.service.gateway import (
    Service,
    build_gateway,
    build_service,
    gateway_deployer,
    serve,
)
from clora_feedback.service.parts import pointer_listen_url, register_initial
from clora_feedback.service.workers import (
    IngestWorker,
    TrainerWorker,
    build_ingest_worker,
    build_trainer_worker,
)

__all__ = [
    "IngestWorker",
    "Service",
    "TrainerWorker",
    "build_gateway",
    "build_ingest_worker",
    "build_service",
    "build_trainer_worker",
    "gateway_deployer",
    "pointer_listen_url",
    "register_initial",
    "serve",
]
