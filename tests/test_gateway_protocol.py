"""Unit tests of the gateway's wire models and error mapping (no server, no model)."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from clora_feedback.errors import InvalidRequestError, NotFoundError, OverloadedError
from clora_feedback.gateway.errors import error_response, param_from_loc, validation_error
from clora_feedback.schemas.openai import (
    ChatCompletionRequest,
    CloraResponseExtension,
    CompletionRequest,
    LoadLoRAAdapterRequest,
    NamedToolChoice,
    include_usage,
    stop_list,
)

USER = [{"role": "user", "content": "hi"}]
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
]


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "a", "messages": USER, **fields})


def translated(exc: ValidationError) -> InvalidRequestError:
    """What the gateway answers for a pydantic failure of the request body."""
    errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]
    return validation_error(RequestValidationError(errors))


def test_defaults_follow_openai() -> None:
    req = chat()
    assert (req.n, req.temperature, req.top_p, req.stream, req.logprobs) == (
        1,
        1.0,
        1.0,
        False,
        False,
    )
    assert req.effective_tool_choice == "none"
    assert chat(tools=TOOLS).effective_tool_choice == "auto"
    assert req.max_tokens_param == ("max_tokens", None)
    assert chat(max_tokens=5, max_completion_tokens=7).max_tokens_param == (
        "max_completion_tokens",
        7,
    )


def test_all_message_roles_parse() -> None:
    req = chat(
        messages=[
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "weather?"}]},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        ]
    )
    assert [m.role for m in req.messages] == ["developer", "user", "assistant", "tool"]


def test_named_tool_choice_parses() -> None:
    req = chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert isinstance(req.tool_choice, NamedToolChoice)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 0}, "n"),
        ({"n": 17}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_completion_tokens": -3}, "max_completion_tokens"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"messages": []}, "messages"),
        ({"temperature": "hot"}, "temperature"),
        ({"n": 2.0}, "n"),
        ({"stream": "yes"}, "stream"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0]"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages[0].content",
        ),
        ({"tool_choice": "sometimes", "tools": TOOLS}, "tool_choice"),
        ({"stop": 5}, "stop"),
    ],
)
def test_field_errors_name_the_parameter(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(ValidationError) as info:
        chat(**fields)
    err = translated(info.value)
    assert err.http_status == 400
    assert err.param == param
    assert err.message.startswith(param)


def test_missing_messages_names_the_parameter() -> None:
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate({"model": "a"})
    assert translated(info.value).param == "messages"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        # penalties and logit_bias are honoured (issue 12 item 16); only bad values are refused
        ({"logit_bias": {"5": 101.0}}, "logit_bias"),
        ({"logit_bias": {"five": 1.0}}, "logit_bias"),
        (
            {"response_format": {"type": "json_object"}, "tools": TOOLS, "tool_choice": "required"},
            "response_format",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": TOOLS},
            "tool_choice",
        ),
        ({"tools": TOOLS + TOOLS}, "tools"),
        ({"stop": ["ok", ""]}, "stop"),
    ],
)
def test_cross_field_rules_raise_named_errors(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        chat(**fields)
    assert info.value.param == param


def test_noop_values_of_unsupported_parameters_are_accepted() -> None:
    req = chat(
        frequency_penalty=0.0, presence_penalty=0, logit_bias={}, response_format={"type": "text"}
    )
    assert req.frequency_penalty == 0.0


def test_unknown_fields_are_ignored() -> None:
    assert chat(store=True, metadata={"k": "v"}).model == "a"


def test_stop_and_usage_helpers() -> None:
    assert stop_list(None) == ()
    assert stop_list("x") == ("x",)
    assert stop_list(["a", "b"]) == ("a", "b")
    assert include_usage(chat(stream=True, stream_options={"include_usage": True}))
    assert not include_usage(chat(stream=True))


def test_completion_prompt_forms() -> None:
    text = CompletionRequest.model_validate({"model": "m", "prompt": "hello"})
    assert (text.prompts, text.max_tokens) == (["hello"], 16)
    ids = CompletionRequest.model_validate({"model": "m", "prompt": [5, 6, 7]})
    assert ids.prompts == [[5, 6, 7]]
    nested = CompletionRequest.model_validate({"model": "m", "prompt": [[1, 2], [3]]})
    assert nested.prompts == [[1, 2], [3]]
    assert CompletionRequest.model_validate({"model": "m", "prompt": ["x", "y"]}).prompts == [
        "x",
        "y",
    ]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"prompt": ["a"] * 65}, "prompt"),
        ({"prompt": ["a", ""]}, "prompt[1]"),
        ({"prompt": [[1], []]}, "prompt[1]"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": "x", "echo": True}, "echo"),
        ({"prompt": "x", "suffix": "y"}, "suffix"),
        ({"prompt": "x", "best_of": 3}, "best_of"),
    ],
)
def test_completion_refusals(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        CompletionRequest.model_validate({"model": "m", **fields})
    assert info.value.param == param


def test_completion_logprobs_range() -> None:
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate({"model": "m", "prompt": "x", "logprobs": 6})
    assert translated(info.value).param == "logprobs"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"lora_name": "a"}, "lora_name"),
        ({"lora_path": "/x"}, "lora_name"),
        ({"lora_name": "bad name!", "lora_path": "/x"}, "lora_name"),
    ],
)
def test_load_adapter_request_rules(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        LoadLoRAAdapterRequest.model_validate(body)
    assert info.value.param == param


@pytest.mark.parametrize(
    ("loc", "param"),
    [
        (("body", "temperature"), "temperature"),
        (("body", "messages", 2, "user", "content", "str"), "messages[2].content"),
        (
            ("body", "messages", 0, "assistant", "tool_calls", 1, "function", "name"),
            "messages[0].tool_calls[1].function.name",
        ),
        (("body", "tool_choice", "literal['none','auto','required']"), "tool_choice"),
        (("body", "tool_choice", "NamedToolChoice", "function"), "tool_choice.function"),
        (("query", "limit"), "limit"),
        (("body",), None),
        (("body", 0), None),
    ],
)
def test_param_from_loc(loc: tuple[Any, ...], param: str | None) -> None:
    assert param_from_loc(loc) == param


def test_invalid_json_is_a_plain_400() -> None:
    err = validation_error(
        RequestValidationError(
            [{"type": "json_invalid", "loc": ("body", 1), "msg": "JSON decode error"}]
        )
    )
    assert err.http_status == 400 and err.param is None and "JSON" in err.message


def test_error_response_shape_and_retry_after() -> None:
    response = error_response(OverloadedError("busy", retry_after_s=2.2))
    assert response.status_code == 429
    assert response.headers["retry-after"] == "3"
    plain = error_response(NotFoundError("gone", param="model", code="model_not_found"))
    assert plain.status_code == 404
    assert plain.body == (
        b'{"error":{"message":"gone","type":"not_found_error","param":"model","code":"model_not_found"}}'
    )
    assert "retry-after" not in plain.headers


def test_extension_wire_keeps_null_agent() -> None:
    assert CloraResponseExtension(agent=None, adapter_version=0).wire() == {
        "agent": None,
        "adapter_version": 0,
    }
    ext = CloraResponseExtension(agent="a", adapter_version=3, prompt_token_ids=[1]).wire()
    assert ext["prompt_token_ids"] == [1]
