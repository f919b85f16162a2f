"""`/v1/chat/completions` through the official openai client against a real server."""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any

import jsonschema
import pytest

if TYPE_CHECKING:
    from conftest import GatewayServer

HI = [{"role": "user", "content": "hello there"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}


def clora(obj: Any) -> dict[str, Any]:
    extension: dict[str, Any] = obj.model_extra["clora"]
    return extension


def test_non_stream_response_shape_and_extension(module_gateway: GatewayServer) -> None:
    client = module_gateway.openai()
    reply = client.chat.completions.create(model="support", messages=HI, max_tokens=12, seed=3)
    assert (
        reply.id.startswith("chatcmpl-")
        and reply.object == "chat.completion"
        and reply.model == "support"
    )
    [choice] = reply.choices
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    top, per_choice = clora(reply), clora(choice)
    tokenizer = module_gateway.engine.tokenizer
    prompt = tokenizer.apply_chat_template(HI, tokenize=False, add_generation_prompt=True)
    assert top["prompt_token_ids"] == tokenizer.encode(prompt, add_special_tokens=False)
    assert (top["agent"], top["adapter_version"]) == ("support", 0)
    ids = per_choice["token_ids"]
    assert per_choice["token_versions"] == [0] * len(ids)
    assert reply.usage is not None
    assert reply.usage.completion_tokens == len(ids) <= 12
    assert reply.usage.prompt_tokens == len(top["prompt_token_ids"])
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    assert choice.message.content == tokenizer.decode(ids, skip_special_tokens=True)
    if choice.finish_reason == "length":
        assert len(ids) == 12


def test_base_model_name_is_served_without_agent(module_gateway: GatewayServer) -> None:
    reply = module_gateway.openai().chat.completions.create(
        model="tiny-base", messages=HI, max_tokens=2
    )
    assert clora(reply)["agent"] is None and clora(reply)["adapter_version"] == 0


def test_seeded_n_choices_repeat_single_requests(module_gateway: GatewayServer) -> None:
    client = module_gateway.openai()
    many = client.chat.completions.create(model="support", messages=HI, max_tokens=8, n=3, seed=40)
    assert [c.index for c in many.choices] == [0, 1, 2]
    for choice in many.choices:
        single = client.chat.completions.create(
            model="support", messages=HI, max_tokens=8, seed=40 + choice.index
        )
        assert clora(single.choices[0])["token_ids"] == clora(choice)["token_ids"]
    assert many.usage is not None
    assert many.usage.completion_tokens == sum(len(clora(c)["token_ids"]) for c in many.choices)


def test_stream_matches_non_stream_and_ends_with_usage(module_gateway: GatewayServer) -> None:
    client = module_gateway.openai()
    kwargs: dict[str, Any] = {"model": "support", "messages": HI, "max_tokens": 10, "seed": 5}
    whole = client.chat.completions.create(**kwargs)
    chunks = list(
        client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
    )
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    assert clora(chunks[0])["prompt_token_ids"] == clora(whole)["prompt_token_ids"]
    body = [c for c in chunks if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in body)
    ids = [t for c in body[1:] for t in clora(c.choices[0])["token_ids"]]
    assert text == whole.choices[0].message.content
    assert ids == clora(whole.choices[0])["token_ids"]
    assert body[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert usage_chunk.usage.completion_tokens == len(ids)
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_with_n_choices(module_gateway: GatewayServer) -> None:
    stream = module_gateway.openai().chat.completions.create(
        model="sales", messages=HI, max_tokens=6, n=2, seed=1, stream=True
    )
    finished: dict[int, str] = {}
    for chunk in stream:
        for choice in chunk.choices:
            if choice.finish_reason is not None:
                finished[choice.index] = choice.finish_reason
    assert set(finished) == {0, 1}


def test_stop_string_cuts_the_content(module_gateway: GatewayServer) -> None:
    client = module_gateway.openai()
    kwargs: dict[str, Any] = {
        "model": "support",
        "messages": HI,
        "max_tokens": 40,
        "temperature": 0,
    }
    free = client.chat.completions.create(**kwargs).choices[0].message.content or ""
    assert len(free) > 12, "greedy output is long enough to cut"
    stop = free[8:11]
    cut = client.chat.completions.create(**kwargs, stop=[stop]).choices[0]
    assert cut.message.content == free[: free.find(stop)]
    assert cut.finish_reason == "stop"


def test_logprobs_shape(module_gateway: GatewayServer) -> None:
    reply = module_gateway.openai().chat.completions.create(
        model="support", messages=HI, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    choice = reply.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    ids = clora(choice)["token_ids"]
    assert len(choice.logprobs.content) == len(ids)
    tokenizer = module_gateway.engine.tokenizer
    for entry, token_id in zip(choice.logprobs.content, ids, strict=True):
        assert entry.logprob <= 0
        assert len(entry.top_logprobs) == 3
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        # Greedy: the sampled token is the most likely one.
        assert entry.logprob == pytest.approx(values[0])
        if token_id not in tokenizer.all_special_ids:
            assert bytes(entry.bytes or []).decode("utf-8", errors="replace") == entry.token
    no_lp = module_gateway.openai().chat.completions.create(
        model="support", messages=HI, max_tokens=2
    )
    assert no_lp.choices[0].logprobs is None


def test_logprobs_in_stream(module_gateway: GatewayServer) -> None:
    stream = module_gateway.openai().chat.completions.create(
        model="support", messages=HI, max_tokens=5, logprobs=True, top_logprobs=1, stream=True
    )
    # `logprobs.content` lists the tokens `content` shows: special tokens (an
    # end-of-turn the random model may emit) keep only their id in `clora`.
    special = set(module_gateway.engine.tokenizer.all_special_ids)
    counted = 0
    for chunk in stream:
        for choice in chunk.choices:
            ids = clora(choice)["token_ids"] if "clora" in (choice.model_extra or {}) else []
            n = sum(1 for t in ids if t not in special)
            if n:
                assert choice.logprobs is not None and len(choice.logprobs.content or []) == n
                counted += n
    assert counted >= 1


@pytest.mark.parametrize("max_tokens", [3, 12, 200])
@pytest.mark.parametrize("forced", ["named", "required"])
def test_forced_tool_calls_are_always_well_formed(
    module_gateway: GatewayServer, forced: str, max_tokens: int
) -> None:
    choice_param: Any = (
        {"type": "function", "function": {"name": "get_weather"}}
        if forced == "named"
        else "required"
    )
    reply = module_gateway.openai().chat.completions.create(
        model="support",
        messages=[{"role": "user", "content": "weather in Paris?"}],
        tools=[WEATHER, CLOCK],
        tool_choice=choice_param,
        max_tokens=max_tokens,
        n=3,
        seed=max_tokens,
    )
    for choice in reply.choices:
        assert choice.finish_reason == "tool_calls"
        calls = choice.message.tool_calls or []
        assert len(calls) == 1
        call = calls[0]
        assert call.type == "function" and call.id.startswith("call_")
        assert isinstance(json.loads(call.function.arguments), dict)
        if forced == "named":
            assert call.function.name == "get_weather"
        else:
            assert call.function.name in ("get_weather", "get_time")
        # The arguments follow the declared parameters too (the required "city" included).
        declared = {"get_weather": WEATHER, "get_time": CLOCK}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), declared["function"]["parameters"])


def test_forced_tool_call_streams_one_complete_delta(module_gateway: GatewayServer) -> None:
    stream = module_gateway.openai().chat.completions.create(
        model="support",
        messages=[{"role": "user", "content": "time?"}],
        tools=[WEATHER, CLOCK],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=30,
        stream=True,
    )
    calls = []
    reasons = []
    chunk_id = ""
    for chunk in stream:
        chunk_id = chunk.id
        for choice in chunk.choices:
            calls += choice.delta.tool_calls or []
            if choice.finish_reason:
                reasons.append(choice.finish_reason)
    assert reasons == ["tool_calls"]
    assert len(calls) == 1 and calls[0].function is not None
    assert calls[0].function.name == "get_time"
    assert isinstance(json.loads(calls[0].function.arguments or ""), dict)
    # The trajectory records the same call id the client saw.
    with module_gateway.http() as http:
        record = http.get(f"/v1/trajectories/{chunk_id}").json()
    assert record["samples"][0]["tool_calls"][0]["id"] == calls[0].id
    assert record["samples"][0]["finish_reason"] == "tool_calls"


def test_multi_turn_with_tool_results(module_gateway: GatewayServer) -> None:
    client = module_gateway.openai()
    first = client.chat.completions.create(
        model="support",
        messages=[{"role": "user", "content": "weather in Paris?"}],
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=20,
    )
    call = (first.choices[0].message.tool_calls or [])[0]
    history: list[Any] = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "weather in Paris?"},
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21C"},
    ]
    second = client.chat.completions.create(
        model="support", messages=history, tools=[WEATHER], max_tokens=5
    )
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    prompt = module_gateway.engine.tokenizer.decode(clora(second)["prompt_token_ids"])
    assert '<tool_response name="get_weather">sunny, 21C</tool_response>' in prompt
    # The earlier call is rendered back exactly as the model is asked to write calls.
    arguments = json.dumps(json.loads(call.function.arguments))
    assert f'<tool_call>{{"name": "get_weather", "arguments": {arguments}}}</tool_call>' in prompt
    assert "You are terse." in prompt


def test_tool_message_must_answer_a_call(module_gateway: GatewayServer) -> None:
    from openai import BadRequestError

    with pytest.raises(BadRequestError) as info:
        module_gateway.openai().chat.completions.create(
            model="support",
            messages=[*HI, {"role": "tool", "tool_call_id": "nope", "content": "x"}],
            max_tokens=2,
        )
    assert info.value.param == "messages[1].tool_call_id"


def test_trajectory_is_recorded_before_the_reply(module_gateway: GatewayServer) -> None:
    client = module_gateway.openai()
    reply = client.chat.completions.create(
        model="sales", messages=HI, max_tokens=4, n=2, seed=9, logprobs=True
    )
    with module_gateway.http() as http:
        record = http.get(f"/v1/trajectories/{reply.id}").json()
        assert record["id"] == reply.id and record["agent"] == "sales" and record["kind"] == "chat"
        assert record["prompt_token_ids"] == clora(reply)["prompt_token_ids"]
        assert record["request"]["messages"] == HI
        for sample, choice in zip(record["samples"], reply.choices, strict=True):
            assert sample["completion_token_ids"] == clora(choice)["token_ids"]
            assert sample["token_versions"] == clora(choice)["token_versions"]
            assert choice.logprobs is not None and choice.logprobs.content is not None
            assert sample["logprobs"] == pytest.approx([t.logprob for t in choice.logprobs.content])
            assert sample["finish_reason"] == choice.finish_reason
        assert record["timings"]["total_s"] >= record["timings"]["ttft_s"] >= 0

        stream = client.chat.completions.create(
            model="sales", messages=HI, max_tokens=3, stream=True
        )
        (streamed_id,) = {c.id for c in stream}  # reads the whole stream, through [DONE]
        # The stream is over ([DONE] received): the trajectory must already be there.
        assert http.get(f"/v1/trajectories/{streamed_id}").status_code == 200
        listed = http.get("/v1/trajectories", params={"agent": "sales", "limit": 2}).json()["data"]
        assert [r["id"] for r in listed] == [streamed_id, reply.id]


async def test_async_client_concurrent_agents(module_gateway: GatewayServer) -> None:
    client = module_gateway.async_openai()
    models = ["support", "sales", "tiny-base", "support"]
    replies = await asyncio.gather(
        *(
            client.chat.completions.create(model=m, messages=HI, max_tokens=5, seed=i)
            for i, m in enumerate(models)
        )
    )
    assert [r.model for r in replies] == models
    assert len({r.id for r in replies}) == len(models)
    stream = await client.chat.completions.create(
        model="support", messages=HI, max_tokens=3, stream=True
    )
    chunks = [c async for c in stream]
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    await client.close()


def _raw_stream(gateway: GatewayServer, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The SSE events of one streamed request as JSON, each checked against the official spec."""
    from openai_spec import validate

    events = []
    with gateway.http() as http, http.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[len("data: ") :])
                validate("CreateChatCompletionStreamResponse", event)
                events.append(event)
    return events


def test_streamed_tool_call_finishes_in_its_own_chunk(module_gateway: GatewayServer) -> None:
    """The SDK's stream helper fires `arguments.done` and the final content is null."""
    client = module_gateway.openai()
    kwargs: dict[str, Any] = {
        "model": "support",
        "messages": [{"role": "user", "content": "weather?"}],
        "tools": [WEATHER, CLOCK],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "max_tokens": 40,
        "seed": 2,
    }
    with client.chat.completions.stream(**kwargs) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_completion()
    assert "tool_calls.function.arguments.done" in kinds
    message = final.choices[0].message
    assert message.content is None and final.choices[0].finish_reason == "tool_calls"
    [call] = message.tool_calls or []
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    chunks = _raw_stream(module_gateway, {**kwargs, "stream": True})
    last = [c for c in chunks if c["choices"]][-1]["choices"][0]
    assert last["finish_reason"] == "tool_calls" and last["delta"] == {}
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1] if c["choices"])


def test_logprobs_list_the_tokens_of_the_content(module_gateway: GatewayServer) -> None:
    """The end-of-turn token has no text: logprobs leave it out, the clora ids keep it."""
    tokenizer = module_gateway.engine.tokenizer
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    client = module_gateway.openai()
    checked = 0
    for seed in range(40):
        reply = client.chat.completions.create(
            model="support", messages=HI, max_tokens=60, seed=seed, logprobs=True
        )
        choice = reply.choices[0]
        assert choice.logprobs is not None and choice.logprobs.content is not None
        entries = choice.logprobs.content
        joined = b"".join(bytes(t.bytes or []) for t in entries)
        assert joined.decode("utf-8", errors="replace") == choice.message.content
        ids = clora(choice)["token_ids"]
        assert len(entries) == sum(t not in tokenizer.all_special_ids for t in ids)
        if ids[-1:] == [eos]:
            checked += 1
            if checked == 2:
                break
    assert checked, "some seed ends its reply with the end-of-turn token"
