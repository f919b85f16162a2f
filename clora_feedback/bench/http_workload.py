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

Agents' multi-turn episodes (`episode`, `episodes`) are what a chat client
sends: each turn posts the conversation so far as messages (the system
prompt, the user's messages, the assistant's earlier replies as the text the
stream delivered), so the server renders and tokenizes it again every turn
and only a prefix cache spares it re-prefilling. `cache_counters` reads the
server's prefix-cache counters from its Prometheus `/metrics` (the gateway's
`clora_engine_prefix_cache_*` blocks, vLLM's `vllm:prefix_cache_*` tokens).

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
        prompt_tokens: prompt tokens (the server's usage; 0 if it sent none).
        text: the content the stream delivered.
    """

    start: float
    first: float
    end: float
    tokens: int
    prompt_tokens: int = 0
    text: str = ""

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


Message = dict[str, str]


def chat_body(model: str, messages: str | Sequence[Message], new_tokens: int) -> dict[str, Any]:
    """The request every server gets: greedy, EOS ignored, streamed with usage.

    `messages` is a whole conversation, or one user prompt.
    """
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    return {
        "model": model,
        "messages": list(messages),
        "max_tokens": new_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def streamed_chat(
    http: httpx.AsyncClient, model: str, messages: str | Sequence[Message], new_tokens: int
) -> StreamedRow:
    """One streamed chat completion; raises `ServerError` on an error status."""
    start = time.perf_counter()
    first: float | None = None
    tokens = prompt_tokens = 0
    text: list[str] = []
    async with http.stream(
        "POST", "/v1/chat/completions", json=chat_body(model, messages, new_tokens)
    ) as response:
        if response.status_code != 200:
            await response.aread()
            raise ServerError(f"{response.status_code} from {model!r}: {response.text[:300]}")
        async for line in response.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            for choice in chunk.get("choices") or []:
                content = (choice.get("delta") or {}).get("content")
                if content:
                    if first is None:
                        first = time.perf_counter()
                    text.append(content)
            usage = chunk.get("usage")
            if usage:
                tokens = int(usage["completion_tokens"])
                prompt_tokens = int(usage.get("prompt_tokens") or 0)
    end = time.perf_counter()
    first = end if first is None else first
    return StreamedRow(start, first, end, tokens, prompt_tokens, "".join(text))


async def batch(
    http: httpx.AsyncClient, requests: Sequence[tuple[str, str]], new_tokens: int
) -> StreamedBatch:
    """One streamed chat completion per (model, prompt), all sent at once."""
    start = time.perf_counter()
    rows = await asyncio.gather(*(streamed_chat(http, m, p, new_tokens) for m, p in requests))
    return StreamedBatch(time.perf_counter() - start, list(rows))


@dataclass(frozen=True)
class Episode:
    """One agent's conversation: a streamed completion per turn."""

    turns: list[StreamedRow]

    @property
    def tokens(self) -> int:
        return sum(t.tokens for t in self.turns)

    @property
    def prompt_tokens(self) -> int:
        return sum(t.prompt_tokens for t in self.turns)


@dataclass(frozen=True)
class EpisodeRun:
    """Several agents' episodes, run together or one after another.

    Attributes:
        wall_s: first request sent -> last chunk of the last episode.
        episodes: each agent's episode, in the order given.
        cache: the server's prefix-cache counters accrued during the run
            (`cache_counters` after minus before; empty if it exposes none).
    """

    wall_s: float
    episodes: list[Episode]
    cache: dict[str, float]

    @property
    def tokens(self) -> int:
        return sum(e.tokens for e in self.episodes)

    @property
    def prompt_tokens(self) -> int:
        return sum(e.prompt_tokens for e in self.episodes)

    @property
    def cache_hit_fraction(self) -> float | None:
        """Hits over lookups (gateway: 16-token blocks; vLLM: tokens); None without counters."""
        c = self.cache
        if "clora_engine_prefix_cache_hits_total" in c:
            hits = c["clora_engine_prefix_cache_hits_total"]
            looked = hits + c.get("clora_engine_prefix_cache_misses_total", 0.0)
        elif "vllm:prefix_cache_hits_total" in c:
            hits = c["vllm:prefix_cache_hits_total"]
            looked = c.get("vllm:prefix_cache_queries_total", 0.0)
        else:
            return None
        return hits / looked if looked > 0 else 0.0


async def episode(
    http: httpx.AsyncClient,
    model: str,
    system: str,
    user_turns: Sequence[str],
    new_tokens: int,
) -> Episode:
    """A chat: turn k sends the system prompt, every earlier message and user turn k."""
    messages: list[Message] = [{"role": "system", "content": system}]
    turns = []
    for content in user_turns:
        messages.append({"role": "user", "content": content})
        row = await streamed_chat(http, model, messages, new_tokens)
        messages.append({"role": "assistant", "content": row.text})
        turns.append(row)
    return Episode(turns)


async def episodes(
    http: httpx.AsyncClient,
    plan: Sequence[tuple[str, Sequence[str]]],
    system: str,
    new_tokens: int,
    *,
    together: bool,
) -> EpisodeRun:
    """One episode per (model, user turns): all at once, or each after the one before."""
    before = await cache_counters(http)
    start = time.perf_counter()
    if together:
        done = list(
            await asyncio.gather(*(episode(http, m, system, u, new_tokens) for m, u in plan))
        )
    else:
        done = [await episode(http, m, system, u, new_tokens) for m, u in plan]
    wall = time.perf_counter() - start
    after = await cache_counters(http)
    delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
    return EpisodeRun(wall, done, delta)


CACHE_COUNTERS = (
    "clora_engine_prefix_cache_hits_total",
    "clora_engine_prefix_cache_misses_total",
    "vllm:prefix_cache_hits_total",
    "vllm:prefix_cache_queries_total",
)
"""Prefix-cache counters `cache_counters` reads (summed over their label sets)."""


def parse_counters(text: str, names: Sequence[str] = CACHE_COUNTERS) -> dict[str, float]:
    """The named samples of a Prometheus text exposition, each summed over its labels."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in names:
            with contextlib.suppress(ValueError, IndexError):
                found[name] = found.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return found


async def cache_counters(http: httpx.AsyncClient) -> dict[str, float]:
    """The server's prefix-cache counters now (empty if it has no such `/metrics`)."""
    try:
        response = await http.get("/metrics")
    except httpx.HTTPError:
        return {}
    return parse_counters(response.text) if response.status_code == 200 else {}


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
