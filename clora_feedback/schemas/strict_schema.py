"""OpenAI's rule for a `strict` JSON schema: every object in it is closed.

With `strict: true`, OpenAI refuses (400) a `response_format` schema in which
some object does not set `additionalProperties: false`, naming where:
"In context=('properties', 'detail'), 'additionalProperties' is required to be
supplied and to be false." This gateway answers the same, rather than closing
the schema silently as the official SDK's `to_strict_json_schema` does for
pydantic models it builds: a schema the client wrote is either what it meant
or a mistake worth hearing about, and an open object under a grammar lets a
small model write extra keys until `max_tokens`. Without `strict` a schema is
served as written.

Only closure is checked; the other strict-mode rules of OpenAI (every property
`required`, the keyword subset) are not, since breaking them cannot make a
reply unbounded here.

Not here: compiling a schema into a grammar (see `clora_feedback.chat_format.schema`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from clora_feedback.errors import InvalidRequestError

__all__ = ["check_strict_schema", "open_objects"]

_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONE = ("items", "not", "if", "then", "else", "additionalProperties")


def _is_object(schema: dict[str, Any]) -> bool:
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    return "object" in kinds or ("properties" in schema and kind is None)


def open_objects(
    schema: Any, context: tuple[str | int, ...] = ()
) -> Iterator[tuple[str | int, ...]]:
    """Where `schema` has an object schema without `additionalProperties: false`.

    Yields:
        The path of each such subschema, as OpenAI writes it (`()` for the root).
    """
    if not isinstance(schema, dict):
        return
    if _is_object(schema) and schema.get("additionalProperties") is not False:
        yield context
    for key in _SCHEMA_MAPS:
        children = schema.get(key)
        if isinstance(children, dict):
            for name, child in children.items():
                yield from open_objects(child, (*context, key, name))
    for key in _SCHEMA_LISTS:
        children = schema.get(key)
        if isinstance(children, list):
            for i, child in enumerate(children):
                yield from open_objects(child, (*context, key, i))
    for key in _SCHEMA_ONE:
        child = schema.get(key)
        if isinstance(child, dict):
            yield from open_objects(child, (*context, key))
        elif isinstance(child, list):  # draft-4 tuple `items`
            for i, item in enumerate(child):
                yield from open_objects(item, (*context, key, i))


def check_strict_schema(schema: dict[str, Any] | None, *, name: str, param: str) -> None:
    """Refuse a strict schema that leaves an object open (or is absent: any object).

    Args:
        schema: the JSON Schema of the reply; None means "any JSON object".
        name: the format's `name`, quoted in the message as OpenAI does.
        param: the request parameter to name (`response_format`, `text.format`).

    Raises:
        InvalidRequestError: some object allows properties beyond its own.
    """
    where = next(open_objects(schema if schema is not None else {"type": "object"}), None)
    if where is None:
        return
    raise InvalidRequestError(
        f"Invalid schema for response_format {name!r}: In context={where!r}, "
        "'additionalProperties' is required to be supplied and to be false "
        "(a strict schema must be closed; drop `strict` to serve it as written).",
        param=param,
        code="invalid_json_schema",
    )
