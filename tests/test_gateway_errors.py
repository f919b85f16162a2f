"""Every bad input answers OpenAI error JSON with the right status and `param`."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import openai
import pytest

if TYPE_CHECKING:
    from conftest import GatewayServer

HI = [{"role": "user", "content": "hi"}]


def error_of(response: httpx.Response) -> dict[str, Any]:
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    error: dict[str, Any] = body["error"]
    return error


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -5}, "max_tokens"),
        ({"temperature": 2.1}, "temperature"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"n": 0}, "n"),
        ({"n": 17}, "n"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"top_logprobs": -1, "logprobs": True}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"messages": []}, "messages"),
        ({"temperature": "warm"}, "temperature"),
        ({"max_tokens": "10"}, "max_tokens"),
        ({"messages": "hello"}, "messages"),
        ({"messages": [{"role": "user", "content": 7}]}, "messages[0].content"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"max_tokens": 5000}, "max_tokens"),
        ({"max_completion_tokens": 5000}, "max_completion_tokens"),
    ],
)
def test_chat_bad_inputs(module_gateway: GatewayServer, fields: dict[str, Any], param: str) -> None:
    body = {"model": "support", "messages": HI, **fields}
    with module_gateway.http() as http:
        response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    error = error_of(response)
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"


def test_missing_messages(module_gateway: GatewayServer) -> None:
    with module_gateway.http() as http:
        response = http.post("/v1/chat/completions", json={"model": "support"})
    assert (response.status_code, error_of(response)["param"]) == (400, "messages")


def test_context_length_names_the_parameter(module_gateway: GatewayServer) -> None:
    client = module_gateway.openai()
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="support", messages=HI, max_tokens=4000)
    assert (info.value.code, info.value.param) == ("context_length_exceeded", "max_tokens")
    long_prompt = [{"role": "user", "content": "x" * 3000}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="support", messages=long_prompt)
    assert (info.value.code, info.value.param) == ("context_length_exceeded", "messages")
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="support", prompt="y" * 3000)
    assert (info.value.code, info.value.param) == ("context_length_exceeded", "prompt")


def test_max_tokens_defaults_to_the_rest_of_the_context(module_gateway: GatewayServer) -> None:
    # A prompt that leaves room for exactly 2 tokens; without max_tokens the request fits.
    tokenizer = module_gateway.engine.tokenizer
    overhead = len(
        tokenizer.encode(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": ""}], tokenize=False, add_generation_prompt=True
            ),
            add_special_tokens=False,
        )
    )
    room = module_gateway.engine.max_model_len - overhead
    messages = [{"role": "user", "content": "z" * (room - 2)}]
    reply = module_gateway.openai().chat.completions.create(
        model="support", messages=messages, temperature=0
    )
    assert reply.usage is not None and reply.usage.completion_tokens <= 2


def test_unknown_model(module_gateway: GatewayServer) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        module_gateway.openai().chat.completions.create(model="nobody", messages=HI)
    assert (info.value.code, info.value.param) == ("model_not_found", "model")
    with pytest.raises(openai.NotFoundError):
        module_gateway.openai().completions.create(model="nobody", prompt="x")


def test_invalid_json_and_wrong_bodies(module_gateway: GatewayServer) -> None:
    with module_gateway.http() as http:
        for content in (b"{not json", b"", b"[1, 2]", b'"text"'):
            response = http.post(
                "/v1/chat/completions",
                content=content,
                headers={"content-type": "application/json"},
            )
            assert response.status_code == 400, content
            error = error_of(response)
            assert error["type"] == "invalid_request_error" and error["param"] is None


def test_unknown_route_and_wrong_method(module_gateway: GatewayServer) -> None:
    with module_gateway.http() as http:
        missing = http.post("/v1/nothing", json={})
        assert missing.status_code == 404 and error_of(missing)["code"] == "unknown_url"
        wrong = http.get("/v1/chat/completions")
        assert wrong.status_code == 405 and error_of(wrong)["code"] == "method_not_allowed"
        bad_query = http.get("/v1/trajectories", params={"limit": "many"})
        assert bad_query.status_code == 400 and error_of(bad_query)["param"] == "limit"
        missing_trajectory = http.get("/v1/trajectories/chatcmpl-nope")
        assert missing_trajectory.status_code == 404


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"prompt": ["a", ""]}, "prompt[1]"),
        ({"echo": True}, "echo"),
        ({"logprobs": 6}, "logprobs"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"prompt": [1, 2, 99999]}, "prompt"),
    ],
)
def test_completion_bad_inputs(
    module_gateway: GatewayServer, fields: dict[str, Any], param: str
) -> None:
    with module_gateway.http() as http:
        response = http.post("/v1/completions", json={"model": "support", "prompt": "x", **fields})
    assert response.status_code == 400
    assert error_of(response)["param"] == param


def test_a_deeply_nested_adapter_config_is_400_naming_lora_path(
    module_gateway: GatewayServer, tmp_path: Path
) -> None:
    """A config nested 50k deep used to raise RecursionError in the JSON decoder (500)."""
    head = '{"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"], "x": '
    (tmp_path / "adapter_config.json").write_text(head + "[" * 50_000 + "]" * 50_000 + "}")
    (tmp_path / "adapter_model.safetensors").write_bytes(b"")
    with module_gateway.http() as http:
        response = http.post(
            "/v1/load_lora_adapter", json={"lora_name": "deep", "lora_path": str(tmp_path)}
        )
        assert response.status_code == 400, response.text
        error = error_of(response)
        assert (error["type"], error["param"]) == ("invalid_request_error", "lora_path")
        assert "nested deeper" in error["message"]
        assert http.get("/health").status_code == 200


def test_a_missing_adapter_directory_names_lora_path(module_gateway: GatewayServer) -> None:
    with module_gateway.http() as http:
        response = http.post(
            "/v1/load_lora_adapter", json={"lora_name": "gone", "lora_path": "/no/such/dir"}
        )
    assert response.status_code == 400
    assert error_of(response)["param"] == "lora_path"


def test_a_deeply_nested_request_body_is_400(module_gateway: GatewayServer) -> None:
    deep = '{"model": "support", "messages": ' + "[" * 50_000 + "]" * 50_000 + "}"
    with module_gateway.http() as http:
        response = http.post(
            "/v1/chat/completions", content=deep, headers={"content-type": "application/json"}
        )
    assert response.status_code == 400
    assert error_of(response)["type"] == "invalid_request_error"
