"""`/v1/responses` through the official openai client against a real server (tiny random model).

Every response body and stream event is validated against the official OpenAPI
description's schemas (`Response`, `ResponseStreamEvent`); the outputs of a
random model are garbage, so the tests assert on the protocol: shapes, ids,
the function-call round trip, trajectories and keys.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from openai_spec import validate

if TYPE_CHECKING:
    from conftest import GatewayFactory, GatewayServer

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather for a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}


def checked(response: Any) -> dict[str, Any]:
    """The response as JSON, valid under the official `Response` schema."""
    body: dict[str, Any] = response.model_dump(mode="json", exclude_unset=True, by_alias=True)
    validate("Response", body)
    return body


def stream_events(gateway: GatewayServer, **body: Any) -> list[dict[str, Any]]:
    """The raw events of a streamed response, each valid under `ResponseStreamEvent`."""
    events: list[dict[str, Any]] = []
    with (
        gateway.http() as http,
        http.stream("POST", "/v1/responses", json={**body, "stream": True}) as reply,
    ):
        assert reply.status_code == 200, reply.read()
        kinds: list[str] = []
        for line in reply.iter_lines():
            if line.startswith("event: "):
                kinds.append(line.removeprefix("event: "))
            elif line.startswith("data: "):
                event = json.loads(line.removeprefix("data: "))
                validate("ResponseStreamEvent", event)
                assert event["type"] == kinds[-1]
                events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def test_text_input_answers_a_response(module_gateway: GatewayServer) -> None:
    client = module_gateway.openai()
    response = client.responses.create(
        model="support",
        input="hello there",
        instructions="Be brief.",
        max_output_tokens=8,
        metadata={"conversation_id": "conv-7"},
    )
    body = checked(response)
    assert response.id.startswith("chatcmpl-") and response.object == "response"
    assert response.status in ("completed", "incomplete") and response.model == "support"
    assert response.instructions == "Be brief." and body["store"] is True
    [message] = response.output
    assert message.type == "message" and message.role == "assistant"
    assert response.output_text == message.content[0].text  # type: ignore[union-attr]
    usage = response.usage
    assert usage is not None and 0 < usage.output_tokens <= 8
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    if response.status == "incomplete":
        assert response.incomplete_details is not None
        assert response.incomplete_details.reason == "max_output_tokens"
    # The same completion as a trajectory: the prompt had the instructions first.
    with module_gateway.http() as http:
        stored = http.get(f"/v1/trajectories/{response.id}").json()
    messages = stored["request"]["messages"]
    assert messages == [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "hello there"},
    ]
    assert len(stored["prompt_token_ids"]) == usage.input_tokens
    # Feedback may name the conversation: its id is stored with the trajectory.
    assert stored["request"]["metadata"] == {"conversation_id": "conv-7"}
    assert body["metadata"] == {"conversation_id": "conv-7"}


def test_message_items_and_retrieve(module_gateway: GatewayServer) -> None:
    client = module_gateway.openai()
    items: list[Any] = [
        {"role": "system", "content": "You answer in French."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "salut"}]},
        {"role": "user", "content": "again"},
    ]
    response = client.responses.create(
        model="sales", input=items, temperature=0, max_output_tokens=4
    )
    again = client.responses.retrieve(response.id)
    assert checked(again)["output"] == checked(response)["output"]
    assert again.usage == response.usage and again.id == response.id
    with module_gateway.http() as http:
        stored = http.get(f"/v1/trajectories/{response.id}").json()["request"]["messages"]
    assert [m["content"] for m in stored] == ["You answer in French.", "hi", "salut", "again"]


def test_stream_events_match_the_response(module_gateway: GatewayServer) -> None:
    body = {"model": "support", "input": "hello", "max_output_tokens": 6, "temperature": 0}
    events = stream_events(module_gateway, **body)
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:-1] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    final = events[-1]["response"]
    assert final["output"][0]["content"][0]["text"] == deltas
    assert final["usage"]["output_tokens"] > 0
    # Greedy decoding: the JSON answer says the same.
    whole = module_gateway.openai().responses.create(**body)
    assert whole.output_text == deltas
    retrieved = module_gateway.openai().responses.retrieve(final["id"])
    assert retrieved.output_text == deltas


def test_sdk_stream_helpers(module_gateway: GatewayServer) -> None:
    client = module_gateway.openai()
    # A forced call always completes (a cut one is closed by its grammar): a final response.
    with client.responses.stream(
        model="support",
        input="weather?",
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice="required",
        max_output_tokens=60,
    ) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.done" in kinds
    assert checked(final)["output"][-1]["type"] == "function_call"
    events = list(
        client.responses.create(model="support", input="hi", max_output_tokens=3, stream=True)
    )
    last = events[-1]
    assert last.type in ("response.completed", "response.incomplete")
    texts = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert last.response.output_text == "".join(texts)  # type: ignore[union-attr]


def test_function_call_round_trip_with_previous_response_id(module_gateway: GatewayServer) -> None:
    client = module_gateway.openai()
    first = client.responses.create(
        model="support",
        input="What is the weather in Paris?",
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice="required",
        max_output_tokens=60,
    )
    checked(first)
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert set(json.loads(call.arguments)) == {"city"}  # constrained to the schema
    second = client.responses.create(
        model="support",
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice="none",
        max_output_tokens=4,
    )
    checked(second)
    assert second.previous_response_id == first.id and second.output[0].type == "message"
    with module_gateway.http() as http:
        messages = http.get(f"/v1/trajectories/{second.id}").json()["request"]["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "tool"]
    assert messages[1]["tool_calls"][0]["id"] == call.call_id
    assert messages[2] == {"role": "tool", "content": "sunny", "tool_call_id": call.call_id}


def test_input_items_list_this_requests_input(module_gateway: GatewayServer) -> None:
    """`input_items` lists a response's own input (not its instructions, not the previous
    response's conversation), as the official client pages it."""
    client = module_gateway.openai()
    first = client.responses.create(
        model="support",
        instructions="Be brief.",
        input=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": "Checking."},
        ],
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice="required",
        max_output_tokens=60,
    )
    [call] = first.output
    assert call.type == "function_call"
    listed = [
        i.model_dump(mode="json", exclude_none=True)
        for i in client.responses.input_items.list(first.id)
    ]
    assert [(i["type"], i["role"]) for i in listed] == [
        ("message", "assistant"),
        ("message", "user"),
    ]
    assert listed[1]["content"] == [{"type": "input_text", "text": "What is the weather in Paris?"}]
    second = client.responses.create(
        model="support",
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        max_output_tokens=4,
    )
    with module_gateway.http() as http:
        reply = http.get(f"/v1/responses/{second.id}/input_items", params={"order": "asc"})
        assert reply.status_code == 200, reply.text
        body = reply.json()
        validate("ResponseItemList", body)
        [output] = body["data"]
        assert (output["type"], output["call_id"], output["output"]) == (
            "function_call_output", call.call_id, "sunny"
        )  # fmt: skip
        # Pages: one item at a time, in both orders, ids stable across calls.
        pages: list[dict[str, Any]] = []
        after: str | None = None
        while True:
            params: dict[str, Any] = {"limit": 1, "order": "asc"}
            if after is not None:
                params["after"] = after
            page = http.get(f"/v1/responses/{first.id}/input_items", params=params).json()
            validate("ResponseItemList", page)
            pages += page["data"]
            if not page["has_more"]:
                break
            after = page["last_id"]
        assert pages == listed[::-1]
        for params, param in (({"limit": 0}, "limit"), ({"order": "up"}, "order"),
                              ({"after": "msg_nope"}, "after")):  # fmt: skip
            bad = http.get(f"/v1/responses/{first.id}/input_items", params=params)
            assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text
        missing = http.get("/v1/responses/chatcmpl-nope/input_items")
        assert missing.status_code == 404
        validate("ErrorResponse", missing.json())


def test_streamed_function_call_events(module_gateway: GatewayServer) -> None:
    events = stream_events(
        module_gateway,
        model="support",
        input="weather?",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=60,
    )
    kinds = [e["type"] for e in events]
    added = kinds.index("response.output_item.added")
    assert kinds[added : added + 4] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    done = events[added + 2]
    assert set(json.loads(done["arguments"])) == {"city"}
    final = events[-1]["response"]
    assert final["output"][-1]["arguments"] == done["arguments"]
    assert final["output"][-1]["call_id"].startswith("call_")


def test_agent_loop_without_previous_response_id(module_gateway: GatewayServer) -> None:
    """The whole history sent back, as the Agents SDK does without server-side state."""
    client = module_gateway.openai()
    first = client.responses.create(
        model="support",
        input="weather?",
        tools=[WEATHER],
        tool_choice="required",
        max_output_tokens=60,  # type: ignore[list-item]
    )
    history: list[Any] = [{"role": "user", "content": "weather?"}]
    history += [item.model_dump(exclude_none=True) for item in first.output]
    history.append(
        {"type": "function_call_output", "call_id": first.output[0].call_id, "output": "rain"}  # type: ignore[union-attr]
    )
    second = client.responses.create(model="support", input=history, max_output_tokens=3)
    checked(second)


def test_structured_output_follows_the_schema(module_gateway: GatewayServer) -> None:
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string"}, "score": {"type": "integer"}},
        "required": ["answer", "score"],
        "additionalProperties": False,
    }
    response = module_gateway.openai().responses.create(
        model="support",
        input="rate it",
        text={
            "format": {"type": "json_schema", "name": "rating", "schema": schema, "strict": True}
        },
        max_output_tokens=200,
    )
    checked(response)
    if response.status == "completed":
        assert set(json.loads(response.output_text)) == {"answer", "score"}
    loose = module_gateway.openai().responses.create(
        model="support",
        input="json",
        text={"format": {"type": "json_object"}},
        max_output_tokens=200,
    )
    if loose.status == "completed":
        assert isinstance(json.loads(loose.output_text), dict)


def test_forced_call_turn_leaves_text_format_for_the_answer(module_gateway: GatewayServer) -> None:
    """As the Agents SDK sends it for an agent with tools and a typed output."""
    client = module_gateway.openai()
    fmt: Any = {"format": {"type": "json_object"}}
    first = client.responses.create(
        model="support",
        input="weather?",
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice="required",
        text=fmt,
        max_output_tokens=60,
    )
    assert checked(first)["text"] == fmt and first.output[-1].type == "function_call"
    call_id = first.output[-1].call_id  # type: ignore[union-attr]
    second = client.responses.create(
        model="support",
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call_id, "output": "sunny"}],
        tools=[WEATHER],  # type: ignore[list-item]
        text=fmt,
        max_output_tokens=200,
    )
    checked(second)
    assert second.output[0].type == "message"
    if second.status == "completed":
        assert isinstance(json.loads(second.output_text), dict)


def test_store_false_is_captured_but_not_retrievable(module_gateway: GatewayServer) -> None:
    client = module_gateway.openai()
    response = client.responses.create(
        model="support", input="hi", store=False, max_output_tokens=2
    )
    assert checked(response)["store"] is False
    with module_gateway.http() as http:
        assert http.get(f"/v1/trajectories/{response.id}").status_code == 200
        for reply in (
            http.get(f"/v1/responses/{response.id}"),
            http.get(f"/v1/responses/{response.id}/input_items"),
            http.post(
                "/v1/responses",
                json={"model": "support", "input": "more", "previous_response_id": response.id},
            ),
        ):
            assert reply.status_code == 404
            validate("ErrorResponse", reply.json())


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0]"),
        ({"tools": [{"type": "file_search", "vector_store_ids": []}]}, "tools[0]"),
        ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0]"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input[0].content"),
        (
            {"input": [{"type": "function_call_output", "call_id": "x", "output": "y"}]},
            "input[0].call_id",
        ),
        ({"input": ""}, "input"),
        ({"background": True}, "background"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"truncation": "auto"}, "truncation"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"temperature": 3}, "temperature"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"previous_response_id": "chatcmpl-nope"}, "previous_response_id"),
    ],
)
def test_unsupported_and_bad_input_name_the_parameter(
    module_gateway: GatewayServer, body: dict[str, Any], param: str
) -> None:
    with module_gateway.http() as http:
        reply = http.post("/v1/responses", json={"model": "support", "input": "hi", **body})
    error = reply.json()
    validate("ErrorResponse", error)
    assert reply.status_code in (400, 404), error
    assert error["error"]["param"] == param, error


def test_keys_scope_responses(start_gateway: GatewayFactory) -> None:
    gateway = start_gateway(
        agents=[
            {"name": "support", "api_keys": ["k-support"]},
            {"name": "sales", "api_keys": ["k-sales"]},
        ]
    )
    support, sales = gateway.openai("k-support"), gateway.openai("k-sales")
    mine = support.responses.create(model="support", input="hi", max_output_tokens=2)
    assert support.responses.retrieve(mine.id).id == mine.id
    import openai

    with pytest.raises(openai.NotFoundError):
        sales.responses.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError):
        sales.responses.input_items.list(mine.id)
    with pytest.raises(openai.NotFoundError):
        sales.responses.create(
            model="sales", input="more", previous_response_id=mine.id, max_output_tokens=2
        )
    with pytest.raises((openai.NotFoundError, openai.PermissionDeniedError)):
        sales.responses.create(model="support", input="hi", max_output_tokens=2)


def test_feedback_naming_the_response_joins_its_trajectory(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from openai import OpenAI
    from test_webhook import serve

    from clora_feedback.client import FeedbackClient
    from clora_feedback.config import EngineConfig, Settings
    from clora_feedback.engine.embedded import EmbeddedEngine
    from clora_feedback.feedback.ingest import FeedbackIngest, LogDeadLetters
    from clora_feedback.feedback.rewards import DefaultRewardPolicy
    from clora_feedback.feedback.store import FeedbackStore
    from clora_feedback.gateway.app import create_app
    from clora_feedback.gateway.feedback import build_feedback_router
    from clora_feedback.service import gateway_deployer
    from clora_feedback.store.trajectories import AsyncTrajectoryStore, TrajectoryStore

    engine_config = EngineConfig(model=str(tiny_model_dir), max_model_len=1024, num_threads=1)
    settings = Settings(
        data_dir=tmp_path, engine=engine_config, agents=[{"name": "support", "api_keys": ["k"]}]
    )
    engine = EmbeddedEngine(tiny_model_dir, engine_config, model_name="tiny-base")
    app = create_app(
        settings,
        engine,
        AsyncTrajectoryStore(settings.trajectory_db),
        deployer=gateway_deployer(settings, engine),
    )
    feedback = FeedbackStore(
        settings.trajectory_db,
        trajectories=TrajectoryStore(settings.trajectory_db),
        policy=DefaultRewardPolicy(settings.feedback),
    )
    ingest = FeedbackIngest(feedback, LogDeadLetters(), park_ttl_s=settings.feedback.park_ttl_s)
    app.include_router(build_feedback_router(ingest, settings))
    try:
        with serve(app, lifespan="on") as url:
            with OpenAI(base_url=url + "/v1", api_key="k", max_retries=0) as client:
                response = client.responses.create(model="support", input="hi", max_output_tokens=4)
            with FeedbackClient(url + "/v1", api_key="k") as sender:
                receipt = sender.resolution("support", "resolved", completion_id=response.id)
        assert receipt.joined == receipt.event_ids
        (sample,) = feedback.training_samples("support")
        assert sample.completion_id == response.id and sample.reward == 1.0
        assert response.usage is not None
        assert len(sample.completion_token_ids) == response.usage.output_tokens
    finally:
        feedback.close()


def test_a_failure_mid_stream_ends_with_response_failed() -> None:
    """A chat turn that fails after some text becomes `error` then `response.failed`."""
    import asyncio
    from types import SimpleNamespace

    from clora_feedback.errors import EngineError
    from clora_feedback.gateway.chat import ChoiceChunk
    from clora_feedback.gateway.responses_stream import responses_events

    aborted: list[bool] = []
    run = SimpleNamespace(created_at=1.0, abort=lambda: aborted.append(True))
    turn = SimpleNamespace(completion_id="chatcmpl-x", run=run)

    class FailingChat:
        async def chunks(self, _turn: Any) -> Any:
            yield ChoiceChunk(0, content="Hel", token_ids=(5,), token_versions=(0,))
            raise EngineError("engine died")

    async def collect() -> list[dict[str, Any]]:
        origin = {"model": "support"}
        extension = {"agent": "support", "adapter_version": 0}
        return [
            json.loads(e.split("data: ", 1)[1])
            async for e in responses_events(origin, turn, extension, FailingChat())  # type: ignore[arg-type]
        ]

    events = asyncio.run(collect())
    for event in events:
        validate("ResponseStreamEvent", event)
    kinds = [e["type"] for e in events]
    assert kinds[-2:] == ["error", "response.failed"]
    assert "response.output_text.done" in kinds  # the open message was closed first
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["message"] == "engine died"
    assert failed["output"][0]["content"][0]["text"] == "Hel"
    assert failed["clora"]["token_ids"] == [5] and aborted
