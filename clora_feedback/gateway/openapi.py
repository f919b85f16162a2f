"""The served `/openapi.json` says every status each route really answers.

FastAPI documents a route's 200 and a 422 "Validation Error" of its own, but
this gateway answers request-validation failures with 400 (`gateway.errors`)
and fails in many more ways (401 no key, 404 unknown model, 413 too large,
429 overloaded, ...). `ROUTE_STATUSES` is the table of what each route answers
besides its 200, kept here beside `install_openapi`, which writes it into the
generated document: every listed error status with the `ErrorResponse` body
(`clora_feedback.schemas.errors`), FastAPI's 422 and its validation schemas
removed unless the route really answers 422. A route missing from the table
fails `tests/test_openapi_routes.py`, and a schemathesis run there checks
that no answer carries an undocumented status.

Statuses every route can answer (`COMMON_STATUSES`): 413 (a body over
`server.max_body_bytes`, `gateway.limits`) and 500.

Not here: the routes (`routes`, `adapters`, `feedback`), error bodies (`errors`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from clora_feedback.schemas.errors import ErrorResponse

COMMON_STATUSES = (413, 500)
_GENERATION = (400, 401, 404, 429, 503)
_ADMIN = (401, 403)

ROUTE_STATUSES: Mapping[str, tuple[int, ...]] = {
    # The OpenAI routes: 404 for an unknown model and for another key's model alike.
    "POST /v1/chat/completions": _GENERATION,
    "POST /v1/completions": _GENERATION,
    "POST /v1/responses": _GENERATION,
    "GET /v1/responses/{response_id}": (401, 404),
    "GET /v1/responses/{response_id}/input_items": (400, 401, 404),
    "GET /v1/models": (401,),
    "GET /v1/models/{model_id}": (401, 404),
    # vLLM's runtime adapter routes (admin key).
    "POST /v1/load_lora_adapter": (400, *_ADMIN, 409),
    "POST /v1/unload_lora_adapter": (400, *_ADMIN, 404),
    # Captured trajectories, scoped by key (another agent's is 404, as if missing).
    "GET /v1/trajectories": (400, 401, 403),
    "GET /v1/trajectories/{completion_id}": (401, 404),
    "DELETE /v1/trajectories": (400, *_ADMIN),
    # Operations.
    "GET /health": (),
    "GET /metrics": _ADMIN,
    # Adapter versions (admin key).
    "GET /v1/adapters": _ADMIN,
    "GET /v1/adapters/{agent}/versions": (*_ADMIN, 404),
    "GET /v1/adapters/{agent}/versions/{version}": (400, *_ADMIN, 404),
    "POST /v1/adapters/{agent}/rollback": (400, *_ADMIN, 404, 409, 410),
    "POST /v1/adapters/{agent}/pin": (*_ADMIN, 404),
    "POST /v1/adapters/{agent}/unpin": (*_ADMIN, 404),
    # The release path (admin key): 409 when it is off or the version cannot move that way.
    "POST /v1/adapters/{agent}/gate": (400, *_ADMIN, 404, 409),
    "POST /v1/adapters/{agent}/promote": (400, *_ADMIN, 404, 409),
    "POST /v1/adapters/{agent}/abort": (400, *_ADMIN, 404, 409),
    "POST /v1/adapters/{agent}/cases": (400, *_ADMIN, 404, 409),
    # The operator console (`gateway.console`): a session cookie, not a key; POSTs need the
    # session's CSRF token (403); login refuses a wrong key (401) and an agent's key (403),
    # and too many failures from one address in a minute (429).
    "GET /console": (),
    "GET /console/static/{name}": (404,),
    "GET /console/api/session": (401,),
    "POST /console/api/login": (400, 401, 403, 429),
    "POST /console/api/logout": (400, 401, 403),
    "GET /console/api/agents": (400, 401),
    "GET /console/api/agents/{agent}": (401, 404),
    "GET /console/api/agents/{agent}/trajectories": (400, 401, 404),
    "POST /console/api/agents/{agent}/rollback": (400, 401, 403, 404, 409, 410),
    "POST /console/api/agents/{agent}/pin": (400, 401, 403, 404),
    "POST /console/api/agents/{agent}/unpin": (400, 401, 403, 404),
    "GET /console/api/events": (401,),
    # The feedback webhook: 202 when delivered to Kafka or parked, 422 all refused.
    "POST /v1/feedback": (202, 400, 401, 403, 422, 429, 503),
}
"""`"METHOD /path"` (FastAPI's path template) -> statuses answered besides 200."""

_DESCRIPTIONS = {
    202: "Accepted: delivered to Kafka, or some events wait for their completion.",
    400: "Invalid request; `error.param` names the parameter.",
    401: "Missing or unknown API key (or webhook signature).",
    403: "This API key may not use this route or touch this agent.",
    404: "Unknown (or, for this key, invisible) model, agent, version or completion.",
    409: "Conflicts with the current state (already active, pinned, raced another change).",
    410: "The adapter version's payload was pruned by retention (its manifest is kept).",
    413: "The request body is larger than `server.max_body_bytes`.",
    422: "Well-formed, but none of it can apply.",
    429: "Overloaded or over a quota; retry after `Retry-After` seconds.",
    500: "The server failed; the error is logged.",
    503: "A dependency (engine server, Kafka) is unreachable; retry after `Retry-After`.",
}
_RETRY_AFTER = {"Retry-After": {"description": "Seconds to wait.", "schema": {"type": "integer"}}}
_FASTAPI_VALIDATION = ("HTTPValidationError", "ValidationError")


def route_key(method: str, path: str) -> str:
    """The `ROUTE_STATUSES` key of one operation."""
    return f"{method.upper()} {path}"


def documented_statuses(method: str, path: str) -> tuple[int, ...] | None:
    """Every status documented for a route besides 200; None when the table lacks it."""
    extra = ROUTE_STATUSES.get(route_key(method, path))
    return None if extra is None else tuple(sorted({*extra, *COMMON_STATUSES}))


def _error_response(status: int) -> dict[str, Any]:
    answer: dict[str, Any] = {"description": _DESCRIPTIONS[status]}
    if status >= 400:
        ref = {"$ref": "#/components/schemas/ErrorResponse"}
        answer["content"] = {"application/json": {"schema": ref}}
    if status in (429, 503):
        answer["headers"] = _RETRY_AFTER
    return answer


def document_errors(schema: dict[str, Any]) -> None:
    """Rewrite a generated OpenAPI document in place from `ROUTE_STATUSES`."""
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    error_schema = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
    components.update(error_schema.pop("$defs", {}))
    components["ErrorResponse"] = error_schema
    for path, operations in schema.get("paths", {}).items():
        for method, operation in operations.items():
            statuses = documented_statuses(method, path)
            responses = operation.setdefault("responses", {})
            if statuses is None:
                continue  # undocumented route: tests/test_openapi_routes.py names it
            if 422 not in statuses:
                responses.pop("422", None)  # FastAPI's; validation failures are 400 here
            for status in statuses:
                responses[str(status)] = _error_response(status)
    text = json.dumps(schema.get("paths", {}))
    for name in _FASTAPI_VALIDATION:
        if f"#/components/schemas/{name}" not in text:
            components.pop(name, None)


def install_openapi(app: FastAPI) -> None:
    """Serve `app`'s OpenAPI document with `ROUTE_STATUSES` written in (built once)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title,
                version=app.version,
                description=app.description,
                routes=app.routes,
            )
            document_errors(schema)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
