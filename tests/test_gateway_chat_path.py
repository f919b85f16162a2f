"""The chat path compiles a request's grammar once, in the engine (review R4, issue 25 house item 2).

A forced tool call with n choices is compiled once by the engine for all its
sequences, and not at all by the gateway while every call completes; only a
call that `max_tokens` cuts makes the gateway build the grammar, to close it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

import clora_feedback.engine.guided as guided
import clora_feedback.gateway.chat as chat

if TYPE_CHECKING:
    from conftest import GatewayServer

TOOL = {
    "type": "function",
    "function": {
        "name": "pick",
        "parameters": {
            "type": "object",
            "properties": {"colour": {"type": "string", "enum": ["red", "blue"]}},
            "required": ["colour"],
            "additionalProperties": False,
        },
    },
}
FORCED = {"type": "function", "function": {"name": "pick"}}


def _counting(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> list[int]:
    calls: list[int] = []
    original: Callable[..., Any] = getattr(module, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def _ask(gateway: GatewayServer, max_tokens: int) -> Any:
    return gateway.openai().chat.completions.create(
        model="support",
        messages=[{"role": "user", "content": "pick a colour"}],
        tools=[TOOL],  # type: ignore[list-item]
        tool_choice=FORCED,  # type: ignore[arg-type]
        n=3,
        max_tokens=max_tokens,
        temperature=0.7,
        seed=5,
    )


def test_one_compile_for_all_choices_and_none_in_the_gateway(
    module_gateway: GatewayServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine_compiles = _counting(monkeypatch, guided, "_compile")
    gateway_compiles = _counting(monkeypatch, chat, "call_grammar")
    reply = _ask(module_gateway, max_tokens=200)
    assert len(reply.choices) == 3
    for choice in reply.choices:
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        assert json.loads(call.function.arguments)["colour"] in ("red", "blue")
    assert engine_compiles == [1]
    assert gateway_compiles == []


def test_a_cut_call_is_closed_by_the_gateway(
    module_gateway: GatewayServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    gateway_compiles = _counting(monkeypatch, chat, "call_grammar")
    reply = _ask(module_gateway, max_tokens=2)
    for choice in reply.choices:
        (call,) = choice.message.tool_calls
        assert json.loads(call.function.arguments)["colour"] in ("red", "blue")
    assert 1 <= len(gateway_compiles) <= 3  # one per cut choice


def test_a_routed_request_prefetches_its_adapter_before_the_prompt_is_built(
    module_gateway: GatewayServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Issue 27: a cold agent's adapter is read while its prompt is rendered and tokenised."""
    from clora_feedback.lora.peft_io import save_peft_adapter
    from clora_feedback.lora.weights import random_lora_weights

    engine = module_gateway.engine
    weights = random_lora_weights(engine.lora_limits, rank=4, seed=1)
    save_peft_adapter(weights, tmp_path / "a", base_model="tiny")
    load = {"lora_name": "prefetched", "lora_path": str(tmp_path / "a")}
    with module_gateway.http() as http:
        assert http.post("/v1/load_lora_adapter", json=load).status_code == 200
    order: list[str] = []
    prefetch, add_requests = engine.prefetch, engine.add_requests

    def prefetching(agent: str) -> None:
        order.append(f"prefetch {agent}")
        prefetch(agent)

    def adding(requests: Any) -> Any:
        order.append("add_requests")
        return add_requests(requests)

    monkeypatch.setattr(engine, "prefetch", prefetching)
    monkeypatch.setattr(engine, "add_requests", adding)
    render = chat.render_messages

    def rendering(*args: Any, **kwargs: Any) -> Any:
        order.append("render")
        return render(*args, **kwargs)

    monkeypatch.setattr(chat, "render_messages", rendering)
    module_gateway.openai().chat.completions.create(
        model="prefetched", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert order == ["prefetch prefetched", "render", "add_requests"], order
