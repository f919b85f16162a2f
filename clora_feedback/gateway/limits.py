"""Request body bound: 413 in OpenAI error JSON before an oversized body is read.

`BodyLimitMiddleware` is a plain ASGI middleware in front of every route:

- a `Content-Length` over the limit (or not a number) is answered at once,
  without reading a byte of the body;
- a body without a length (chunked) is counted as it arrives, and the first
  chunk that crosses the limit ends the read with the same 413, so at most
  one chunk beyond the limit is ever held in memory.

The route that reads the body sees the overflow as an `HTTPException(413)`
raised from `receive` (FastAPI re-raises those untouched), and the one error
mapper (`gateway.errors`) answers it like every other failure.

Not here: per-route limits below this one (the webhook's `feedback.max_body_bytes`),
token limits (the context window, checked by the handlers).
"""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from clora_feedback.errors import PayloadTooLargeError
from clora_feedback.gateway.errors import TOO_LARGE_CODE, error_response


def too_large(limit: int) -> PayloadTooLargeError:
    """The error for a body over `limit` bytes."""
    return PayloadTooLargeError(
        f"The request body is larger than this server accepts ({limit} bytes).",
        code=TOO_LARGE_CODE,
    )


class BodyTooLarge(HTTPException):
    """Raised from `receive` once a streamed body crosses the limit (mapped to 413)."""

    def __init__(self, limit: int) -> None:
        super().__init__(status_code=413, detail=too_large(limit).message)
        self.limit = limit


class BodyLimitMiddleware:
    """Refuse request bodies over `max_body_bytes` with 413, before reading them whole."""

    def __init__(self, app: ASGIApp, *, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and (declared < 0 or declared > self.max_body_bytes):
            # The connection stays open: closing while the client still sends would reset
            # it before the 413 is read; the server discards the rest of the body instead.
            await error_response(too_large(self.max_body_bytes))(scope, receive, send)
            return
        await self.app(scope, self._counting(receive), send)

    def _counting(self, receive: Receive) -> Receive:
        seen = 0
        limit = self.max_body_bytes

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge(limit)
            return message

        return counted


def _content_length(scope: Scope) -> int | None:
    """The declared body length; -1 when the header is not a decimal number."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            text = value.decode("latin-1").strip()
            if not text.isdigit():
                return -1
            # More digits than any int64 length: too large, without int()'s digit limit.
            return int(text) if len(text) <= 18 else 10**18
    return None
