"""The engine contract: what every `Engine` must do, checked through the Protocol only.

Each test runs once per entry of `FACTORIES`: the embedded torch engine and the
vLLM engine on a real vLLM-CPU server (`vllm_fixtures`, marked `vllm`), each on
a tiny random Llama (vLLM's with head size 32, the least its CPU attention takes). Adapters arrive as PEFT directories through
`load_adapter(AdapterRef)`, as the deployer hands them over; version attribution
and logprobs are checked against what the engine's `capabilities` declare.
Embedded-only behaviour (slots, LRU eviction, staged flips) stays in `test_engine.py`;
the one look past the Protocol is `_hold_after_steps`, which paces the embedded
engine's thread so a mid-stream update cannot race a finished request.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from vllm_fixtures import VLLMServer, vllm_engine

from clora_feedback.chat_format.constraint import call_grammar, completion_suffix
from clora_feedback.chat_format.tools import forced_call_prefix
from clora_feedback.config import EngineConfig
from clora_feedback.engine.base import Engine, RequestStream
from clora_feedback.engine.factory import build_engine
from clora_feedback.engine.types import (
    GenerationRequest,
    JSONSchemaSpec,
    RequestOutput,
    SamplingParams,
    ToolCallSpec,
)
from clora_feedback.errors import AdapterError, ConfigError, InvalidRequestError, NotFoundError
from clora_feedback.lora.peft_io import save_peft_adapter
from clora_feedback.lora.weights import LoRALimits, random_lora_weights
from clora_feedback.store.versions import AdapterRef

EngineFactory = Callable[..., AbstractAsyncContextManager[Engine]]


@asynccontextmanager
async def embedded_engine(model_dir: Path, **config: Any) -> AsyncIterator[Engine]:
    """The embedded engine, built the way the service builds engines (`build_engine`)."""
    settings = {"max_num_seqs": 4, "max_loras": 3, "max_model_len": 512, "num_threads": 1}
    engine = build_engine(EngineConfig(**{**settings, **config}), model_dir, "tiny-base")
    await engine.start()
    try:
        yield engine
    finally:
        await engine.stop()


@asynccontextmanager
async def engine_on_vllm(
    server: VLLMServer, model_dir: Path, **config: Any
) -> AsyncIterator[Engine]:
    """The vLLM engine on the session's vLLM server, on the model that server serves (the
    tiny model with vLLM's smallest head size, `vllm_fixtures.vllm_model_dir`), not `model_dir`."""
    async with vllm_engine(server, **config) as engine:
        yield engine


def _embedded(request: pytest.FixtureRequest) -> EngineFactory:
    return embedded_engine


def _vllm(request: pytest.FixtureRequest) -> EngineFactory:
    return functools.partial(engine_on_vllm, request.getfixturevalue("vllm_server"))


FACTORIES: dict[str, Callable[[pytest.FixtureRequest], EngineFactory]] = {
    "embedded": _embedded,
    "vllm": _vllm,
}
"""Engine kind -> the factory of an engine of that kind (given the test's fixtures)."""
_MARKS = {"vllm": pytest.mark.vllm}


@pytest.fixture(
    params=[pytest.param(kind, marks=_MARKS.get(kind, ())) for kind in sorted(FACTORIES)]
)
def make_engine(request: pytest.FixtureRequest) -> EngineFactory:
    return FACTORIES[request.param](request)


def _req(rid: str, agent: str | None, prompt: list[int], **sp: Any) -> GenerationRequest:
    guided = sp.pop("guided", None)
    return GenerationRequest(rid, agent, prompt, SamplingParams(**sp), guided=guided)


async def _collect(stream: RequestStream) -> list[RequestOutput]:
    return [chunk async for chunk in stream]


def _tokens(chunks: list[RequestOutput]) -> list[int]:
    return [t.token_id for c in chunks for t in c.tokens]


def _versions(chunks: list[RequestOutput]) -> list[int]:
    return [t.adapter_version for c in chunks for t in c.tokens]


def _adapter(
    engine: Engine, tmp_path: Path, agent: str, version: int, seed: int, **kw: Any
) -> AdapterRef:
    """A version's PEFT directory, as the registry writes it."""
    limits: LoRALimits = kw.pop("limits", engine.lora_limits)
    path = tmp_path / f"{agent}-v{version}"
    rank = kw.pop("rank", 8)
    weights = random_lora_weights(limits, seed=seed, std=0.3, rank=rank)
    save_peft_adapter(weights, path, base_model=engine.model_name)
    return AdapterRef(agent, version, path)


GREEDY = {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True}


async def test_a_mixed_batch_equals_each_adapter_alone(
    make_engine: EngineFactory, tiny_model_dir: Path, tmp_path: Path
) -> None:
    async with make_engine(tiny_model_dir) as engine:
        for agent, seed in (("a", 1), ("b", 2)):
            await engine.load_adapter(_adapter(engine, tmp_path, agent, 1, seed))
        prompt = list(engine.tokenizer.encode("The quick brown fox"))
        agents = ["a", "b", None]
        alone = {}
        for agent in agents:
            alone[agent] = await _collect(
                engine.add_request(_req(f"x{agent}", agent, prompt, **GREEDY))
            )
        streams = [
            engine.add_request(_req(f"y{agent}", agent, prompt, **GREEDY)) for agent in agents
        ]
        together = await asyncio.gather(*(_collect(s) for s in streams))
        for agent, chunks in zip(agents, together, strict=True):
            assert _tokens(chunks) == _tokens(alone[agent]), agent
            assert set(_versions(chunks)) == {0 if agent is None else 1}
        assert len({tuple(_tokens(alone[a])) for a in agents}) == 3  # the adapters matter
        assert engine.adapter_version("a") == 1 and engine.adapter_version("nobody") is None
        with pytest.raises(NotFoundError):
            engine.add_request(_req("nf", "nobody", prompt))


def _hold_after_steps(engine: Engine, steps: int) -> threading.Event:
    """The embedded engine's thread waits before step `steps + 1` until the returned
    event is set. A tiny model decodes faster than a loaded event loop reads its
    stream, so without the hold a 120-token request can be over before the update
    the client sends after its fifth token is staged."""
    release = threading.Event()
    step = engine.step  # type: ignore[attr-defined]  # EmbeddedEngine's; the loop calls it
    done = itertools.count(1)

    def held() -> bool:
        if next(done) > steps:
            release.wait(timeout=60)
        return bool(step())

    engine.step = held  # type: ignore[attr-defined]
    return release


async def test_an_update_lands_mid_stream_without_pausing_other_agents(
    make_engine: EngineFactory, tiny_model_dir: Path, tmp_path: Path
) -> None:
    async with make_engine(tiny_model_dir) as engine:
        per_token = engine.capabilities.per_token_versions
        for agent, seed in (("a", 1), ("b", 2)):
            await engine.load_adapter(_adapter(engine, tmp_path, agent, 1, seed))
        v2 = _adapter(engine, tmp_path, "a", 2, 3)
        prompt = list(engine.tokenizer.encode("hello"))
        long = {"max_tokens": 120, "temperature": 0.0, "ignore_eos": True}
        loaded = _hold_after_steps(engine, 12) if per_token else None
        other = asyncio.ensure_future(_collect(engine.add_request(_req("b", "b", prompt, **long))))
        versions: list[int] = []
        async for chunk in engine.add_request(_req("a", "a", prompt, **long)):
            versions += [t.adapter_version for t in chunk.tokens]
            if len(versions) >= 5 and engine.adapter_version("a") == 1:
                await engine.load_adapter(v2)
                if loaded is not None:
                    loaded.set()
        assert len(versions) == 120 and versions[0] == 1
        if per_token:  # every token names the version that produced it: one switch, never back
            assert versions[-1] == 2 and versions == sorted(versions)
        else:  # one version per request: the one it was admitted under
            assert set(versions) == {1}
        b_chunks = await other
        assert len(_tokens(b_chunks)) == 120 and set(_versions(b_chunks)) == {1}
        assert engine.adapter_version("a") == 2
        after = await _collect(engine.add_request(_req("a2", "a", prompt, **GREEDY)))
        assert set(_versions(after)) == {2}


async def test_a_bad_adapter_is_refused_without_disturbing_traffic(
    make_engine: EngineFactory, tiny_model_dir: Path, tmp_path: Path
) -> None:
    async with make_engine(tiny_model_dir) as engine:
        await engine.load_adapter(_adapter(engine, tmp_path, "a", 1, 1))
        prompt = list(engine.tokenizer.encode("hello"))
        baseline = await _collect(engine.add_request(_req("base", "a", prompt, **GREEDY)))
        limits = engine.lora_limits
        too_wide = LoRALimits(
            max_rank=limits.max_rank * 4,
            target_modules=limits.target_modules,
            shapes=limits.shapes,
            num_layers=limits.num_layers,
        )
        bad = _adapter(engine, tmp_path, "a", 2, 2, limits=too_wide, rank=limits.max_rank * 2)
        running = engine.add_request(_req("run", "a", prompt, **GREEDY))
        with pytest.raises(AdapterError):
            await engine.load_adapter(bad)
        with pytest.raises(AdapterError):  # not PEFT files at all
            await engine.load_adapter(AdapterRef("c", 1, tmp_path / "missing"))
        chunks = await _collect(running)
        assert _tokens(chunks) == _tokens(baseline) and set(_versions(chunks)) == {1}
        assert engine.adapter_version("a") == 1 and engine.adapter_version("c") is None


async def test_abort_frees_the_row_at_once(
    make_engine: EngineFactory, tiny_model_dir: Path
) -> None:
    async with make_engine(tiny_model_dir) as engine:
        prompt = list(engine.tokenizer.encode("hello"))
        stream = engine.add_request(_req("ab", None, prompt, max_tokens=200, ignore_eos=True))
        async for chunk in stream:
            if chunk.tokens:
                stream.abort()
                break
        for _ in range(100):
            if engine.stats().running == 0:
                break
            await asyncio.sleep(0.01)
        assert engine.stats().running == 0


async def test_stop_strings(make_engine: EngineFactory, tiny_model_dir: Path) -> None:
    async with make_engine(tiny_model_dir) as engine:
        prompt = list(engine.tokenizer.encode("abc"))
        greedy = {"max_tokens": 30, "temperature": 0.0, "ignore_eos": True}
        full = await _collect(engine.add_request(_req("f", None, prompt, **greedy)))
        text = "".join(c.text for c in full)
        assert text == engine.tokenizer.decode(_tokens(full), skip_special_tokens=True)
        assert full[-1].finish_reason == "length" and len(_tokens(full)) == 30
        stop = next(
            text[i : i + 2]
            for i in range(3, len(text) - 2)
            if text[i : i + 2].strip() and "\ufffd" not in text[i : i + 2]
        )
        cut = await _collect(engine.add_request(_req("s", None, prompt, stop=(stop,), **greedy)))
        assert "".join(c.text for c in cut) == text[: text.index(stop)]
        assert cut[-1].finish_reason == "stop"


async def test_min_tokens_holds_back_stop_strings(
    make_engine: EngineFactory, tiny_model_dir: Path
) -> None:
    """vLLM's rule: a stop string ends the sequence only when a token after the first
    `min_tokens` completes it (here every token is "a" and so is the stop string)."""
    async with make_engine(tiny_model_dir) as engine:
        prompt = list(engine.tokenizer.encode("Once upon"))
        [a] = engine.tokenizer.encode("a")
        forced = {"max_tokens": 8, "temperature": 0.0, "logit_bias": ((a, 100.0),), "stop": ("a",)}
        early = await _collect(engine.add_request(_req("e", None, prompt, **forced)))
        assert ("".join(c.text for c in early), early[-1].finish_reason) == ("", "stop")
        held = await _collect(engine.add_request(_req("h", None, prompt, min_tokens=3, **forced)))
        assert "".join(c.text for c in held) == "aaa"
        assert held[-1].finish_reason == "stop" and _tokens(held) == [a] * 4


async def test_seeds_reproduce_and_n_choices_differ(
    make_engine: EngineFactory, tiny_model_dir: Path
) -> None:
    async with make_engine(tiny_model_dir) as engine:
        prompt = list(engine.tokenizer.encode("Once upon"))
        sampled = {"max_tokens": 12, "temperature": 1.0, "ignore_eos": True}
        # n = 3: one request per choice, same prompt, seeds 7, 8, 9, submitted together.
        streams = [
            engine.add_request(_req(f"n{s}", None, prompt, seed=s, **sampled)) for s in (7, 8, 9)
        ]
        first = [_tokens(c) for c in await asyncio.gather(*(_collect(s) for s in streams))]
        again = [
            _tokens(
                await _collect(engine.add_request(_req(f"r{s}", None, prompt, seed=s, **sampled)))
            )
            for s in (7, 8, 9)
        ]
        assert first == again  # alone or batched, a seed gives the same tokens
        assert len({tuple(t) for t in first}) == 3


async def test_sampling_controls_act_and_a_mixed_batch_equals_each_alone(
    make_engine: EngineFactory, tiny_model_dir: Path
) -> None:
    async with make_engine(tiny_model_dir) as engine:
        prompt = list(engine.tokenizer.encode("Once upon"))
        eos = engine.tokenizer.eos_token_id
        [a] = engine.tokenizer.encode("a")
        greedy = {"max_tokens": 8, "temperature": 0.0}
        [first] = _tokens(
            await _collect(
                engine.add_request(_req("g", None, prompt, max_tokens=1, temperature=0.0))
            )
        )
        rows: dict[str, dict[str, Any]] = {
            "forced": {**greedy, "logit_bias": ((a, 100.0),)},
            "banned": {**greedy, "ignore_eos": True, "logit_bias": ((first, -100.0),)},
            "held": {**greedy, "min_tokens": 3, "logit_bias": ((eos, 100.0),)},
            "penalized": {
                **greedy,
                "ignore_eos": True,
                "presence_penalty": 1.5,
                "frequency_penalty": 0.5,
            },
            "top_k": {
                "max_tokens": 8,
                "temperature": 1.0,
                "seed": 3,
                "top_k": 1,
                "ignore_eos": True,
            },
        }
        together = await asyncio.gather(
            *(
                _collect(engine.add_request(_req(f"b-{name}", None, prompt, **sp)))
                for name, sp in rows.items()
            )
        )
        batch = {name: _tokens(chunks) for name, chunks in zip(rows, together, strict=True)}
        alone = {
            name: _tokens(await _collect(engine.add_request(_req(f"s-{name}", None, prompt, **sp))))
            for name, sp in rows.items()
        }
        assert batch == alone  # each row's controls are its own
        assert batch["forced"] == [a] * 8
        assert batch["banned"][0] != first
        held = batch["held"]
        assert eos not in held[:3] and len(held) <= 4  # EOS (forced) as soon as min_tokens allow
        plain = _tokens(
            await _collect(engine.add_request(_req("p", None, prompt, ignore_eos=True, **greedy)))
        )
        assert batch["top_k"] == plain  # top_k = 1 samples greedily at any temperature


async def test_logprobs_follow_the_declared_mode(
    make_engine: EngineFactory, tiny_model_dir: Path
) -> None:
    async with make_engine(tiny_model_dir) as engine:
        prompt = list(engine.tokenizer.encode("abc"))
        asked = {"logprobs": True, "top_logprobs": 3, "ignore_eos": True}
        greedy = await _collect(
            engine.add_request(_req("g", None, prompt, max_tokens=4, temperature=0.0, **asked))
        )
        for t in (t for c in greedy for t in c.tokens):
            assert len(t.top_logprobs) == 3 and t.top_logprobs[0][0] == t.token_id  # top-1
            assert t.logprob == pytest.approx(t.top_logprobs[0][1]) and t.logprob <= 0
        firsts = {}
        for temperature in (1.0, 0.5):
            chunks = await _collect(
                engine.add_request(
                    _req(
                        f"t{temperature}",
                        None,
                        prompt,
                        max_tokens=1,
                        temperature=temperature,
                        seed=1,
                        **asked,
                    )
                )
            )
            firsts[temperature] = chunks[0].tokens[0].top_logprobs[0][1]
        if engine.capabilities.logprobs == "raw":  # the raw logits: temperature plays no part
            assert firsts[0.5] == pytest.approx(firsts[1.0])
        else:  # the distribution sampled from: sharper at a lower temperature
            assert firsts[0.5] > firsts[1.0]


WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer"},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}


async def test_a_forced_tool_call_yields_schema_valid_arguments(
    make_engine: EngineFactory, tiny_model_dir: Path
) -> None:
    async with make_engine(tiny_model_dir) as engine:
        assert {"tool_call", "json_schema"} <= engine.capabilities.constraints
        functions = {"get_weather": WEATHER, "get_time": None}
        tools = [{"type": "function", "function": {"name": n}} for n in functions]
        for name in ("get_weather", None):
            choice: Any = (
                "required" if name is None else {"type": "function", "function": {"name": name}}
            )
            prompt_text = "weather?" + forced_call_prefix(choice, tools)
            prompt = list(engine.tokenizer.encode(prompt_text))
            spec = ToolCallSpec(functions=functions, name=name)
            streams = [
                engine.add_request(
                    _req(
                        f"c{name}{s}",
                        None,
                        prompt,
                        max_tokens=150,
                        temperature=1.0,
                        seed=s,
                        guided=spec,
                    )
                )
                for s in range(3)
            ]
            for chunks in await asyncio.gather(*(_collect(s) for s in streams)):
                text = "".join(c.text for c in chunks)
                text += completion_suffix(call_grammar(functions, name), text)  # when cut short
                opened = prompt_text.split("<tool_call>")[1]
                call = json.loads(opened + text)
                assert call["name"] in ({name} if name else set(functions))
                jsonschema.validate(
                    call["arguments"], functions[call["name"]] or {"type": "object"}
                )
        with pytest.raises(InvalidRequestError):  # refused at once: no value satisfies it
            engine.add_request(
                _req(
                    "bad",
                    None,
                    prompt,
                    guided=JSONSchemaSpec(
                        {"type": "object", "required": ["x"], "additionalProperties": False}
                    ),
                )
            )


async def test_a_json_schema_spec_yields_a_valid_object(
    make_engine: EngineFactory, tiny_model_dir: Path
) -> None:
    async with make_engine(tiny_model_dir) as engine:
        prompt = list(engine.tokenizer.encode("json:"))
        spec = JSONSchemaSpec(WEATHER)
        chunks = await _collect(
            engine.add_request(
                _req("j", None, prompt, max_tokens=300, temperature=0.0, guided=spec)
            )
        )
        text = "".join(c.text for c in chunks)
        if chunks[-1].finish_reason == "stop":
            jsonschema.validate(json.loads(text), WEATHER)
        else:  # cut short: still a valid prefix that completes to a valid object
            from clora_feedback.chat_format.constraint import object_grammar

            jsonschema.validate(
                json.loads(text + completion_suffix(object_grammar(WEATHER), text)), WEATHER
            )


def test_engine_kind_selects_the_engine(tiny_model_dir: Path) -> None:
    with pytest.raises(ConfigError, match=r"engine\.vllm\.urls"):
        build_engine(EngineConfig(kind="vllm"), tiny_model_dir, "tiny-base")
    engine = build_engine(EngineConfig(max_model_len=64), tiny_model_dir, "tiny-base")
    assert engine.model_name == "tiny-base" and engine.capabilities.per_token_versions
    remote = build_engine(
        EngineConfig(kind="vllm", vllm={"urls": ["http://127.0.0.1:9"]}), tiny_model_dir, "t"
    )
    assert remote.capabilities.logprobs == "raw"
    assert not remote.capabilities.per_token_versions
