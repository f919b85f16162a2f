"""The incremental JSON validator under forced tool calls: is this text still a prefix of the grammar?

`JSONPrefix` is a small character-level state machine over objects, arrays,
strings with escapes, numbers and the literals true/false/null, for two
grammars (see `calls` for the call format):

    object:    <JSON object>                                   (`for_object`)
    named:     <JSON object>}                                  (the arguments, then the call's "}")
    required:  <tool name>", "arguments": <JSON object>}       (JSON whitespace allowed between parts)

Guided by a compiled schema (`schema.SchemaNode`), every value also follows
it: a value may only start with a character its node's types allow, a
declared key is spelt out and never repeated, `}` waits for the required keys,
`,` and `]` respect the item counts, and an enum value is matched against its
exact texts. With no schema the machine is plain JSON syntax.

Its state is a handful of immutable fields (the open containers are a short
`str` plus a tuple of frames), so checking a candidate token copies it in O(1)
and feeds only that token's characters. `closing_suffix` gives the shortest
text that completes the current prefix, used when `max_tokens` runs out.

Not here: tokens (see `constraint`), the schema subset (see `schema`),
parsing finished text (see `calls.parse_tool_calls`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Literal, NamedTuple

from clora_feedback.chat_format.schema import ANY, ANY_OBJECT, SchemaNode, minimal_text

__all__ = ["CallMode", "JSONPrefix"]

CallMode = Literal["named", "required"]
""""named": the function is fixed by the prefix; "required": the model picks one of the tools."""

_WS = " \t\n\r"
_DIGITS = "0123456789"
_HEX = "0123456789abcdefABCDEF"
_ARGUMENTS_KEY = 'arguments"'  # the opening quote is consumed by the state before it

# Lexical modes of the machine. Structural modes accept JSON whitespace.
_VALUE = 0  # any value (after ':' or after ',' in an array)
_OBJ_FIRST = 1  # after '{': a key or '}'
_OBJ_KEY = 2  # after ',' in an object: a key
_ARR_FIRST = 3  # after '[': a value or ']'
_COLON = 4  # after a key
_AFTER = 5  # after a value: ',' or the closer of the innermost container
_STR = 6
_STR_ESC = 7  # after a backslash
_STR_HEX = 8  # inside \uXXXX
_LIT = 9  # matching the rest of a fixed literal (true/false/null, "arguments")
_N_MINUS = 10
_N_ZERO = 11  # complete
_N_INT = 12  # complete
_N_DOT = 13
_N_FRAC = 14  # complete
_N_EXP = 15
_N_EXP_SIGN = 16
_N_EXP_DIG = 17  # complete
_ROOT = 18  # the root value, which must be an object
_NAME = 19  # inside the tool-name string (required mode)
_HDR_COMMA = 20  # after the name's closing quote
_HDR_KEY = 21  # before the '"' that opens "arguments"
_HDR_COLON = 22  # after "arguments"
_DONE = 23
_KEY = 24  # inside a key of an object whose keys the schema tracks (spelt out, no escapes)
_ENUM = 25  # matching one of an enum's exact texts

_STRUCTURAL = frozenset(
    {
        _VALUE,
        _OBJ_FIRST,
        _OBJ_KEY,
        _ARR_FIRST,
        _COLON,
        _AFTER,
        _ROOT,
        _HDR_COMMA,
        _HDR_KEY,
        _HDR_COLON,
    }
)
_NUMBER_COMPLETE = frozenset({_N_ZERO, _N_INT, _N_FRAC, _N_EXP_DIG})
_NUMBER_OPEN = frozenset({_N_MINUS, _N_DOT, _N_EXP, _N_EXP_SIGN})
_LITERALS = {"t": ("rue", "boolean"), "f": ("alse", "boolean"), "n": ("ull", "null")}
_CALL_FRAME = "C"  # the tool-call object around the arguments: closed by '}' only, no more keys
_MAX_SUFFIX_STEPS = 100_000


class _Frame(NamedTuple):
    """One open container: its schema node, the keys written (objects), the items started (arrays)."""

    node: SchemaNode
    used: frozenset[str] = frozenset()
    items: int = 0


class JSONPrefix:
    """Incremental validator: is the text fed so far a prefix of the grammar?

    Build one with `for_object()` (a bare JSON object, used by the stream
    parser and `response_format`) or `for_call()` (the forced tool-call
    grammar). `push` returns False on the first character that cannot continue
    a valid prefix; the state is then unspecified, so callers push onto a
    `copy()` when they need to keep the old one.
    """

    __slots__ = (
        "_after_lit",
        "_frames",
        "_hex_left",
        "_int",
        "_key",
        "_lit",
        "_max_ws",
        "_mode",
        "_names",
        "_node",
        "_prefixes",
        "_schemas",
        "_stack",
        "_ws_run",
    )

    def __init__(
        self,
        mode: int,
        stack: str,
        names: tuple[str, ...] = (),
        max_whitespace: int | None = None,
        *,
        node: SchemaNode = ANY_OBJECT,
        schemas: Mapping[str, SchemaNode] | None = None,
    ) -> None:
        self._mode = mode
        self._stack = stack  # open containers, innermost last: '{', '[' or the call frame
        self._frames: tuple[_Frame, ...] = tuple(_Frame(ANY_OBJECT) for _ in stack)
        self._node = node  # the node of the value about to start (or being matched)
        self._lit = ""  # rest of a literal in _LIT; the name, key or enum text so far
        self._after_lit = _AFTER
        self._key = False  # the open string is an (untracked) object key
        self._int = False  # the open number must be an integer
        self._hex_left = 0
        self._ws_run = 0
        self._max_ws = max_whitespace
        self._names = names
        self._prefixes = frozenset(n[:i] for n in names for i in range(len(n) + 1))
        self._schemas: Mapping[str, SchemaNode] = schemas or {}

    @classmethod
    def for_object(
        cls, schema: SchemaNode | None = None, max_whitespace: int | None = None
    ) -> JSONPrefix:
        """A validator for exactly one JSON object (done when it closes), following `schema`."""
        return cls(_ROOT, "", max_whitespace=max_whitespace, node=schema or ANY_OBJECT)

    @classmethod
    def for_call(
        cls,
        mode: CallMode,
        tool_names: Sequence[str] = (),
        max_whitespace: int | None = None,
        *,
        arguments: SchemaNode | None = None,
        schemas: Mapping[str, SchemaNode] | None = None,
    ) -> JSONPrefix:
        """A validator for the text generated after a forced call prefix.

        Args:
            mode: "named" (arguments object then `}`) or "required" (tool name,
                `", "arguments": `, arguments object, `}`).
            tool_names: names the model may pick in "required" mode (non-empty there).
            max_whitespace: most consecutive structural whitespace characters,
                so a model cannot idle forever between tokens; None for no cap.
            arguments: "named" mode: the arguments' schema (None: any object).
            schemas: "required" mode: tool name -> its arguments' schema (absent: any object).
        """
        if mode == "named":
            return cls(
                _ROOT, _CALL_FRAME, max_whitespace=max_whitespace, node=arguments or ANY_OBJECT
            )
        if mode == "required":
            if not tool_names:
                raise ValueError("required mode needs at least one tool name")
            return cls(_NAME, _CALL_FRAME, tuple(tool_names), max_whitespace, schemas=schemas)
        raise ValueError(f"unknown call mode {mode!r}")

    def copy(self) -> JSONPrefix:
        """An independent copy (every field is immutable, so this is shallow)."""
        new = JSONPrefix.__new__(JSONPrefix)
        for slot in JSONPrefix.__slots__:
            setattr(new, slot, getattr(self, slot))
        return new

    @property
    def done(self) -> bool:
        """True once the grammar is complete; no character is accepted after that."""
        return self._mode == _DONE

    @property
    def free(self) -> bool:
        """Never: every character belongs to the JSON (`trigger.TriggeredCalls` has free text)."""
        return False

    def push(self, text: str) -> bool:
        """Feed `text`; False if some character of it breaks the grammar."""
        return all(self._step(c) for c in text)

    # -- one character ---------------------------------------------------------------

    def _step(self, c: str) -> bool:
        mode = self._mode
        if mode == _STR:
            return self._in_string(c)
        if mode == _KEY:
            return self._in_key(c)
        if mode == _ENUM:
            if self._enum_continues(c):
                return True
            if self._lit not in (self._node.enum or ()):
                return False
            self._mode = mode = _AFTER  # the value ended; `c` belongs to what follows
        if mode in _NUMBER_COMPLETE:
            if self._number_continues(c):
                return True
            self._mode = mode = _AFTER
        if mode in _STRUCTURAL and c in _WS:
            self._ws_run += 1
            return self._max_ws is None or self._ws_run <= self._max_ws
        self._ws_run = 0
        return self._step_token(mode, c)

    def _in_string(self, c: str) -> bool:
        if c == '"':
            if self._key:  # an untracked key: its value follows the object's extra-key node
                self._node = self._frames[-1].node.additional or ANY
                self._mode = _COLON
            else:
                self._mode = _AFTER
        elif c == "\\":
            self._mode = _STR_ESC
        elif c < " ":  # JSON forbids raw control characters in strings
            return False
        return True

    def _in_key(self, c: str) -> bool:
        frame = self._frames[-1]
        node = frame.node
        if c == '"':
            key = self._lit
            value = node.value_of(key)
            if key in frame.used or value is None:
                return False
            self._frames = (*self._frames[:-1], frame._replace(used=frame.used | {key}))
            self._node, self._mode = value, _COLON
            return True
        if c == "\\" or c < " ":
            return False
        key = self._lit + c
        if node.additional is None and not any(
            k.startswith(key) and k not in frame.used for k in node.properties
        ):
            return False
        self._lit = key
        return True

    def _enum_continues(self, c: str) -> bool:
        text = self._lit + c
        if text not in self._node.enum_prefixes:
            return False
        self._lit = text
        self._enum_maybe_ended()
        return True

    def _enum_maybe_ended(self) -> None:
        """End the enum value at once when no longer text could follow (e.g. after `"x"`)."""
        texts = self._node.enum or frozenset()
        lit = self._lit
        if lit in texts and not any(t != lit and t.startswith(lit) for t in texts):
            self._mode = _AFTER if self._stack else _DONE

    def _number_continues(self, c: str) -> bool:
        mode = self._mode
        if c in _DIGITS:
            return mode != _N_ZERO  # digits keep the mode; JSON forbids leading zeros
        if self._int:
            return False  # an integer has no fraction or exponent
        if c == "." and mode in (_N_ZERO, _N_INT):
            self._mode = _N_DOT
            return True
        if c in "eE" and mode in (_N_ZERO, _N_INT, _N_FRAC):
            self._mode = _N_EXP
            return True
        return False

    def _step_token(self, mode: int, c: str) -> bool:
        if mode in (_VALUE, _ROOT):
            return self._start_value(c, object_only=mode == _ROOT)
        if mode == _AFTER:
            return self._after_value(c)
        if mode in (_OBJ_FIRST, _OBJ_KEY):
            if c == '"':
                return self._open_key()
            return mode == _OBJ_FIRST and c == "}" and self._close("{")
        if mode == _ARR_FIRST:
            return self._close("[") if c == "]" else self._first_item(c)
        if mode == _COLON:
            self._mode = _VALUE
            return c == ":"
        if mode == _STR_ESC:
            if c == "u":
                self._mode, self._hex_left = _STR_HEX, 4
                return True
            self._mode = _STR
            return c in '"\\/bfnrt'
        if mode == _STR_HEX:
            self._hex_left -= 1
            if self._hex_left == 0:
                self._mode = _STR
            return c in _HEX
        if mode == _LIT:
            if c != self._lit[0]:
                return False
            self._lit = self._lit[1:]
            if not self._lit:
                self._mode = self._after_lit
            return True
        if mode in _NUMBER_OPEN:
            return self._number_open(mode, c)
        return self._step_header(mode, c)

    def _number_open(self, mode: int, c: str) -> bool:
        if mode == _N_MINUS:
            self._mode = _N_ZERO if c == "0" else _N_INT
        elif mode == _N_DOT:
            self._mode = _N_FRAC
        elif mode == _N_EXP and c in "+-":
            self._mode = _N_EXP_SIGN
            return True
        else:
            self._mode = _N_EXP_DIG
        return c in _DIGITS

    def _step_header(self, mode: int, c: str) -> bool:
        if mode == _NAME:
            if c == '"':
                self._mode = _HDR_COMMA
                self._node = self._schemas.get(self._lit, ANY_OBJECT)
                return self._lit in self._names
            self._lit += c
            return self._lit in self._prefixes
        if mode == _HDR_COMMA:
            self._mode = _HDR_KEY
            return c == ","
        if mode == _HDR_KEY:
            self._mode, self._lit, self._after_lit = _LIT, _ARGUMENTS_KEY, _HDR_COLON
            return c == '"'
        if mode == _HDR_COLON:
            self._mode = _ROOT
            return c == ":"
        return False  # _DONE accepts nothing

    def _start_value(self, c: str, *, object_only: bool) -> bool:
        node = self._node
        if node.enum is not None:
            if c not in node.enum_prefixes or (object_only and c != "{"):
                return False
            self._mode, self._lit = _ENUM, c
            self._enum_maybe_ended()
            return True
        types = node.types
        if c == "{":
            if "object" not in types:
                return False
            self._push_frame("{", node)
            self._mode = _OBJ_FIRST
            return True
        if object_only:
            return False
        if c == "[" and "array" in types:
            self._push_frame("[", node)
            self._mode, self._node = _ARR_FIRST, node.items or ANY
        elif c == '"' and "string" in types:
            self._mode, self._key = _STR, False
        elif (c == "-" or c in _DIGITS) and types & {"number", "integer"}:
            self._int = "number" not in types
            self._mode = _N_MINUS if c == "-" else _N_ZERO if c == "0" else _N_INT
        elif c in _LITERALS and _LITERALS[c][1] in types:
            self._mode, self._lit, self._after_lit = _LIT, _LITERALS[c][0], _AFTER
        else:
            return False
        return True

    def _push_frame(self, kind: str, node: SchemaNode) -> None:
        self._stack += kind
        self._frames = (*self._frames, _Frame(node))

    def _set_count(self, count: int) -> None:
        self._frames = (*self._frames[:-1], self._frames[-1]._replace(items=count))

    def _first_item(self, c: str) -> bool:
        top = self._frames[-1].node.max_items
        if top is not None and top < 1:
            return False
        self._set_count(1)
        return self._start_value(c, object_only=False)

    def _can_add_key(self, frame: _Frame) -> bool:
        node = frame.node
        if not node.tracks_keys or node.additional is not None:
            return True
        return any(k not in frame.used for k in node.properties)

    def _open_key(self) -> bool:
        frame = self._frames[-1]
        if not self._can_add_key(frame):
            return False
        if frame.node.tracks_keys:
            self._mode, self._lit = _KEY, ""
        else:
            self._mode, self._key = _STR, True
        return True

    def _after_value(self, c: str) -> bool:
        top = self._stack[-1]
        frame = self._frames[-1]
        if c == ",":
            if top == "{":
                self._mode = _OBJ_KEY
                return self._can_add_key(frame)
            if top == "[":
                most = frame.node.max_items
                self._set_count(frame.items + 1)
                self._mode, self._node = _VALUE, frame.node.items or ANY
                return most is None or frame.items < most
            return False
        if c == "}":
            return self._close("{") or self._close(_CALL_FRAME)
        return c == "]" and self._close("[")

    def _close(self, frame: str) -> bool:
        if not self._stack.endswith(frame):
            return False
        top = self._frames[-1]
        if frame == "{" and not set(top.node.required) <= top.used:
            return False
        if frame == "[" and top.items < top.node.min_items:
            return False
        self._stack = self._stack[:-1]
        self._frames = self._frames[:-1]
        self._mode = _AFTER if self._stack else _DONE
        return True

    # -- completing ------------------------------------------------------------------

    def closing_suffix(self) -> str:
        """The shortest text that completes the grammar from here ("" once done).

        Open strings, escapes and numbers are finished (`\\u` escapes with
        zeros, `-`/`1.`/`1e` with a `0`), a missing value becomes its node's
        shortest valid text (`0` without a schema), a missing key `""` (or the
        next required key), and every open container is closed. Built by
        feeding a copy, so the suffix is valid by construction.
        """
        state = self.copy()
        state._max_ws = None
        parts: list[str] = []
        for _ in range(_MAX_SUFFIX_STEPS):
            if state._mode == _DONE:
                return "".join(parts)
            fragment = state._next_fragment()
            if not state.push(fragment):
                raise AssertionError(f"closing fragment {fragment!r} refused after {parts!r}")
            parts.append(fragment)
        raise AssertionError("closing_suffix did not converge")

    def _next_fragment(self) -> str:
        mode = self._mode
        fixed = {
            _HDR_COMMA: ",",
            _HDR_KEY: '"' + _ARGUMENTS_KEY,
            _HDR_COLON: ":",
            _STR_ESC: '"',  # `\"` is the shortest escape
            _STR: '"',
            _COLON: ":",
        }
        if mode in fixed:
            return fixed[mode]
        if mode == _NAME:
            rest = min((n for n in self._names if n.startswith(self._lit)), key=len)
            return rest[len(self._lit) :] + '"'
        if mode == _LIT:
            return self._lit
        if mode in (_ROOT, _VALUE):
            return minimal_text(self._node)
        if mode == _STR_HEX:
            return "0" * self._hex_left
        if mode in _NUMBER_OPEN:
            return "0"
        if mode == _KEY:
            return self._key_rest()
        if mode == _ENUM and self._lit not in (self._node.enum or ()):
            rest = min((t for t in self._node.enum or () if t.startswith(self._lit)), key=len)
            return rest[len(self._lit) :]
        if mode in (_OBJ_FIRST, _OBJ_KEY):
            missing = self._missing()
            if missing:
                return json.dumps(missing[0], ensure_ascii=False)
            return "}" if mode == _OBJ_FIRST else self._fresh_key()
        if mode == _ARR_FIRST:
            node = self._frames[-1].node
            return minimal_text(node.items or ANY) if node.min_items else "]"
        return self._closer()  # _AFTER, a finished number or enum text

    def _missing(self) -> list[str]:
        frame = self._frames[-1]
        return [k for k in frame.node.required if k not in frame.used]

    def _closer(self) -> str:
        top, frame = self._stack[-1], self._frames[-1]
        if top == "{":
            return "," if self._missing() else "}"
        if top == "[":
            return "," if frame.items < frame.node.min_items else "]"
        return "}"

    def _fresh_key(self) -> str:
        """A key that may follow a `,` when no required key is missing."""
        frame = self._frames[-1]
        node = frame.node
        if node.tracks_keys and node.additional is None:
            return json.dumps(
                min((k for k in node.properties if k not in frame.used), key=len),
                ensure_ascii=False,
            )
        key = ""
        while node.tracks_keys and (key in frame.used or node.value_of(key) is None):
            key += "_"
        return json.dumps(key, ensure_ascii=False)

    def _key_rest(self) -> str:
        frame = self._frames[-1]
        node, lit = frame.node, self._lit
        if lit not in frame.used and node.value_of(lit) is not None:
            return '"'
        names = [k for k in node.properties if k.startswith(lit) and k not in frame.used]
        if names:
            return min(names, key=len)[len(lit) :] + '"'
        return "_"  # an extra key that repeats a written one: lengthen it
