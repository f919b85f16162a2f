"""The tool-call tag: writing one call, and parsing calls back out of generated text.

The model emits each call as

    <tool_call>{"name": "<function>", "arguments": {<JSON object>}}</tool_call>

one tag per call, possibly several, possibly after some text. `format_call`
writes a call in exactly this form (with `json.dumps` spacing); the prompt
renderer uses it for earlier assistant turns, so a multi-turn conversation
looks like the model's own. JSON numbers are kept as their source text in both
directions, so re-serialising never rounds or overflows.

**Parsing.** Text outside calls is the content (stripped; None when empty). A
tag whose body is not one JSON object with a string "name" and an object
"arguments" (missing: `{}`; a JSON string holding an object also counts), or
that is not followed by `</tool_call>`, stays in the content as text; only at
the very end of the text may the closing tag be missing. Each call gets an id
`call_<24 hex>` and its arguments as compact JSON, numbers kept as generated.
Parsed arguments are not validated against the schema here; a forced call's
arguments follow it by construction.

**Streaming.** `ToolCallStreamParser` emits content once it can no longer be
part of a call: it holds back a suffix that could start `<tool_call>`, a
candidate call until it resolves, and trailing whitespace (content is
stripped). A call is emitted when its `</tool_call>` arrives (or at the end),
since until then it could still turn out to be text.

Not here: rendering prompts and forced calls (see `tools`), the grammar (see
`json_prefix`), HTTP, the engine.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any

from clora_feedback.chat_format.json_prefix import JSONPrefix

__all__ = [
    "CALL_CLOSE",
    "CALL_OPEN",
    "ContentDelta",
    "ParsedToolCall",
    "StreamEvent",
    "ToolCallEvent",
    "ToolCallStreamParser",
    "format_call",
    "parse_tool_calls",
]

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
_JSON_WS = " \t\n\r"


# ---------------------------------------------------------------- value types


@dataclass(frozen=True)
class ParsedToolCall:
    """One tool call found in generated text.

    Attributes:
        id: fresh id, "call_" + 24 hex digits.
        name: the function name as generated (not checked against the tools offered).
        arguments: the arguments object as compact JSON text.
    """

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ContentDelta:
    """Streamed content text that is final (can no longer belong to a call)."""

    text: str


@dataclass(frozen=True)
class ToolCallEvent:
    """A complete streamed tool call: `ParsedToolCall`'s fields plus `index` (0, 1, ... per reply)."""

    index: int
    id: str
    name: str
    arguments: str


StreamEvent = ContentDelta | ToolCallEvent


# ---------------------------------------------------------------- JSON with verbatim numbers


class _RawNumber:
    """A JSON number kept as its source text, so re-serialising never rounds or overflows."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


_DECODER = json.JSONDecoder(
    parse_float=_RawNumber, parse_int=_RawNumber, parse_constant=_reject_constant
)


def _dump(value: Any, *, spaced: bool = False, ascii_only: bool = False) -> str:
    """JSON text of a `_DECODER` result: compact, or with `json.dumps`' default spacing."""
    item, colon = (", ", ": ") if spaced else (",", ":")
    if isinstance(value, dict):
        pairs = (
            _dump(k, ascii_only=ascii_only) + colon + _dump(v, spaced=spaced, ascii_only=ascii_only)
            for k, v in value.items()
        )
        return "{" + item.join(pairs) + "}"
    if isinstance(value, list):
        return "[" + item.join(_dump(v, spaced=spaced, ascii_only=ascii_only) for v in value) + "]"
    if isinstance(value, _RawNumber):
        return value.text
    return json.dumps(value, ensure_ascii=ascii_only)


def _dump_encodable(value: Any, *, spaced: bool = False) -> str | None:
    """`_dump`, escaping non-ASCII only if a lone surrogate (from `\\ud8xx`) makes UTF-8 fail."""
    try:
        text = _dump(value, spaced=spaced)
        text.encode("utf-8")
    except RecursionError:
        return None
    except UnicodeEncodeError:
        text = _dump(value, spaced=spaced, ascii_only=True)
    return text


# ---------------------------------------------------------------- writing


def format_call(name: str, arguments: str) -> str:
    """One call as the model writes it; `arguments` that are not JSON are kept as a string."""
    try:
        args: Any = _DECODER.decode(arguments) if arguments.strip() else {}
    except (ValueError, RecursionError):
        args = arguments  # not JSON: keep the client's text rather than reject its history
    body = _dump_encodable(args, spaced=True) or json.dumps(arguments)
    head = json.dumps(name, ensure_ascii=False)
    return f'{CALL_OPEN}{{"name": {head}, "arguments": {body}}}{CALL_CLOSE}'


# ---------------------------------------------------------------- parsing


def _new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _call_from_object(obj: Any) -> ParsedToolCall | None:
    """A call from a decoded `{"name", "arguments"}` object; None if malformed."""
    if not isinstance(obj, dict):
        return None
    name, args = obj.get("name"), obj.get("arguments")
    if not isinstance(name, str) or not name.strip():  # _RawNumber is not a str
        return None
    args = {} if args is None else args
    if isinstance(args, str):
        try:
            args = _DECODER.decode(args)
        except (ValueError, RecursionError):
            return None
    if not isinstance(args, dict):
        return None
    arguments = _dump_encodable(args)
    return None if arguments is None else ParsedToolCall(_new_call_id(), name, arguments)


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _JSON_WS:
        i += 1
    return i


def _match_call(text: str, start: int) -> tuple[int, ParsedToolCall] | None:
    """Match a call body at `start` (just after `<tool_call>`); (end, call) or None."""
    i = _skip_ws(text, start)
    if not text.startswith("{", i):
        return None
    try:
        obj, j = _DECODER.raw_decode(text, i)
    except (ValueError, RecursionError):
        return None
    call = _call_from_object(obj)
    if call is None:
        return None
    k = _skip_ws(text, j)
    if text.startswith(CALL_CLOSE, k):
        return k + len(CALL_CLOSE), call
    return (k, call) if k == len(text) else None


def parse_tool_calls(text: str) -> tuple[str | None, list[ParsedToolCall]]:
    """Split generated text into content and tool calls (format in the module docstring).

    Returns:
        (content stripped of surrounding whitespace, or None if empty; calls in order).
    """
    parts: list[str] = []
    calls: list[ParsedToolCall] = []
    pos = 0
    while (k := text.find(CALL_OPEN, pos)) >= 0:
        parts.append(text[pos:k])
        start = k + len(CALL_OPEN)
        match = _match_call(text, start)
        if match is None:  # malformed: the tag is text, and scanning resumes right after it
            parts.append(CALL_OPEN)
            pos = start
        else:
            pos, call = match
            calls.append(call)
    parts.append(text[pos:])
    content = "".join(parts).strip()
    return content or None, calls


def _partial_tag_len(text: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `<tool_call>`."""
    longest = min(len(text), len(CALL_OPEN) - 1)
    return next((n for n in range(longest, 0, -1) if text.endswith(CALL_OPEN[:n])), 0)


class ToolCallStreamParser:
    """Incremental `parse_tool_calls` for SSE: same content and calls, any chunking.

    Feed generated text deltas with `feed` and call `finish` once at the end;
    both return the events that became final. The joined `ContentDelta` texts
    equal `parse_tool_calls(full_text)[0]` (or "" for None) and the
    `ToolCallEvent`s match its calls in order (ids are fresh).
    """

    def __init__(self) -> None:
        self._buf = ""  # undecided text outside any call (a partial `<tool_call>` at most)
        self._open_call()
        self._in_call = False
        self._started = False  # some non-whitespace content was emitted
        self._pending_ws = ""  # trailing content whitespace, emitted only if content follows
        self._index = 0
        self._finished = False

    def _open_call(self) -> None:
        self._in_call = True
        self._body: list[str] = []  # chars after the current `<tool_call>`, in case they are text
        self._json: JSONPrefix | None = None  # validator once the body's '{' arrived
        self._json_start = 0  # offset of that '{' in `_body`
        self._call: ParsedToolCall | None = None  # decoded once the JSON object closed
        self._close_seen = 0  # characters of `</tool_call>` matched after the object

    def feed(self, delta: str) -> list[StreamEvent]:
        """Consume a text delta; return events that are now final."""
        if self._finished:
            raise RuntimeError("feed() after finish()")
        events: list[StreamEvent] = []
        self._scan(delta, events)
        return events

    def finish(self) -> list[StreamEvent]:
        """End of generation: resolve what is held back; return the last events."""
        if self._finished:
            raise RuntimeError("finish() called twice")
        self._finished = True
        events: list[StreamEvent] = []
        while self._in_call:
            if self._call is not None and self._close_seen == 0:
                # Only whitespace followed the object: the final closing tag may be missing.
                self._emit_call(events)
            else:
                self._scan(self._abandon(events), events)
        self._content(self._buf, events)
        self._buf = ""
        return events

    def _scan(self, text: str, events: list[StreamEvent]) -> None:
        while text:
            if self._in_call:
                text = self._feed_call(text, events)
                continue
            buf, text = self._buf + text, ""
            k = buf.find(CALL_OPEN)
            if k >= 0:
                self._content(buf[:k], events)
                self._buf = ""
                self._open_call()
                text = buf[k + len(CALL_OPEN) :]
            else:
                keep = _partial_tag_len(buf)
                self._content(buf[: len(buf) - keep], events)
                self._buf = buf[len(buf) - keep :]

    def _feed_call(self, text: str, events: list[StreamEvent]) -> str:
        """Advance the open call over `text`; return the text left to scan afterwards."""
        for pos, c in enumerate(text):
            self._body.append(c)
            if not self._step_call(c):
                return self._abandon(events) + text[pos + 1 :]
            if self._close_seen == len(CALL_CLOSE):
                self._emit_call(events)
                return text[pos + 1 :]
        return ""

    def _step_call(self, c: str) -> bool:
        """One character of a call body (already in `_body`); False once it is malformed."""
        if self._json is None:
            if c in _JSON_WS:
                return True
            if c != "{":
                return False
            self._json = JSONPrefix.for_object()
            self._json_start = len(self._body) - 1
        if self._call is None:
            if not self._json.push(c):
                return False
            if self._json.done:
                self._call = self._decode_body()
                return self._call is not None
            return True
        if self._close_seen == 0 and c in _JSON_WS:
            return True
        if c != CALL_CLOSE[self._close_seen]:
            return False
        self._close_seen += 1
        return True

    def _decode_body(self) -> ParsedToolCall | None:
        try:
            obj = _DECODER.decode("".join(self._body[self._json_start :]))
        except (ValueError, RecursionError):
            return None
        return _call_from_object(obj)

    def _emit_call(self, events: list[StreamEvent]) -> None:
        assert self._call is not None
        call = self._call
        events.append(ToolCallEvent(self._index, call.id, call.name, call.arguments))
        self._index += 1
        self._in_call = False

    def _abandon(self, events: list[StreamEvent]) -> str:
        """The candidate is text: emit the tag as content; return its body for rescanning."""
        self._in_call = False
        self._content(CALL_OPEN, events)
        return "".join(self._body)

    def _content(self, raw: str, events: list[StreamEvent]) -> None:
        """Emit raw content, keeping the overall stream equal to the stripped content."""
        if not self._started:
            raw = raw.lstrip()
            if not raw:
                return
            self._started = True
        text = self._pending_ws + raw
        core = text.rstrip()
        self._pending_ws = text[len(core) :]
        if core:
            events.append(ContentDelta(core))
