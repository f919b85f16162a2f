"""The embedded engine's prefix cache: same outputs as without it, keyed by adapter identity,
bounded in memory, counted in `/metrics`.

Greedy tokens are compared with an engine whose cache is off, over multi-turn
conversations (each turn's prompt is the last one plus its completion and a new
message), a shared system prompt, mixed adapters and `n > 1` siblings. Counters
are asserted, never times.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from clora_feedback.config import EngineConfig
from clora_feedback.engine.embedded import EmbeddedEngine
from clora_feedback.engine.types import (
    EngineStats,
    GenerationRequest,
    PrefixCacheStats,
    RequestOutput,
    SamplingParams,
)
from clora_feedback.gateway.metrics import Metrics
from clora_feedback.lora.weights import random_lora_weights
from clora_feedback.model.tiny import build_tiny_model_dir

SYSTEM = "You are a careful assistant for a bicycle shop. Answer briefly. "


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "m", seed=3)


def _engine(model_dir: Path, cache_mb: int) -> EmbeddedEngine:
    config = EngineConfig(max_num_seqs=6, max_loras=3, max_model_len=512, prefix_cache_mb=cache_mb)
    return EmbeddedEngine(model_dir, config)


def _tokens(chunks: list[RequestOutput]) -> list[int]:
    return [t.token_id for c in chunks for t in c.tokens]


async def _generate(
    engine: EmbeddedEngine, rid: str, agent: str | None, prompt: list[int], n: int = 12
) -> list[int]:
    sampling = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    chunks = await engine.add_request(GenerationRequest(rid, agent, prompt, sampling)).collect()
    return _tokens(chunks)


def _cache(engine: EmbeddedEngine) -> PrefixCacheStats:
    stats = engine.stats().prefix_cache
    assert stats is not None
    return stats


async def _conversations(engine: EmbeddedEngine) -> list[list[int]]:
    """Three agents (base, a, b) hold 3-turn conversations at once on one system prompt;
    every turn also asks for 2 siblings (n > 1) of the first one."""
    encode = engine.tokenizer.encode
    agents: list[str | None] = [None, "a", "b"]
    contexts = {i: encode(SYSTEM + f"Customer {i}: my chain skips.") for i in range(3)}
    outputs: list[list[int]] = []
    for turn in range(3):
        jobs = []
        for i, agent in enumerate(agents):
            for sibling in range(3 if turn != 1 else 1):
                jobs.append(_generate(engine, f"t{turn}-{i}-{sibling}", agent, contexts[i]))
        results = await asyncio.gather(*jobs)
        outputs += results
        k = 0
        for i in range(3):
            contexts[i] = contexts[i] + results[k] + encode(f" Turn {turn}: and the brakes?")
            k += 3 if turn != 1 else 1
    return outputs


async def test_cached_outputs_equal_uncached(model_dir: Path) -> None:
    runs = []
    for cache_mb in (0, 64):
        engine = _engine(model_dir, cache_mb)
        await engine.start()
        try:
            limits = engine.lora_limits
            engine.set_adapter("a", 1, random_lora_weights(limits, seed=1, std=0.3))
            engine.set_adapter("b", 1, random_lora_weights(limits, seed=2, std=0.3))
            runs.append(await _conversations(engine))
            if cache_mb:
                stats = _cache(engine)
                assert stats.hits > 0 and stats.evictions == 0
                assert stats.bytes == stats.blocks * engine.prefix_cache.block_bytes  # type: ignore[union-attr]
            else:
                assert engine.stats().prefix_cache is None
        finally:
            await engine.stop()
    assert runs[0] == runs[1]


async def test_a_new_version_never_hits_the_old_versions_blocks(model_dir: Path) -> None:
    engine = _engine(model_dir, 64)
    fresh = _engine(model_dir, 0)
    await engine.start()
    await fresh.start()
    try:
        limits = engine.lora_limits
        v1, v2, v2b = (random_lora_weights(limits, seed=s, std=0.3) for s in (11, 12, 13))
        prompt = engine.tokenizer.encode(SYSTEM * 2)
        full = (len(prompt) - 1) // 16
        engine.set_adapter("a", 1, v1)
        await _generate(engine, "v1", "a", prompt)
        assert _cache(engine).hits == 0
        await _generate(engine, "v1-again", "a", prompt)
        assert _cache(engine).hits == full  # the same version reuses its blocks

        engine.set_adapter("a", 2, v2)  # a publish
        hits = _cache(engine).hits
        got = await _generate(engine, "v2", "a", prompt)
        assert _cache(engine).hits == hits  # no block of v1 served v2
        fresh.set_adapter("a", 2, v2)
        assert got == await _generate(fresh, "v2", "a", prompt)

        engine.set_adapter("a", 2, v2b)  # an in-place reload of the same version number
        got = await _generate(engine, "v2b", "a", prompt)
        assert _cache(engine).hits == hits
        fresh.set_adapter("a", 2, v2b)
        assert got == await _generate(fresh, "v2b", "a", prompt)

        engine.remove_adapter("a")  # removed and re-added: other weights, no alias either
        engine.set_adapter("a", 1, v2)
        await _generate(engine, "readd", "a", prompt)
        assert _cache(engine).hits == hits
        await _generate(engine, "readd-again", "a", prompt)
        assert _cache(engine).hits == hits + full
    finally:
        await engine.stop()
        await fresh.stop()


async def test_a_flip_mid_request_stores_no_mixed_blocks(model_dir: Path) -> None:
    engine = _engine(model_dir, 64)
    await engine.start()
    try:
        limits = engine.lora_limits
        engine.set_adapter("a", 1, random_lora_weights(limits, seed=1))
        prompt = engine.tokenizer.encode(SYSTEM)
        sampling = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
        stream = engine.add_request(GenerationRequest("m", "a", prompt, sampling))
        versions: list[int] = []
        async for chunk in stream:
            versions += [t.adapter_version for t in chunk.tokens]
            if len(versions) == 3:
                engine.set_adapter("a", 2, random_lora_weights(limits, seed=2))
        assert versions[0] == 1 and versions[-1] == 2
        # Only the prompt's blocks (all computed by v1) were kept, none of the generated ones.
        assert _cache(engine).blocks == len(prompt) // 16
    finally:
        await engine.stop()


async def test_least_recently_used_blocks_are_evicted_within_the_bound(model_dir: Path) -> None:
    engine = _engine(model_dir, 1)  # 1 MiB: 128 blocks of this model's 8 KiB
    await engine.start()
    try:
        cache = engine.prefix_cache
        assert cache is not None and cache.capacity_bytes // cache.block_bytes == 128
        prompts = [engine.tokenizer.encode(f"{i:03d} " + SYSTEM * 7)[:400] for i in range(8)]
        assert all(len(p) == 400 for p in prompts)
        for i, prompt in enumerate(prompts):  # 8 x 25 blocks > 128
            await _generate(engine, f"p{i}", None, prompt, n=1)
        stats = _cache(engine)
        assert stats.evictions > 0 and stats.bytes <= stats.capacity_bytes
        assert stats.blocks == 128
        before = stats.hits
        await _generate(engine, "last", None, prompts[-1], n=1)
        assert _cache(engine).hits == before + (len(prompts[-1]) - 1) // 16
        before = _cache(engine).hits
        await _generate(engine, "first", None, prompts[0], n=1)  # evicted long ago
        assert _cache(engine).hits == before
    finally:
        await engine.stop()


def test_metrics_render_the_prefix_cache() -> None:
    cache = PrefixCacheStats(
        16, hits=5, misses=7, evictions=2, blocks=3, bytes=96, capacity_bytes=128
    )
    text = Metrics().render(EngineStats(0, 0, 4, 8, 1, 2, {}, prefix_cache=cache))
    for line in (
        "clora_engine_prefix_cache_hits_total 5",
        "clora_engine_prefix_cache_misses_total 7",
        "clora_engine_prefix_cache_evictions_total 2",
        "clora_engine_prefix_cache_bytes 96",
        "clora_engine_prefix_cache_capacity_bytes 128",
    ):
        assert line in text.splitlines()
    assert "prefix_cache" not in Metrics().render(EngineStats(0, 0, 4, 8, 1, 2, {}))
