"""The one place that turns errors into OpenAI error JSON.

Every failure the gateway answers with looks like OpenAI's:

    {"error": {"message": "...", "type": "invalid_request_error", "param": "temperature", "code": null}}

Sources, each translated once here:
- `CloraError` (the package hierarchy): status, type, param and code come from
  the exception's attributes; a retriable error with `retry_after_s` (an
  overloaded queue, an unreachable engine server) adds a `Retry-After` header.
- FastAPI's `RequestValidationError` (a body that fails the pydantic models,
  including a body that is not JSON): 400, with `param` rebuilt from the
  error location (`messages[0].content`), never from message text.
- Starlette's `HTTPException` (unknown URL, wrong method, a body cut off at the size
  limit): OpenAI's 404/405/413 shape.
- Anything else: 500 with a generic message; the traceback goes to the log.

Errors that happen after a stream has started cannot change the status code;
`error_event` gives the payload sent as a final SSE event instead.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from clora_feedback.errors import (
    CloraError,
    InvalidRequestError,
    NotFoundError,
    PayloadTooLargeError,
)
from clora_feedback.schemas.paths import json_path

log = logging.getLogger(__name__)

TOO_LARGE_CODE = "request_too_large"
"""The `code` of every 413 (a body over `server.max_body_bytes`)."""

_JSON_HINT = (
    "We could not parse the JSON body of your request. The API expects a JSON object; "
    "what was sent was not valid JSON."
)
# Location items pydantic adds for union members and discriminator tags; they are not
# parameter names (e.g. `messages.0.user.content.list[TextContentPart]`).
_TYPE_NOISE = re.compile(r"^(str|int|float|bool|dict|list|none|[A-Z]\w*|.*[\[\]\-,'= ].*)$")
_LOCATIONS = frozenset({"body", "query", "path", "header", "cookie"})
_ROLE_TAGS = frozenset({"system", "developer", "user", "assistant", "tool"})


def error_payload(
    message: str, *, error_type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """The OpenAI error object: `{"error": {"message", "type", "param", "code"}}`."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_event(exc: CloraError) -> dict[str, Any]:
    """The payload for an error that happens mid-stream (sent as one SSE `data:` event)."""
    return error_payload(exc.message, error_type=exc.error_type, param=exc.param, code=exc.code)


def error_response(exc: CloraError) -> JSONResponse:
    """A JSON response for a package error, with `Retry-After` when the error names a wait
    (an overloaded queue, an unreachable engine server)."""
    headers: dict[str, str] = {}
    if exc.retriable and exc.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after_s)))
    return JSONResponse(error_event(exc), status_code=exc.http_status, headers=headers)


def param_from_loc(loc: Sequence[int | str]) -> str | None:
    """Rebuild the request parameter a pydantic error location points at.

    `("body", "messages", 0, "user", "content", "str")` -> `"messages[0].content"`;
    `("body",)` (the whole body) -> None.
    """
    items = list(loc[1:] if loc and loc[0] in _LOCATIONS else loc)
    path = json_path(items, skip=_not_a_param)
    if not path or path.startswith("["):
        return None
    return path


def _not_a_param(item: str, previous: int | str | None) -> bool:
    return bool(_TYPE_NOISE.match(item)) or (isinstance(previous, int) and item in _ROLE_TAGS)


def validation_error(exc: RequestValidationError) -> InvalidRequestError:
    """Translate FastAPI's body validation failure into one `InvalidRequestError`."""
    errors = list(exc.errors())
    if not errors:
        return InvalidRequestError("invalid request body")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return InvalidRequestError(_JSON_HINT)
    loc = tuple(first.get("loc", ()))
    param = param_from_loc(loc)
    if first.get("type") == "missing" and param is None:
        return InvalidRequestError("the request body is missing; send a JSON object")
    if first.get("type") == "model_attributes_type" and param is None:
        return InvalidRequestError("the request body must be a JSON object")
    # A union reports one error per member; say all of them, once each.
    messages: list[str] = []
    for err in errors:
        if param_from_loc(tuple(err.get("loc", ()))) == param and err["msg"] not in messages:
            messages.append(str(err["msg"]).removeprefix("Value error, "))
    text = "; ".join(messages[:3])
    return InvalidRequestError(f"{param}: {text}" if param else text, param=param)


class _RoutingError(CloraError):
    """A Starlette routing failure (wrong method, other HTTP errors) as a package error."""

    error_type = "invalid_request_error"

    def __init__(self, message: str, *, status: int, code: str | None = None):
        super().__init__(message, code=code)
        self.http_status = status
        if status >= 500:
            self.error_type = "server_error"


def http_error(request: Request, exc: StarletteHTTPException) -> CloraError:
    """Routing errors in OpenAI's wording (404 unknown URL, 405 wrong method)."""
    where = f"{request.method} {request.url.path}"
    if exc.status_code == 404:
        return NotFoundError(f"Unknown request URL: {where}.", code="unknown_url")
    if exc.status_code == 405:
        return _RoutingError(f"Method not allowed: {where}.", status=405, code="method_not_allowed")
    if exc.status_code == 413:  # a body cut off while it was read (`gateway.limits`)
        return PayloadTooLargeError(str(exc.detail), code=TOO_LARGE_CODE)
    return _RoutingError(str(exc.detail), status=exc.status_code)


async def _on_clora_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, CloraError)
    if exc.http_status >= 500:
        log.error("%s %s failed: %s", request.method, request.url.path, exc.message, exc_info=exc)
    return error_response(exc)


async def _on_validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return error_response(validation_error(exc))


async def _on_http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    response = error_response(http_error(request, exc))
    if exc.headers:
        response.headers.update(exc.headers)
    return response


async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error in %s %s", request.method, request.url.path, exc_info=exc)
    return JSONResponse(
        error_payload(
            "The server had an error while processing your request.", error_type="server_error"
        ),
        status_code=500,
    )


def install_error_handlers(app: FastAPI) -> None:
    """Register the handlers above on `app`."""
    app.add_exception_handler(CloraError, _on_clora_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_unexpected)
