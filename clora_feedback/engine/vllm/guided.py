"""Declarative constraints (`GuidedDecoding`) compiled into vLLM structured outputs.

Both kinds become one xgrammar *structural tag* (`structured_outputs.structural_tag`),
because that format can say exactly what our chat format expects after a forced
call prefix, not only "one JSON document":

- `JSONSchemaSpec`: the object, following the schema;
- `ToolCallSpec` with `name`: the arguments object (the function's parameter
  schema), then the call's closing `}`;
- `ToolCallSpec` without `name`: one of the functions' names and `", "arguments": `,
  that function's arguments object, then `}`.

Consecutive whitespace is capped as in our own grammar
(`chat_format.constraint.DEFAULT_MAX_WHITESPACE`), so text vLLM produces also
replays through `chat_format` (the gateway closes a call that `max_tokens` cut
short that way). Schemas are first compiled by our own grammar too: a schema no
value satisfies is refused at once (400) with the same message as on the
embedded engine, before any request is sent; the n sequences of one request
share that compile (`engine.guided.grammar_for`).

Not here: the grammar itself (see `clora_feedback.chat_format`), HTTP (see `client`).
"""

from __future__ import annotations

import json
from typing import Any

from clora_feedback.chat_format.constraint import DEFAULT_MAX_WHITESPACE
from clora_feedback.engine.guided import grammar_for
from clora_feedback.engine.types import GuidedDecoding, JSONSchema, JSONSchemaSpec, ToolCallSpec
from clora_feedback.errors import InvalidRequestError

_ANY_OBJECT: dict[str, Any] = {"type": "object"}


def _json(schema: JSONSchema | None) -> dict[str, Any]:
    return {
        "type": "json_schema",
        "json_schema": dict(schema) if schema is not None else _ANY_OBJECT,
        "max_whitespace_cnt": DEFAULT_MAX_WHITESPACE,
    }


def _const(text: str) -> dict[str, Any]:
    return {"type": "const_string", "value": text}


def structured_outputs(guided: GuidedDecoding) -> dict[str, Any]:
    """The `structured_outputs` field of a vLLM completion request for `guided`.

    Raises:
        InvalidRequestError: a schema is malformed or unsatisfiable, the forced
            function is not among the functions, or there are none.
    """
    if isinstance(guided, ToolCallSpec):
        if not guided.functions:
            raise InvalidRequestError("a forced tool call needs tools", param="tools")
        if guided.name is not None and guided.name not in guided.functions:
            raise InvalidRequestError(
                f"the forced function {guided.name!r} is not among the tools", param="tool_choice"
            )
        grammar_for(guided)  # raises for a schema no value satisfies (once per request)
        if guided.name is not None:
            fmt: dict[str, Any] = {
                "type": "sequence",
                "elements": [_json(guided.functions[guided.name]), _const("}")],
            }
        else:
            fmt = {
                "type": "or",
                "elements": [
                    {
                        "type": "sequence",
                        # The prefix ends inside the name's string: `{"name": "`.
                        "elements": [
                            _const(json.dumps(name)[1:] + ', "arguments": '),
                            _json(schema),
                            _const("}"),
                        ],
                    }
                    for name, schema in guided.functions.items()
                ],
            }
    elif isinstance(guided, JSONSchemaSpec):
        grammar_for(guided)  # raises for a schema no value satisfies (once per request)
        fmt = _json(guided.schema)
    else:  # pragma: no cover - the union is closed
        raise InvalidRequestError(f"unknown constraint {guided!r}")
    return {"structural_tag": json.dumps({"type": "structural_tag", "format": fmt})}
