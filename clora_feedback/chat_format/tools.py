"""Tool calling in the prompt format: prompt rendering, call parsing (whole and streamed), forced calls.

The base model's chat template knows nothing about tools, so tools travel as
plain text that any ChatML template renders. Pure functions and small classes:
no HTTP, no engine (the constraint built here only satisfies the engine's
`TokenConstraint` Protocol). Parsed arguments are not validated against the
schema here; a forced call's arguments follow it by construction.

Format
------
**Offering tools.** Unless `tool_choice` is "none", the first system message
(a new one if there is none; `developer` counts as `system`) starts with a
"# Tools" block listing each function as one JSON line `{"name", "description",
"parameters": <JSON schema>}` inside `<tools>...</tools>`, then the call format,
then the rule: a call is optional ("auto"), at least one is mandatory
("required"), or the named function must be called.

**A call.** The model emits each call as

    <tool_call>{"name": "<function>", "arguments": {<JSON object>}}</tool_call>

one tag per call, possibly several, possibly after some text. Earlier
assistant `tool_calls` are rendered back in exactly this form (with
`json.dumps` spacing), so a multi-turn conversation looks like the model's own.

**A result.** A `role: "tool"` message stays role "tool", with content
`<tool_response name="<function>">RESULT</tool_response>`; the name comes from
the assistant call that its `tool_call_id` answers.

**Parsing.** Text outside calls is the content (stripped; None when empty). A
tag whose body is not one JSON object with a string "name" and an object
"arguments" (missing: `{}`; a JSON string holding an object also counts), or
that is not followed by `</tool_call>`, stays in the content as text; only at
the very end of the text may the closing tag be missing. Each call gets an id
`call_<24 hex>` and its arguments as compact JSON, numbers kept as generated.

**Streaming.** `ToolCallStreamParser` emits content once it can no longer be
part of a call: it holds back a suffix that could start `<tool_call>`, a
candidate call until it resolves, and trailing whitespace (content is
stripped). A call is emitted when its `</tool_call>` arrives (or at the end),
since until then it could still turn out to be text.

**Forced calls.** For `tool_choice` "required" or a named function the gateway
appends `forced_call_prefix(...)` after the generation prompt and generates
under a constraint on the arguments' schema (`forced_call` gives the declarative
form that engines compile; `forced_call_constraint` the compiled one, see `constraint`).

Not here: the grammar itself (see `json_prefix`, `schema`), HTTP, the engine.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from clora_feedback.chat_format.constraint import JSONCallConstraint, call_grammar
from clora_feedback.chat_format.json_prefix import JSONPrefix
from clora_feedback.errors import InvalidRequestError

__all__ = [
    "CALL_CLOSE",
    "CALL_OPEN",
    "ContentDelta",
    "ParsedToolCall",
    "StreamEvent",
    "ToolCallEvent",
    "ToolCallStreamParser",
    "forced_call",
    "forced_call_constraint",
    "forced_call_prefix",
    "parse_tool_calls",
    "render_messages",
]

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
_JSON_WS = " \t\n\r"
_NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


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


# ---------------------------------------------------------------- rendering


def _invalid(param: str, problem: str) -> InvalidRequestError:
    return InvalidRequestError(f"{param} {problem}", param=param)


def _tool_names(tools: list[dict[str, Any]] | None) -> list[str]:
    """Validate `tools` and return their function names, in order."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise _invalid("tools", "must be a list")
    names: list[str] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise _invalid(f"{where}.type", "must be 'function'")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise _invalid(f"{where}.function", "must be an object")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
            raise _invalid(f"{where}.function.name", "must match [A-Za-z0-9_-]{1,64}")
        if name in names:
            raise _invalid(f"{where}.function.name", f"repeats the tool name {name!r}")
        for field, kind in (("description", str), ("parameters", dict)):
            if fn.get(field) is not None and not isinstance(fn[field], kind):
                raise _invalid(f"{where}.function.{field}", f"must be a {kind.__name__}")
        names.append(name)
    return names


def _resolve_choice(tool_choice: str | dict[str, Any] | None, names: list[str]) -> str:
    """Return "none", "auto", "required" or "fn:<name>" for a validated `tool_choice`."""
    if tool_choice is None:
        return "auto" if names else "none"
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise _invalid("tool_choice", "must be 'none', 'auto', 'required' or a function")
        if tool_choice == "required" and not names:
            raise _invalid("tool_choice", "'required' needs a non-empty tools list")
        return tool_choice if names else "none"
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not name:
        raise _invalid(
            "tool_choice", 'must look like {"type": "function", "function": {"name": ...}}'
        )
    if name not in names:
        raise _invalid("tool_choice", f"names {name!r}, which is not in tools")
    return f"fn:{name}"


def _tools_block(tools: list[dict[str, Any]], choice: str) -> str:
    lines = []
    for tool in tools:
        fn = tool["function"]
        spec = {
            "name": fn["name"],
            "description": fn.get("description") or "",
            "parameters": fn.get("parameters") or {"type": "object", "properties": {}},
        }
        lines.append(json.dumps(spec, ensure_ascii=False))
    if choice == "required":
        rule = "You must call at least one function in this reply."
    elif choice.startswith("fn:"):
        rule = f'You must call the function "{choice[3:]}" in this reply.'
    else:
        rule = "Call a function only when it helps; otherwise answer directly."
    return (
        "# Tools\n\n"
        "You can call functions. Each one is described below as a JSON object with its name, "
        "description and JSON-schema parameters:\n"
        "<tools>\n" + "\n".join(lines) + "\n</tools>\n\n"
        "To call a function, write exactly one tag per call, with the arguments as a JSON object:\n"
        f'{CALL_OPEN}{{"name": "<function name>", "arguments": {{...}}}}{CALL_CLOSE}\n'
        "You may make several calls in one reply. Each result comes back in a tool message as "
        '<tool_response name="<function name>">...</tool_response>.\n' + rule
    )


def _text_content(msg: dict[str, Any], where: str, *, allow_none: bool) -> str:
    content = msg.get("content")
    if content is None and allow_none:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _invalid(f"{where}.content", "must be a string or a list of text parts")
    kinds = ("text", "refusal") if msg.get("role") == "assistant" else ("text",)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in kinds or not isinstance(part.get(kind), str):
            raise _invalid(f"{where}.content[{j}]", "must be a text part")
        texts.append(part[kind])
    return "\n".join(texts)


def _format_call(name: str, arguments: str) -> str:
    try:
        args: Any = _DECODER.decode(arguments) if arguments.strip() else {}
    except (ValueError, RecursionError):
        args = arguments  # not JSON: keep the client's text rather than reject its history
    body = _dump_encodable(args, spaced=True) or json.dumps(arguments)
    head = json.dumps(name, ensure_ascii=False)
    return f'{CALL_OPEN}{{"name": {head}, "arguments": {body}}}{CALL_CLOSE}'


def _render_assistant(msg: dict[str, Any], where: str, call_names: dict[str, str]) -> str:
    text = _text_content(msg, where, allow_none=True)
    calls = msg.get("tool_calls") or []
    if not isinstance(calls, list):
        raise _invalid(f"{where}.tool_calls", "must be a list")
    rendered = []
    for j, call in enumerate(calls):
        cw = f"{where}.tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or call.get("type", "function") != "function":
            raise _invalid(cw, "must be a function call")
        call_id, name, arguments = call.get("id"), fn.get("name"), fn.get("arguments", "")
        if not isinstance(call_id, str) or not call_id:
            raise _invalid(f"{cw}.id", "must be a non-empty string")
        if not isinstance(name, str) or not name:
            raise _invalid(f"{cw}.function.name", "must be a non-empty string")
        if not isinstance(arguments, str):
            raise _invalid(f"{cw}.function.arguments", "must be a string of JSON")
        call_names[call_id] = name
        rendered.append(_format_call(name, arguments))
    return "\n".join(([text] if text else []) + rendered)


def render_messages(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    tool_choice: str | dict[str, Any] | None,
) -> list[dict[str, str]]:
    """Turn OpenAI chat messages with tools into plain `{"role", "content": str}` messages.

    Args:
        messages: OpenAI chat messages (roles system/developer/user/assistant/tool).
        tools: OpenAI `tools` (`{"type": "function", "function": {...}}`), or None.
        tool_choice: "none", "auto", "required", `{"type": "function", "function":
            {"name": ...}}`, or None (OpenAI's default: "auto" with tools, else "none").

    Returns:
        messages with roles system/user/assistant/tool and string content, in
        the format documented in this module's docstring.

    Raises:
        InvalidRequestError: a message, tool or tool_choice is malformed (`param` names it).
    """
    tool_list = tools or []
    choice = _resolve_choice(tool_choice, _tool_names(tools))
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list", param="messages")
    out: list[dict[str, str]] = []
    call_names: dict[str, str] = {}  # tool_call_id -> function name, from assistant turns
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        role = msg.get("role") if isinstance(msg, dict) else None
        if role not in _ROLES:
            raise _invalid(f"{where}.role", f"must be one of {', '.join(sorted(_ROLES))}")
        if role == "assistant":
            content = _render_assistant(msg, where, call_names)
        elif role == "tool":
            call_id = msg.get("tool_call_id")
            if not isinstance(call_id, str) or call_id not in call_names:
                raise _invalid(
                    f"{where}.tool_call_id", "must answer an earlier assistant tool call"
                )
            result = _text_content(msg, where, allow_none=False)
            content = f'<tool_response name="{call_names[call_id]}">{result}</tool_response>'
        else:
            content = _text_content(msg, where, allow_none=False)
        out.append({"role": "system" if role == "developer" else str(role), "content": content})
    if tool_list and choice != "none":
        block = _tools_block(tool_list, choice)
        if out[0]["role"] == "system":
            out[0] = {"role": "system", "content": block + "\n\n" + out[0]["content"]}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


# ---------------------------------------------------------------- forced calls


def forced_call_prefix(
    tool_choice: str | dict[str, Any] | None, tools: list[dict[str, Any]] | None
) -> str:
    """Text the gateway appends after the generation prompt to force a call ("" if none is forced).

    Returns:
        `<tool_call>{"name": "<fn>", "arguments": ` for a named function,
        `<tool_call>{"name": "` for "required", "" for "auto"/"none"/None.
    """
    choice = _resolve_choice(tool_choice, _tool_names(tools))
    if choice == "required":
        return CALL_OPEN + '{"name": "'
    if choice.startswith("fn:"):
        return CALL_OPEN + '{"name": ' + json.dumps(choice[3:]) + ', "arguments": '
    return ""


def forced_call(
    tool_choice: str | dict[str, Any] | None, tools: list[dict[str, Any]] | None
) -> tuple[str | None, dict[str, dict[str, Any] | None]] | None:
    """What a forced call may be, as plain data for a declarative spec; None when none is forced.

    Returns:
        (the forced function's name, or None for "required"; function name ->
        its `parameters` JSON Schema, None when the tool declares none).
    """
    choice = _resolve_choice(tool_choice, _tool_names(tools))
    if choice not in ("required",) and not choice.startswith("fn:"):
        return None
    functions = {t["function"]["name"]: t["function"].get("parameters") for t in tools or []}
    return (choice[3:] if choice.startswith("fn:") else None), functions


def forced_call_constraint(
    tool_choice: str | dict[str, Any] | None,
    tools: list[dict[str, Any]] | None,
    token_texts: Sequence[str],
) -> JSONCallConstraint | None:
    """The constraint that pairs with `forced_call_prefix`, or None when no call is forced.

    The arguments follow the chosen function's `parameters` schema (see `schema`).

    Args:
        token_texts: decoded text per token id (`constraint.vocab_texts(tokenizer)`).
    """
    forced = forced_call(tool_choice, tools)
    if forced is None:
        return None
    name, functions = forced
    return JSONCallConstraint.from_grammar(token_texts, call_grammar(functions, name))


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
