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

Not here: request bodies and token bookkeeping (see `engine`), adapter names (see `names`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncGenerator, Mapping
from typing import Any

import httpx

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
ADAPTER_MISSING = "engine_adapter_missing"
"""`EngineUnavailableError.code` when the server no longer knows the adapter name sent."""


def _server_message(response: httpx.Response) -> str:
    """The `error.message` of vLLM's OpenAI error JSON, else the body's start."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:_MAX_MESSAGE]
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return str(body["error"].get("message", ""))[:_MAX_MESSAGE]
    if isinstance(body, dict) and "message" in body:  # older vLLM: {"message", "type", ...}
        return str(body["message"])[:_MAX_MESSAGE]
    return response.text[:_MAX_MESSAGE]


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

    Args:
        base_url: e.g. `http://127.0.0.1:8000`.
        api_key: the server's `--api-key`, if it has one.
        connect_timeout_s: connecting; past it `EngineUnavailableError`.
        read_timeout_s: longest wait for any reply or the next streamed chunk.
        transport: an httpx transport to use instead of the network (tests).

    Create inside the event loop that uses it; `close` when done.
    """

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float = 120.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        timeout = httpx.Timeout(read_timeout_s, connect=connect_timeout_s)
        # No connection cap: every in-flight request holds one open stream.
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            headers=headers,
            timeout=timeout,
            limits=limits,
            transport=transport,
        )

    async def close(self) -> None:
        await self._http.aclose()

    # -- plumbing -------------------------------------------------------------------

    def _unavailable(self, exc: httpx.HTTPError) -> EngineUnavailableError:
        kind = "timed out" if isinstance(exc, httpx.TimeoutException) else "is unreachable"
        log.warning("vLLM server %s %s: %r", self.base_url, kind, exc)
        return EngineUnavailableError(f"the vLLM server at {self.base_url} {kind}; retry shortly")

    async def _call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            return await self._http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise self._unavailable(exc) from exc

    def _json(self, response: httpx.Response) -> Any:
        try:
            return response.json()
        except ValueError as exc:
            raise EngineError("the vLLM server sent a malformed reply") from exc

    # -- server facts ---------------------------------------------------------------

    async def healthy(self, timeout_s: float | None = None) -> bool:
        """Whether `/health` answers 200 within `timeout_s` (default: the read timeout)."""
        timeout = httpx.USE_CLIENT_DEFAULT if timeout_s is None else httpx.Timeout(timeout_s)
        try:
            response = await self._http.get("/health", timeout=timeout)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def metrics_text(self) -> str | None:
        """`GET /metrics` (Prometheus text), or None when the server has none."""
        response = await self._call("GET", "/metrics")
        return response.text if response.status_code == 200 else None

    async def models(self) -> list[dict[str, Any]]:
        """`GET /v1/models`: the `data` entries (base models and loaded adapters)."""
        response = await self._call("GET", "/v1/models")
        if response.status_code != 200:
            raise request_error(response.status_code, _server_message(response), self.base_url)
        data = self._json(response).get("data")
        if not isinstance(data, list):
            raise EngineError("the vLLM server sent a malformed model list")
        return [m for m in data if isinstance(m, dict)]

    async def tokenize(self, model: str, text: str) -> list[int] | None:
        """`POST /tokenize` without special tokens; None when the server has no such route."""
        body = {"model": model, "prompt": text, "add_special_tokens": False}
        response = await self._call("POST", "/tokenize", json=body)
        if response.status_code == 404:
            return None
        if response.status_code != 200:
            raise request_error(response.status_code, _server_message(response), self.base_url)
        tokens = self._json(response).get("tokens")
        return [int(t) for t in tokens] if isinstance(tokens, list) else None

    # -- adapters -------------------------------------------------------------------

    async def load_lora(self, name: str, path: str) -> None:
        """`POST /v1/load_lora_adapter`; raises `AdapterError` when the server refuses it."""
        body = {"lora_name": name, "lora_path": path}
        response = await self._call("POST", "/v1/load_lora_adapter", json=body)
        if response.status_code == 200:
            return
        message = _server_message(response)
        if response.status_code == 400 and "already been loaded" in message:
            return  # names are never reused: this very version is there (reconnect, retry)
        if response.status_code == 404 and "Not Found" in message:
            raise AdapterError(
                f"the vLLM server at {self.base_url} has no runtime adapter routes: start it "
                "with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True and --enable-lora"
            )
        raise AdapterError(f"the vLLM server refused adapter {name!r}: {message}")

    async def unload_lora(self, name: str) -> None:
        """`POST /v1/unload_lora_adapter`; an unknown name is not an error."""
        response = await self._call("POST", "/v1/unload_lora_adapter", json={"lora_name": name})
        if response.status_code not in (200, 404):
            log.warning(
                "vLLM server %s: unloading %s failed (HTTP %d): %s",
                self.base_url, name, response.status_code, _server_message(response),
            )  # fmt: skip

    # -- generation -----------------------------------------------------------------

    async def complete(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """`POST /v1/completions` without streaming: the response object."""
        response = await self._call("POST", "/v1/completions", json=dict(body))
        if response.status_code != 200:
            raise request_error(response.status_code, _server_message(response), self.base_url)
        result = self._json(response)
        if not isinstance(result, dict):
            raise EngineError("the vLLM server sent a malformed completion")
        return result

    async def stream(self, body: Mapping[str, Any]) -> AsyncGenerator[dict[str, Any], None]:
        """`POST /v1/completions` with `stream: true`: each SSE chunk's JSON object.

        Closing the generator early (`contextlib.aclosing`) or cancelling it closes
        the HTTP stream, which makes vLLM abort the request. Iterated to its end, it
        reads the body to its end after `[DONE]`: only a response read to the end
        leaves its keep-alive connection in the pool for the next request (else every
        request would open a new connection, and vLLM would see each client leave).
        """
        try:
            async with self._http.stream("POST", "/v1/completions", json=dict(body)) as response:
                if response.status_code != 200:
                    await response.aread()
                    raise request_error(
                        response.status_code, _server_message(response), self.base_url
                    )
                lines = response.aiter_lines()
                async for line in lines:
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    yield self._chunk(data)
                async for _ in lines:  # the end of the body (nothing follows `[DONE]`)
                    pass
        except httpx.HTTPError as exc:
            raise self._unavailable(exc) from exc

    def _chunk(self, data: str) -> dict[str, Any]:
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
