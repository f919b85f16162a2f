"""Lazy start-up (issue 27): serving does not wait for the Kafka consumer group, and
adapters are read from disk on first use, not at start-up."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from kafka_fixtures import feedback_store, store_trajectory, wait_until  # noqa: F401

from clora_feedback.config import FeedbackConfig, KafkaConfig
from clora_feedback.feedback.pipeline import FeedbackPipeline
from clora_feedback.feedback.store import FeedbackStore
from clora_feedback.schemas.feedback import Resolution


@pytest.mark.slow  # a real Kafka-protocol broker
async def test_pipeline_start_does_not_wait_for_the_group_join(
    tmp_path: Path,
    feedback_store: FeedbackStore,  # noqa: F811
) -> None:
    config = FeedbackConfig(kafka=KafkaConfig(embedded_broker=True))
    pipeline = FeedbackPipeline(
        config, feedback_store, lambda: {"support"}, broker_dir=tmp_path / "kafka"
    )
    t0 = time.perf_counter()
    await pipeline.start()
    started_s = time.perf_counter() - t0
    try:
        # The join alone took 5.0 s on the embedded broker when `start` awaited it.
        assert started_s < 3.0, started_s
        assert not pipeline.joined.is_set()
        store_trajectory(feedback_store.trajectories, "c-1", agent="support")
        await pipeline.send(  # produced before the group joined: consumed once it has
            Resolution(event_id="early", agent="support", completion_id="c-1", source="t",
                       outcome="resolved")
        )  # fmt: skip
        await wait_until(pipeline.joined.is_set, what="the consumer joined", timeout_s=60)
        await wait_until(
            lambda: feedback_store.event_state("early") is not None,
            what="the early event applied",
            timeout_s=60,
        )
    finally:
        await pipeline.stop()


@pytest.mark.slow  # a real Kafka-protocol broker
async def test_pipeline_stops_cleanly_while_the_group_is_joining(
    tmp_path: Path,
    feedback_store: FeedbackStore,  # noqa: F811
) -> None:
    config = FeedbackConfig(kafka=KafkaConfig(embedded_broker=True))
    pipeline = FeedbackPipeline(config, feedback_store, set, broker_dir=tmp_path / "kafka")
    await pipeline.start()
    assert not pipeline.joined.is_set()
    await pipeline.stop()  # no unclosed consumer is left behind (warnings are errors)


async def test_start_up_reads_no_weights_and_a_first_request_reads_one(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from clora_feedback.config import EngineConfig
    from clora_feedback.engine.deployer import Deployer
    from clora_feedback.engine.embedded import EmbeddedEngine
    from clora_feedback.engine.probe import NoopProbe
    from clora_feedback.engine.types import GenerationRequest, SamplingParams
    from clora_feedback.lora.peft_io import save_peft_adapter
    from clora_feedback.lora.weights import random_lora_weights
    from clora_feedback.store.registry import AdapterRegistry

    engine = EmbeddedEngine(tiny_model_dir, EngineConfig(max_num_seqs=2, max_model_len=128))
    agents = [f"agent-{i}" for i in range(5)]
    with AdapterRegistry(tmp_path / "adapters", tmp_path / "registry.db") as registry:
        for i, agent in enumerate(agents):
            weights = random_lora_weights(engine.lora_limits, seed=i, std=0.3)
            save_peft_adapter(weights, tmp_path / "src" / agent, base_model="tiny")
            registry.register_initial(agent, tmp_path / "src" / agent, limits=engine.lora_limits)
        probe = NoopProbe(engine, registry)  # as the service wires it
        deployer = Deployer(engine, registry, on_installed=probe.schedule)
        await engine.start()
        try:
            await deployer.start()
            assert {a: deployer.serving(a) for a in agents} == dict.fromkeys(agents, 1)
            assert engine.adapters() == dict.fromkeys(agents, 1)
            await probe.idle()
            # Pointers and manifests only: restoring what served before is no new version,
            # so the no-op probe reads nothing (it read every adapter here before).
            assert engine.host_cache_stats()["reads"] == 0
            assert probe.results == {}
            request = GenerationRequest("r", "agent-3", [1, 2, 3], SamplingParams(max_tokens=3))
            chunks = await engine.add_request(request).collect()
            assert [t.adapter_version for c in chunks for t in c.tokens] == [1, 1, 1]
            assert engine.host_cache_stats()["reads"] == 1  # this agent's, on its request
        finally:
            await probe.stop()
            await deployer.stop()
            await engine.stop()
