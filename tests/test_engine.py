"""The embedded engine's own behaviour: its in-memory adapter fast path (`set_adapter`),
staged flips into the spare slot, slot eviction and queue limits.

What every engine must do (mixed batches, mid-stream updates, abort, stop
strings, seeds, logprobs, constraints) is in `test_engine_contract.py`."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch

from clora_feedback.config import EngineConfig
from clora_feedback.engine.decoder import KVCache, PrefillChunk
from clora_feedback.engine.embedded import EmbeddedEngine
from clora_feedback.engine.types import GenerationRequest, RequestOutput, SamplingParams
from clora_feedback.errors import AdapterError, ContextLengthError, NotFoundError, OverloadedError
from clora_feedback.lora.weights import LoRAWeights, random_lora_weights
from clora_feedback.model.tiny import build_tiny_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "m", seed=1)


def _engine(model_dir: Path, **kw: object) -> EmbeddedEngine:
    config = EngineConfig(**{"max_num_seqs": 4, "max_loras": 3, "max_model_len": 256, **kw})  # type: ignore[arg-type]
    return EmbeddedEngine(model_dir, config)


def _req(rid: str, agent: str | None, prompt: list[int], **sp: object) -> GenerationRequest:
    return GenerationRequest(rid, agent, prompt, SamplingParams(**sp))  # type: ignore[arg-type]


def _tokens(chunks: list[RequestOutput]) -> list[int]:
    return [t.token_id for c in chunks for t in c.tokens]


async def test_outputs_do_not_depend_on_batch_neighbours(model_dir: Path) -> None:
    engine = _engine(model_dir)
    await engine.start()
    try:
        engine.set_adapter("a", 1, random_lora_weights(engine.lora_limits, seed=1, std=0.3))
        prompt = engine.tokenizer.encode("The quick brown fox")
        alone = await engine.add_request(
            _req("x", "a", prompt, max_tokens=12, temperature=0.8, seed=7)
        ).collect()
        streams = [
            engine.add_request(_req("y", "a", prompt, max_tokens=12, temperature=0.8, seed=7))
        ]
        streams += [
            engine.add_request(_req(f"n{i}", None, prompt[: i + 2], max_tokens=9)) for i in range(3)
        ]
        together = await asyncio.gather(*(s.collect() for s in streams))
        assert _tokens(together[0]) == _tokens(alone)
        assert all(t.adapter_version == 1 for c in alone for t in c.tokens)
        assert all(t.adapter_version == 0 for c in together[1] for t in c.tokens)
        assert together[1][-1].finish_reason in ("length", "stop")
    finally:
        await engine.stop()


@pytest.mark.parametrize("fuse", [True, False])
async def test_a_prompt_beside_decoding_rows_changes_none_of_their_tokens(
    model_dir: Path, fuse: bool
) -> None:
    """A step that starts prompts while other rows decode runs both in one forward (the
    rows as one-token chunks, `fuse_prefill`): every row's tokens and logprobs are those
    it gets alone, with adapters mixed across the rows."""
    engine = _engine(model_dir)
    engine.fuse_prefill = fuse
    forwards: list[list[int]] = []  # chunk lengths of each prefill forward
    prefill_many = engine.model.prefill_many

    def recorded(chunks: list[PrefillChunk], cache: KVCache) -> torch.Tensor:
        forwards.append([len(c.token_ids) for c in chunks])
        return prefill_many(chunks, cache)

    engine.model.prefill_many = recorded  # type: ignore[method-assign]
    await engine.start()
    try:
        for i, agent in enumerate(("a", "b")):
            engine.set_adapter(agent, 1, random_lora_weights(engine.lora_limits, seed=i, std=0.3))
        prompts = {
            "long": ("a", engine.tokenizer.encode("The quick brown fox")),
            "late": ("b", engine.tokenizer.encode("Jumps over the lazy dog, twice")),
            "base": (None, engine.tokenizer.encode("hello")),
        }

        def request(name: str, rid: str) -> GenerationRequest:
            agent, prompt = prompts[name]
            sampling = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=0)
            return GenerationRequest(rid, agent, prompt, sampling)

        alone = {n: await engine.add_request(request(n, f"{n}-alone")).collect() for n in prompts}
        running = aiter(engine.add_request(request("long", "long")))
        first = await anext(running)  # decoding now: the next prompts join mid-stream
        late = [engine.add_request(request(n, n)) for n in ("late", "base")]

        async def rest() -> list[RequestOutput]:
            return [chunk async for chunk in running]

        tail, *others = await asyncio.gather(rest(), *(s.collect() for s in late))
        together = {"long": [first, *tail], "late": others[0], "base": others[1]}
        fused = [f for f in forwards if 1 in f and max(f) > 1]  # prompts and decoding rows
        assert bool(fused) == fuse, forwards
        for name in prompts:
            got, want = together[name], alone[name]
            assert _tokens(got) == _tokens(want), name
            torch.testing.assert_close(
                [t.logprob for c in got for t in c.tokens],
                [t.logprob for c in want for t in c.tokens],
                atol=1e-4,
                rtol=0,
            )
    finally:
        await engine.stop()


async def test_adapter_update_lands_between_steps_mid_stream(model_dir: Path) -> None:
    engine = _engine(model_dir)
    await engine.start()
    try:
        limits = engine.lora_limits
        engine.set_adapter("a", 1, random_lora_weights(limits, seed=1))
        prompt = engine.tokenizer.encode("hello")
        stream = engine.add_request(
            _req("m", "a", prompt, max_tokens=200, temperature=0.0, ignore_eos=True)
        )
        versions: list[int] = []
        async for chunk in stream:
            versions += [t.adapter_version for t in chunk.tokens]
            if len(versions) == 5:
                engine.set_adapter("a", 2, random_lora_weights(limits, seed=2))
        assert versions[0] == 1 and versions[-1] == 2
        assert versions == sorted(versions)  # a single switch, never back
        with pytest.raises(AdapterError):  # bad adapter refused; the agent keeps serving v2
            engine.set_adapter("a", 3, LoRAWeights(rank=64, alpha=1.0, tensors={}))
        assert engine.adapter_version("a") == 2
    finally:
        await engine.stop()


async def test_staged_updates_serve_the_latest_weights_and_spare_the_neighbours(
    model_dir: Path,
) -> None:
    """Updates are written into the spare slot off the step and flipped in: many in a row,
    from another thread, while two agents decode, must leave each agent serving exactly
    its latest weights (same tokens as a fresh engine holding only those)."""
    limits_engine = _engine(model_dir)
    limits = limits_engine.lora_limits
    final = {"a": random_lora_weights(limits, seed=40), "b": random_lora_weights(limits, seed=41)}
    prompt = limits_engine.tokenizer.encode("the quick brown fox")
    greedy = {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True}

    async def tokens_of(engine: EmbeddedEngine, agent: str, rid: str) -> list[int]:
        return _tokens(await engine.add_request(_req(rid, agent, prompt, **greedy)).collect())

    fresh = _engine(model_dir)
    await fresh.start()
    try:
        for agent, weights in final.items():
            fresh.set_adapter(agent, 9, weights)
        expected = {agent: await tokens_of(fresh, agent, f"x-{agent}") for agent in final}
    finally:
        await fresh.stop()

    engine = _engine(model_dir)
    await engine.start()
    try:
        engine.set_adapter("a", 1, random_lora_weights(limits, seed=1))
        engine.set_adapter("b", 1, final["b"])
        long = {"max_tokens": 120, "temperature": 0.0, "ignore_eos": True}
        streams = {a: engine.add_request(_req(f"long-{a}", a, prompt, **long)) for a in "ab"}

        def publish_many() -> None:
            for version in range(2, 8):
                engine.set_adapter("a", version, random_lora_weights(limits, seed=version))
            engine.set_adapter("a", 8, final["a"])

        collected = await asyncio.gather(
            asyncio.to_thread(publish_many), *(s.collect() for s in streams.values())
        )
        versions_a = [t.adapter_version for c in collected[1] for t in c.tokens]
        assert versions_a == sorted(versions_a) and versions_a[-1] == 8
        assert {t.adapter_version for c in collected[2] for t in c.tokens} == {1}
        for agent in final:
            assert await tokens_of(engine, agent, f"y-{agent}") == expected[agent]
    finally:
        await engine.stop()


async def test_more_agents_than_slots_and_limits(model_dir: Path) -> None:
    engine = _engine(model_dir, max_loras=2, max_waiting=2, max_num_seqs=2)
    await engine.start()
    try:
        for i in range(4):
            engine.set_adapter(f"a{i}", 1, random_lora_weights(engine.lora_limits, seed=i))
        prompt = engine.tokenizer.encode("hi")
        streams = [
            engine.add_request(_req(f"r{i}", f"a{i}", prompt, max_tokens=6)) for i in range(4)
        ]
        with pytest.raises(OverloadedError):
            engine.add_request(_req("over", None, prompt, max_tokens=2))
        results = await asyncio.gather(*(s.collect() for s in streams))
        assert all(r[-1].finished and len(_tokens(r)) >= 1 for r in results)
        with pytest.raises(ContextLengthError):
            engine.add_request(_req("long", None, prompt, max_tokens=300))
        with pytest.raises(NotFoundError):
            engine.add_request(_req("nf", "nobody", prompt))
    finally:
        await engine.stop()


async def test_unloading_an_adapter_fails_none_of_its_queued_requests(model_dir: Path) -> None:
    """Bug: a canary arm unloaded (its release promoted) while a burst of its requests
    waited for rows failed the waiting ones with 404 "the adapter ... was unloaded".
    Requests the engine accepted now run on the weights they were routed to; new ones
    are refused at once; the adapter is dropped when the last waiting one is admitted."""
    engine = _engine(model_dir, max_num_seqs=2, max_waiting=8)
    await engine.start()
    try:
        engine.set_adapter("c", 3, random_lora_weights(engine.lora_limits, seed=5, std=0.3))
        prompt = engine.tokenizer.encode("hello there")
        streams = engine.add_requests(
            [_req(f"r{i}", "c", prompt, max_tokens=8, ignore_eos=True) for i in range(6)]
        )
        await engine.unload_adapter("c")  # two rows run, the rest wait
        assert engine.adapter_version("c") is None and "c" not in engine.adapters()
        assert "c" not in engine.stats().adapters
        with pytest.raises(NotFoundError):
            engine.add_request(_req("late", "c", prompt, max_tokens=2))
        results = await asyncio.gather(*(s.collect() for s in streams))
        for chunks in results:
            assert len(_tokens(chunks)) == 8
            assert {t.adapter_version for c in chunks for t in c.tokens} == {3}
        assert engine.host_cache_stats()["bytes"] == 0  # dropped once none waited
        await engine.unload_adapter("c")  # gone: a no-op, as for any unknown agent
        engine.set_adapter("c", 4, random_lora_weights(engine.lora_limits, seed=6))
        assert engine.adapter_version("c") == 4
    finally:
        await engine.stop()


async def test_reloading_a_retiring_adapter_serves_its_queued_requests_the_new_version(
    model_dir: Path,
) -> None:
    """An adapter loaded again under the same name while removed requests still wait:
    it is served again (new requests accepted), the waiting ones move on with it."""
    engine = _engine(model_dir, max_num_seqs=1, max_waiting=8)
    await engine.start()
    try:
        engine.set_adapter("c", 1, random_lora_weights(engine.lora_limits, seed=5))
        prompt = engine.tokenizer.encode("hello there")
        streams = engine.add_requests(
            [_req(f"r{i}", "c", prompt, max_tokens=6, ignore_eos=True) for i in range(3)]
        )
        engine.remove_adapter("c")
        with pytest.raises(NotFoundError):
            engine.remove_adapter("c")  # removed already, as far as callers can tell
        engine.set_adapter("c", 2, random_lora_weights(engine.lora_limits, seed=6))
        assert engine.adapter_version("c") == 2
        streams.append(
            engine.add_request(_req("again", "c", prompt, max_tokens=6, ignore_eos=True))
        )
        results = await asyncio.gather(*(s.collect() for s in streams))
        assert all(len(_tokens(r)) == 6 for r in results)  # none failed
        assert {t.adapter_version for c in results[-1] for t in c.tokens} == {2}
        queued = {t.adapter_version for r in results[1:3] for c in r for t in c.tokens}
        assert queued <= {1, 2}  # admitted before or after the new version's flip
        assert engine.adapter_version("c") == 2 and engine.adapters() == {"c": 2}
    finally:
        await engine.stop()


async def test_background_requests_yield_rows_to_clients(model_dir: Path) -> None:
    """Evaluation traffic (the gate's, the probe's) queues no client behind it: with three
    background requests ahead of three clients in a 6-row engine, one background row runs
    (evaluation never starves) and the clients take the other rows at once, ahead of the
    other background requests, which wait while clients run (`engine.background_rows`),
    free rows or not."""
    engine = _engine(model_dir, max_num_seqs=6)
    await engine.start()
    try:
        prompt = engine.tokenizer.encode("The quick brown fox")
        first: dict[str, float] = {}
        done: dict[str, float] = {}

        async def run(request: GenerationRequest) -> None:
            async for _ in engine.add_request(request):
                first.setdefault(request.request_id, asyncio.get_running_loop().time())
            done[request.request_id] = asyncio.get_running_loop().time()

        def sampling(max_tokens: int) -> SamplingParams:
            return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

        # bg0 outlives the clients, so the rows that come free first are the clients'.
        requests = [GenerationRequest("bg0", None, prompt, sampling(30), background=True)]
        requests += [
            GenerationRequest(f"bg{i}", None, prompt, sampling(10), background=True) for i in (1, 2)
        ]
        requests += [GenerationRequest(f"client{i}", None, prompt, sampling(10)) for i in range(3)]
        await asyncio.gather(*(run(r) for r in requests))
        clients_first = max(first[f"client{i}"] for i in range(3))
        first_client_done = min(done[f"client{i}"] for i in range(3))
        # side by side: bg0 answers while the clients decode (on its token credit)
        assert first["bg0"] <= first_client_done and clients_first < done["bg0"], (first, done)
        assert first_client_done <= min(first["bg1"], first["bg2"]), (first, done)
        # While clients run, background work holds `engine.background_rows` (1) rows;
        # with no client it takes every free row.
        first.clear(), done.clear()
        alone = [
            GenerationRequest(f"idle{i}", None, prompt, sampling(10), background=True)
            for i in range(3)
        ]
        await asyncio.gather(*(run(r) for r in alone))
        assert max(first.values()) < min(done.values()), (first, done)
    finally:
        await engine.stop()


async def test_background_tokens_follow_their_credit_while_clients_run(model_dir: Path) -> None:
    """While a client decodes, a background request advances about
    `engine.background_tokens_per_step` tokens a step (its prompt included), so a gate's
    cost to clients is bounded; once the client is done it runs unthrottled."""
    engine = _engine(model_dir, max_num_seqs=4, background_tokens_per_step=0.5)
    await engine.start()
    try:
        prompt = engine.tokenizer.encode("The quick brown fox jumps")
        greedy = dict(temperature=0.0, ignore_eos=True)
        client = engine.add_request(  # first: the engine thread may step in between
            GenerationRequest("client", None, prompt, SamplingParams(max_tokens=40, **greedy))
        )
        background = engine.add_request(GenerationRequest(
            "bg", None, prompt, SamplingParams(max_tokens=60, **greedy), background=True))  # fmt: skip
        counted: list[int] = []

        async def count_background() -> None:
            async for out in background:
                counted.append(len(out.tokens))

        counter = asyncio.create_task(count_background())
        await client.collect()
        during = sum(counted)
        await counter
        # 41 client steps (a prefill, 40 decodes) earn 20.5 tokens of credit, the
        # prompt's 5-6 tokens of them first: about 15 answer tokens (slack for the stream's
        # delivery under load); unthrottled it would have had 40.
        assert 5 <= during <= 22, during
        assert sum(counted) == 60
    finally:
        await engine.stop()


async def test_background_rows_finish_at_full_speed_for_a_client_waiting_for_a_row(
    model_dir: Path,
) -> None:
    """Evaluation admitted while the server was idle may hold every row; a client that then
    arrives waits for one of them, so they are not throttled by the token credit (it
    protects running clients' steps, and there are none): the client starts after the
    background answers finish at full speed (well under a second here), not after the
    credit's pace (0.25 tokens a step, and a step without work waits 50 ms: minutes)."""
    engine = _engine(model_dir, max_num_seqs=2, background_tokens_per_step=0.25)
    await engine.start()
    try:
        prompt = engine.tokenizer.encode("The quick brown fox")
        greedy = dict(temperature=0.0, ignore_eos=True)
        background = [
            engine.add_request(
                GenerationRequest(
                    f"bg{i}", None, prompt, SamplingParams(max_tokens=120, **greedy),
                    background=True,
                )
            )
            for i in range(2)
        ]  # fmt: skip
        async with asyncio.timeout(30):  # both rows taken (idle: no credit), both decoding
            while engine.stats().running < 2 or engine.stats().generated_tokens < 4:
                await asyncio.sleep(0.001)
        t0 = time.perf_counter()
        client = engine.add_request(
            GenerationRequest("client", None, prompt, SamplingParams(max_tokens=1, **greedy))
        )
        async with asyncio.timeout(60):
            await client.collect()
        assert time.perf_counter() - t0 < 15.0
        for stream in background:
            await stream.collect()
    finally:
        await engine.stop()
