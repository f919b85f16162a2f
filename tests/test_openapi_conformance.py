"""Real gateway responses validate against the official OpenAI OpenAPI schemas.

Every body an agent can receive from the OpenAI routes (chat, each stream
chunk, completions, the model list, error bodies) is checked with
`openai_spec.validate` against `components/schemas` of the official
description, so no change can drift from it unnoticed.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from openai_spec import validate

if TYPE_CHECKING:
    from conftest import GatewayFactory, GatewayServer

HI = [{"role": "user", "content": "hi"}]


def sse_events(response: httpx.Response) -> list[dict[str, Any]]:
    """The JSON `data:` events of an SSE response, `[DONE]` left out."""
    events: list[dict[str, Any]] = []
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            events.append(json.loads(line.removeprefix("data: ")))
    return events


@pytest.mark.parametrize(
    "extra",
    [{}, {"n": 2, "logprobs": True, "top_logprobs": 2}, {"stop": ["a"], "temperature": 0}],
)
def test_chat_completion(module_gateway: GatewayServer, extra: dict[str, Any]) -> None:
    body = {"model": "support", "messages": HI, "max_tokens": 4, **extra}
    with module_gateway.http() as http:
        response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    validate("CreateChatCompletionResponse", response.json())


@pytest.mark.parametrize(
    "extra",
    [{}, {"stream_options": {"include_usage": True}, "n": 2, "logprobs": True, "top_logprobs": 1}],
)
def test_chat_stream_chunks(module_gateway: GatewayServer, extra: dict[str, Any]) -> None:
    body = {"model": "support", "messages": HI, "max_tokens": 4, "stream": True, **extra}
    with module_gateway.http() as http, http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        chunks = sse_events(r)
    assert chunks
    for chunk in chunks:
        validate("CreateChatCompletionStreamResponse", chunk)


def test_chat_tool_call(module_gateway: GatewayServer) -> None:
    tool = {
        "type": "function",
        "function": {
            "name": "lookup",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        },
    }
    body = {
        "model": "support",
        "messages": HI,
        "max_tokens": 24,
        "tools": [tool],
        "tool_choice": {"type": "function", "function": {"name": "lookup"}},
    }
    with module_gateway.http() as http:
        response = http.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        validate("CreateChatCompletionResponse", response.json())
        with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            chunks = sse_events(r)
    for chunk in chunks:
        validate("CreateChatCompletionStreamResponse", chunk)


@pytest.mark.parametrize("extra", [{}, {"n": 2, "logprobs": 2}])
def test_completion(module_gateway: GatewayServer, extra: dict[str, Any]) -> None:
    body = {"model": "support", "prompt": "hello", "max_tokens": 4, **extra}
    with module_gateway.http() as http:
        response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    validate("CreateCompletionResponse", response.json())


def test_completion_stream_chunks(module_gateway: GatewayServer) -> None:
    # OpenAI streams legacy completions as CreateCompletionResponse objects, with
    # `finish_reason: null` until a choice ends; the spec has no stream schema for them
    # and types finish_reason as a plain string. So a pending null is checked to be the
    # last word only, and every other field against the spec.
    body = {"model": "support", "prompt": "hello", "max_tokens": 4, "stream": True}
    with module_gateway.http() as http, http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        chunks = sse_events(r)
    finished: set[int] = set()
    for chunk in chunks:
        if not chunk.get("choices"):  # a usage-only chunk has none
            continue
        for choice in chunk["choices"]:
            assert choice["index"] not in finished, "a chunk after the choice finished"
            if choice["finish_reason"] is None:
                choice["finish_reason"] = "stop"
            else:
                finished.add(choice["index"])
        validate("CreateCompletionResponse", chunk)
    assert finished == {0}


def test_models(module_gateway: GatewayServer) -> None:
    with module_gateway.http() as http:
        listed = http.get("/v1/models")
    assert listed.status_code == 200
    validate("ListModelsResponse", listed.json())
    for model in listed.json()["data"]:
        validate("Model", model)
        with module_gateway.http() as http:
            retrieved = http.get(f"/v1/models/{model['id']}")
        assert retrieved.status_code == 200
        validate("Model", retrieved.json())


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/v1/chat/completions", {"model": "support", "messages": []}),
        ("POST", "/v1/chat/completions", {"model": "nobody", "messages": HI}),
        ("POST", "/v1/chat/completions", "not json"),
        ("POST", "/v1/completions", {"model": "support", "prompt": "x", "max_tokens": 0}),
        ("GET", "/v1/nowhere", None),
        ("DELETE", "/v1/models", None),
        ("GET", "/v1/trajectories/chatcmpl-missing", None),
        ("GET", "/v1/models/nobody", None),
        ("POST", "/v1/completions", {"model": "support", "prompt": "x" * 5_000_000}),
    ],
)
def test_error_bodies(
    module_gateway: GatewayServer, method: str, path: str, body: dict[str, Any] | str | None
) -> None:
    with module_gateway.http() as http:
        if isinstance(body, str):
            response = http.request(method, path, content=body)
        else:
            response = http.request(method, path, json=body)
    assert response.status_code >= 400
    validate("ErrorResponse", response.json())


def test_auth_error_bodies(start_gateway: GatewayFactory) -> None:
    gateway = start_gateway(admin_api_key="sk-admin", agents=[{"name": "a", "api_keys": ["sk-a"]}])
    with gateway.http() as http:
        missing = http.post("/v1/chat/completions", json={"model": "a", "messages": HI})
        wrong = http.get("/v1/models", headers={"Authorization": "Bearer sk-wrong"})
        not_admin = http.post(
            "/v1/unload_lora_adapter",
            json={"lora_name": "a"},
            headers={"Authorization": "Bearer sk-a"},
        )
    assert (missing.status_code, wrong.status_code, not_admin.status_code) == (401, 401, 403)
    for response in (missing, wrong, not_admin):
        validate("ErrorResponse", response.json())
