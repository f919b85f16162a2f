"""The gateway's per-request fast paths behave as the general ones they stand in for.

- `GenerationRun` with one choice reads its stream directly (no merge task):
  the same events, the same errors, an engine abort is an `EngineError`, and
  leaving early aborts the engine request at once;
- `choice_extension` is `CloraChoiceExtension(...).model_dump()`;
- the vLLM engine's loop stream hands chunks over in order, without the
  thread-safe wake-up.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from clora_feedback.engine.stream import RequestStreamImpl
from clora_feedback.engine.types import (
    EngineCapabilities,
    GenerationRequest,
    RequestOutput,
    SamplingParams,
    TokenEvent,
)
from clora_feedback.engine.vllm.engine import _LoopStream
from clora_feedback.errors import EngineError, InvalidRequestError
from clora_feedback.gateway.generation import GenerationRun
from clora_feedback.schemas.openai import CloraChoiceExtension, choice_extension


@dataclass
class _ScriptedEngine:
    """Answers each request with the scripted chunks (or error), pushed at once."""

    script: list[RequestOutput | Exception]
    capabilities: EngineCapabilities = field(
        default_factory=lambda: EngineCapabilities(
            per_token_versions=True, logprobs="raw", in_memory_adapters=False
        )
    )
    aborted: list[str] = field(default_factory=list)

    def add_requests(self, requests: list[GenerationRequest]) -> list[RequestStreamImpl]:
        return [self.add_request(r) for r in requests]

    def add_request(self, request: GenerationRequest) -> RequestStreamImpl:
        stream = RequestStreamImpl(
            request.request_id, asyncio.get_running_loop(), self.aborted.append
        )
        for item in self.script:
            if isinstance(item, Exception):
                stream.push(InvalidRequestError(str(item)))
            else:
                stream.push(
                    RequestOutput(
                        request.request_id,
                        item.tokens,
                        item.text,
                        item.finished,
                        item.finish_reason,
                        item.prompt_tokens,
                    )
                )
        return stream


def _token(i: int) -> TokenEvent:
    return TokenEvent(i, -0.5, 3, ())


def _run(engine: _ScriptedEngine, n: int) -> GenerationRun:
    sampling = SamplingParams(max_tokens=4)
    return GenerationRun(
        engine,  # type: ignore[arg-type]
        completion_id="c",
        agent=None,
        prompts=[[1, 2]],
        sampling=sampling,
        n=n,
    )


SCRIPT: list[RequestOutput | Exception] = [
    RequestOutput("x", [_token(7)], "a"),
    RequestOutput("x", [_token(8)], "b"),
    RequestOutput("x", [], "", True, "length"),
]


@pytest.mark.parametrize("n", [1, 2])
async def test_one_choice_and_several_give_the_same_events(n: int) -> None:
    run = _run(_ScriptedEngine(list(SCRIPT)), n)
    choices = await run.run()
    assert [c.token_ids for c in choices] == [[7, 8]] * n
    assert [c.text for c in choices] == ["ab"] * n
    assert [c.finish_reason for c in choices] == ["length"] * n
    assert [c.versions for c in choices] == [[3, 3]] * n
    assert run.finished_at is not None


@pytest.mark.parametrize("n", [1, 2])
async def test_an_engine_abort_is_an_error(n: int) -> None:
    script: list[RequestOutput | Exception] = [RequestOutput("x", [], "", True, "abort")]
    with pytest.raises(EngineError, match="aborted"):
        await _run(_ScriptedEngine(script), n).run()


@pytest.mark.parametrize("n", [1, 2])
async def test_an_engine_error_propagates(n: int) -> None:
    script: list[RequestOutput | Exception] = [SCRIPT[0], ValueError("refused")]
    with pytest.raises(InvalidRequestError, match="refused"):
        await _run(_ScriptedEngine(script), n).run()


@pytest.mark.parametrize("n", [1, 2])
async def test_leaving_early_aborts_every_request_at_once(n: int) -> None:
    engine = _ScriptedEngine([SCRIPT[0]])  # still generating when the client leaves
    run = _run(engine, n)
    events = run.events()
    await anext(events)
    await events.aclose()  # the client left after the first token
    assert sorted(engine.aborted) == [f"c-{i}" for i in range(n)]
    assert run.finished_at is None


def test_choice_extension_is_the_models_dump() -> None:
    cases = (([], [], None), ([5], [0], None), ([1, 2, 3], [2, 2, 3], "cmpl-x-p1"))
    for ids, versions, completion_id in cases:
        expected = CloraChoiceExtension(
            token_ids=ids, token_versions=versions, completion_id=completion_id
        ).model_dump(exclude_none=True)
        got = choice_extension(ids, versions, completion_id)
        assert got == expected
        assert list(got) == list(expected)
        assert got["token_ids"] is not ids  # copies, as the model makes


async def test_loop_stream_hands_chunks_over_in_order_without_a_wake_up() -> None:
    stream = _LoopStream("r", asyncio.get_running_loop(), lambda _: None)
    for i in range(3):
        stream.push(RequestOutput("r", [_token(i)], str(i), i == 2, "stop" if i == 2 else None))
    assert stream._queue.qsize() == 3  # already queued: no call_soon_threadsafe round trip
    assert [c.text for c in await stream.collect()] == ["0", "1", "2"]
