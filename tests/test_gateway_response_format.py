"""`response_format` on `/v1/chat/completions`, through the official openai client.

The embedded engine compiles the request's `JSONSchemaSpec`, so even the tiny
random model answers with one JSON object that validates against the schema
(checked with `jsonschema`); refusals are 400s naming `response_format`. The
random model pads with whitespace (up to the constraint's cap per position), so
replies get a budget that bounded schemas always finish within; an "any object"
reply may write endless strings, so a cut one must still be a JSON prefix.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from clora_feedback.chat_format.constraint import completion_suffix, object_grammar

if TYPE_CHECKING:
    from conftest import GatewayServer

ASK = [{"role": "user", "content": "Answer in JSON: is the sky blue?"}]
BUDGET = 1200
"""Tokens per reply: the schemas below finish within it even at 32 whitespace tokens a position."""
VERDICT = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "enum": ["yes", "no"]},
        "sure": {"type": "boolean"},
    },
    "required": ["answer", "sure"],
    "additionalProperties": False,
}
TAGS = {
    "type": "object",
    "properties": {
        "tags": {
            "type": "array",
            "items": {"enum": ["red", "green"]},
            "minItems": 1,
            "maxItems": 3,
        },
        "note": {"type": "null"},
    },
    "required": ["tags", "note"],
    "additionalProperties": False,
}
NESTED = {
    "type": "object",
    "$defs": {"level": {"type": "string", "enum": ["low", "high"]}},
    "properties": {
        "risk": {"$ref": "#/$defs/level"},
        "detail": {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"level": {"$ref": "#/$defs/level"}, "ok": {"type": "boolean"}},
                    "required": ["level", "ok"],
                    "additionalProperties": False,
                },
                {"type": "null"},
            ]
        },
    },
    "required": ["risk", "detail"],
    "additionalProperties": False,
}


def json_schema_format(schema: dict[str, Any] | None, **extra: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {"name": "reply", **extra}
    if schema is not None:
        spec["schema"] = schema
    return {"type": "json_schema", "json_schema": spec}


def test_the_wire_model_has_the_openai_packages_fields() -> None:
    from openai.types.shared.response_format_json_schema import JSONSchema

    from clora_feedback.schemas.openai import JSONSchemaFormat

    def wire_names(model: Any) -> set[str]:
        return {f.alias or name for name, f in model.model_fields.items()}

    assert wire_names(JSONSchemaFormat) == wire_names(JSONSchema)


def ask(gateway: GatewayServer, response_format: Any, **kwargs: Any) -> Any:
    params: dict[str, Any] = {"model": "support", "messages": ASK, "max_tokens": BUDGET, **kwargs}
    return gateway.openai().chat.completions.create(response_format=response_format, **params)


@pytest.mark.parametrize("schema", [VERDICT, TAGS, NESTED], ids=["enum", "array", "refs"])
def test_json_schema_replies_validate(
    module_gateway: GatewayServer, schema: dict[str, Any]
) -> None:
    reply = ask(module_gateway, json_schema_format(schema, strict=True), n=3, seed=7)
    for choice in reply.choices:
        assert choice.finish_reason == "stop"
        assert choice.message.tool_calls is None
        jsonschema.validate(json.loads(choice.message.content or ""), schema)


def assert_json_objects(reply: Any) -> None:
    """Finished choices are JSON objects; choices cut by the budget are prefixes of one."""
    finished = 0
    for choice in reply.choices:
        content = choice.message.content or ""
        if choice.finish_reason == "length":
            content += completion_suffix(object_grammar(None), content)
            assert content != choice.message.content, "a cut reply cannot be complete"
        else:
            assert choice.finish_reason == "stop"
            finished += 1
        assert isinstance(json.loads(content), dict)
    assert finished


@pytest.mark.parametrize(
    "response_format", [{"type": "json_object"}, json_schema_format(None)], ids=["object", "none"]
)
def test_any_object_replies_are_objects(
    module_gateway: GatewayServer, response_format: Any
) -> None:
    assert_json_objects(ask(module_gateway, response_format, max_tokens=300, n=3, seed=7))


def test_text_is_unconstrained(module_gateway: GatewayServer) -> None:
    kwargs: dict[str, Any] = {"max_tokens": 6, "seed": 11}
    plain = module_gateway.openai().chat.completions.create(model="support", messages=ASK, **kwargs)
    text = ask(module_gateway, {"type": "text"}, **kwargs)
    assert text.choices[0].message.content == plain.choices[0].message.content


def test_stream_matches_non_stream(module_gateway: GatewayServer) -> None:
    fmt = json_schema_format(VERDICT)
    whole = ask(module_gateway, fmt, seed=5).choices[0].message.content
    parts = []
    reasons = []
    for chunk in ask(module_gateway, fmt, seed=5, stream=True):
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            if choice.finish_reason:
                reasons.append(choice.finish_reason)
    assert "".join(parts) == whole and reasons == ["stop"]
    jsonschema.validate(json.loads(whole or ""), VERDICT)


def test_tools_offered_with_auto_are_not_parsed_from_a_json_reply(
    module_gateway: GatewayServer,
) -> None:
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
    reply = ask(module_gateway, json_schema_format(VERDICT), tools=[tool], seed=2)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None
    jsonschema.validate(json.loads(choice.message.content or ""), VERDICT)


class Verdict(BaseModel):
    answer: Literal["yes", "no"]
    sure: bool


def test_the_clients_parse_helper_gets_its_model(module_gateway: GatewayServer) -> None:
    """`chat.completions.parse` sends a strict schema built from a pydantic model and parses it."""
    reply = module_gateway.openai().chat.completions.parse(
        model="support", messages=ASK, response_format=Verdict, max_tokens=BUDGET, seed=1
    )
    assert isinstance(reply.choices[0].message.parsed, Verdict)


def test_the_trajectory_records_the_response_format(module_gateway: GatewayServer) -> None:
    reply = ask(module_gateway, json_schema_format(VERDICT, strict=True), seed=4)
    with module_gateway.http() as http:
        record = http.get(f"/v1/trajectories/{reply.id}").json()
    assert record["request"]["response_format"]["json_schema"]["schema"] == VERDICT


@pytest.mark.parametrize(
    ("response_format", "param"),
    [
        (json_schema_format({"type": "string"}), "response_format"),
        (json_schema_format({"required": ["a"], "additionalProperties": False}), "response_format"),
        (
            json_schema_format({"type": "object", "properties": {"a": {"type": "date"}}}),
            "response_format",
        ),
        ({"type": "json_schema"}, "response_format.json_schema"),
        (
            {"type": "json_schema", "json_schema": {"name": "no spaces"}},
            "response_format.json_schema.name",
        ),
        (
            {"type": "json_schema", "json_schema": {"schema": {}}},
            "response_format.json_schema.name",
        ),
        ({"type": "yaml"}, "response_format.type"),
    ],
)
def test_bad_response_formats_are_400s(
    module_gateway: GatewayServer, response_format: Any, param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        ask(module_gateway, response_format, max_tokens=2)
    assert info.value.status_code == 400
    assert info.value.param == param


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "lookup"}}]
)
def test_a_forced_tool_call_and_a_json_reply_are_refused_together(
    module_gateway: GatewayServer, tool_choice: Any
) -> None:
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError) as info:
        ask(module_gateway, {"type": "json_object"}, tools=[tool], tool_choice=tool_choice)
    assert info.value.param == "response_format"
    assert "tool_choice" in info.value.message


class Step(BaseModel):
    kind: Literal["read", "write"]
    done: bool


class Plan(BaseModel):
    """A nested model as agents send them: `$defs`, bounded lists, Optional, enums.

    No free strings: the random model could write one forever (bounds are not enforced).
    """

    steps: list[Step] = Field(max_length=2)
    risk: Literal["low", "high"]
    owner: Step | None


def test_parse_and_stream_with_a_nested_pydantic_model(module_gateway: GatewayServer) -> None:
    client = module_gateway.openai()
    kwargs: dict[str, Any] = {
        "model": "support",
        "messages": ASK,
        "response_format": Plan,
        "max_tokens": BUDGET,
        "seed": 3,
        "temperature": 0.7,
    }
    reply = client.chat.completions.parse(**kwargs)
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(reply.choices[0].message.parsed, Plan)
    with client.chat.completions.stream(**kwargs) as stream:
        kinds = {event.type for event in stream}
        final = stream.get_final_completion()
    assert "content.done" in kinds
    assert isinstance(final.choices[0].message.parsed, Plan)
