"""The served `/openapi.json` documents every status each route answers (issue 12 item 18).

The app is the whole service (`build_service`: OpenAI routes, adapters, feedback) on the
tiny model, with keys configured so the 401/403 paths exist. Three checks:

- every route is in `gateway.openapi.ROUTE_STATUSES`, and the document says exactly
  that table (FastAPI's own 422 and validation schemas gone);
- hand-made bad requests per route (no key, an agent key on admin routes, bodies that
  are not JSON, the wrong shape, too large, out-of-range path values) only ever
  answer statuses the document lists;
- (slow) schemathesis generates requests from the document and its undocumented-status
  and no-5xx checks pass.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import GatewayServer, serve_app
from fastapi.routing import APIRoute, iter_route_contexts
from jsonschema import Draft202012Validator

from clora_feedback.config import Settings
from clora_feedback.gateway.openapi import ROUTE_STATUSES, documented_statuses, route_key
from clora_feedback.service import build_service

ADMIN = "sk-admin-openapi"
AGENT = "sk-agent-openapi"
LIMIT = 64 * 1024
EXAMPLES = 30
"""Generated requests per operation and mode: the strength at which outside fuzzing found
a 500 on `/v1/responses` (a content part whose `type` is an object, issue 25)."""


def _settings(model_dir: Path, tmp_path: Path) -> Settings:
    return Settings(
        data_dir=tmp_path / "var",
        adapters_dir=tmp_path / "adapters",
        engine={"model": str(model_dir), "max_model_len": 256, "num_threads": 1},  # type: ignore[arg-type]
        agents=[{"name": "support", "api_keys": [AGENT]}],  # type: ignore[list-item]
        admin_api_key=ADMIN,
        trainer={"enabled": False},  # type: ignore[arg-type]
        feedback={"kafka": {"embedded_broker": False}},  # type: ignore[arg-type]
        server={"max_body_bytes": LIMIT},  # type: ignore[arg-type]
    )


@pytest.fixture(scope="module")
def service_gateway(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayServer]:
    service = build_service(_settings(tiny_model_dir, tmp_path_factory.mktemp("openapi")))
    with serve_app(service.app, service.engine) as gateway:
        yield gateway


@pytest.fixture(scope="module")
def document(service_gateway: GatewayServer) -> dict[str, Any]:
    with service_gateway.http() as http:
        served: dict[str, Any] = http.get("/openapi.json").json()
    return served


def _operations(document: dict[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            yield method.upper(), path, operation


def test_every_route_is_in_the_status_table(service_gateway: GatewayServer) -> None:
    # FastAPI nests included routers; its own iterator yields each route with its prefix.
    routes = [
        r
        for r in iter_route_contexts(service_gateway.app.routes)
        if isinstance(r.original_route, APIRoute) and r.original_route.include_in_schema
    ]
    assert {"/v1/chat/completions", "/v1/feedback", "/v1/adapters"} <= {r.path for r in routes}
    missing = [
        route_key(method, str(route.path_format))
        for route in routes
        for method in route.methods or ()
        if documented_statuses(method, str(route.path_format)) is None
    ]
    assert not missing, f"add these routes to gateway.openapi.ROUTE_STATUSES: {missing}"


def test_the_document_says_what_the_table_says(document: dict[str, Any]) -> None:
    seen = set()
    for method, path, operation in _operations(document):
        statuses = documented_statuses(method, path)
        assert statuses is not None, (method, path)
        seen.add(route_key(method, path))
        errors = {int(s) for s in operation["responses"] if int(s) >= 300}
        assert errors == {s for s in statuses if s >= 300}, (method, path)
        for status in errors:
            body = operation["responses"][str(status)]["content"]["application/json"]["schema"]
            assert body == {"$ref": "#/components/schemas/ErrorResponse"}
    assert "HTTPValidationError" not in json.dumps(document)
    # Routes of parts not mounted here (e.g. the Responses API) may be listed ahead.
    assert seen <= set(ROUTE_STATUSES)


def test_the_documented_error_schema_fits_real_errors(
    service_gateway: GatewayServer, document: dict[str, Any]
) -> None:
    # A root schema carrying the components, so `#/components/schemas/...` resolves.
    schema = {"$ref": "#/components/schemas/ErrorResponse", "components": document["components"]}
    with service_gateway.http() as http:
        body = http.post("/v1/chat/completions", json={}).json()
    Draft202012Validator(schema).validate(body)
    assert not Draft202012Validator(schema).is_valid({"error": {"message": "x"}})


def _path_values(path: str) -> Iterator[str]:
    """The path with each parameter filled by plausible and hostile values."""
    for value in ("support", "99999999999999999999", "-1", "x" * 300):
        filled = path
        for name in ("agent", "version", "completion_id", "model_id", "response_id"):
            filled = filled.replace("{" + name + "}", value)
        yield filled


_BODIES: list[tuple[bytes, str]] = [
    (b"", "application/json"),
    (b"not json", "application/json"),
    (b"[]", "application/json"),
    (b'{"model": 7, "messages": "x", "version": "1", "lora_name": 5}', "application/json"),
    (b"{}", "text/plain"),
    (b'{"x": "' + b"y" * LIMIT + b'"}', "application/json"),
]


def test_bad_requests_answer_only_documented_statuses(
    service_gateway: GatewayServer, document: dict[str, Any]
) -> None:
    undocumented: list[str] = []
    keys = {"none": None, "agent": AGENT, "admin": ADMIN, "wrong": "sk-wrong"}
    with service_gateway.http() as http:
        for method, path, operation in _operations(document):
            allowed = {int(s) for s in operation["responses"]}
            for url in _path_values(path):
                for who, key in keys.items():
                    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
                    bodies = _BODIES if method == "POST" else [(b"", "application/json")]
                    for content, kind in bodies:
                        response = http.request(
                            method,
                            url,
                            content=content,
                            headers={**headers, "content-type": kind},
                        )
                        if response.status_code not in allowed:
                            undocumented.append(
                                f"{method} {url[:60]} ({who}, {content[:20]!r}): "
                                f"{response.status_code} {response.text[:120]}"
                            )
    assert not undocumented, "\n".join(undocumented)


@pytest.mark.slow
def test_schemathesis_finds_no_undocumented_status(
    service_gateway: GatewayServer, document: dict[str, Any]
) -> None:
    """A bounded schemathesis run: a few generated requests per operation, positive and
    negative, with the admin key; undocumented statuses and 5xx fail."""
    schemathesis = pytest.importorskip("schemathesis")

    schema = schemathesis.openapi.from_dict(document)
    failures: list[str] = []
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            _fuzz(operation, mode, service_gateway.url, failures)
    assert not failures, "\n".join(sorted(set(failures)))


def _fuzz(operation: Any, mode: Any, url: str, failures: list[str]) -> None:
    """`EXAMPLES` generated requests for one operation, with the admin key."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import status_code_conformance

    label = f"{operation.label} [{mode.value}]"

    # derandomize: the same examples every run, so CI cannot flake on a lucky draw.
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case: Any) -> None:
        try:
            case.call_and_validate(
                base_url=url,
                headers={"Authorization": f"Bearer {ADMIN}"},
                checks=[status_code_conformance, not_a_server_error],
                timeout=60,
            )
        # schemathesis reports a BaseExceptionGroup; collect it, so one run names every route.
        except (Exception, BaseExceptionGroup) as exc:
            found = "; ".join(str(e) for e in getattr(exc, "exceptions", [exc]))
            failures.append(f"{label}: {' '.join(found.split())[:300]}")

    try:
        run()
    except Unsatisfiable:
        # Nothing to make invalid (no parameters, no body): only the positive run applies.
        assert mode.value == "negative", label


def test_the_feedback_route_documents_202_and_422(document: dict[str, Any]) -> None:
    responses = document["paths"]["/v1/feedback"]["post"]["responses"]
    assert {"200", "202", "400", "401", "413", "422"} <= set(responses)


def test_no_route_documents_fastapis_422_it_never_sends(document: dict[str, Any]) -> None:
    for method, path, operation in _operations(document):
        statuses = documented_statuses(method, path) or ()
        if 422 not in statuses:
            assert "422" not in operation["responses"], (method, path)
