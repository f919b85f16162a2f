"""Chat parameters that used to be dropped silently: each is honoured or refused by name.

`metadata` is stored with the trajectory (its `conversation_id` joins feedback),
legacy `functions`/`function_call` are mapped onto tools, `store` and
`service_tier` are accepted at what the gateway does, `prediction` is refused,
vLLM's `guided_json` constrains the reply like a json_schema `response_format`,
and rendering/tokenising a prompt leaves the event loop free.
"""

from __future__ import annotations

import json
import threading
from typing import TYPE_CHECKING, Any

import httpx
import jsonschema
import openai
import pytest
from openai_spec import validate

if TYPE_CHECKING:
    from conftest import GatewayServer

HI = [{"role": "user", "content": "hello there"}]
WEATHER_FN = {
    "name": "get_weather",
    "description": "Current weather for a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Oslo"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
VERDICT = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "level": {"enum": ["low", "high"]}},
    "required": ["ok", "level"],
    "additionalProperties": False,
}


def post(gateway: GatewayServer, body: dict[str, Any]) -> httpx.Response:
    with gateway.http() as http:
        return http.post("/v1/chat/completions", json={"model": "support", **body})


def refused(gateway: GatewayServer, body: dict[str, Any]) -> str | None:
    response = post(gateway, {"messages": HI, "max_tokens": 2, **body})
    assert response.status_code == 400, response.text
    validate("ErrorResponse", response.json())
    param: str | None = response.json()["error"]["param"]
    return param


def test_metadata_is_stored_and_joins_by_conversation(module_gateway: GatewayServer) -> None:
    metadata = {"conversation_id": "conv-77", "ticket": "T-1"}
    reply = module_gateway.openai().chat.completions.create(
        model="support", messages=HI, max_tokens=3, metadata=metadata, store=True
    )
    with module_gateway.http() as http:
        record = http.get(f"/v1/trajectories/{reply.id}").json()
    assert record["request"]["metadata"] == metadata
    store = module_gateway.app.state.gateway.store.store
    assert store.by_conversation("conv-77") == [reply.id]
    assert store.get(reply.id).conversation_id == "conv-77"
    assert store.get(reply.id).metadata == metadata


@pytest.mark.parametrize(
    ("metadata", "param"),
    [
        ({f"k{i}": "v" for i in range(17)}, "metadata"),
        ({"k" * 65: "v"}, "metadata"),
        ({"long": "v" * 513}, "metadata.long"),
        ({"n": 1}, "metadata.n"),
    ],
)
def test_metadata_follows_openais_limits(
    module_gateway: GatewayServer, metadata: dict[str, Any], param: str
) -> None:
    assert refused(module_gateway, {"metadata": metadata}) == param


def test_legacy_functions_answer_with_function_call(module_gateway: GatewayServer) -> None:
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": "weather?"}],
        "functions": [WEATHER_FN],
        "function_call": {"name": "get_weather"},
        "max_tokens": 60,
    }
    response = post(module_gateway, body)
    assert response.status_code == 200, response.text
    validate("CreateChatCompletionResponse", response.json())
    [choice] = response.json()["choices"]
    assert choice["finish_reason"] == "function_call" and "tool_calls" not in choice["message"]
    call = choice["message"]["function_call"]
    assert call["name"] == "get_weather"
    jsonschema.validate(json.loads(call["arguments"]), WEATHER_FN["parameters"])
    prompt = module_gateway.engine.tokenizer.decode(response.json()["clora"]["prompt_token_ids"])
    assert "at most one call" in prompt
    stream = module_gateway.openai().chat.completions.create(model="support", stream=True, **body)
    deltas = [c.choices[0] for c in stream if c.choices]
    streamed = [d.delta.function_call for d in deltas if d.delta.function_call]
    assert [f.name for f in streamed] == ["get_weather"]
    assert deltas[-1].finish_reason == "function_call"


def test_legacy_functions_and_tools_together_are_refused(module_gateway: GatewayServer) -> None:
    tool = {"type": "function", "function": WEATHER_FN}
    assert refused(module_gateway, {"functions": [WEATHER_FN], "tools": [tool]}) == "functions"
    assert refused(module_gateway, {"function_call": "auto"}) == "function_call"


@pytest.mark.parametrize("value", [True, False])
def test_store_is_accepted_either_way(module_gateway: GatewayServer, value: bool) -> None:
    response = post(module_gateway, {"messages": HI, "max_tokens": 2, "store": value})
    assert response.status_code == 200


def test_service_tier_and_prediction(module_gateway: GatewayServer) -> None:
    for tier in ("auto", "default"):
        ok = post(module_gateway, {"messages": HI, "max_tokens": 2, "service_tier": tier})
        assert ok.status_code == 200
    assert refused(module_gateway, {"service_tier": "flex"}) == "service_tier"
    prediction = {"type": "content", "content": "hello"}
    assert refused(module_gateway, {"prediction": prediction}) == "prediction"


@pytest.mark.parametrize("as_text", [False, True])
def test_guided_json_constrains_the_reply(module_gateway: GatewayServer, as_text: bool) -> None:
    guided: Any = json.dumps(VERDICT) if as_text else VERDICT
    reply = module_gateway.openai().chat.completions.create(
        model="support",
        messages=HI,
        max_tokens=1200,
        seed=2,
        extra_body={"guided_json": guided},
    )
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content or ""), VERDICT)


def test_bad_guided_json_is_refused(module_gateway: GatewayServer) -> None:
    assert refused(module_gateway, {"guided_json": "not json"}) == "guided_json"
    both = {"guided_json": VERDICT, "response_format": {"type": "json_object"}}
    assert refused(module_gateway, both) == "guided_json"


# OpenAI's metadata limits (16 keys, 512-character values) make a body over 8 KiB whose
# prompt is still tiny: the size decision reads the body's bytes, not its tokens.
BIG_BODY_METADATA = {f"k{i}": "x" * 512 for i in range(16)}


def test_tokenizing_a_prompt_leaves_the_event_loop_free(
    module_gateway: GatewayServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a big request's prompt is being rendered, /health still answers (no timing is
    asserted: the rendering blocks until /health has answered)."""
    tokenizer = module_gateway.engine.tokenizer
    original = tokenizer.apply_chat_template
    entered, release = threading.Event(), threading.Event()

    def slow_template(*args: Any, **kwargs: Any) -> Any:
        entered.set()
        release.wait(timeout=60)
        return original(*args, **kwargs)

    monkeypatch.setattr(tokenizer, "apply_chat_template", slow_template)
    result: dict[str, Any] = {}

    def chat() -> None:
        result["reply"] = module_gateway.openai().chat.completions.create(
            model="support", messages=HI, max_tokens=2, metadata=BIG_BODY_METADATA
        )

    worker = threading.Thread(target=chat)
    worker.start()
    try:
        assert entered.wait(timeout=60)
        with module_gateway.http() as http:
            # Blocked loop: this read would wait for the release below, which never comes first.
            health = http.get("/health", timeout=httpx.Timeout(30.0))
        assert health.status_code == 200
    finally:
        release.set()
        worker.join(timeout=60)
    assert result["reply"].choices[0].message.role == "assistant"


def test_small_prompts_render_on_the_loop_big_ones_on_the_tokenizing_thread(
    module_gateway: GatewayServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A short chat skips the thread hop (it costs more than the rendering); a body over
    `INLINE_MAX_BYTES` still goes to the tokenizing thread."""
    tokenizer = module_gateway.engine.tokenizer
    original = tokenizer.apply_chat_template
    threads: list[str] = []

    def recording_template(*args: Any, **kwargs: Any) -> Any:
        threads.append(threading.current_thread().name)
        return original(*args, **kwargs)

    monkeypatch.setattr(tokenizer, "apply_chat_template", recording_template)
    client = module_gateway.openai()
    client.chat.completions.create(model="support", messages=HI, max_tokens=1)
    client.chat.completions.create(
        model="support", messages=HI, max_tokens=1, metadata=BIG_BODY_METADATA
    )
    assert len(threads) == 2
    assert not threads[0].startswith("clora-tokenize")
    assert threads[1].startswith("clora-tokenize")


def test_openai_client_sends_them_through(module_gateway: GatewayServer) -> None:
    """The SDK's typed parameters reach the gateway (nothing is dropped client-side)."""
    with pytest.raises(openai.BadRequestError) as info:
        module_gateway.openai().chat.completions.create(
            model="support",
            messages=HI,
            max_tokens=2,
            prediction={"type": "content", "content": "x"},
        )
    assert info.value.param == "prediction"
