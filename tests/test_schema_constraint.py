"""Schema-guided forced calls: every walk over allowed tokens ends in arguments that validate."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from clora_feedback.chat_format.constraint import (
    JSONCallConstraint,
    call_grammar,
    completion_suffix,
    object_grammar,
)
from clora_feedback.chat_format.json_prefix import JSONPrefix
from clora_feedback.chat_format.schema import compile_schema
from clora_feedback.errors import InvalidRequestError

jsonschema = pytest.importorskip("jsonschema")

# Single characters cover every text the grammars need; a few longer pieces make
# multi-character tokens that straddle grammar boundaries.
VOCAB = [
    *'{}[]:,"\\ \n-+.0123456789eE',
    *"abcdefghijklmnopqrstuvwxyz_ABCDEFGHIJKLMNOPQRSTUVWXYZé/",
    '{"',
    '":',
    '",',
    '", "',
    "1.5",
    "true",
    "null",
    "false",
    "\\u00",
    "}}",
    "]}",
    '"city',
    "unit",
    '"celsius"',
    ' {"',
    "",
]

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer"},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
NESTED = {
    "type": "object",
    "properties": {
        "query": {"type": "string"},
        "filters": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"field": {"type": "string"}, "value": {"type": ["number", "null"]}},
                "required": ["field"],
            },
            "minItems": 1,
            "maxItems": 3,
        },
        "exact": {"type": "boolean"},
        "limit": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
    },
    "required": ["filters"],
}
REFS = {
    "type": "object",
    "$defs": {
        "Node": {
            "type": "object",
            "properties": {
                "name": {"const": "n"},
                "children": {"type": "array", "items": {"$ref": "#/$defs/Node"}, "maxItems": 2},
            },
            "required": ["name"],
            "additionalProperties": False,
        }
    },
    "properties": {
        "root": {"$ref": "#/$defs/Node"},
        "tags": {"additionalProperties": {"type": "integer"}},
    },
    "required": ["root"],
    "additionalProperties": False,
}
FREE_EXTRAS = {
    "type": "object",
    "properties": {"a": {"type": "null"}, "b": {"type": "array", "items": {"type": "string"}}},
    "required": ["b"],
    "additionalProperties": {"type": "boolean"},
}
SCHEMAS = [WEATHER, NESTED, REFS, FREE_EXTRAS]


_CLOSERS = frozenset({'"', "}", "]", "}}", "]}", "0", "null"})


def _walk(constraint: JSONCallConstraint, rng: random.Random, steps: int) -> str:
    text = []
    for _ in range(steps):
        if constraint.is_done():
            break
        allowed = [i for i in range(len(VOCAB)) if constraint.allows(i)]
        assert allowed, "".join(text)  # never a dead end
        # Favour closers so walks also finish, not only wander in strings.
        weights = [20 if VOCAB[i] in _CLOSERS else 1 for i in allowed]
        token = rng.choices(allowed, weights)[0]
        constraint.advance(token)
        text.append(VOCAB[token])
    return "".join(text)


@pytest.mark.parametrize("schema", SCHEMAS, ids=["weather", "nested", "refs", "extras"])
def test_named_call_walks_always_validate(schema: dict[str, Any]) -> None:
    rng = random.Random(11)
    finished = 0
    for i in range(80):
        grammar = call_grammar({"f": schema, "g": None}, "f")
        constraint = JSONCallConstraint.from_grammar(VOCAB, grammar)
        generated = _walk(constraint, rng, 600 if i % 10 == 0 else rng.randint(0, 120))
        suffix = constraint.closing_suffix()
        assert suffix == completion_suffix(grammar, generated)
        finished += constraint.is_done()
        text = generated + suffix
        assert text.endswith("}")
        arguments = json.loads(text[:-1])
        jsonschema.validate(arguments, schema)
    if schema.get("additionalProperties") is False:  # else walks mostly wander in extra keys
        assert finished > 0


def test_required_call_follows_the_picked_functions_schema() -> None:
    rng = random.Random(5)
    functions = {"weather": WEATHER, "search": NESTED, "ping": None}
    seen = set()
    for _ in range(120):
        constraint = JSONCallConstraint.from_grammar(VOCAB, call_grammar(functions, None))
        generated = _walk(constraint, rng, rng.randint(0, 120))
        obj = json.loads('{"name": "' + generated + constraint.closing_suffix())
        seen.add(obj["name"])
        schema = functions[obj["name"]] or {"type": "object"}
        jsonschema.validate(obj["arguments"], schema)
    assert seen == set(functions)


def test_object_grammar_follows_the_schema() -> None:
    rng = random.Random(3)
    for _ in range(80):
        constraint = JSONCallConstraint.from_grammar(VOCAB, object_grammar(NESTED))
        generated = _walk(constraint, rng, rng.randint(0, 120))
        jsonschema.validate(json.loads(generated + constraint.closing_suffix()), NESTED)


@pytest.mark.parametrize(
    ("accepted", "refused"),
    [
        ("", '"x"'),  # root must be an object
        ("{", "}"),  # city and unit are required
        ('{"', "x"),  # no undeclared keys
        ('{"c', "\\"),  # tracked keys have no escapes
        ('{"city":', "1"),  # city is a string
        ('{"city": "x", "unit": "', "k"),  # not an enum value
        ('{"city": "x", "unit": "celsius"', "}}}"),
        ('{"city": "x", "unit": "celsius", "days": 1', "."),  # integer: no fraction
        ('{"city": "x", "unit": "celsius", "days": 1', "e"),
        ('{"city": "x", "unit": "celsius", "', "city"),  # no repeated key
        ('{"city": "x", "unit": "celsius", "days": 2', ', "'),  # every property written
    ],
)
def test_schema_refuses_invalid_continuations(accepted: str, refused: str) -> None:
    state = call_grammar({"f": WEATHER}, "f")
    assert state.push(accepted), accepted
    assert not state.copy().push(refused)


@pytest.mark.parametrize(
    ("prefix", "suffix"),
    [
        ("", '{"city":"","unit":"celsius"}}'),
        ('{"city": "Pa', '","unit":"celsius"}}'),
        ('{"unit": "fahr', 'enheit","city":""}}'),
        ('{"ci', 'ty":"","unit":"celsius"}}'),
        ('{"city": "x", "unit": "celsius", "days": -', "0}}"),
    ],
)
def test_closing_suffix_adds_required_keys(prefix: str, suffix: str) -> None:
    state = call_grammar({"f": WEATHER}, "f")
    assert state.push(prefix)
    assert state.closing_suffix() == suffix


def test_unsupported_keywords_fall_back_to_plain_json() -> None:
    schema = {
        "type": "object",
        "properties": {"x": {"not": {"type": "string"}}, "s": {"type": "string", "pattern": "^a"}},
        "additionalProperties": False,
    }
    state = JSONPrefix.for_object(compile_schema(schema, param="p", object_only=True))
    assert state.push('{"x": [1, {"deep": null}], "s": "zzz"}') and state.done


@pytest.mark.parametrize(
    "schema",
    [
        False,
        {"type": "string"},
        {"type": "object", "required": ["a"], "additionalProperties": False},
        {"type": "object", "properties": {"e": {"enum": []}}},
        {
            "$ref": "#/$defs/Loop",
            "$defs": {
                "Loop": {
                    "type": "object",
                    "properties": {"l": {"$ref": "#/$defs/Loop"}},
                    "required": ["l"],
                }
            },
        },
        {"type": "object", "properties": {"a": {"type": "array", "minItems": 3, "maxItems": 2}}},
        {"type": "weird"},
    ],
)
def test_unsatisfiable_or_malformed_schemas_are_refused(schema: Any) -> None:
    with pytest.raises(InvalidRequestError):
        compile_schema(schema, param="tools[0].function.parameters", object_only=True)


def test_nullable_recursion_is_finite() -> None:
    schema = {
        "$defs": {
            "L": {
                "type": ["object", "null"],
                "properties": {"next": {"$ref": "#/$defs/L"}},
                "required": ["next"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {"head": {"$ref": "#/$defs/L"}},
        "required": ["head"],
        "additionalProperties": False,
    }
    state = JSONPrefix.for_object(compile_schema(schema, param="p", object_only=True))
    assert state.push('{"head": {"next": ')
    assert state.closing_suffix() == "null}}"
