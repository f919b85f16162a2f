"""Memory has a budget (issue 27): host copies of adapters and trainer state are bounded,
and what was dropped comes back bit-identical from the version directories.

- the engine's host cache (`engine.host_adapter_cache_mb`): a copy dropped beyond the
  budget is read back on the agent's next request, off the step loop, and serves
  exactly as before; a version registered by its directory is not read until then;
- trainer residency (`trainer.max_resident_agents`): a trainer that drops and
  restores agents' masters and Adam moments publishes bit-identical versions to
  one that keeps them all (so it keeps training from its optimizer state).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from test_trainer import World

from clora_feedback.config import EngineConfig
from clora_feedback.engine.embedded import EmbeddedEngine
from clora_feedback.engine.types import GenerationRequest, SamplingParams
from clora_feedback.errors import AdapterError
from clora_feedback.gateway.metrics import Metrics
from clora_feedback.lora.peft_io import save_peft_adapter
from clora_feedback.lora.weights import LoRAWeights, random_lora_weights
from clora_feedback.model.tiny import build_tiny_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "m", seed=5)


def _same(a: LoRAWeights, b: LoRAWeights) -> bool:
    return a.tensors.keys() == b.tensors.keys() and all(
        torch.equal(a.tensors[k][0], b.tensors[k][0])
        and torch.equal(a.tensors[k][1], b.tensors[k][1])
        for k in a.tensors
    )


async def _greedy(engine: EmbeddedEngine, rid: str, agent: str) -> list[int]:
    prompt = engine.tokenizer.encode("Route this ticket")
    request = GenerationRequest(rid, agent, prompt, SamplingParams(max_tokens=8, temperature=0.0))
    chunks = await engine.add_request(request).collect()
    return [t.token_id for c in chunks for t in c.tokens]


async def test_dropped_host_copies_are_read_back_on_demand_bit_identical(
    model_dir: Path, tmp_path: Path
) -> None:
    # A zero budget keeps no copy that lives in a directory beyond the one just read,
    # and one slot (plus the spare) makes every agent switch rewrite the slot from it.
    engine = EmbeddedEngine(
        model_dir,
        EngineConfig(max_num_seqs=2, max_loras=1, max_model_len=256, host_adapter_cache_mb=0),
    )
    weights = {}
    for i, agent in enumerate(("a", "b", "c")):
        weights[agent] = random_lora_weights(engine.lora_limits, seed=10 + i, std=0.3)
        save_peft_adapter(weights[agent], tmp_path / agent, base_model="tiny")
        engine.register_adapter(agent, 1, tmp_path / agent)
    assert engine.host_cache_stats()["reads"] == 0  # registered by directory: nothing read
    assert engine.host_cache_stats()["bytes"] == 0
    await engine.start()
    try:
        first = {agent: await _greedy(engine, f"1{agent}", agent) for agent in ("a", "b", "c")}
        stats = engine.host_cache_stats()
        assert stats["reads"] == 3 and stats["drops"] >= 2  # each read dropped the previous copy
        assert stats["bytes"] == weights["c"].num_bytes()  # only the last read is held
        text = Metrics().render(engine.stats())  # /metrics shows the budget and its traffic
        assert "clora_engine_adapter_reads_total 3" in text
        assert f"clora_engine_host_adapter_cache_bytes {stats['bytes']}" in text
        assert "clora_engine_host_adapter_cache_capacity_bytes 0" in text
        # "a" lost its host copy and its slot: it is read again and serves the same tokens.
        again = await _greedy(engine, "2a", "a")
        assert again == first["a"] and engine.host_cache_stats()["reads"] == 4
        live = engine.adapter_weights("a")
        assert live is not None and live[0] == 1 and _same(live[1], weights["a"])
        # An adapter staged from memory (a trainer's hand-off) is never dropped until its
        # directory is named: it has no other copy.
        engine.set_adapter("d", 7, random_lora_weights(engine.lora_limits, seed=99, std=0.3))
        await _greedy(engine, "1d", "d")
        await _greedy(engine, "3b", "b")
        assert engine.adapter_weights("d") is not None and engine.host_cache_stats()["bytes"] > 0
        held = engine.host_cache_stats()["bytes"]
        save_peft_adapter(engine.adapter_weights("d")[1], tmp_path / "d", base_model="tiny")  # type: ignore[index]
        engine.set_adapter_source("d", 7, tmp_path / "d")
        assert engine.host_cache_stats()["bytes"] < held  # now it may go
        assert engine.adapter_version("d") == 7
    finally:
        await engine.stop()


async def test_a_cold_agent_whose_directory_went_bad_fails_only_its_request(
    model_dir: Path, tmp_path: Path
) -> None:
    engine = EmbeddedEngine(
        model_dir,
        EngineConfig(max_num_seqs=2, max_loras=2, max_model_len=256, host_adapter_cache_mb=0),
    )
    good = random_lora_weights(engine.lora_limits, seed=1, std=0.3)
    save_peft_adapter(good, tmp_path / "good", base_model="tiny")
    save_peft_adapter(good, tmp_path / "bad", base_model="tiny")
    engine.register_adapter("good", 1, tmp_path / "good")
    engine.register_adapter("bad", 1, tmp_path / "bad")
    (tmp_path / "bad" / "adapter_model.safetensors").write_bytes(b"truncated")
    await engine.start()
    try:
        stream = engine.add_request(
            GenerationRequest("x", "bad", [1, 2, 3], SamplingParams(max_tokens=2))
        )
        with pytest.raises(AdapterError, match="cannot be read"):
            await stream.collect()
        assert len(await _greedy(engine, "y", "good")) >= 1  # the engine serves on
    finally:
        await engine.stop()


def test_trainer_residency_drops_and_restores_bit_identical(
    model_dir: Path, tmp_path: Path
) -> None:
    engine = EmbeddedEngine(model_dir, EngineConfig(max_num_seqs=2, max_loras=4, max_model_len=256))
    capped = World(tmp_path / "capped", engine, max_resident_agents=1)
    free = World(tmp_path / "free", engine, max_resident_agents=None)
    try:
        for _ in range(3):  # the two worlds in lockstep: the same samples, the same order
            for world in (capped, free):
                for agent in ("a", "b"):
                    world.serve_and_reward(agent, 1.0)
                    world.serve_and_reward(agent, correction=f"the answer of {agent}")
                assert len(world.trainer.run_round()) == 2
            assert capped.trainer.residency.resident == 1
            assert free.trainer.residency.resident == 2
        assert capped.trainer.residency.drops >= 3 and capped.trainer.residency.restores >= 2
        for agent in ("a", "b"):  # version 3 came from restored masters and moments
            (w1, o1), (w2, o2) = (w.registry.load(agent, 3) for w in (capped, free))
            assert _same(w1, w2), agent
            assert o1 is not None and o2 is not None
            assert all(torch.equal(o1[k], o2[k]) for k in ("exp_avg", "exp_avg_sq", "step"))
            assert int(o1["step"].item()) == 3
    finally:
        capped.close()
        free.close()


def test_trainer_residency_holds_its_cap_within_a_round(model_dir: Path, tmp_path: Path) -> None:
    """The cap holds step by step, not only at the end of a round: a round of five ready
    agents under a cap of two never holds more than the cap plus the agent stepping."""
    engine = EmbeddedEngine(model_dir, EngineConfig(max_num_seqs=2, max_loras=4, max_model_len=256))
    world = World(tmp_path, engine, max_resident_agents=2)
    trainer = world.trainer
    seen: list[int] = []
    step = trainer._step

    def watched(group: list[Any]) -> list[Any]:
        seen.append(trainer.residency.resident)  # before this step restores its agent
        return step(group)

    trainer._step = watched  # type: ignore[method-assign]
    try:
        for _ in range(2):
            for agent in ("a", "b", "c", "d", "e"):
                world.serve_and_reward(agent, correction=f"the answer of {agent}")
                world.serve_and_reward(agent, correction=f"again, the answer of {agent}")
            assert len(trainer.run_round()) == 5
        assert max(seen) <= 2 and trainer.residency.resident <= 2, seen
    finally:
        world.close()


async def _until(check: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


async def test_a_prefetch_reads_a_cold_adapter_before_its_request(
    model_dir: Path, tmp_path: Path
) -> None:
    """The gateway prefetches as soon as a request is routed (`Serving.route`), so a cold
    agent's directory is read while its prompt is rendered and tokenised; a prefetch is a
    hint: unknown agents are ignored and a failed read is reported by the request."""
    engine = EmbeddedEngine(
        model_dir,
        EngineConfig(max_num_seqs=2, max_loras=2, max_model_len=256, host_adapter_cache_mb=0),
    )
    weights = random_lora_weights(engine.lora_limits, seed=3, std=0.3)
    for agent in ("a", "bad"):
        save_peft_adapter(weights, tmp_path / agent, base_model="tiny")
        engine.register_adapter(agent, 1, tmp_path / agent)
    (tmp_path / "bad" / "adapter_model.safetensors").write_bytes(b"truncated")
    await engine.start()
    try:
        engine.prefetch("a")
        engine.prefetch("nobody")
        await _until(lambda: engine.host_cache_stats()["reads"] == 1, "the prefetched read")
        assert engine.adapter_weights("a") is not None
        await _greedy(engine, "1a", "a")
        assert engine.host_cache_stats()["reads"] == 1  # the request found it in memory
        engine.prefetch("bad")
        await asyncio.sleep(0.2)
        engine.prefetch("bad")  # the failed read stays for the request to report
        with pytest.raises(AdapterError, match="cannot be read"):
            await engine.add_request(
                GenerationRequest("x", "bad", [1, 2, 3], SamplingParams(max_tokens=2))
            ).collect()
    finally:
        await engine.stop()


async def test_an_overflowing_agent_waits_for_one_slot_not_a_drained_batch(
    model_dir: Path, tmp_path: Path
) -> None:
    """Three agents, two slots: the third agent's request starts when the short row's slot
    frees, while the long row is still decoding."""
    engine = EmbeddedEngine(model_dir, EngineConfig(max_num_seqs=3, max_loras=2, max_model_len=256))
    for i, agent in enumerate(("long", "short", "late")):
        engine.set_adapter(agent, 1, random_lora_weights(engine.lora_limits, seed=i, std=0.3))
    await engine.start()
    try:
        loop = asyncio.get_running_loop()
        first: dict[str, float] = {}
        done: dict[str, float] = {}

        async def run(agent: str, max_tokens: int) -> None:
            sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            request = GenerationRequest(agent, agent, [1, 2, 3], sampling)
            async for _ in engine.add_request(request):
                first.setdefault(agent, loop.time())
            done[agent] = loop.time()

        running = [asyncio.create_task(run("long", 120)), asyncio.create_task(run("short", 4))]
        await _until(lambda: "long" in first and "short" in first, "both rows decoding")
        await run("late", 4)  # no slot free now: waits for the short row's slot
        await asyncio.gather(*running)
        assert done["short"] <= first["late"] < done["long"], (first, done)
    finally:
        await engine.stop()
