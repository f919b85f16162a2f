"""`VLLMClient`: the HTTP calls the vLLM engine makes to one vLLM OpenAI server.

Every foreign failure is translated here, once, into the package's errors:

- no connection, a timeout, a dropped stream, a 503 -> `EngineUnavailableError`
  (503 with `Retry-After`; the request may be retried); a 404 too (the server
  no longer knows the adapter name: it restarted), with code `ADAPTER_MISSING`;
- a 429 -> `OverloadedError`;
- a 400 -> `ContextLengthError` when the server says the context is exceeded
  (a fallback: the engine checks the window itself before sending), else
  `InvalidRequestError` with the server's message;
- adapter routes -> `AdapterError` (the adapter is refused; serving is untouched);
- anything else (5xx, a malformed reply) -> `EngineError` with a generic message;
  the server's own text goes to the log only.

The calls go over one pooled keep-alive `aiohttp` session per server (chosen
for its per-request cost: the gateway's added latency is issue 10's benchmark
1); streamed replies are read line by line from the response body.

Not here: request bodies and token bookkeeping (see `engine`), adapter names (see `names`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp.http_exceptions import HttpProcessingError
from yarl import URL

from clora_feedback.errors import (
    AdapterError,
    CloraError,
    ContextLengthError,
    EngineError,
    EngineUnavailableError,
    InvalidRequestError,
    OverloadedError,
)

log = logging.getLogger(__name__)

_MAX_MESSAGE = 400  # longest server message passed on to a client
_MAX_LINE = 4 * 2**20  # longest SSE line read (one chunk's JSON; top logprobs make it long)
_KEEPALIVE_S = 4.0  # an idle connection is dropped before uvicorn's (vLLM's) 5 s: never stale
ADAPTER_MISSING = "engine_adapter_missing"
"""`EngineUnavailableError.code` when the server no longer knows the adapter name sent."""

_FAILURES = (aiohttp.ClientError, TimeoutError)
"""What aiohttp raises for no connection, a timeout or a dropped stream (`ServerTimeoutError`
is both; a `total` timeout is a bare `TimeoutError`)."""


@dataclass(frozen=True, slots=True)
class Reply:
    """One non-streamed answer, read to its end: the status and the raw body."""

    status: int
    body: bytes

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", errors="replace")

    def json(self) -> Any:
        """The body as JSON; `ValueError` when it is not."""
        return json.loads(self.body)


def _server_message(reply: Reply) -> str:
    """The `error.message` of vLLM's OpenAI error JSON, else the body's start."""
    try:
        body = reply.json()
    except ValueError:
        return reply.text[:_MAX_MESSAGE]
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return str(body["error"].get("message", ""))[:_MAX_MESSAGE]
    if isinstance(body, dict) and "message" in body:  # older vLLM: {"message", "type", ...}
        return str(body["message"])[:_MAX_MESSAGE]
    return reply.text[:_MAX_MESSAGE]


def request_error(status: int, message: str, url: str) -> CloraError:
    """The package error for a generation request that vLLM answered with `status`."""
    if status == 400:
        lowered = message.lower()
        if "context length" in lowered or "maximum model length" in lowered:
            return ContextLengthError(
                f"the request exceeds the model's context window: {message}", param="max_tokens"
            )
        return InvalidRequestError(f"the engine refused the request: {message}")
    if status == 404:  # the adapter name is gone: the server restarted (the engine reloads it)
        return EngineUnavailableError(
            f"the vLLM server at {url} lost the adapter; retry shortly", code=ADAPTER_MISSING
        )
    if status == 429:
        return OverloadedError("the vLLM server is at capacity; retry shortly")
    if status == 503:
        return EngineUnavailableError(f"the vLLM server at {url} is unavailable; retry shortly")
    log.error("vLLM server %s answered %d: %s", url, status, message)
    return EngineError(f"the vLLM server failed (HTTP {status})")


class VLLMClient:
    """Async calls to one vLLM OpenAI server (`base_url` without `/v1`).

    One pooled keep-alive `aiohttp` session per server, without a connection cap
    (every in-flight request holds one open stream). aiohttp needs a running loop
    for it: the session is opened at the first call, and `close` closes it; use a
    client from one event loop only.

    Args:
        base_url: e.g. `http://127.0.0.1:8000`.
        api_key: the server's `--api-key`, if it has one.
        connect_timeout_s: connecting; past it `EngineUnavailableError`.
        read_timeout_s: longest wait for any reply or the next streamed chunk.
    """

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float = 120.0,
    ) -> None:
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # No total: a long stream is fine while each read arrives within `sock_read`.
        self._timeout = aiohttp.ClientTimeout(
            total=None,
            connect=connect_timeout_s,
            sock_connect=connect_timeout_s,
            sock_read=read_timeout_s,
        )
        self._session: aiohttp.ClientSession | None = None
        self._urls: dict[str, URL] = {}

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    # -- plumbing -------------------------------------------------------------------

    def _http(self) -> aiohttp.ClientSession:
        """The session, opened on first use (inside the running loop, as aiohttp needs)."""
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=_KEEPALIVE_S)
            self._session = aiohttp.ClientSession(
                connector=connector,
                headers=self._headers,
                timeout=self._timeout,
                cookie_jar=aiohttp.DummyCookieJar(),
                read_bufsize=_MAX_LINE // 2,  # readline's limit is twice this
            )
        return self._session

    def _url(self, path: str) -> URL:
        url = self._urls.get(path)
        if url is None:  # the base URL's own path is kept (a server behind a path prefix)
            url = self._urls[path] = URL(self.base_url + path)
        return url

    def _unavailable(self, exc: BaseException) -> EngineUnavailableError:
        kind = "timed out" if isinstance(exc, TimeoutError) else "is unreachable"
        log.warning("vLLM server %s %s: %r", self.base_url, kind, exc)
        return EngineUnavailableError(f"the vLLM server at {self.base_url} {kind}; retry shortly")

    async def _send(
        self,
        method: str,
        path: str,
        body: Mapping[str, Any] | None = None,
        timeout: aiohttp.ClientTimeout | None = None,
    ) -> Reply:
        """One request, its reply read to its end (the connection goes back to the pool)."""
        async with self._http().request(
            method,
            self._url(path),
            json=None if body is None else dict(body),
            timeout=timeout or self._timeout,
            allow_redirects=False,
        ) as response:
            return Reply(response.status, await response.read())

    async def _call(self, method: str, path: str, body: Mapping[str, Any] | None = None) -> Reply:
        try:
            return await self._send(method, path, body)
        except _FAILURES as exc:
            raise self._unavailable(exc) from exc

    def _json(self, reply: Reply) -> Any:
        try:
            return reply.json()
        except ValueError as exc:
            raise EngineError("the vLLM server sent a malformed reply") from exc

    # -- server facts ---------------------------------------------------------------

    async def healthy(self, timeout_s: float | None = None) -> bool:
        """Whether `/health` answers 200 within `timeout_s` (default: the read timeout)."""
        timeout = None if timeout_s is None else aiohttp.ClientTimeout(total=timeout_s)
        try:
            reply = await self._send("GET", "/health", timeout=timeout)
        except _FAILURES:
            return False
        return reply.status == 200

    async def metrics_text(self) -> str | None:
        """`GET /metrics` (Prometheus text), or None when the server has none."""
        reply = await self._call("GET", "/metrics")
        return reply.text if reply.status == 200 else None

    async def models(self) -> list[dict[str, Any]]:
        """`GET /v1/models`: the `data` entries (base models and loaded adapters)."""
        reply = await self._call("GET", "/v1/models")
        if reply.status != 200:
            raise request_error(reply.status, _server_message(reply), self.base_url)
        result = self._json(reply)
        data = result.get("data") if isinstance(result, dict) else None
        if not isinstance(data, list):
            raise EngineError("the vLLM server sent a malformed model list")
        return [m for m in data if isinstance(m, dict)]

    async def tokenize(self, model: str, text: str) -> list[int] | None:
        """`POST /tokenize` without special tokens; None when the server has no such route."""
        body = {"model": model, "prompt": text, "add_special_tokens": False}
        reply = await self._call("POST", "/tokenize", body)
        if reply.status == 404:
            return None
        if reply.status != 200:
            raise request_error(reply.status, _server_message(reply), self.base_url)
        result = self._json(reply)
        tokens = result.get("tokens") if isinstance(result, dict) else None
        return [int(t) for t in tokens] if isinstance(tokens, list) else None

    # -- adapters -------------------------------------------------------------------

    async def load_lora(self, name: str, path: str) -> None:
        """`POST /v1/load_lora_adapter`; raises `AdapterError` when the server refuses it."""
        body = {"lora_name": name, "lora_path": path}
        reply = await self._call("POST", "/v1/load_lora_adapter", body)
        if reply.status == 200:
            return
        message = _server_message(reply)
        if reply.status == 400 and "already been loaded" in message:
            return  # names are never reused: this very version is there (reconnect, retry)
        if reply.status == 404 and "Not Found" in message:
            raise AdapterError(
                f"the vLLM server at {self.base_url} has no runtime adapter routes: start it "
                "with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True and --enable-lora"
            )
        raise AdapterError(f"the vLLM server refused adapter {name!r}: {message}")

    async def unload_lora(self, name: str) -> None:
        """`POST /v1/unload_lora_adapter`; an unknown name is not an error."""
        reply = await self._call("POST", "/v1/unload_lora_adapter", {"lora_name": name})
        if reply.status not in (200, 404):
            log.warning(
                "vLLM server %s: unloading %s failed (HTTP %d): %s",
                self.base_url, name, reply.status, _server_message(reply),
            )  # fmt: skip

    # -- generation -----------------------------------------------------------------

    async def complete(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """`POST /v1/completions` without streaming: the response object."""
        reply = await self._call("POST", "/v1/completions", body)
        if reply.status != 200:
            raise request_error(reply.status, _server_message(reply), self.base_url)
        result = self._json(reply)
        if not isinstance(result, dict):
            raise EngineError("the vLLM server sent a malformed completion")
        return result

    async def stream(self, body: Mapping[str, Any]) -> AsyncGenerator[dict[str, Any], None]:
        """`POST /v1/completions` with `stream: true`: each SSE chunk's JSON object.

        Closing the generator early (`contextlib.aclosing`) or cancelling it closes
        the HTTP response and its connection, which makes vLLM abort the request.
        Iterated to its end, it reads the body to its end after `[DONE]`: only a
        response read to the end leaves its keep-alive connection in the pool for
        the next request (else every request would open a new connection, and vLLM
        would see each client leave).
        """
        try:
            async with self._http().post(
                self._url("/v1/completions"), json=dict(body), allow_redirects=False
            ) as response:
                if response.status != 200:
                    reply = Reply(response.status, await response.read())
                    raise request_error(reply.status, _server_message(reply), self.base_url)
                read_to_end = False
                try:
                    content = response.content
                    while line := await _readline(content):  # b"" at the body's end
                        if not line.startswith(b"data:"):
                            continue
                        data = line[5:].strip()
                        if data == b"[DONE]":
                            break
                        yield self._chunk(data)
                    await content.read()  # the end of the body (nothing follows `[DONE]`)
                    read_to_end = True
                finally:
                    if not read_to_end:  # closed, cancelled or failed midway: drop it
                        response.close()
        except _FAILURES as exc:
            raise self._unavailable(exc) from exc

    def _chunk(self, data: bytes) -> dict[str, Any]:
        try:
            chunk = json.loads(data)
        except ValueError as exc:
            raise EngineError("the vLLM server sent a malformed stream chunk") from exc
        if not isinstance(chunk, dict):
            raise EngineError("the vLLM server sent a malformed stream chunk")
        error = chunk.get("error")
        if isinstance(error, dict):  # a failure after the stream started
            status = int(error.get("code") or 500)
            raise request_error(status, str(error.get("message", ""))[:_MAX_MESSAGE], self.base_url)
        return chunk


async def _readline(content: aiohttp.StreamReader) -> bytes:
    """The next line of a streamed body (a line may span any number of reads)."""
    try:
        return await content.readline()
    except (ValueError, HttpProcessingError) as exc:  # longer than `_MAX_LINE`
        raise EngineError("the vLLM server sent a malformed stream chunk") from exc
