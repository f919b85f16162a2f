"""Token-level constraint that forces a well-formed JSON tool call, and the JSON prefix validator under it.

When a request sets `tool_choice` to "required" or to a named function, the
gateway appends a forced prefix to the prompt (see
`clora_feedback.gateway.tools.forced_call_prefix`) and lets the model continue
under a `JSONCallConstraint`, which admits a token only if the text generated so
far plus that token's text is still a prefix of the call grammar:

    named:     <JSON object>}                                  (the arguments, then the call's "}")
    required:  <tool name>", "arguments": <JSON object>}       (JSON whitespace allowed between parts)

`JSONPrefix` is the incremental validator: a small character-level state
machine over objects, arrays, strings with escapes, numbers and the literals
true/false/null. Its state is a handful of immutable fields (the open
containers are a short `str`), so checking a candidate token copies it in O(1)
and feeds only that token's characters. `closing_suffix` gives the shortest
text that completes the current prefix, used when `max_tokens` runs out.

Deliberately not here: JSON-schema conformance of the arguments (only JSON
syntax is enforced), HTTP, the engine, and parsing of the finished text (that
is `tools.parse_tool_calls`).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Sequence
from typing import Any, Literal, Protocol

__all__ = ["CallMode", "JSONCallConstraint", "JSONPrefix", "vocab_texts"]

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
_LITERALS = {"t": "rue", "f": "alse", "n": "ull"}
_CALL_FRAME = "C"  # the tool-call object around the arguments: closed by '}' only, no more keys


class JSONPrefix:
    """Incremental validator: is the text fed so far a prefix of the grammar?

    Build one with `for_object()` (a bare JSON object, used by the stream
    parser) or `for_call()` (the forced tool-call grammar). `push` returns
    False on the first character that cannot continue a valid prefix; the state
    is then unspecified, so callers push onto a `copy()` when they need to keep
    the old one.
    """

    __slots__ = (
        "_after_lit",
        "_hex_left",
        "_key",
        "_lit",
        "_max_ws",
        "_mode",
        "_names",
        "_prefixes",
        "_stack",
        "_ws_run",
    )

    def __init__(
        self,
        mode: int,
        stack: str,
        names: tuple[str, ...] = (),
        max_whitespace: int | None = None,
    ) -> None:
        self._mode = mode
        self._stack = stack  # open containers, innermost last: '{', '[' or the call frame
        self._lit = ""  # rest of a literal in _LIT; the name so far in _NAME
        self._after_lit = _AFTER
        self._key = False  # the open string is an object key
        self._hex_left = 0
        self._ws_run = 0
        self._max_ws = max_whitespace
        self._names = names
        self._prefixes = frozenset(n[:i] for n in names for i in range(len(n) + 1))

    @classmethod
    def for_object(cls) -> JSONPrefix:
        """A validator for exactly one JSON object (done when it closes)."""
        return cls(_ROOT, "")

    @classmethod
    def for_call(
        cls, mode: CallMode, tool_names: Sequence[str] = (), max_whitespace: int | None = None
    ) -> JSONPrefix:
        """A validator for the text generated after a forced call prefix.

        Args:
            mode: "named" (arguments object then `}`) or "required" (tool name,
                `", "arguments": `, arguments object, `}`).
            tool_names: names the model may pick in "required" mode (non-empty there).
            max_whitespace: most consecutive structural whitespace characters,
                so a model cannot idle forever between tokens; None for no cap.
        """
        if mode == "named":
            return cls(_ROOT, _CALL_FRAME, max_whitespace=max_whitespace)
        if mode == "required":
            if not tool_names:
                raise ValueError("required mode needs at least one tool name")
            return cls(_NAME, _CALL_FRAME, tuple(tool_names), max_whitespace)
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

    def push(self, text: str) -> bool:
        """Feed `text`; False if some character of it breaks the grammar."""
        return all(self._step(c) for c in text)

    def _step(self, c: str) -> bool:
        mode = self._mode
        if mode == _STR:
            if c == '"':
                self._mode = _COLON if self._key else _AFTER
            elif c == "\\":
                self._mode = _STR_ESC
            elif c < " ":  # JSON forbids raw control characters in strings
                return False
            return True
        if mode in _NUMBER_COMPLETE:
            if self._number_continues(c):
                return True
            self._mode = mode = _AFTER  # the number ended; `c` belongs to what follows
        if mode in _STRUCTURAL and c in _WS:
            self._ws_run += 1
            return self._max_ws is None or self._ws_run <= self._max_ws
        self._ws_run = 0
        return self._step_token(mode, c)

    def _number_continues(self, c: str) -> bool:
        mode = self._mode
        if c in _DIGITS:
            return mode != _N_ZERO  # digits keep the mode; JSON forbids leading zeros
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
                self._mode, self._key = _STR, True
                return True
            return mode == _OBJ_FIRST and c == "}" and self._close("{")
        if mode == _ARR_FIRST:
            return self._close("[") if c == "]" else self._start_value(c, object_only=False)
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
        if c == "{":
            self._stack += "{"
            self._mode = _OBJ_FIRST
            return True
        if object_only:
            return False
        if c == "[":
            self._stack += "["
            self._mode = _ARR_FIRST
        elif c == '"':
            self._mode, self._key = _STR, False
        elif c == "-":
            self._mode = _N_MINUS
        elif c == "0":
            self._mode = _N_ZERO
        elif c in "123456789":
            self._mode = _N_INT
        elif c in _LITERALS:
            self._mode, self._lit, self._after_lit = _LIT, _LITERALS[c], _AFTER
        else:
            return False
        return True

    def _after_value(self, c: str) -> bool:
        top = self._stack[-1]
        if c == ",":
            if top == "{":
                self._mode = _OBJ_KEY
                return True
            if top == "[":
                self._mode = _VALUE
                return True
            return False
        if c == "}":
            return self._close("{") or self._close(_CALL_FRAME)
        return c == "]" and self._close("[")

    def _close(self, frame: str) -> bool:
        if not self._stack.endswith(frame):
            return False
        self._stack = self._stack[:-1]
        self._mode = _AFTER if self._stack else _DONE
        return True

    def closing_suffix(self) -> str:
        """The shortest text that completes the grammar from here ("" once done).

        Open strings, escapes and numbers are finished (`\\u` escapes with
        zeros, `-`/`1.`/`1e` with a `0`), a missing value becomes `0`, a
        missing key `""`, and every open container is closed.
        """
        parts: list[str] = []
        mode, stack = self._mode, self._stack
        while mode != _DONE:
            if mode == _NAME:
                rest = min((n for n in self._names if n.startswith(self._lit)), key=len)
                parts.append(rest[len(self._lit) :] + '"')
                mode = _HDR_COMMA
            elif mode == _HDR_COMMA:
                parts.append(",")
                mode = _HDR_KEY
            elif mode == _HDR_KEY:
                parts.append('"' + _ARGUMENTS_KEY)
                mode = _HDR_COLON
            elif mode == _HDR_COLON:
                parts.append(":")
                mode = _ROOT
            elif mode == _LIT:
                parts.append(self._lit)
                mode = self._after_lit
            elif mode == _ROOT:
                parts.append("{}")
                mode = _AFTER if stack else _DONE
            elif mode in (_STR_ESC, _STR_HEX):
                # `\"` is the shortest escape; \uXXXX is padded with zeros.
                parts.append('"' if mode == _STR_ESC else "0" * self._hex_left)
                mode = _STR
            elif mode == _STR:
                parts.append('"')
                mode = _COLON if self._key else _AFTER
            elif mode == _COLON:
                parts.append(":")
                mode = _VALUE
            elif mode in (_VALUE, *_NUMBER_OPEN):
                parts.append("0")
                mode = _AFTER
            elif mode == _OBJ_KEY:
                parts.append('""')
                mode = _COLON
            elif mode in _NUMBER_COMPLETE:
                mode = _AFTER
            else:  # _AFTER, _OBJ_FIRST, _ARR_FIRST: close the innermost container
                parts.append("]" if stack[-1] == "[" else "}")
                stack = stack[:-1]
                mode = _AFTER if stack else _DONE
        return "".join(parts)


class JSONCallConstraint:
    """`TokenConstraint` that keeps a forced tool call well formed, token by token.

    Implements the engine's `TokenConstraint` Protocol (`allows`, `advance`,
    `is_done`). Not thread-safe: one instance per sequence.

    Args:
        token_texts: decoded text of every token id (see `vocab_texts`); an
            empty text (special tokens) is never allowed.
        mode: "named" or "required" (see `JSONPrefix.for_call`).
        tool_names: the tools the model may pick in "required" mode.
        max_whitespace: cap on consecutive structural whitespace characters.
    """

    def __init__(
        self,
        token_texts: Sequence[str],
        mode: CallMode,
        tool_names: Sequence[str] = (),
        *,
        max_whitespace: int | None = 32,
    ) -> None:
        self._texts = token_texts
        self._state = JSONPrefix.for_call(mode, tool_names, max_whitespace)
        self._generated: list[str] = []
        # allows() is usually followed by advance() on the same token: keep its result.
        self._checked: tuple[int, JSONPrefix] | None = None

    def allows(self, token_id: int) -> bool:
        """Whether appending this token's text keeps the text a valid prefix."""
        if not 0 <= token_id < len(self._texts):
            return False
        text = self._texts[token_id]
        if not text:
            return False
        state = self._state.copy()
        if not state.push(text):
            return False
        self._checked = (token_id, state)
        return True

    def advance(self, token_id: int) -> None:
        """Commit `token_id`; raises ValueError if it is not allowed."""
        checked = self._checked
        self._checked = None
        if checked is None or checked[0] != token_id:
            if not self.allows(token_id):
                raise ValueError(f"token {token_id} is not allowed by the tool-call grammar")
            checked = self._checked
            self._checked = None
        assert checked is not None
        self._state = checked[1]
        self._generated.append(self._texts[token_id])

    def is_done(self) -> bool:
        """True exactly when the call's closing `}` has been generated."""
        return self._state.done

    def closing_suffix(self) -> str:
        """Shortest text completing what was generated ("" when done)."""
        return self._state.closing_suffix()

    @property
    def generated_text(self) -> str:
        """Concatenated text of the tokens advanced so far."""
        return "".join(self._generated)


class _Tokenizer(Protocol):
    """The slice of a Hugging Face tokenizer that `vocab_texts` uses."""

    @property
    def all_special_ids(self) -> list[int]: ...

    def __len__(self) -> int: ...

    def encode(self, text: str, **kwargs: Any) -> list[int]: ...

    def batch_decode(self, sequences: list[list[int]], **kwargs: Any) -> list[str]: ...


_VOCAB_CACHE: weakref.WeakKeyDictionary[Any, list[str]] = weakref.WeakKeyDictionary()


def vocab_texts(tokenizer: _Tokenizer) -> list[str]:
    """Decoded text of every token id, "" for special tokens; cached per tokenizer object.

    Each token is decoded after an anchor token and the anchor's text is cut
    off, because SentencePiece-style decoders drop a token's leading space when
    it starts the text, yet mid-sequence that space is really generated.

    Returns:
        list of length `len(tokenizer)`; index = token id.
    """
    try:
        cached = _VOCAB_CACHE.get(tokenizer)
    except TypeError:
        cached = None
    if cached is not None:
        return cached
    n = len(tokenizer)
    anchor = tokenizer.encode("a", add_special_tokens=False)
    opts: dict[str, Any] = {"skip_special_tokens": False, "clean_up_tokenization_spaces": False}
    base = tokenizer.batch_decode([anchor], **opts)[0] if anchor else ""
    anchored = tokenizer.batch_decode([[*anchor, i] for i in range(n)], **opts)
    plain = tokenizer.batch_decode([[i] for i in range(n)], **opts)
    texts = [
        a[len(base) :] if anchor and a.startswith(base) else p
        for a, p in zip(anchored, plain, strict=True)
    ]
    for special in tokenizer.all_special_ids:
        if 0 <= special < n:
            texts[special] = ""
    with contextlib.suppress(TypeError):  # not weak-referenceable: correct, just uncached
        _VOCAB_CACHE[tokenizer] = texts
    return texts
