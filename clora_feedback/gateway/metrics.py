"""Prometheus metrics in text exposition format, without a client library.

Counters are kept in process memory and rendered on `GET /metrics`:

    clora_http_requests_total{route, method, status}   every HTTP request
    clora_completions_total{agent, endpoint}           completions served (and recorded)
    clora_prompt_tokens_total{agent}                   prompt tokens of served completions
    clora_generation_tokens_total{agent}               tokens generated for served completions
    clora_engine_running / clora_engine_waiting        rows decoding / requests queued (gauges)
    clora_engine_max_num_seqs / clora_engine_max_waiting   capacity (gauges)
    clora_engine_steps_total / clora_engine_generated_tokens_total   engine counters
    clora_engine_adapter_version{agent}                live adapter version per agent
    clora_engine_prefix_cache_{hits,misses,evictions}_total   prefix-cache blocks (when on)
    clora_engine_prefix_cache_bytes / _capacity_bytes  its memory and bound (gauges)
    clora_engine_host_adapter_cache_bytes / _capacity_bytes   host copies of adapters, budget
    clora_engine_adapter_reads_total / clora_engine_host_adapter_drops_total   cold reads, drops

Bounded whatever the number of agents: families labelled by `agent` keep rows
for the `top_agents` agents with the most completions (ties by name) and fold
every other agent into one `agent="_other"` row (counters: summed, so a family
still adds up to the total; gauges such as the adapter version: left out).
`clora_agents{state}` counts the agents (`served`: with a live adapter;
`labelled`: with their own rows), so a scrape is O(top_agents) lines whatever
the fleet. `top_agents: 0` keeps only the aggregates.

`HTTPMetricsMiddleware` is a plain ASGI middleware (not Starlette's
`BaseHTTPMiddleware`, which buffers streams and hides client disconnects) that
labels requests by route template, so label cardinality stays bounded.

Not here: histograms, multi-process aggregation.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from clora_feedback.engine.types import EngineStats

OTHER_AGENTS = "_other"
"""The `agent` label of the row that folds every agent beyond the top ones (counters)."""


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(names: tuple[str, ...], values: tuple[str, ...]) -> str:
    if not names:
        return ""
    return "{" + ",".join(f'{n}="{_escape(v)}"' for n, v in zip(names, values, strict=True)) + "}"


@dataclass(frozen=True)
class Family:
    """One metric family from an outside source: name, type, help, label names, rows."""

    name: str
    kind: str
    help: str
    labels: tuple[str, ...]
    rows: dict[Any, float]


class Metrics:
    """Thread-safe counters for the gateway.

    Args:
        top_agents: agents with rows of their own in agent-labelled families (the most
            completions first); the rest are folded into `agent="_other"`.
    """

    def __init__(self, top_agents: int = 20) -> None:
        self.top_agents = top_agents
        self._lock = threading.Lock()
        self._sources: list[Callable[[], list[Family]]] = []
        self.http = Counter[tuple[str, str, str]]()
        self.completions = Counter[tuple[str, str]]()
        self.prompt_tokens = Counter[str]()
        self.generation_tokens = Counter[str]()

    def add_source(self, source: Callable[[], list[Family]]) -> None:
        """Register more metric families (trainer, feedback consumer), rendered on each scrape."""
        self._sources.append(source)

    def observe_http(self, route: str, method: str, status: int) -> None:
        with self._lock:
            self.http[(route, method, str(status))] += 1

    def observe_completion(
        self, agent: str, endpoint: str, prompt_tokens: int, generated: int
    ) -> None:
        with self._lock:
            self.completions[(agent, endpoint)] += 1
            self.prompt_tokens[agent] += prompt_tokens
            self.generation_tokens[agent] += generated

    def labelled_agents(self) -> set[str]:
        """The `top_agents` agents with the most completions (ties: by name); caller holds no lock."""
        with self._lock:
            served = Counter[str]()
            for (agent, _), count in self.completions.items():
                served[agent] += count
        ranked = sorted(served.items(), key=lambda kv: (-kv[1], kv[0]))
        return {agent for agent, _ in ranked[: self.top_agents]}

    def render(self, stats: EngineStats) -> str:
        """The exposition text, with engine gauges from `stats`; O(`top_agents`) lines."""
        lines: list[str] = []
        top = self.labelled_agents()

        def family(
            name: str, kind: str, help_text: str, names: tuple[str, ...], rows: dict[Any, float]
        ) -> None:
            if "agent" in names:
                rows = _fold_agents(rows, names.index("agent"), top, counter=kind == "counter")
            lines.append(f"# HELP {name} {help_text}")
            lines.append(f"# TYPE {name} {kind}")
            for key, value in sorted(rows.items()):
                values = key if isinstance(key, tuple) else (key,)
                lines.append(f"{name}{_labels(names, values if names else ())} {value:g}")

        family(
            "clora_agents",
            "gauge",
            "Agents: with a live adapter (served), with rows of their own here (labelled).",
            ("state",),
            {"served": len(stats.adapters), "labelled": len(top)},
        )
        with self._lock:
            family(
                "clora_http_requests_total",
                "counter",
                "HTTP requests by route, method and status.",
                ("route", "method", "status"),
                dict(self.http),
            )
            family(
                "clora_completions_total",
                "counter",
                "Completions served and recorded.",
                ("agent", "endpoint"),
                dict(self.completions),
            )
            family(
                "clora_prompt_tokens_total",
                "counter",
                "Prompt tokens of served completions.",
                ("agent",),
                dict(self.prompt_tokens),
            )
            family(
                "clora_generation_tokens_total",
                "counter",
                "Generated tokens of served completions.",
                ("agent",),
                dict(self.generation_tokens),
            )
        family(
            "clora_engine_running",
            "gauge",
            "Sequences in the decode batch.",
            (),
            {"": stats.running},
        )
        family(
            "clora_engine_waiting",
            "gauge",
            "Requests queued for a batch row.",
            (),
            {"": stats.waiting},
        )
        family("clora_engine_max_num_seqs", "gauge", "Batch rows.", (), {"": stats.max_num_seqs})
        family(
            "clora_engine_max_waiting",
            "gauge",
            "Queue capacity beyond the batch.",
            (),
            {"": stats.max_waiting},
        )
        family("clora_engine_steps_total", "counter", "Engine steps run.", (), {"": stats.steps})
        family(
            "clora_engine_generated_tokens_total",
            "counter",
            "Tokens generated by the engine.",
            (),
            {"": stats.generated_tokens},
        )
        family(
            "clora_engine_adapter_version",
            "gauge",
            "Live adapter version per agent.",
            ("agent",),
            dict(stats.adapters),
        )
        cache = stats.prefix_cache
        if cache is not None:
            for what, value, text in (
                ("hits", cache.hits, "reused instead of prefilled"),
                ("misses", cache.misses, "looked up, not found, prefilled"),
                ("evictions", cache.evictions, "evicted to stay within the bound"),
            ):
                family(
                    f"clora_engine_prefix_cache_{what}_total",
                    "counter",
                    f"Prefix-cache blocks of {cache.block_tokens} tokens {text}.",
                    (),
                    {"": value},
                )
            family(
                "clora_engine_prefix_cache_bytes",
                "gauge",
                "Prefix-cache memory held.",
                (),
                {"": cache.bytes},
            )
            family(
                "clora_engine_prefix_cache_capacity_bytes",
                "gauge",
                "Prefix-cache memory bound.",
                (),
                {"": cache.capacity_bytes},
            )
        host = stats.host_cache
        if host is not None:
            for name, kind, value, text in (
                ("host_adapter_cache_bytes", "gauge", host.bytes, "Host copies of adapters held."),
                ("host_adapter_cache_capacity_bytes", "gauge", host.capacity_bytes,
                 "Budget of the host copies of adapters (0: none)."),
                ("adapter_reads_total", "counter", host.reads,
                 "Adapter versions read from their directories for cold agents."),
                ("host_adapter_drops_total", "counter", host.drops,
                 "Host copies of adapters dropped to stay within the budget."),
            ):  # fmt: skip
                family(f"clora_engine_{name}", kind, text, (), {"": value})
        for source in self._sources:
            for fam in source():
                family(fam.name, fam.kind, fam.help, fam.labels, fam.rows)
        return "\n".join(lines) + "\n"


def _fold_agents(
    rows: dict[Any, float], index: int, top: set[str], *, counter: bool
) -> dict[Any, float]:
    """`rows` keeping agents in `top`; the others summed into `_other` (counters) or dropped."""
    out: dict[Any, float] = {}
    for key, value in rows.items():
        values = key if isinstance(key, tuple) else (key,)
        if values[index] in top:
            out[key] = value
        elif counter:
            folded = (*values[:index], OTHER_AGENTS, *values[index + 1 :])
            other = folded if isinstance(key, tuple) else folded[0]
            out[other] = out.get(other, 0.0) + value
    return out


class HTTPMetricsMiddleware:
    """Counts every HTTP request by route template, method and response status."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def counting_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            route = scope.get("route")
            template = getattr(route, "path", None) or "unmatched"
            self.metrics.observe_http(template, scope.get("method", ""), status)
