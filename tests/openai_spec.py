"""Validate response bodies against the official OpenAI OpenAPI description.

`validate(component, body)` checks a JSON body against one schema under
`components/schemas` of the official `openapi.yaml` (OpenAPI 3.1, JSON Schema
2020-12, with a few OpenAPI 3.0 `nullable: true` left in it, which are turned
into `null`-allowing schemas here). The description is test data kept beside
the repository (`../shared/data/openai-openapi/openapi.yaml`); a missing file
fails the test rather than skipping it, so conformance can never be silently
unchecked. The document is parsed once per test process.

Not here: request validation, the gateway's own `/openapi.json` (see
tests/test_openapi_routes.py), or anything that talks to a server.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import yaml
from jsonschema import Draft202012Validator
from jsonschema.exceptions import ValidationError
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

__all__ = ["SPEC_PATH", "schema_names", "validate"]

SPEC_PATH = Path(__file__).resolve().parents[2] / "shared/data/openai-openapi/openapi.yaml"
_SPEC_URI = "urn:openai-openapi"


def _allow_null(node: Any) -> Any:
    """Rewrite OpenAPI 3.0 `nullable: true` into JSON Schema's own null."""
    if isinstance(node, list):
        return [_allow_null(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: _allow_null(value) for key, value in node.items()}
    if out.get("nullable") is True:
        out.pop("nullable")
        # anyOf works whatever the schema is (typed, $ref, oneOf, enum).
        return {"anyOf": [out, {"type": "null"}]}
    return out


@functools.lru_cache(maxsize=1)
def _registry() -> tuple[Registry, frozenset[str]]:
    if not SPEC_PATH.is_file():
        raise AssertionError(f"the official OpenAI OpenAPI description is missing: {SPEC_PATH}")
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    with SPEC_PATH.open(encoding="utf-8") as fh:
        document = _allow_null(yaml.load(fh, Loader=loader))
    resource = Resource.from_contents(document, default_specification=DRAFT202012)
    names = frozenset(document["components"]["schemas"])
    return Registry().with_resource(_SPEC_URI, resource), names


def schema_names() -> frozenset[str]:
    """Every name under `components/schemas` of the official description."""
    return _registry()[1]


def _describe(error: ValidationError) -> list[str]:
    where = error.json_path
    lines = [f"{where}: {error.message}"]
    # anyOf/oneOf say only "is not valid under any of the given schemas":
    # list each alternative's own complaints so the report names the field.
    for sub in sorted(error.context or (), key=lambda e: (len(e.path), str(e.path))):
        lines.append(f"    [alt {list(sub.schema_path)[:1]}] {sub.json_path}: {sub.message}")
    return lines


def validate(component: str, body: Any) -> None:
    """Assert that `body` is valid under `components/schemas/<component>`.

    Raises:
        AssertionError: listing every violation (JSON path and message), or
            naming an unknown component.
    """
    registry, names = _registry()
    if component not in names:
        raise AssertionError(f"no schema {component!r} in {SPEC_PATH.name}")
    schema = {"$ref": f"{_SPEC_URI}#/components/schemas/{component}"}
    validator = Draft202012Validator(schema, registry=registry)
    errors = sorted(validator.iter_errors(body), key=lambda e: (list(map(str, e.path)), e.message))
    if errors:
        lines = [f"{component}: {len(errors)} violation(s)"]
        for error in errors:
            lines.extend(_describe(error))
        raise AssertionError("\n".join(lines))
