"""Timed streamed chat completions against any OpenAI-compatible server: what a user sees.

The client side of `clora bench serve`: the same requests go to the gateway
on the embedded engine and to any other OpenAI server (`--against URL`, e.g.
vLLM's). Every request is greedy with `ignore_eos` (vLLM's extension, which
the gateway also accepts), streamed with `stream_options.include_usage`, so
each row's completion token count comes from the server's own usage and each
chunk's arrival time is read on the client.

Decode steps per second of a batch are those of its longest row, over the
time after its first content chunk: random adapters may stop rows early, so
counting tokens of all rows would flatter whichever side stopped more.

Adapters are loaded the way a user loads them: PEFT directories written by
`save_peft_adapter` and `POST /v1/load_lora_adapter`.

Not here: which figures make the benchmark and the roofline (see `serve`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from clora_feedback.errors import EngineError


class ServerError(EngineError):
    """The server under test answered a benchmark request with an error."""


@dataclass(frozen=True)
class StreamedRow:
    """One streamed completion.

    Attributes:
        start: request sent (s, `time.perf_counter`).
        first: arrival of the first chunk carrying content (s).
        end: arrival of the final chunk (s).
        tokens: completion tokens (the server's usage).
    """

    start: float
    first: float
    end: float
    tokens: int

    @property
    def decode_steps_per_s(self) -> float:
        """Tokens after the first, per second after the first."""
        span = self.end - self.first
        return (self.tokens - 1) / span if span > 0 and self.tokens > 1 else float("nan")


@dataclass(frozen=True)
class StreamedBatch:
    """Several streamed completions sent together.

    Attributes:
        wall_s: first request sent -> last chunk received.
        rows: each request.
    """

    wall_s: float
    rows: list[StreamedRow]

    @property
    def tokens(self) -> int:
        return sum(r.tokens for r in self.rows)

    @property
    def tokens_per_s(self) -> float:
        """All completion tokens over the wall time (prefill included)."""
        return self.tokens / self.wall_s

    @property
    def decode_steps_per_s(self) -> float:
        """Decode steps per second of the longest row (see the module docstring)."""
        return max(self.rows, key=lambda r: r.tokens).decode_steps_per_s


def chat_body(model: str, prompt: str, new_tokens: int) -> dict[str, Any]:
    """The request every server gets: greedy, EOS ignored, streamed with usage."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": new_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def streamed_chat(
    http: httpx.AsyncClient, model: str, prompt: str, new_tokens: int
) -> StreamedRow:
    """One streamed chat completion; raises `ServerError` on an error status."""
    start = time.perf_counter()
    first: float | None = None
    tokens = 0
    async with http.stream(
        "POST", "/v1/chat/completions", json=chat_body(model, prompt, new_tokens)
    ) as response:
        if response.status_code != 200:
            await response.aread()
            raise ServerError(f"{response.status_code} from {model!r}: {response.text[:300]}")
        async for line in response.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if first is None and any(
                (c.get("delta") or {}).get("content") for c in chunk.get("choices") or []
            ):
                first = time.perf_counter()
            usage = chunk.get("usage")
            if usage:
                tokens = int(usage["completion_tokens"])
    end = time.perf_counter()
    return StreamedRow(start, end if first is None else first, end, tokens)


async def batch(
    http: httpx.AsyncClient, requests: Sequence[tuple[str, str]], new_tokens: int
) -> StreamedBatch:
    """One streamed chat completion per (model, prompt), all sent at once."""
    start = time.perf_counter()
    rows = await asyncio.gather(*(streamed_chat(http, m, p, new_tokens) for m, p in requests))
    return StreamedBatch(time.perf_counter() - start, list(rows))


async def base_model(http: httpx.AsyncClient) -> str:
    """The server's base model: the first entry of `/v1/models` without a parent."""
    response = await http.get("/v1/models")
    response.raise_for_status()
    models = response.json()["data"]
    for entry in models:
        if entry.get("parent") is None:
            return str(entry["id"])
    raise ServerError("no base model in /v1/models")


async def load_adapters(http: httpx.AsyncClient, adapters: dict[str, Path]) -> None:
    """`POST /v1/load_lora_adapter` for each name -> PEFT directory."""
    for name, path in adapters.items():
        response = await http.post(
            "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)}
        )
        if response.status_code != 200:
            raise ServerError(f"loading {name!r}: {response.status_code} {response.text[:300]}")


async def unload_adapters(http: httpx.AsyncClient, names: Sequence[str]) -> None:
    """Best-effort `POST /v1/unload_lora_adapter` (the server under test is not ours to litter)."""
    for name in names:
        with contextlib.suppress(httpx.HTTPError):
            await http.post("/v1/unload_lora_adapter", json={"lora_name": name})
