"""Token-level constraints for forced tool calls and JSON replies, and the vocabulary's token texts.

When a request forces a tool call (`tool_choice` "required" or a named
function), the prompt ends with the call's opening (see
`clora_feedback.chat_format.tools.forced_call_prefix`) and the model continues
under a `JSONCallConstraint`, which admits a token only if the text generated so
far plus that token's text is still a prefix of the grammar (see `json_prefix`):
the call's arguments, now also following the function's parameter schema (the
subset in `schema`). `call_grammar` / `object_grammar` build the grammar from
plain JSON Schemas; an engine compiles a declarative spec with them, and the
gateway replays finished text through them (`completion_suffix`) to close a call
that `max_tokens` cut short.

When the model may choose (`tool_choice` "auto"), `triggered_grammar` leaves the
text free until the model opens a call with `<tool_call>`, and constrains the
call from there (the tool's name, then its arguments' schema; see `trigger`):
a call the model chooses is as well formed as a forced one.

Not here: HTTP, the engine, parsing of the finished text (that is
`calls.parse_tool_calls`).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from clora_feedback.chat_format.json_prefix import CallMode, JSONPrefix
from clora_feedback.chat_format.schema import compile_schema
from clora_feedback.chat_format.trigger import TriggeredCalls

Grammar = JSONPrefix | TriggeredCalls
"""A character grammar a `JSONCallConstraint` follows."""

__all__ = [
    "Grammar",
    "JSONCallConstraint",
    "call_grammar",
    "completion_suffix",
    "object_grammar",
    "triggered_grammar",
    "vocab_texts",
]

DEFAULT_MAX_WHITESPACE = 32
"""Cap on consecutive structural whitespace under a constraint, so a model cannot idle forever."""


def call_grammar(
    functions: Mapping[str, Mapping[str, Any] | None],
    name: str | None,
    *,
    max_whitespace: int | None = DEFAULT_MAX_WHITESPACE,
) -> JSONPrefix:
    """The grammar after a forced call prefix, with each function's parameters compiled.

    Args:
        functions: function name -> its `parameters` JSON Schema (None: any object).
        name: the forced function ("named" mode), or None to let the model pick one.
        max_whitespace: see `JSONPrefix.for_call`.

    Raises:
        InvalidRequestError: a parameter schema is malformed or unsatisfiable, or
            `name` is not one of `functions`.
    """
    nodes = {
        fn: compile_schema(schema, param=f"tools[{fn}].function.parameters", object_only=True)
        for fn, schema in functions.items()
        if name is None or fn == name
    }
    if name is not None:
        if name not in nodes:
            raise ValueError(f"the forced function {name!r} is not among the functions")
        return JSONPrefix.for_call("named", max_whitespace=max_whitespace, arguments=nodes[name])
    return JSONPrefix.for_call("required", list(functions), max_whitespace, schemas=nodes)


def object_grammar(
    schema: Mapping[str, Any] | None, *, max_whitespace: int | None = DEFAULT_MAX_WHITESPACE
) -> JSONPrefix:
    """The grammar of a reply that is one JSON object following `schema` (None: any object)."""
    node = compile_schema(schema, param="response_format", object_only=True)
    return JSONPrefix.for_object(node, max_whitespace)


def triggered_grammar(
    functions: Mapping[str, Mapping[str, Any] | None],
    *,
    parallel: bool,
    max_whitespace: int | None = DEFAULT_MAX_WHITESPACE,
) -> TriggeredCalls:
    """Free text in which every call the model opens follows `functions` (see `trigger`).

    Args:
        functions: function name -> its `parameters` JSON Schema (None: any object).
        parallel: several calls may be made; false: the reply ends with the first call.
        max_whitespace: see `JSONPrefix.for_call`.

    Raises:
        InvalidRequestError: a parameter schema is malformed or unsatisfiable.
    """
    if not functions:
        raise ValueError("a triggered call grammar needs at least one function")
    call = call_grammar(functions, None, max_whitespace=max_whitespace)
    return TriggeredCalls(call, parallel=parallel, max_whitespace=max_whitespace)


def completion_suffix(grammar: Grammar, text: str) -> str:
    """Text that completes `text` under `grammar` ("" when complete, or when `text` strays)."""
    state = grammar.copy()
    if not state.push(text):
        return ""
    return state.closing_suffix()


class JSONCallConstraint:
    """`TokenConstraint` that keeps a forced tool call well formed, token by token.

    Implements the engine's `TokenConstraint` Protocol (`allows`, `advance`,
    `is_done`). Not thread-safe: one instance per sequence.

    Args:
        token_texts: decoded text of every token id (see `vocab_texts`); an
            empty text (special tokens) is allowed only in a grammar's free text.
        mode: "named" or "required" (see `JSONPrefix.for_call`).
        tool_names: the tools the model may pick in "required" mode.
        max_whitespace: cap on consecutive structural whitespace characters.

    `from_grammar` builds one over any `Grammar` (a schema-guided call or object, or
    free text with calls).
    """

    def __init__(
        self,
        token_texts: Sequence[str],
        mode: CallMode,
        tool_names: Sequence[str] = (),
        *,
        max_whitespace: int | None = DEFAULT_MAX_WHITESPACE,
    ) -> None:
        self._texts = token_texts
        self._state: Grammar = JSONPrefix.for_call(mode, tool_names, max_whitespace)
        self._generated: list[str] = []
        # allows() is usually followed by advance() on the same token: keep its result.
        self._checked: tuple[int, Grammar] | None = None

    @classmethod
    def from_grammar(cls, token_texts: Sequence[str], grammar: Grammar) -> JSONCallConstraint:
        """A constraint that follows `grammar` (copied; see `call_grammar`, `object_grammar`)."""
        new = cls.__new__(cls)
        new._texts = token_texts
        new._state = grammar.copy()
        new._generated = []
        new._checked = None
        return new

    def allows(self, token_id: int) -> bool:
        """Whether appending this token's text keeps the text a valid prefix."""
        if not 0 <= token_id < len(self._texts):
            return False
        text = self._texts[token_id]
        if not text and not self._state.free:  # special tokens (end of turn): free text only
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
