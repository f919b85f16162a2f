"""JSON Schema, the subset a token constraint can enforce, compiled into `SchemaNode`s.

`compile_schema` turns a schema document into a graph of `SchemaNode`s that
`json_prefix.JSONPrefix` follows character by character, so every value it
completes validates against the schema. Enforced:

- `type` (one name or a list): object, array, string, number, integer
  (digits only: no fraction or exponent), boolean, null; `nullable: true`;
- `enum` and `const` (the value is written exactly as `json.dumps` writes it);
- objects: `properties`, `required` (a `}` is refused until all are present),
  `additionalProperties` (false: only declared names; a schema: the extra
  values follow it); a declared key is never repeated, and the keys of an
  object with declared properties are written without backslash escapes;
- arrays: `items` (one schema), `minItems`, `maxItems`;
- `anyOf` / `oneOf` whose branches have different types (e.g. pydantic's
  `Optional[X]`: `[{X}, {"type": "null"}]`), a one-branch `allOf`, and local
  `$ref`s (`#/$defs/...`, `#/definitions/...`), recursive ones included.

Fallback, by design: any other keyword is not enforced. A subtree whose shape
cannot be followed (`anyOf` branches sharing a structured type, several
`allOf` branches, `not`, `if`/`then`, tuple `items`/`prefixItems`, a remote
`$ref`, property names that need escapes) accepts any JSON value there; value
bounds (`pattern`, `format`, `minLength`, `maxLength`, `minimum`, `maximum`,
`multipleOf`, `uniqueItems`, `propertyNames`, ...) are ignored. A schema that no
finite value satisfies (`false`, an empty `enum`, a required name that
`additionalProperties: false` forbids, required recursion) is refused with
`InvalidRequestError`.

Not here: the character machine (see `json_prefix`), tokens (see `constraint`),
validating finished documents (tests use `jsonschema` for that).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from clora_feedback.errors import InvalidRequestError

__all__ = ["ANY", "ANY_OBJECT", "SchemaNode", "compile_schema", "minimal_text"]

TYPES = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})
_STRUCTURED = frozenset({"object", "array"})
_UNFOLLOWED = ("not", "if", "then", "else", "prefixItems", "dependentSchemas")
_NEEDS_ESCAPE = frozenset('"\\') | frozenset(chr(i) for i in range(32))


@dataclass(eq=False)
class SchemaNode:
    """One schema position, as the JSON prefix machine reads it.

    Attributes:
        types: JSON types a value here may have ("integer" alone forbids fractions).
        enum: when set, the value is one of these exact JSON texts (types then unused).
        properties: declared object keys -> their value's node.
        required: keys a `}` waits for.
        additional: node of undeclared keys' values; None forbids undeclared keys.
        items: node of array elements.
        min_items: fewest array elements.
        max_items: most array elements (None: no limit).
        free: accepts any JSON value (the fallback; keys are then untracked too).
    """

    types: frozenset[str] = TYPES
    enum: frozenset[str] | None = None
    properties: dict[str, SchemaNode] = field(default_factory=dict)
    required: tuple[str, ...] = ()
    additional: SchemaNode | None = None
    items: SchemaNode | None = None
    min_items: int = 0
    max_items: int | None = None
    free: bool = False
    enum_prefixes: frozenset[str] = frozenset()
    minimal: str | None = None  # shortest valid text, filled by compile_schema

    @property
    def tracks_keys(self) -> bool:
        """Keys matter (declared, required or forbidden), so the machine spells them out."""
        return bool(self.properties or self.required) or self.additional is None

    def value_of(self, key: str) -> SchemaNode | None:
        """The node of `key`'s value, or None when the key is not allowed."""
        node = self.properties.get(key)
        return node if node is not None else self.additional


def _free() -> SchemaNode:
    node = SchemaNode(free=True, minimal="0")
    node.additional = node.items = node
    return node


ANY = _free()
"""Any JSON value (no schema, or a fallback subtree)."""

ANY_OBJECT = SchemaNode(types=frozenset({"object"}), additional=ANY, minimal="{}")
"""Any JSON object (a tool without parameters)."""


def compile_schema(schema: Any, *, param: str, object_only: bool = False) -> SchemaNode:
    """Compile a JSON Schema document into nodes.

    Args:
        schema: the schema (a dict, True/False, or None for "anything").
        param: request parameter named in errors (e.g. "tools[0].function.parameters").
        object_only: the value must be an object (tool arguments, `response_format`).

    Raises:
        InvalidRequestError: the schema is malformed or no finite value satisfies it.
    """
    if schema is None:
        return ANY_OBJECT if object_only else ANY
    root = _Compiler(schema, param).node(schema)
    if object_only:
        root = _only_objects(root, param)
    _fill_minimal(root, param)
    return root


def minimal_text(node: SchemaNode) -> str:
    """The shortest JSON text valid at `node` (computed at compile time)."""
    assert node.minimal is not None, "nodes come from compile_schema"
    return node.minimal


def _only_objects(node: SchemaNode, param: str) -> SchemaNode:
    if node.free:
        return ANY_OBJECT
    if node.enum is not None:
        texts = frozenset(t for t in node.enum if t.startswith("{"))
        if not texts:
            raise InvalidRequestError(f"{param} must allow a JSON object", param=param)
        return _enum_node(texts)
    if "object" not in node.types:
        raise InvalidRequestError(f"{param} must allow a JSON object", param=param)
    if node.types == {"object"}:
        return node
    narrowed = SchemaNode(**{**node.__dict__, "types": frozenset({"object"})})
    return narrowed


def _enum_node(texts: frozenset[str]) -> SchemaNode:
    prefixes = frozenset(t[:i] for t in texts for i in range(1, len(t) + 1))
    return SchemaNode(types=frozenset(), enum=texts, enum_prefixes=prefixes)


class _Compiler:
    """One compilation: resolves local `$ref`s against `root`, memoised (recursion allowed)."""

    def __init__(self, root: Any, param: str) -> None:
        self._root = root
        self._param = param
        self._refs: dict[str, SchemaNode] = {}

    def _error(self, problem: str) -> InvalidRequestError:
        return InvalidRequestError(f"{self._param}: {problem}", param=self._param)

    def node(self, schema: Any) -> SchemaNode:
        if schema is True or schema is None or schema == {}:
            return ANY
        if schema is False:
            raise self._error("the schema `false` accepts no value")
        if not isinstance(schema, Mapping):
            raise self._error(f"a schema must be an object or a boolean, not {schema!r}")
        if "$ref" in schema:
            return self._ref(schema["$ref"])
        if any(k in schema for k in _UNFOLLOWED):
            return ANY
        for key in ("anyOf", "oneOf"):
            if key in schema:
                return self._union(schema[key])
        if "allOf" in schema:
            branches = schema["allOf"]
            ok = isinstance(branches, list) and len(branches) == 1
            return self.node(branches[0]) if ok else ANY
        if "const" in schema or "enum" in schema:
            return self._enum(schema)
        return self._typed(schema, self._types(schema))

    def _ref(self, ref: Any) -> SchemaNode:
        if not isinstance(ref, str) or not ref.startswith("#"):
            return ANY  # remote references are not followed
        if ref in self._refs:
            return self._refs[ref]
        target: Any = self._root
        for part in [p for p in ref[1:].split("/") if p]:
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, Mapping) or part not in target:
                raise self._error(f"$ref {ref!r} points nowhere")
            target = target[part]
        placeholder = SchemaNode()
        self._refs[ref] = placeholder
        placeholder.__dict__.update(self.node(target).__dict__)
        if placeholder.free:
            placeholder.additional = placeholder.items = placeholder
        return placeholder

    def _types(self, schema: Mapping[str, Any]) -> frozenset[str]:
        declared = schema.get("type")
        if declared is None:
            if any(k in schema for k in ("properties", "required", "additionalProperties")):
                declared = ["object"]
            elif "items" in schema:
                declared = ["array"]
            else:
                return TYPES
        names = [declared] if isinstance(declared, str) else declared
        if not isinstance(names, list) or not names or not set(names) <= TYPES:
            raise self._error(f"unsupported type {declared!r}")
        types = set(names) | ({"null"} if schema.get("nullable") is True else set())
        return frozenset(types)

    def _typed(self, schema: Mapping[str, Any], types: frozenset[str]) -> SchemaNode:
        if types == TYPES and not any(k in schema for k in ("properties", "items")):
            return ANY
        node = SchemaNode(types=types)
        if "object" in types:
            self._object(schema, node)
        if "array" in types:
            self._array(schema, node)
        return node

    def _object(self, schema: Mapping[str, Any], node: SchemaNode) -> None:
        props = schema.get("properties") or {}
        required = schema.get("required") or []
        extra = schema.get("additionalProperties", True)
        if not isinstance(props, Mapping) or not isinstance(required, list):
            raise self._error("properties must be an object and required a list")
        if any(_NEEDS_ESCAPE & set(name) for name in [*props, *required]):
            node.additional = ANY  # keys are tracked without escapes: leave this object free
            return
        node.properties = {str(k): self.node(v) for k, v in props.items()}
        node.required = tuple(dict.fromkeys(str(r) for r in required))
        node.additional = None if extra is False else self.node(extra)
        if node.additional is None and set(node.required) - set(node.properties):
            missing = sorted(set(node.required) - set(node.properties))
            raise self._error(f"required {missing} forbidden by additionalProperties: false")

    def _array(self, schema: Mapping[str, Any], node: SchemaNode) -> None:
        items = schema.get("items")
        node.items = ANY if isinstance(items, list) else self.node(items)
        node.min_items = int(schema.get("minItems", 0))
        top = schema.get("maxItems")
        node.max_items = None if top is None else int(top)
        if node.max_items is not None and node.max_items < node.min_items:
            raise self._error("maxItems is below minItems")

    def _enum(self, schema: Mapping[str, Any]) -> SchemaNode:
        values = [schema["const"]] if "const" in schema else schema["enum"]
        if not isinstance(values, list):
            raise self._error("enum must be a list")
        types = self._types(schema) if "type" in schema else TYPES
        texts = frozenset(
            json.dumps(v, ensure_ascii=False) for v in values if _json_type(v) & types
        )
        if not texts:
            raise self._error("enum/const leaves no value of the declared type")
        return _enum_node(texts)

    def _union(self, branches: Any) -> SchemaNode:
        if not isinstance(branches, list) or not branches:
            raise self._error("anyOf/oneOf must be a non-empty list")
        nodes = [self.node(b) for b in branches]
        if any(n.free for n in nodes):
            return ANY
        if all(n.enum is not None for n in nodes):
            return _enum_node(frozenset().union(*(n.enum or () for n in nodes)))
        if any(n.enum is not None for n in nodes):
            return ANY
        merged = SchemaNode(types=frozenset().union(*(n.types for n in nodes)))
        for kind in _STRUCTURED:
            owners = [n for n in nodes if kind in n.types]
            if len(owners) > 1:
                return ANY  # two object (or array) shapes: not followed
            if owners and kind == "object":
                merged.properties, merged.required = owners[0].properties, owners[0].required
                merged.additional = owners[0].additional
            if owners and kind == "array":
                merged.items, merged.min_items = owners[0].items, owners[0].min_items
                merged.max_items = owners[0].max_items
        return merged


def _json_type(value: Any) -> frozenset[str]:
    if value is None:
        return frozenset({"null"})
    if isinstance(value, bool):
        return frozenset({"boolean"})
    if isinstance(value, int):
        return frozenset({"integer", "number"})
    if isinstance(value, float):
        return frozenset({"number"} | ({"integer"} if value.is_integer() else set()))
    if isinstance(value, str):
        return frozenset({"string"})
    return frozenset({"array"}) if isinstance(value, list) else frozenset({"object"})


_SCALAR_MINIMAL = (
    ("integer", "0"),
    ("number", "0"),
    ("string", '""'),
    ("null", "null"),
    ("boolean", "true"),
)


def _options(node: SchemaNode) -> list[str]:
    """Candidate shortest texts of `node` from its children's current ones (None = unknown)."""
    options = [text for kind, text in _SCALAR_MINIMAL if kind in node.types]
    if node.enum is not None:
        options.append(min(node.enum, key=lambda t: (len(t), t)))
    if "array" in node.types and node.items is not None:
        item = node.items.minimal
        if item is not None or node.min_items == 0:
            options.append("[" + ",".join([item or ""] * node.min_items) + "]")
    if "object" in node.types:
        values = [(k, node.value_of(k)) for k in node.required]
        if all(v is not None and v.minimal is not None for _, v in values):
            fields = [
                json.dumps(k, ensure_ascii=False) + ":" + str(v.minimal)
                for k, v in values
                if v is not None
            ]
            options.append("{" + ",".join(fields) + "}")
    return options


def _fill_minimal(root: SchemaNode, param: str) -> None:
    """Give every reachable node its shortest valid text (a fixed point, so recursion through
    an optional or nullable branch is fine); refuse a schema with an unfinishable node."""
    nodes: dict[int, SchemaNode] = {}
    todo = [root]
    while todo:
        node = todo.pop()
        if id(node) in nodes:
            continue
        nodes[id(node)] = node
        todo += [c for c in (*node.properties.values(), node.additional, node.items) if c]
    changed = True
    while changed:
        changed = False
        for node in nodes.values():
            best = min(_options(node), key=len, default=None)
            if best is not None and (node.minimal is None or len(best) < len(node.minimal)):
                node.minimal = best
                changed = True
    if any(node.minimal is None for node in nodes.values()):
        raise InvalidRequestError(f"{param}: the schema requires endless nesting", param=param)
