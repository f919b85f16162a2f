"""The Responses API's output shapes: output items, usage and the response object.

Shared by `responses` (a created or stored response) and `responses_stream`
(the events of a streamed one). Item ids derive from the completion and call
ids (`msg_...`, `fc_...`), so `GET /v1/responses/{id}` answers the same items
as the creation did.

Not here: requests and the handler (see `responses`), streaming (see `responses_stream`).
"""

from __future__ import annotations

import time
from typing import Any

from openai.types.responses import Response

__all__ = [
    "call_item",
    "message_id",
    "message_item",
    "output_items",
    "response_json",
    "usage_json",
]


def message_id(response_id: str) -> str:
    """The id of a response's assistant message item (`msg_` + the completion's hex)."""
    return "msg_" + response_id.removeprefix("chatcmpl-")


def _call_item_id(call_id: str) -> str:
    return "fc_" + call_id.removeprefix("call_")


def message_item(response_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    """The assistant message output item (one `output_text` part)."""
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {
        "id": message_id(response_id),
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
