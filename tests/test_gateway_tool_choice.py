"""Calls the model chooses (`tool_choice` "auto") are constrained like forced ones.

The tiny random model never opens a call by itself, so these tests steer it:
`steer` adds a large logit to the next token of a script for the first tokens
of every sequence (a model that decided to call a tool), then lets it sample
freely. The engine, the constraint, the gateway and the client are the real
ones: once the script has opened a call with `<tool_call>`, whatever the random
model writes must still end as a call of a declared tool whose arguments follow
its schema.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import jsonschema
import openai
import pytest
from pydantic import BaseModel

if TYPE_CHECKING:
    from conftest import GatewayServer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Oslo"]},
                "unit": {"type": "string", "enum": ["C", "F"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
        "strict": True,
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    },
}
ASK = [{"role": "user", "content": "weather in Paris?"}]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}


def steer(gateway: GatewayServer, monkeypatch: pytest.MonkeyPatch, script: str) -> None:
    """Make every sequence start with `script`, then sample as the model likes."""
    engine = gateway.engine
    ids = engine.tokenizer.encode(script, add_special_tokens=False)
    original = engine._accept

    def accept(seqs: list[Any], logits: Any) -> None:
        logits = logits.clone()
        for row, seq in enumerate(seqs):
            if seq.generated < len(ids):
                logits[row, ids[seq.generated]] += 1e4
        original(seqs, logits)

    monkeypatch.setattr(engine, "_accept", accept)


def assert_valid_calls(message: Any) -> list[Any]:
    calls = message.tool_calls or []
    for call in calls:
        declared = SCHEMAS[call.function.name]["function"]["parameters"]
        jsonschema.validate(json.loads(call.function.arguments), declared)
    return calls


@pytest.mark.parametrize(
    "script",
    [
        'Let me check. <tool_call>{"name": "get_weather", "arguments": {"ci',
        "<tool_call>",
        '<tool_call>{"name": "get_w',
    ],
)
def test_a_call_the_model_opens_follows_the_schema(
    module_gateway: GatewayServer, monkeypatch: pytest.MonkeyPatch, script: str
) -> None:
    steer(module_gateway, monkeypatch, script)
    reply = module_gateway.openai().chat.completions.create(
        model="support", messages=ASK, tools=[WEATHER, CLOCK], max_tokens=400, n=3, seed=7
    )
    for choice in reply.choices:
        assert choice.finish_reason == "tool_calls", choice.message.content
        calls = assert_valid_calls(choice.message)
        assert calls and calls[0].function.name in SCHEMAS
        if "get_w" in script:
            assert calls[0].function.name == "get_weather"


def test_a_call_cut_by_max_tokens_is_closed(
    module_gateway: GatewayServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    steer(module_gateway, monkeypatch, '<tool_call>{"name": "get_weather", "arguments": {"')
    kwargs: dict[str, Any] = {
        "model": "support",
        "messages": ASK,
        "tools": [WEATHER],
        "max_tokens": 45,
        "seed": 1,
    }
    reply = module_gateway.openai().chat.completions.create(**kwargs)
    [call] = assert_valid_calls(reply.choices[0].message)
    assert reply.choices[0].finish_reason == "tool_calls"
    chunks = list(module_gateway.openai().chat.completions.create(**kwargs, stream=True))
    streamed = [t for c in chunks for ch in c.choices for t in ch.delta.tool_calls or []]
    assert [t.function.arguments for t in streamed] == [call.function.arguments]


def test_parallel_tool_calls_false_allows_one_call(
    module_gateway: GatewayServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    two = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>' * 2
    steer(module_gateway, monkeypatch, two)
    client = module_gateway.openai()
    kwargs: dict[str, Any] = {"model": "support", "messages": ASK, "tools": [CLOCK], "seed": 3}
    several = client.chat.completions.create(**kwargs, max_tokens=len(two) + 1)
    assert len(several.choices[0].message.tool_calls or []) == 2
    one = client.chat.completions.create(**kwargs, max_tokens=200, parallel_tool_calls=False)
    assert len(one.choices[0].message.tool_calls or []) == 1
    assert one.choices[0].finish_reason == "tool_calls"
    # The prompt says so too.
    prompt = module_gateway.engine.tokenizer.decode(one.model_extra["clora"]["prompt_token_ids"])
    assert "at most one call" in prompt and "several calls" not in prompt


class GetWeather(BaseModel):
    """Current weather for a city."""

    city: str
    days: int


def test_parse_with_a_strict_pydantic_tool(
    module_gateway: GatewayServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`pydantic_function_tool` sends `strict: true`; the SDK parses the arguments into the model."""
    steer(module_gateway, monkeypatch, 'Sure. <tool_call>{"name": "GetWeather", "arguments": {')
    reply = module_gateway.openai().chat.completions.parse(
        model="support",
        messages=ASK,
        tools=[openai.pydantic_function_tool(GetWeather)],
        max_tokens=600,
        seed=5,
        temperature=0.6,
    )
    message = reply.choices[0].message
    [call] = message.tool_calls or []
    assert isinstance(call.function.parsed_arguments, GetWeather)


def test_an_engine_without_triggered_calls_refuses_strict_tools(
    module_gateway: GatewayServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Like vLLM today: forced calls only. Strict tools are a 400 naming `tools` rather
    than a promise silently broken; other tools are served unconstrained, as before."""
    from dataclasses import replace

    engine = module_gateway.engine
    forced_only = replace(engine.capabilities, constraints=frozenset({"json_schema", "tool_call"}))
    monkeypatch.setattr(type(engine), "capabilities", property(lambda self: forced_only))
    client = module_gateway.openai()
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="support", messages=ASK, tools=[WEATHER], max_tokens=4)
    assert info.value.param == "tools" and "tool_call_trigger" in info.value.message
    loose = client.chat.completions.create(
        model="support", messages=ASK, tools=[CLOCK], max_tokens=4
    )
    assert loose.choices[0].finish_reason in ("stop", "length", "tool_calls")
    forced = client.chat.completions.create(
        model="support", messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=60
    )
    assert assert_valid_calls(forced.choices[0].message)
