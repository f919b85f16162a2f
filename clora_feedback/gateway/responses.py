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

Not here: the wire models (see `schemas.responses`), prompt format, engine
work and capture (see `chat`, `generation`, `capture`).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from openai.types.responses import Response, ResponseItem, ResponseStreamEvent
from pydantic import TypeAdapter, ValidationError
from starlette.requests import Request

from clora_feedback.chat_format.calls import parse_tool_calls
from clora_feedback.errors import CloraError, EngineError, InvalidRequestError, NotFoundError
from clora_feedback.gateway.agents import AgentRegistry
from clora_feedback.gateway.auth import Principal
from clora_feedback.gateway.chat import ChatHandler, ChatTurn, ChoiceChunk, ChoiceResult
from clora_feedback.gateway.errors import error_event
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

log = logging.getLogger(__name__)
_EVENT: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
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


# ---------------------------------------------------------------- output


def _message_id(response_id: str) -> str:
    return "msg_" + response_id.removeprefix("chatcmpl-")


def _call_item_id(call_id: str) -> str:
    return "fc_" + call_id.removeprefix("call_")


def message_item(response_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    """The assistant message output item (one `output_text` part)."""
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {
        "id": _message_id(response_id),
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [part] if status != "in_progress" else [],
    }


def call_item(call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    """A function_call output item for a chat tool call (`{"id", "function": {...}}`)."""
    fn = call["function"]
    arguments = fn["arguments"] if status != "in_progress" else ""
    return {
        "id": _call_item_id(call["id"]),
        "type": "function_call",
        "call_id": call["id"],
        "name": fn["name"],
        "arguments": arguments,
        "status": status,
    }


def output_items(
    response_id: str, content: str | None, tool_calls: list[dict[str, Any]] | None, finish: str
) -> list[dict[str, Any]]:
    """The output of one finished choice: its text (when any, or when there is nothing
    else), then one item per function call."""
    items: list[dict[str, Any]] = []
    if content or not tool_calls:
        status = "incomplete" if finish == "length" else "completed"
        items.append(message_item(response_id, content or "", status))
    items += [call_item(c) for c in tool_calls or ()]
    return items


def usage_json(input_tokens: int, output_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": input_tokens + output_tokens,
    }


def _wire_tools(origin: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {"parameters": None, "strict": None, **tool, "type": "function"}
        for tool in origin.get("tools") or ()
    ]


def response_json(
    origin: dict[str, Any],
    response_id: str,
    created_at: float,
    *,
    output: list[dict[str, Any]],
    finish: str | None,
    usage: dict[str, Any] | None,
    extension: dict[str, Any] | None = None,
    error: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The response object for `origin` (`ResponsesRequest.origin`); `finish` None means
    still in progress."""
    status = "in_progress" if finish is None else "completed"
    if finish == "length":
        status = "incomplete"
    if error is not None:
        status = "failed"
    text = origin.get("text") or {}
    payload: dict[str, Any] = {
        "id": response_id,
        "object": "response",
        "created_at": int(created_at),
        "status": status,
        "completed_at": int(time.time()) if status == "completed" else None,
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": origin.get("instructions"),
        "max_output_tokens": origin.get("max_output_tokens"),
        "metadata": origin.get("metadata") or {},
        "model": origin["model"],
        "output": output,
        "parallel_tool_calls": origin.get("parallel_tool_calls", True),
        "previous_response_id": origin.get("previous_response_id"),
        "store": origin.get("store", True),
        "temperature": origin.get("temperature", 1.0),
        "text": {"format": text.get("format") or {"type": "text"}},
        "tool_choice": origin.get("tool_choice", "auto"),
        "tools": _wire_tools(origin),
        "top_p": origin.get("top_p", 1.0),
        "truncation": "disabled",
    }
    if usage is not None:  # the official schema has no null usage: absent until known
        payload["usage"] = usage
    if extension is not None:
        payload["clora"] = extension
    # By alias: `text.format.schema` is `schema_` in the openai type.
    return Response.model_validate(payload).model_dump(
        mode="json", exclude_unset=True, by_alias=True
    )


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


# ---------------------------------------------------------------- streaming


def _sse(event: dict[str, Any]) -> str:
    checked = _EVENT.validate_python(event)
    data = json.dumps(
        checked.model_dump(mode="json", exclude_unset=True, by_alias=True),
        ensure_ascii=False,
        separators=(",", ":"),
    )
    return f"event: {event['type']}\ndata: {data}\n\n"


class _Translation:
    """Typed chat chunks of one choice -> Responses events, numbered in order."""

    def __init__(self, origin: dict[str, Any], turn: ChatTurn, extension: dict[str, Any]) -> None:
        self.origin = origin
        self.response_id = turn.completion_id
        self.created = turn.run.created_at
        self.extension: dict[str, Any] = {**extension, "token_ids": [], "token_versions": []}
        self.items: list[dict[str, Any]] = []
        self.text: list[str] | None = None  # the open message's text, while one is open
        self.finish: str | None = None
        self.usage: dict[str, Any] | None = None
        self._sequence = 0

    def event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return _sse(payload)

    def response(self, *, done: bool, error: dict[str, Any] | None = None) -> dict[str, Any]:
        return response_json(
            self.origin,
            self.response_id,
            self.created,
            output=list(self.items),
            finish=(self.finish or "stop") if done else None,
            usage=self.usage,
            extension=self.extension or None,
            error=error,
        )

    def start(self) -> list[str]:
        response = self.response(done=False)
        return [
            self.event("response.created", response=response),
            self.event("response.in_progress", response=response),
        ]

    def chunk(self, chunk: ChoiceChunk) -> list[str]:
        self.extension["token_ids"] += chunk.token_ids
        self.extension["token_versions"] += chunk.token_versions
        out: list[str] = []
        if chunk.content:
            out += self._text(chunk.content)
        for call in chunk.tool_calls:
            out += self._close_text() + self._call(call)
        if chunk.finish_reason is not None:
            self.finish = chunk.finish_reason
            out += self._close_text()
        return out

    def finish_events(self) -> list[str]:
        out = self._close_text()
        if not self.items:  # nothing was said: an empty message, as the JSON answer has
            out += self._text("") + self._close_text()
        kind = "response.incomplete" if self.finish == "length" else "response.completed"
        return [*out, self.event(kind, response=self.response(done=True))]

    def failed(self, error: dict[str, Any]) -> list[str]:
        out = self._close_text()
        out.append(
            self.event(
                "error",
                code=error.get("code"),
                message=error.get("message") or "the stream failed",
                param=error.get("param"),
            )
        )
        failure = {"code": "server_error", "message": error.get("message") or "the stream failed"}
        return [
            *out,
            self.event("response.failed", response=self.response(done=True, error=failure)),
        ]

    def _text(self, text: str) -> list[str]:
        out: list[str] = []
        where = {"item_id": _message_id(self.response_id), "output_index": len(self.items)}
        if self.text is None:
            self.text = []
            item = message_item(self.response_id, "", "in_progress")
            out.append(
                self.event("response.output_item.added", output_index=len(self.items), item=item)
            )
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            out.append(
                self.event("response.content_part.added", **where, content_index=0, part=part)
            )
        if text:
            self.text.append(text)
            out.append(
                self.event(
                    "response.output_text.delta", **where, content_index=0, delta=text, logprobs=[]
                )
            )
        return out

    def _close_text(self) -> list[str]:
        if self.text is None:
            return []
        text, self.text = "".join(self.text), None
        where = {"item_id": _message_id(self.response_id), "output_index": len(self.items)}
        status = "incomplete" if self.finish == "length" else "completed"
        item = message_item(self.response_id, text, status)
        self.items.append(item)
        return [
            self.event(
                "response.output_text.done", **where, content_index=0, text=text, logprobs=[]
            ),
            self.event(
                "response.content_part.done", **where, content_index=0, part=item["content"][0]
            ),
            self.event("response.output_item.done", output_index=where["output_index"], item=item),
        ]

    def _call(self, call: dict[str, Any]) -> list[str]:
        index, done = len(self.items), call_item(call)
        where = {"item_id": done["id"], "output_index": index}
        self.items.append(done)
        return [
            self.event(
                "response.output_item.added",
                output_index=index,
                item=call_item(call, "in_progress"),
            ),
            self.event("response.function_call_arguments.delta", **where, delta=done["arguments"]),
            self.event(
                "response.function_call_arguments.done",
                **where,
                name=done["name"],
                arguments=done["arguments"],
            ),
            self.event("response.output_item.done", output_index=index, item=done),
        ]


async def responses_events(
    origin: dict[str, Any], turn: ChatTurn, extension: dict[str, Any], chat: ChatHandler
) -> AsyncIterator[str]:
    """The turn's typed chat chunks as Responses events.

    The chat handler commits the trajectory after the last chunk, so
    `response.completed` comes after the trajectory is stored.
    """
    translation = _Translation(origin, turn, extension)
    for event in translation.start():
        yield event
    try:
        async with aclosing(chat.chunks(turn)) as chunks:  # closing it aborts the engine run
            async for chunk in chunks:
                for event in translation.chunk(chunk):
                    yield event
    except CloraError as exc:
        failure = error_event(exc)["error"]
    except Exception:
        log.exception("responses stream %s failed", turn.completion_id)
        failure = error_event(EngineError("the stream failed; see the server log"))["error"]
    else:
        usage = turn.run.usage()
        translation.usage = usage_json(usage["prompt_tokens"], usage["completion_tokens"])
        for event in translation.finish_events():
            yield event
        return
    finally:
        turn.run.abort()
    for event in translation.failed(failure):
        yield event
