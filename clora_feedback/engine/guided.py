"""Compiling a request's declarative constraint (`GuidedDecoding`) into a token constraint.

In-process engines call `compile_guided` when a request arrives: a forced
`ToolCallSpec` becomes the chat format's forced-call grammar, an "on_trigger"
one its free-text-with-calls grammar (constrained from `<tool_call>` on), and a
`JSONSchemaSpec` its one-object grammar, each guided by the compiled schema
(see `clora_feedback.chat_format.schema` for the subset enforced and the
fallbacks), over the engine's own token texts. An engine that runs out of
process compiles the same spec its own way (e.g. guided decoding on vLLM).

Not here: the grammar (see `clora_feedback.chat_format`), sampling (see `sampling`).
"""

from __future__ import annotations

from collections.abc import Sequence

from clora_feedback.chat_format.constraint import (
    Grammar,
    JSONCallConstraint,
    call_grammar,
    object_grammar,
    triggered_grammar,
)
from clora_feedback.engine.types import (
    EngineCapabilities,
    GuidedDecoding,
    JSONSchemaSpec,
    TokenConstraint,
    ToolCallSpec,
)
from clora_feedback.errors import InvalidRequestError


def check_supported(guided: GuidedDecoding | None, capabilities: EngineCapabilities) -> None:
    """Raise `InvalidRequestError` (400) when the engine does not compile this kind of spec."""
    if guided is not None and guided.kind not in capabilities.constraints:
        param = "response_format"
        if isinstance(guided, ToolCallSpec):
            param = "tool_choice" if guided.mode == "forced" else "tools"
        raise InvalidRequestError(
            f"this engine cannot enforce a {guided.kind!r} constraint "
            f"(it supports: {', '.join(sorted(capabilities.constraints)) or 'none'})",
            param=param,
        )


def compile_guided(guided: GuidedDecoding, token_texts: Sequence[str]) -> TokenConstraint:
    """A fresh (stateful) constraint for one sequence.

    Args:
        guided: the request's spec.
        token_texts: decoded text of every token id (`chat_format.constraint.vocab_texts`).

    Raises:
        InvalidRequestError: a schema is malformed or unsatisfiable, or the forced
            function is not among the spec's functions.
    """
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
    return JSONCallConstraint.from_grammar(token_texts, grammar)
