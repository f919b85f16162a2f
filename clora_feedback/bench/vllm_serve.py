"""`clora bench serve --engine vllm`: the gateway on vLLM, as ratios taken within one run.

Three measurements against one vLLM OpenAI server (`--vllm-url`, else a local
one started by `VLLMSupervisor` on `--model`):

1. gateway vs vLLM's own server, same requests: `--streams` concurrent chat
   completions through the gateway (HTTP, on the vLLM engine) vs the same
   prompts sent straight to vLLM's `/v1/completions`: the token ids the
   gateway sent, read back from the trajectories it recorded, in the very body
   the engine sends (`VLLMEngine.completion_body`: streamed, `logprobs: 0`,
   `return_token_ids`), checked against vLLM's own prompt count; tokens/s
   ratio (goal >= 0.95x), and the p50 latency the gateway adds to a one-token
   completion (median over pairs, run in alternating order; goal < 2 ms),
   beside vLLM's own latency for the same request with a one-token prompt
   (how much of it is prefill), and the gateway process's CPU time per
   one-token request over the same pairs (`/proc/<pid>/stat`, less its CPU
   rate over `IDLE_WINDOW_S` with no request: what it adds on a core of its
   own, without the noise of vLLM's time per request);
2. 8 rows on 8 adapters vs 8 rows on one adapter through the gateway, as
   decode steps per second: steps are the longest row's completion tokens
   (random adapters can stop rows early, so tokens would flatter one side);
   prompt and prefill identical on both sides (goal >= 0.9x);
3. publish latency: the new version's weights in hand (the end of the
   optimizer step) -> the registry's directory written (`registry.publish`,
   what the trainer does) -> loaded by the deployer into vLLM under a fresh
   name (`Deployer.sync`) -> the first token of a request served by it
   (goal < 500 ms). Beside it, the floor of its last part: the time to first
   token of a new prompt of the same length on the version already loaded
   (what any request costs on vLLM, published or not). The trainer itself
   relies on the deployer's hand-off, or the watcher, which adds up to
   `engine.adapter_poll_interval_s` between the write and the load; that wait
   is reported apart. `--publish-only` runs this one alone (no gateway process).

The gateway runs as its own `clora serve` process on the same settings (trainer
and Kafka off), as a user runs it; one aiohttp client drives both sides, so the
client's own cost is the same on both and small. All requests are greedy with
EOS ignored, so both sides of a ratio do the same work. Not a test: nothing here asserts, and pytest never collects it.

Not here: the embedded engine's serving benchmarks (see `serve`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from clora_feedback.bench.roles import RoleProcess, free_port, wait_healthy, write_settings
from clora_feedback.config import DEFAULT_MODEL, AgentConfig, EngineConfig, Settings
from clora_feedback.engine.types import GenerationRequest, SamplingParams
from clora_feedback.engine.vllm import VLLMEngine
from clora_feedback.engine.vllm.supervisor import VLLMSupervisor
from clora_feedback.errors import EngineError
from clora_feedback.lora.peft_io import save_peft_adapter
from clora_feedback.lora.weights import random_lora_weights
from clora_feedback.store.trajectories import TrajectoryStore

PROMPTS = tuple(
    f"Customer {i}: my order #{1000 + i} arrived with a {part} missing. What should I do?"
    for i, part in enumerate(("pedal", "chain", "saddle", "bell", "light", "lock", "pump", "tube"))
)
AGENTS = tuple(f"agent{i}" for i in range(8))
IDLE_WINDOW_S = 10.0  # how long 1. watches the gateway with no request (its background CPU)


@dataclass(frozen=True)
class Options:
    """What to run.

    Attributes:
        model: model spec (the default name or a HF directory).
        cache_dir: model cache.
        url: an existing vLLM server (None: start one locally).
        dtype: the local server's dtype.
        new_tokens: tokens per request (1. throughput, 2.).
        streams: concurrent requests in 1.
        latency_reps: measured one-token pairs in 1.
        throughput_reps: alternated repetitions of each batch in 1. and 2. (median kept).
        publishes: publishes measured in 3. (median kept).
        json_path: also write the results here.
        publish_only: run 3. only (no gateway process; rows 1. and 2. left out).
    """

    model: str
    cache_dir: Path
    url: str | None
    dtype: str
    new_tokens: int
    streams: int
    latency_reps: int
    throughput_reps: int
    publishes: int
    json_path: Path | None
    publish_only: bool = False


def parse_options(argv: Sequence[str]) -> Options:
    p = argparse.ArgumentParser(prog="clora bench serve --engine vllm", description=__doc__.split("\n")[0])  # fmt: skip
    p.add_argument("--engine", choices=["vllm"], default="vllm", help="This benchmark's engine.")
    p.add_argument("--quick", action="store_true", help="Fewer tokens and repetitions.")
    p.add_argument("--model", default=DEFAULT_MODEL, help="Model spec (default: %(default)s).")
    p.add_argument("--cache-dir", type=Path, default=Path("var/models"), help="Model cache.")
    p.add_argument("--vllm-url", default=None, help="A running vLLM server (default: start one).")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--new-tokens", type=int, default=None, help="Tokens per request.")
    p.add_argument("--streams", type=int, default=8, help="Concurrent requests in 1.")
    p.add_argument("--latency-reps", type=int, default=None, help="One-token pairs in 1.")
    p.add_argument("--throughput-reps", type=int, default=None, help="Batch pairs in 1. and 2.")
    p.add_argument("--publishes", type=int, default=None, help="Publishes timed in 3.")
    p.add_argument("--json", type=Path, default=None, help="Also write results as JSON.")
    p.add_argument("--publish-only", action="store_true", help="Run 3. only (no gateway).")
    p.add_argument("--omp-wait-policy", default="product", help=argparse.SUPPRESS)
    a = p.parse_args(list(argv))
    return Options(
        model=a.model,
        cache_dir=a.cache_dir,
        url=a.vllm_url,
        dtype=a.dtype,
        new_tokens=a.new_tokens or (16 if a.quick else 64),
        streams=a.streams,
        latency_reps=a.latency_reps or (10 if a.quick else 200),
        throughput_reps=a.throughput_reps or (1 if a.quick else 4),
        publishes=a.publishes or (2 if a.quick else 5),
        json_path=a.json,
        publish_only=a.publish_only,
    )


def engine_config(o: Options, model_dir: Path, url: str) -> EngineConfig:
    return EngineConfig(
        kind="vllm",
        model=str(model_dir),
        vllm={"urls": [url], "startup_timeout_s": 900},
        max_loras=8,
        max_lora_rank=16,
        max_num_seqs=16,
        max_model_len=1024,
        adapter_poll_interval_s=1.0,
    )


async def _direct(http: aiohttp.ClientSession, body: dict[str, Any]) -> int:
    """One streamed completion straight to vLLM; the tokens it generated.

    Raises:
        EngineError: vLLM answered with more than one choice (the prompt was not one
            token-id list: the baseline would not be the gateway's request).
    """
    tokens = 0
    async with http.post("/v1/completions", json=body) as response:
        response.raise_for_status()
        async for raw in response.content:
            line = raw.decode().strip()
            if line.startswith("data:") and line != "data: [DONE]":
                chunk = json.loads(line[5:])
                for choice in chunk.get("choices") or []:
                    if choice.get("index", 0) != 0:
                        raise EngineError("the direct request made several completions")
                    tokens += len(choice.get("token_ids") or [])
    return tokens


async def _chat(http: aiohttp.ClientSession, agent: str, prompt: str, new_tokens: int) -> Any:
    """One chat completion through the gateway; the response JSON."""
    body = {"model": agent, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True}  # fmt: skip
    async with http.post("/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        return await response.json()


async def _gateway(http: aiohttp.ClientSession, agent: str, prompt: str, new_tokens: int) -> int:
    """One chat completion through the gateway; its completion tokens."""
    return int((await _chat(http, agent, prompt, new_tokens))["usage"]["completion_tokens"])


async def gateway_prompt_ids(
    gw: aiohttp.ClientSession,
    direct: aiohttp.ClientSession,
    trajectories: TrajectoryStore,
    engine: VLLMEngine,
) -> list[list[int]]:
    """Each of `PROMPTS` as the token ids the gateway sent to vLLM, read back from the
    trajectory it recorded (not rendered again here, so the baseline cannot drift from the
    gateway's template and tokenisation); checked against vLLM's own count of one prompt.

    Raises:
        EngineError: vLLM does not read the ids as one prompt of that length.
    """
    ids = []
    for prompt in PROMPTS:
        reply = await _chat(gw, "bench", prompt, 1)
        record = await asyncio.to_thread(trajectories.get, str(reply["id"]))
        ids.append(list(record.prompt_token_ids))
    check = _direct_body(engine, ids[0], 1) | {"stream": False}
    async with direct.post("/v1/completions", json=check) as response:
        response.raise_for_status()
        answer = await response.json()
    if len(answer["choices"]) != 1 or answer["usage"]["prompt_tokens"] != len(ids[0]):
        raise EngineError(
            f"vLLM read the gateway's {len(ids[0])}-token prompt as "
            f"{len(answer['choices'])} prompts of {answer['usage']['prompt_tokens']} tokens"
        )
    return ids


def _direct_body(engine: VLLMEngine, prompt_ids: list[int], new_tokens: int) -> dict[str, Any]:
    """The body `engine` itself sends for a greedy, EOS-ignoring base-model request."""
    sampling = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    request = GenerationRequest("direct", None, list(prompt_ids), sampling)
    return {"model": engine.served_model, **engine.completion_body(request)}


def process_cpu_s(pid: int | None) -> float | None:
    """CPU seconds (user + system, all threads) process `pid` has used so far, from
    `/proc/<pid>/stat` (clock-tick resolution); None where there is no such file."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, TypeError):
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def median_interval(values: Sequence[float]) -> tuple[float, float]:
    """A distribution-free ~95% confidence interval for the median of `values`: the order
    statistics at n/2 -+ 0.98 sqrt(n) (the binomial's normal approximation)."""
    ordered = sorted(values)
    n = len(ordered)
    half = 0.98 * n**0.5
    return ordered[max(0, int(n / 2 - half))], ordered[min(n - 1, int(n / 2 + half))]


async def bench_gateway_vs_direct(
    gw: aiohttp.ClientSession,
    direct: aiohttp.ClientSession,
    engine: VLLMEngine,
    trajectories: TrajectoryStore,
    o: Options,
    gateway_pid: int | None = None,
) -> dict[str, float]:
    """1. throughput ratio and added latency, gateway vs vLLM's own server; with
    `gateway_pid`, also the gateway process's own CPU time per one-token request (what it
    adds on an idle core, free of the noise in vLLM's own time)."""
    ids = await gateway_prompt_ids(gw, direct, trajectories, engine)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(o.streams)]
    bodies = [_direct_body(engine, ids[i % len(ids)], o.new_tokens) for i in range(o.streams)]
    await asyncio.gather(*(_gateway(gw, "bench", p, 4) for p in prompts))  # warm-up
    rates: dict[str, list[float]] = {"gateway": [], "direct": []}
    for _ in range(o.throughput_reps):  # alternate, so drifting load hits both sides alike
        t0 = time.perf_counter()
        n = sum(await asyncio.gather(*(_gateway(gw, "bench", p, o.new_tokens) for p in prompts)))
        rates["gateway"].append(n / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        n = sum(await asyncio.gather(*(_direct(direct, b) for b in bodies)))
        rates["direct"].append(n / (time.perf_counter() - t0))
    diffs, gw_ms, direct_ms = [], [], []
    one = _direct_body(engine, ids[0], 1)
    # The gateway's CPU with no request (its watcher, health checks), to take out below.
    idle_start, t_idle = process_cpu_s(gateway_pid), time.perf_counter()
    await asyncio.sleep(IDLE_WINDOW_S)
    idle_end, t_idle = process_cpu_s(gateway_pid), time.perf_counter() - t_idle
    cpu_start = t_pairs = None
    for i in range(o.latency_reps + 3):
        if i == 3:
            cpu_start, t_pairs = process_cpu_s(gateway_pid), time.perf_counter()
        times = {}
        for side in ("gateway", "direct") if i % 2 else ("direct", "gateway"):  # both orders
            t0 = time.perf_counter()
            if side == "gateway":
                await _gateway(gw, "bench", PROMPTS[0], 1)
            else:
                await _direct(direct, one)
            times[side] = (time.perf_counter() - t0) * 1e3
        if i >= 3:
            gw_ms.append(times["gateway"])
            direct_ms.append(times["direct"])
            diffs.append(gw_ms[-1] - direct_ms[-1])
    cpu_end, t_pairs = process_cpu_s(gateway_pid), time.perf_counter() - (t_pairs or 0.0)
    cpu_ms = idle_rate = math.nan
    if (cpu_start is not None and cpu_end is not None
            and idle_start is not None and idle_end is not None):  # fmt: skip
        idle_rate = (idle_end - idle_start) / t_idle  # CPU s per s with no request
        cpu_ms = (cpu_end - cpu_start - idle_rate * t_pairs) * 1e3 / len(diffs)
    short = _direct_body(engine, ids[0][-1:], 1)  # the same request with a one-token prompt
    short_ms = []
    for _ in range(5):
        t0 = time.perf_counter()
        await _direct(direct, short)
        short_ms.append((time.perf_counter() - t0) * 1e3)
    low, high = median_interval(diffs)
    g, d = statistics.median(rates["gateway"]), statistics.median(rates["direct"])
    return {"gateway_tok_s": g, "direct_tok_s": d, "throughput_ratio": g / d,
            "gateway_ms": statistics.median(gw_ms), "direct_ms": statistics.median(direct_ms),
            "added_p50_ms": statistics.median(diffs), "added_p50_low_ms": low,
            "added_p50_high_ms": high, "prompt_tokens": float(len(ids[0])),
            "direct_one_token_prompt_ms": statistics.median(short_ms),
            "gateway_cpu_ms": cpu_ms, "gateway_idle_cpu_percent": idle_rate * 100}  # fmt: skip


async def bench_adapters(gw: aiohttp.ClientSession, o: Options) -> dict[str, float]:
    """2. decode steps/s, 8 rows on 8 adapters vs 8 rows on one (same prompt)."""

    async def batch(agents: Sequence[str]) -> float:
        t0 = time.perf_counter()
        counts = await asyncio.gather(*(_gateway(gw, a, PROMPTS[0], o.new_tokens) for a in agents))
        return max(counts) / (time.perf_counter() - t0)

    await batch(AGENTS)  # warm-up: every adapter loaded and used once
    mixed, single = [], []
    for _ in range(o.throughput_reps):
        mixed.append(await batch(AGENTS))
        single.append(await batch([AGENTS[0]] * len(AGENTS)))
    m, s = statistics.median(mixed), statistics.median(single)
    return {"mixed_steps_s": m, "one_adapter_steps_s": s, "adapters_ratio": m / s}


async def _first_token(engine: VLLMEngine, rid: str, agent: str, prompt: list[int]) -> int:
    """Send a one-token request; the adapter version of its first token, once it arrived."""
    request = GenerationRequest(rid, agent, prompt, SamplingParams(max_tokens=1, temperature=0.0))
    async for chunk in engine.add_request(request):
        if chunk.tokens:
            return chunk.tokens[0].adapter_version
    raise EngineError(f"request {rid} produced no token")


async def bench_publish(engine: VLLMEngine, work: Path, o: Options) -> dict[str, float]:
    """3. weights in hand -> directory written -> loaded in vLLM -> first token of it.

    Also the floor under the last part: the time to first token of the same-length
    prompt (rotated, so vLLM's prefix cache cannot serve it) on the version just
    published, i.e. what any request on any version costs (prefill, one decode step).
    """
    from clora_feedback.engine.deployer import Deployer
    from clora_feedback.store.registry import AdapterRegistry

    registry = AdapterRegistry(work / "adapters", work / "registry.db")
    deployer = Deployer(engine, registry, base_model=engine.model_name)
    agent, prompt = "publisher", list(engine.tokenizer.encode(PROMPTS[1]))
    parts: dict[str, list[float]] = {
        "write_ms": [], "load_ms": [], "first_token_ms": [], "ttft_floor_ms": [],
    }  # fmt: skip
    parent = None
    for i in range(o.publishes + 1):
        weights = random_lora_weights(engine.lora_limits, rank=8, seed=100 + i)
        t0 = time.perf_counter()  # the optimizer step's output is in hand
        info = await asyncio.to_thread(
            registry.publish, agent, weights, optimizer_state=None,
            base_model=engine.model_name, parent=parent, step=i, metrics={}, feedback_window={},
        )  # fmt: skip
        parent = info.version
        t1 = time.perf_counter()
        await deployer.sync(agent)
        t2 = time.perf_counter()
        if await _first_token(engine, f"publish-{i}", agent, prompt) != info.version:
            raise EngineError("the first token after a publish came from another version")
        t3 = time.perf_counter()
        k = 1 + i % (len(prompt) - 1)
        await _first_token(engine, f"floor-{i}", agent, prompt[k:] + prompt[:k])
        t4 = time.perf_counter()
        if i > 0:  # the first one warms the path
            parts["write_ms"].append((t1 - t0) * 1e3)
            parts["load_ms"].append((t2 - t1) * 1e3)
            parts["first_token_ms"].append((t3 - t2) * 1e3)
            parts["ttft_floor_ms"].append((t4 - t3) * 1e3)
    out = {k: statistics.median(v) for k, v in parts.items()}
    out["publish_total_ms"] = out["write_ms"] + out["load_ms"] + out["first_token_ms"]
    out["watcher_wait_mean_ms"] = engine.config.adapter_poll_interval_s * 1e3 / 2
    out["publish_prompt_tokens"] = float(len(prompt))
    return out


async def measure(o: Options, url: str, model_dir: Path, work: Path) -> dict[str, float]:
    config = engine_config(o, model_dir, url)
    results: dict[str, float] = {}
    if not o.publish_only:
        results |= await measure_gateway(o, config, url, model_dir, work)
    publisher = VLLMEngine(model_dir, config)
    await publisher.start()
    try:
        results |= await bench_publish(publisher, work / "publish", o)
    finally:
        await publisher.stop()
    return results


async def measure_gateway(
    o: Options, config: EngineConfig, url: str, model_dir: Path, work: Path
) -> dict[str, float]:
    """1. and 2.: through a `clora serve` process on the same server."""
    adapters = []
    probe = VLLMEngine(model_dir, config)
    for i, agent in enumerate(AGENTS):
        path = work / "peft" / agent
        weights = random_lora_weights(probe.lora_limits, rank=8, seed=i, std=0.05)
        save_peft_adapter(weights, path, base_model=probe.model_name)
        adapters.append(AgentConfig(name=agent, adapter_path=path))
    gw_dir = work / "gw"
    settings = Settings(data_dir=gw_dir, adapters_dir=gw_dir / "adapters", engine=config,
                        agents=[AgentConfig(name="bench"), *adapters])  # fmt: skip
    # The gateway runs as its own `clora serve` process, as a user runs it: in a thread of
    # this process it would share the client's interpreter lock and inflate what it adds.
    cfg = settings.model_dump(mode="json", exclude={"data_dir", "adapters_dir"})
    cfg |= {"data_dir": str(gw_dir), "adapters_dir": str(gw_dir / "adapters"),
            "feedback": {"kafka": {"embedded_broker": False}},
            "trainer": {"enabled": False}, "release": {"enabled": False}}  # fmt: skip
    port = free_port()
    gateway = RoleProcess(
        "gateway", ["serve", "--config", str(write_settings(gw_dir / "settings.json", cfg)),
                    "--port", str(port)], work,
    )  # fmt: skip
    gw_url = f"http://127.0.0.1:{port}"
    results: dict[str, float] = {}
    timeout = aiohttp.ClientTimeout(total=600)
    gateway.start()
    try:
        await asyncio.to_thread(wait_healthy, gw_url, gateway, 900.0)
        async with (
            aiohttp.ClientSession(gw_url, timeout=timeout) as gw,
            aiohttp.ClientSession(url, timeout=timeout) as direct,
        ):
            await probe.start()  # for the served model's name
            trajectories = TrajectoryStore(settings.trajectory_db)  # what the gateway recorded
            try:
                pid = None if gateway.proc is None else gateway.proc.pid
                results |= await bench_gateway_vs_direct(
                    gw, direct, probe, trajectories, o, gateway_pid=pid
                )
                results |= await bench_adapters(gw, o)
            finally:
                trajectories.close()
                await probe.stop()
    finally:
        gateway.stop()
    return results


def table(v: dict[str, float], o: Options) -> str:
    serving = [] if o.publish_only else [
        (f"1. gateway vs vLLM's own server, {o.streams} streams x {o.new_tokens} tokens (tokens/s)",
         f"**{v['throughput_ratio']:.2f}x** ({v['gateway_tok_s']:.0f} vs {v['direct_tok_s']:.0f})",
         ">= 0.95x"),
        ("1. latency the gateway adds, one-token completion (p50 of pair differences)",
         f"**{v['added_p50_ms']:.1f} ms** (95% interval {v['added_p50_low_ms']:.1f} to "
         f"{v['added_p50_high_ms']:.1f}; gateway {v['gateway_ms']:.1f} vs vLLM "
         f"{v['direct_ms']:.1f} ms, {v['prompt_tokens']:.0f}-token prompt; vLLM with a "
         f"1-token prompt: {v['direct_one_token_prompt_ms']:.1f} ms)", "< 2 ms"),
        ("1. the gateway process's own CPU time per one-token request (all its threads, "
         "less its CPU when idle)",
         f"**{v.get('gateway_cpu_ms', math.nan):.2f} ms** (idle: "
         f"{v.get('gateway_idle_cpu_percent', math.nan):.1f}% of a core)", ""),
        ("2. 8 rows on 8 adapters vs 8 rows on one, through the gateway (decode steps/s)",
         f"**{v['adapters_ratio']:.2f}x** ({v['mixed_steps_s']:.1f} vs "
         f"{v['one_adapter_steps_s']:.1f})", ">= 0.9x"),
    ]  # fmt: skip
    rows = [
        *serving,
        ("3. publish: weights in hand -> first token of the new version on vLLM",
         f"**{v['publish_total_ms']:.0f} ms** (write {v['write_ms']:.0f}, load {v['load_ms']:.0f}, "
         f"first token {v['first_token_ms']:.0f}, vs {v['ttft_floor_ms']:.0f} for any new "
         f"{v['publish_prompt_tokens']:.0f}-token prompt on a loaded version; + watcher wait, "
         f"mean {v['watcher_wait_mean_ms']:.0f})", "< 500 ms"),
        ("3. the publish's own part: total minus that floor",
         f"**{v['publish_total_ms'] - v['ttft_floor_ms']:.0f} ms**", ""),
    ]  # fmt: skip
    lines = ["| benchmark | result | goal |", "|---|---|---|"]
    return "\n".join([*lines, *(f"| {a} | {b} | {c} |" for a, b, c in rows)])


async def _main(o: Options) -> dict[str, float]:
    from clora_feedback.model.resolve import resolve_model_dir

    model_dir = resolve_model_dir(o.model, o.cache_dir)
    with tempfile.TemporaryDirectory(prefix="clora-bench-vllm-") as scratch:
        work = Path(scratch)
        supervisor = None
        url = o.url
        if url is None:
            local = EngineConfig(
                kind="vllm", model=str(model_dir), max_loras=8, max_lora_rank=16,
                max_num_seqs=16, max_model_len=1024,
                vllm={"startup_timeout_s": 900, "local": {"dtype": o.dtype, "log_dir": work}},
            )  # fmt: skip
            supervisor = VLLMSupervisor(model_dir, local)
            await supervisor.start()
            url = supervisor.url
        try:
            return await measure(o, url, model_dir, work)
        finally:
            if supervisor is not None:
                await supervisor.stop()


def run(argv: Sequence[str]) -> int:
    """`clora bench serve --engine vllm ARGV`: run everything and print the table."""
    import os

    o = parse_options(argv)
    start = time.perf_counter()
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    results = asyncio.run(_main(o))
    print(table(results, o))
    print()
    print(f"- load average at start: {load}; at end: "
          + " ".join(f"{x:.2f}" for x in os.getloadavg()))  # fmt: skip
    print(f"- settings: {o.model}, {o.dtype} (local server) or {o.url}, {o.new_tokens} new tokens")
    print(f"- benchmark wall time: {time.perf_counter() - start:.0f} s")
    if o.json_path is not None:
        o.json_path.write_text(json.dumps(results, indent=2))
    return 0
