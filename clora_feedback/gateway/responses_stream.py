"""A streamed Responses request: the chat turn's typed chunks as Responses events.

`responses_events` reads `ChatHandler.chunks` of one turn (never chat's SSE
text) and sends `response.created`, `response.in_progress`, then per output
item its added / delta / done events, and `response.completed` (or
`response.incomplete` when `max_output_tokens` cut it) after the trajectory is
stored; a failure midway closes the open item and ends with `error` and
`response.failed`. Every event has its `sequence_number` and is checked
against the `openai` package's `ResponseStreamEvent`.

Not here: the request and the handler (see `responses`), the output shapes
(see `responses_output`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from clora_feedback.errors import CloraError, EngineError
from clora_feedback.gateway.chat import ChatHandler, ChatTurn, ChoiceChunk
from clora_feedback.gateway.errors import error_event
from clora_feedback.gateway.responses_output import (
    call_item,
    message_id,
    message_item,
    response_json,
    usage_json,
)

__all__ = ["responses_events"]

log = logging.getLogger(__name__)
_EVENT: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)


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
        where = {"item_id": message_id(self.response_id), "output_index": len(self.items)}
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
        where = {"item_id": message_id(self.response_id), "output_index": len(self.items)}
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
