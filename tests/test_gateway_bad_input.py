"""What outside clients and fuzzers sent, answered as OpenAI would (issue 25 items 1, 4, 5).

- a Responses content part whose `type` is not a string is a 400, not a 500;
- a `json_schema` response format with `strict: true` must be closed
  (`additionalProperties: false` on every object), as OpenAI requires: otherwise
  a 400 naming `response_format` (`text.format` on `/v1/responses`);
- parameters OpenAI documents that this gateway cannot honour (`reasoning_effort`,
  audio `modalities`, `audio`, `web_search_options`, `verbosity`) are 400s naming
  them, never silently ignored; their no-op values still pass.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from conftest import GatewayServer

ASK = [{"role": "user", "content": "hi"}]
CLOSED = {
    "type": "object",
    "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
    "required": ["answer"],
    "additionalProperties": False,
}
OPEN_NESTED = {
    "type": "object",
    "properties": {
        "answer": {"type": "string"},
        "detail": {"type": "object", "properties": {"why": {"type": "string"}}},
    },
    "required": ["answer", "detail"],
    "additionalProperties": False,
}


def _post(gateway: GatewayServer, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    with gateway.http() as http:
        response = http.post(path, json=body)
    return response.status_code, response.json()


def _error(gateway: GatewayServer, path: str, body: dict[str, Any]) -> dict[str, Any]:
    status, payload = _post(gateway, path, body)
    assert status == 400, payload
    error: dict[str, Any] = payload["error"]
    assert error["type"] == "invalid_request_error"
    return error


def _chat(**extra: Any) -> dict[str, Any]:
    return {"model": "support", "messages": ASK, "max_tokens": 2, **extra}


# ---------------------------------------------------------------- item 1


@pytest.mark.parametrize("kind", [{}, [], 7, None])
def test_a_responses_content_part_type_that_is_not_a_string_is_a_400(
    module_gateway: GatewayServer, kind: Any
) -> None:
    body = {
        "model": "support",
        "input": [{"role": "user", "content": [{"type": kind, "text": "hi"}]}],
        "max_output_tokens": 2,
    }
    error = _error(module_gateway, "/v1/responses", body)
    assert error["param"] is not None and error["param"].startswith("input")


def test_a_chat_content_part_type_that_is_not_a_string_is_a_400(
    module_gateway: GatewayServer,
) -> None:
    messages = [{"role": "user", "content": [{"type": {}, "text": "hi"}]}]
    error = _error(module_gateway, "/v1/chat/completions", _chat(messages=messages))
    assert error["param"] is not None and error["param"].startswith("messages")


# ---------------------------------------------------------------- item 4


def _format(schema: dict[str, Any] | None, strict: bool | None) -> dict[str, Any]:
    inner: dict[str, Any] = {"name": "reply"}
    if schema is not None:
        inner["schema"] = schema
    if strict is not None:
        inner["strict"] = strict
    return {"type": "json_schema", "json_schema": inner}


@pytest.mark.parametrize(
    ("schema", "context"),
    [
        ({"type": "object", "properties": {"a": {"type": "string"}}}, "()"),
        (OPEN_NESTED, "('properties', 'detail')"),
        ({**CLOSED, "additionalProperties": True}, "()"),
        (None, "()"),
    ],
)
def test_a_strict_schema_that_is_not_closed_is_a_400(
    module_gateway: GatewayServer, schema: dict[str, Any] | None, context: str
) -> None:
    error = _error(
        module_gateway, "/v1/chat/completions", _chat(response_format=_format(schema, True))
    )
    assert error["param"] == "response_format"
    assert "additionalProperties" in error["message"] and context in error["message"]


def test_closed_strict_and_open_non_strict_schemas_are_served(
    module_gateway: GatewayServer,
) -> None:
    for schema, strict in ((CLOSED, True), (OPEN_NESTED, False), (OPEN_NESTED, None)):
        status, payload = _post(
            module_gateway,
            "/v1/chat/completions",
            _chat(response_format=_format(schema, strict), max_tokens=4),
        )
        assert status == 200, payload


def test_a_strict_responses_text_format_that_is_not_closed_is_a_400(
    module_gateway: GatewayServer,
) -> None:
    body = {
        "model": "support",
        "input": "hi",
        "max_output_tokens": 2,
        "text": {
            "format": {"type": "json_schema", "name": "r", "schema": OPEN_NESTED, "strict": True}
        },
    }
    error = _error(module_gateway, "/v1/responses", body)
    assert error["param"] == "text.format" and "additionalProperties" in error["message"]


# ---------------------------------------------------------------- item 5


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"reasoning_effort": "low"}, "reasoning_effort"),
        ({"reasoning_effort": "minimal"}, "reasoning_effort"),
        ({"modalities": ["audio"]}, "modalities"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"audio": {"voice": "alloy", "format": "mp3"}}, "audio"),
        ({"web_search_options": {}}, "web_search_options"),
        ({"verbosity": "low"}, "verbosity"),
    ],
)
def test_parameters_this_model_cannot_honour_are_400s_naming_them(
    module_gateway: GatewayServer, extra: dict[str, Any], param: str
) -> None:
    error = _error(module_gateway, "/v1/chat/completions", _chat(**extra))
    assert error["param"] == param and error["code"] == "unsupported_parameter"


def test_their_no_op_values_are_served(module_gateway: GatewayServer) -> None:
    for extra in (
        {"modalities": ["text"]},
        {"reasoning_effort": None, "audio": None, "verbosity": None},
        {"prompt_cache_key": "k", "safety_identifier": "u-1"},
    ):
        status, payload = _post(module_gateway, "/v1/chat/completions", _chat(**extra))
        assert status == 200, (extra, payload)


def test_the_openai_client_sees_the_400(module_gateway: GatewayServer) -> None:
    import openai

    with pytest.raises(openai.BadRequestError) as info:
        module_gateway.openai().chat.completions.create(
            model="support", messages=ASK, max_tokens=2, reasoning_effort="high"
        )
    assert info.value.param == "reasoning_effort"  # type: ignore[attr-defined]
