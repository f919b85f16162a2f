"""`POST /v1/responses`, `GET /v1/responses/{id}` and `GET /v1/responses/{id}/input_items`:
the Responses API over the chat path.

A Responses request is served as the chat completion it stands for, by the
same `ChatHandler`: the same routing and keys, prompt template, tool rendering,
forced-call and JSON-Schema constraints, engine run and trajectory capture. So
every response is a completion that feedback can name: the response id is the
completion id.

Per request, `ResponsesHandler`:
1. routes `model` like chat (404 unknown, 403 not this key's);
2. rebuilds the conversation of `previous_response_id` from its stored
   trajectory (404 when it does not exist, belongs to another key's agent, was
   made with `store: false`, or was not a response): its messages without its
   instructions (OpenAI does not carry instructions over), then its reply;
3. turns `instructions` (one developer message first), the rebuilt history
   and `input` into chat messages, function tools and `tool_choice` into their
   chat shapes, `text.format` into `response_format`, `max_output_tokens` into
   `max_completion_tokens` (`schemas.responses.ResponsesChatRequest`, which keeps
   the Responses request beside the messages in the stored trajectory);
4. answers with the response object, or translates the chat handler's typed
   chunks (`ChatHandler.chunks`) into Responses events (`response.created` ...
   `response.completed`, each with `sequence_number`), the trajectory committed
   before the last one.

Output items have ids derived from the completion and call ids, so
`GET /v1/responses/{id}` answers the same items as the creation did. Input
items are rebuilt from the stored messages from `input_offset` on (the chat
request records where this request's own input begins, after the developer
message and a previous response's conversation); their ids derive from the
response id and the item's place, so every listing and page agrees. `store:
false` keeps the trajectory for training (what the gateway is for) and only
hides the response from `GET` and `previous_response_id`.

Not here: the wire models (see `schemas.responses`), the output shapes (see
`responses_output`), the stream's events (see `responses_stream`), prompt
format, engine work and capture (see `chat`, `generation`, `capture`).
"""

from __future__ import annotations

from typing import Any

from openai.types.responses import ResponseItem
from pydantic import TypeAdapter, ValidationError
from starlette.requests import Request

from clora_feedback.chat_format.calls import parse_tool_calls
from clora_feedback.errors import InvalidRequestError, NotFoundError
from clora_feedback.gateway.agents import AgentRegistry
from clora_feedback.gateway.auth import Principal
from clora_feedback.gateway.chat import ChatHandler, ChatTurn, ChoiceResult
from clora_feedback.gateway.responses_output import (
    call_item,
    output_items,
    response_json,
    usage_json,
)
from clora_feedback.gateway.responses_stream import responses_events
from clora_feedback.gateway.sse import SSEResponse
from clora_feedback.schemas.responses import (
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionToolChoice,
    MessageItem,
    ResponsesChatRequest,
    ResponsesRequest,
    item_text,
)
from clora_feedback.store.trajectories import AsyncTrajectoryStore, TrajectoryRecord

_ITEM: TypeAdapter[Any] = TypeAdapter(ResponseItem)


# ---------------------------------------------------------------- requests


def _input_messages(body: ResponsesRequest, known_calls: set[str]) -> list[dict[str, Any]]:
    """`input` as chat messages; consecutive function calls join one assistant turn."""
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(body.input):
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": item_text(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            known_calls.add(item.call_id)
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in known_calls:
                raise InvalidRequestError(
                    f"No tool call found for function call output with call_id {item.call_id!r}.",
                    param=f"input[{i}].call_id",
                )
            content = item_text(item.output)
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": content})
    return messages


def _calls_in(messages: list[dict[str, Any]]) -> set[str]:
    return {c["id"] for m in messages for c in m.get("tool_calls") or ()}


def chat_request(body: ResponsesRequest, history: list[dict[str, Any]]) -> ResponsesChatRequest:
    """The chat completion request that serves `body`, after the conversation `history`.

    Raises:
        InvalidRequestError: the input does not make a valid conversation.
    """
    head = [{"role": "developer", "content": body.instructions}] if body.instructions else []
    messages = head + history + _input_messages(body, _calls_in(history))
    choice = body.tool_choice
    wire: dict[str, Any] = {
        "model": body.model,
        "messages": messages,
        "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "parallel_tool_calls": body.parallel_tool_calls,
        "stream": bool(body.stream),
        "stream_options": {"include_usage": True} if body.stream else None,
        "metadata": body.metadata,
        "user": body.user,
        "responses": {**body.origin(), "input_offset": len(head) + len(history)},
    }
    if body.tools:
        wire["tools"] = [
            {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
            for t in body.tools
        ]
    if isinstance(choice, FunctionToolChoice):
        wire["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    else:
        wire["tool_choice"] = choice
    fmt = body.text.format if body.text is not None else None
    # `text.format` shapes message text; a forced call's turn has none (the Agents SDK
    # sends both for an agent with tools and a typed output), so it waits for a later turn.
    if fmt is not None and not body.forced_call:
        wire["response_format"] = fmt.chat_format()
    try:
        return ResponsesChatRequest.model_validate({k: v for k, v in wire.items() if v is not None})
    except ValidationError as exc:  # the input items could not become chat messages
        first = exc.errors()[0]
        raise InvalidRequestError(f"input: {first['msg']}", param="input") from exc


def _forced(origin: dict[str, Any]) -> bool:
    choice = origin.get("tool_choice")
    return choice == "required" or isinstance(choice, dict)


def _reply(record: TrajectoryRecord) -> tuple[str | None, list[dict[str, Any]] | None, str]:
    """(content, tool calls, finish reason) that a stored response answered with."""
    sample = record.samples[0]
    finish = sample.finish_reason or "stop"
    if not sample.tool_calls:
        return sample.text, None, finish
    # The stored text is what the model generated: the tags of its calls (after a forced
    # call's prefix, which the prompt holds) around any content.
    content = None if _forced(record.request["responses"]) else parse_tool_calls(sample.text)[0]
    return content, sample.tool_calls, finish


# ---------------------------------------------------------------- input items


def input_items(record: TrajectoryRecord) -> list[dict[str, Any]]:
    """The input items of a stored response, in the order they were sent."""
    origin = record.request["responses"]
    default = 1 if origin.get("instructions") else 0  # recorded before `input_offset` existed
    messages = record.request["messages"][origin.get("input_offset", default) :]
    base = record.id.removeprefix("chatcmpl-")
    items: list[dict[str, Any]] = []
    for k, message in enumerate(messages):
        role, content = message["role"], message.get("content")
        if role == "tool":
            items.append(
                {
                    "id": f"fco_{base}_{k}",
                    "type": "function_call_output",
                    "call_id": message["tool_call_id"],
                    "output": content or "",
                    "status": "completed",
                }
            )
            continue
        if content is not None:
            kind = "output_text" if role == "assistant" else "input_text"
            part: dict[str, Any] = {"type": kind, "text": content}
            if role == "assistant":
                part |= {"annotations": [], "logprobs": []}
            items.append(
                {
                    "id": f"msg_{base}_{k}",
                    "type": "message",
                    "role": role,
                    "status": "completed",
                    "content": [part],
                }
            )
        items += [call_item(call) for call in message.get("tool_calls") or ()]
    return [
        _ITEM.validate_python(item).model_dump(mode="json", exclude_unset=True) for item in items
    ]


def item_page(
    items: list[dict[str, Any]], *, limit: int, order: str, after: str | None
) -> dict[str, Any]:
    """One page of `items` as OpenAI's `ResponseItemList`.

    Raises:
        InvalidRequestError: `limit` outside 1..100, `order` not asc/desc, or `after` not
            an item of this list.
    """
    if not 1 <= limit <= 100:
        raise InvalidRequestError(f"limit must be between 1 and 100, got {limit}", param="limit")
    if order not in ("asc", "desc"):
        raise InvalidRequestError(f"order must be 'asc' or 'desc', got {order!r}", param="order")
    ordered = items if order == "asc" else items[::-1]
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise InvalidRequestError(
                f"No input item with id {after!r} in this response.", param="after"
            )
        ordered = ordered[ids.index(after) + 1 :]
    page = ordered[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(ordered) > limit,
    }


# ---------------------------------------------------------------- the handler


class ResponsesHandler:
    """Serves the Responses API through the chat handler, over the same store."""

    def __init__(self, chat: ChatHandler, agents: AgentRegistry, store: AsyncTrajectoryStore):
        self._chat = chat
        self._agents = agents
        self._store = store

    async def create(self, body: ResponsesRequest, principal: Principal, request: Request) -> Any:
        """Answer one request: a JSON-able dict, or an `SSEResponse` when streaming."""
        route = self._agents.resolve(body.model)
        principal.check_model(body.model, route.agent)
        history: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            previous = await self._stored(
                body.previous_response_id, principal, "previous_response_id"
            )
            history = self._conversation(previous)
        chat_body = chat_request(body, history)
        turn = await self._chat.open(chat_body, principal)
        origin = chat_body.responses
        if chat_body.stream:
            events = responses_events(origin, turn, self._chat.extension(turn), self._chat)
            return SSEResponse(events, on_close=turn.run.abort)
        (result,) = await self._chat.complete(turn, request)
        return self._from_chat(origin, turn, result)

    async def get(self, response_id: str, principal: Principal) -> dict[str, Any]:
        """A stored response, as its creation answered it."""
        record = await self._stored(response_id, principal, "response_id")
        content, calls, finish = _reply(record)
        sample = record.samples[0]
        return response_json(
            record.request["responses"],
            record.id,
            record.created_at,
            output=output_items(record.id, content, calls, finish),
            finish=finish,
            usage=usage_json(len(record.prompt_token_ids), len(sample.completion_token_ids)),
        )

    async def input_items(
        self,
        response_id: str,
        principal: Principal,
        *,
        limit: int = 20,
        order: str = "desc",
        after: str | None = None,
    ) -> dict[str, Any]:
        """A page of a stored response's input items (OpenAI's default: newest first)."""
        record = await self._stored(response_id, principal, "response_id")
        return item_page(input_items(record), limit=limit, order=order, after=after)

    async def _stored(self, response_id: str, principal: Principal, param: str) -> TrajectoryRecord:
        """The trajectory of a stored response this caller may see; 404 otherwise."""
        missing = NotFoundError(
            f"Response with id {response_id!r} not found.", param=param, code="response_not_found"
        )
        try:
            record = await self._store.get(response_id)
            principal.check_trajectory(record.agent, response_id)
        except NotFoundError:
            raise missing from None
        origin = record.request.get("responses")
        if not isinstance(origin, dict) or origin.get("store") is False or not record.samples:
            raise missing
        return record

    @staticmethod
    def _conversation(record: TrajectoryRecord) -> list[dict[str, Any]]:
        """A stored response's messages without its instructions, then its reply."""
        messages = list(record.request["messages"])
        if record.request["responses"].get("instructions"):
            messages = messages[1:]
        content, calls, _ = _reply(record)
        reply: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            reply["tool_calls"] = calls
        return [*messages, reply]

    def _from_chat(
        self, origin: dict[str, Any], turn: ChatTurn, result: ChoiceResult
    ) -> dict[str, Any]:
        (choice,) = turn.run.choices
        usage = turn.run.usage()
        response_id, finish = turn.completion_id, result.finish_reason
        return response_json(
            origin,
            response_id,
            turn.run.created_at,
            output=output_items(response_id, result.content, result.tool_calls, finish),
            finish=finish,
            usage=usage_json(usage["prompt_tokens"], usage["completion_tokens"]),
            extension={
                **self._chat.extension(turn),
                "token_ids": list(choice.token_ids),
                "token_versions": list(choice.versions),
            },
        )
