"""Compiling a request's declarative constraint (`GuidedDecoding`) into a token constraint.

In-process engines call `compile_guided` when a request arrives: a forced
`ToolCallSpec` becomes the chat format's forced-call grammar, an "on_trigger"
one its free-text-with-calls grammar (constrained from `<tool_call>` on), and a
`JSONSchemaSpec` its one-object grammar, each guided by the compiled schema
(see `clora_feedback.chat_format.schema` for the subset enforced and the
fallbacks), over the engine's own token texts. An engine that runs out of
process compiles the same spec its own way (e.g. guided decoding on vLLM).

The grammar is compiled once per request: the n sequences of one request share
its spec object, and `grammar_for` keeps the grammars of the last few spec
objects it compiled (by identity: specs hold schemas, which are not hashable);
each sequence gets its own copy of the grammar's state. Whether an engine
compiles a kind of spec at all is `EngineCapabilities.check`.

Not here: the grammar (see `clora_feedback.chat_format`), sampling (see `sampling`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from clora_feedback.chat_format.constraint import (
    Grammar,
    JSONCallConstraint,
    call_grammar,
    object_grammar,
    triggered_grammar,
)
from clora_feedback.engine.types import (
    GuidedDecoding,
    JSONSchemaSpec,
    TokenConstraint,
    ToolCallSpec,
)
from clora_feedback.errors import InvalidRequestError

_RECENT = 8
"""Spec objects whose grammar `grammar_for` keeps: the requests arriving together."""
_grammars: OrderedDict[int, tuple[GuidedDecoding, Grammar]] = OrderedDict()
_lock = threading.Lock()


def compile_guided(guided: GuidedDecoding, token_texts: Sequence[str]) -> TokenConstraint:
    """A fresh (stateful) constraint for one sequence.

    Args:
        guided: the request's spec.
        token_texts: decoded text of every token id (`chat_format.constraint.vocab_texts`).

    Raises:
        InvalidRequestError: a schema is malformed or unsatisfiable, or the forced
            function is not among the spec's functions.
    """
    return JSONCallConstraint.from_grammar(token_texts, grammar_for(guided))


def grammar_for(guided: GuidedDecoding) -> Grammar:
    """The grammar of `guided`, compiled once per spec object (see the module docstring).

    Raises:
        InvalidRequestError: as `compile_guided`.
    """
    key = id(guided)
    with _lock:
        hit = _grammars.get(key)
        if hit is not None and hit[0] is guided:  # the spec held there keeps its id unique
            _grammars.move_to_end(key)
            return hit[1]
    grammar = _compile(guided)
    with _lock:
        _grammars[key] = (guided, grammar)
        while len(_grammars) > _RECENT:
            _grammars.popitem(last=False)
    return grammar


def _compile(guided: GuidedDecoding) -> Grammar:
    if isinstance(guided, ToolCallSpec) and guided.mode == "on_trigger":
        if not guided.functions:
            raise InvalidRequestError("tool calls need tools", param="tools")
        grammar: Grammar = triggered_grammar(guided.functions, parallel=guided.parallel)
    elif isinstance(guided, ToolCallSpec):
        if guided.name is not None and guided.name not in guided.functions:
            raise InvalidRequestError(
                f"the forced function {guided.name!r} is not among the tools", param="tool_choice"
            )
        if not guided.functions:
            raise InvalidRequestError("a forced tool call needs tools", param="tools")
        grammar = call_grammar(guided.functions, guided.name)
    elif isinstance(guided, JSONSchemaSpec):
        grammar = object_grammar(guided.schema)
    else:  # pragma: no cover - the union is closed
        raise InvalidRequestError(f"unknown constraint {guided!r}")
    return grammar
