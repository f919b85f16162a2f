"""What the HTTP gateway adds to a request's latency, measured on a real server.

The gateway (`create_app`) runs under uvicorn on a loopback port in a
background thread of this process, over the same engine the benchmark calls
directly. Each repetition sends one `POST /v1/completions` (max_tokens=1,
through httpx with keep-alive) and then submits the same prompt ids to the
engine in process; the overhead is the per-pair difference, summarised by
its median, so engine noise common to both cancels out.

Not here: the engine benchmarks (see `serve`).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.workload import timed_request
from clora_feedback.config import AgentConfig, Settings
from clora_feedback.engine.embedded import EmbeddedEngine

AGENT = "bench"


@dataclass(frozen=True)
class GatewayOverhead:
    """Latencies of one-token completions, in milliseconds (medians over `reps`).

    Attributes:
        http_ms: through HTTP (request sent -> full JSON response read).
        engine_ms: the same prompt submitted to the engine in process.
        overhead_ms: median of per-pair (http - engine).
        overhead_p90_ms: 90th percentile of the same differences.
        reps: measured pairs (after warm-up).
    """

    http_ms: float
    engine_ms: float
    overhead_ms: float
    overhead_p90_ms: float
    reps: int


@contextmanager
def _uvicorn_thread(app: Any) -> Iterator[str]:
    """Serve `app` on a free loopback port from a daemon thread; yields its base URL."""
    from clora_feedback.gateway.server import ThreadedServer

    with ThreadedServer(app, name="bench-gateway", start_timeout_s=120) as server:
        yield server.url


async def gateway_overhead(
    engine: EmbeddedEngine, data_dir: Path, prompt_text: str, reps: int, warmup: int = 3
) -> GatewayOverhead:
    """Measure HTTP vs in-process latency of one-token completions (stops `engine` at the end).

    Args:
        engine: a started engine; the gateway's shutdown stops it.
        data_dir: scratch directory for the gateway's trajectory store.
        prompt_text: completion prompt (tokenised the way `/v1/completions` does).
        reps: measured pairs.
        warmup: unmeasured pairs first.
    """
    import httpx

    from clora_feedback.gateway.app import create_app
    from clora_feedback.service import gateway_deployer

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise
    from clora_feedback.store.trajectories import AsyncTrajectoryStore

    settings = Settings(
        data_dir=data_dir,
        adapters_dir=data_dir / "adapters",
        engine=engine.config,
        agents=[AgentConfig(name=AGENT)],
    )
    app = create_app(
        settings,
        engine,
        AsyncTrajectoryStore(settings.trajectory_db),
        deployer=gateway_deployer(settings, engine),
    )
    prompt_ids = list(engine.tokenizer.encode(prompt_text))
    body = {"model": AGENT, "prompt": prompt_text, "max_tokens": 1, "temperature": 0}
    http_ms: list[float] = []
    engine_ms: list[float] = []
    with _uvicorn_thread(app) as url:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            for i in range(warmup + reps):
                start = time.perf_counter()
                response = await client.post("/v1/completions", json=body)
                http = time.perf_counter() - start
                response.raise_for_status()
                if response.json()["usage"]["prompt_tokens"] != len(prompt_ids):
                    raise RuntimeError("the gateway tokenised the prompt differently")
                timed = await timed_request(engine, None, prompt_ids, 1)
                if i >= warmup:
                    http_ms.append(http * 1e3)
                    engine_ms.append((timed.end - timed.start) * 1e3)
    diffs = sorted(h - e for h, e in zip(http_ms, engine_ms, strict=True))
    return GatewayOverhead(
        http_ms=statistics.median(http_ms),
        engine_ms=statistics.median(engine_ms),
        overhead_ms=statistics.median(diffs),
        overhead_p90_ms=diffs[min(len(diffs) - 1, int(0.9 * len(diffs)))],
        reps=reps,
    )
