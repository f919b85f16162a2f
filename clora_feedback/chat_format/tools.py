"""Tool calling in the prompt: rendering messages and tools, and forced calls.

The base model's chat template knows nothing about tools, so tools travel as
plain text that any ChatML template renders. Pure functions: no HTTP, no engine
(the constraint built here only satisfies the engine's `TokenConstraint`
Protocol).

Format
------
**Offering tools.** Unless `tool_choice` is "none", the first system message
(a new one if there is none; `developer` counts as `system`) starts with a
"# Tools" block listing each function as one JSON line `{"name", "description",
"parameters": <JSON schema>}` inside `<tools>...</tools>`, then the call format,
then the rule: a call is optional ("auto"), at least one is mandatory
("required"), or the named function must be called; with `parallel_tool_calls`
false the block says at most one call (and no longer that several are allowed).

**A call.** The `<tool_call>` tag (see `calls`, which writes and parses it).
Earlier assistant `tool_calls` are rendered back with `calls.format_call`, so
a multi-turn conversation looks like the model's own.

**A result.** A `role: "tool"` message stays role "tool", with content
`<tool_response name="<function>">RESULT</tool_response>`; the name comes from
the assistant call that its `tool_call_id` answers.

**Forced calls.** For `tool_choice` "required" or a named function the gateway
appends `forced_call_prefix(...)` after the generation prompt and generates
under a constraint on the arguments' schema (`forced_call` gives the declarative
form that engines compile; `forced_call_constraint` the compiled one, see `constraint`).

Not here: parsing generated text (see `calls`), the grammar itself (see
`json_prefix`, `schema`), HTTP, the engine.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from clora_feedback.chat_format.calls import CALL_CLOSE, CALL_OPEN, format_call
from clora_feedback.chat_format.constraint import JSONCallConstraint, call_grammar
from clora_feedback.errors import InvalidRequestError

__all__ = ["forced_call", "forced_call_constraint", "forced_call_prefix", "render_messages"]

_NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


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


def _tools_block(tools: list[dict[str, Any]], choice: str, parallel: bool) -> str:
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
        + ("You may make several calls in one reply. " if parallel else "")
        + "Each result comes back in a tool message as "
        '<tool_response name="<function name>">...</tool_response>.\n'
        + rule
        + ("" if parallel else " Make at most one call in this reply.")
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
        rendered.append(format_call(name, arguments))
    return "\n".join(([text] if text else []) + rendered)


def render_messages(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    tool_choice: str | dict[str, Any] | None,
    *,
    parallel_calls: bool = True,
) -> list[dict[str, str]]:
    """Turn OpenAI chat messages with tools into plain `{"role", "content": str}` messages.

    Args:
        messages: OpenAI chat messages (roles system/developer/user/assistant/tool).
        tools: OpenAI `tools` (`{"type": "function", "function": {...}}`), or None.
        tool_choice: "none", "auto", "required", `{"type": "function", "function":
            {"name": ...}}`, or None (OpenAI's default: "auto" with tools, else "none").
        parallel_calls: the reply may make several calls (`parallel_tool_calls`);
            false: the prompt says at most one.

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
        block = _tools_block(tool_list, choice, parallel_calls)
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
