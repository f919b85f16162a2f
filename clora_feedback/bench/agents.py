"""`clora bench agents`: many agents on one gateway, each with its own adapter (issue 27).

    clora bench agents                       # 8, 100 and 1,000 agents (the default)
    clora bench agents --agents 8,100 --requests 120 --out docs/results/agents.json

For each agent count N it writes N rank-8 PEFT adapters (q and v projections
by default, `--targets`), starts `clora serve` on them as configured agents
(the first start imports each as its version 1), stops it, and measures a
second start, the one every restart pays: the time until `/health` answers
and the resident set of the idle server. Then 8 clients (`--clients`) send the
same Zipf(1.1) stream of streamed greedy chat completions over the N agents
(`--requests`, `--max-tokens`), so with 8 agents the working set fits the 8
slots and with 1,000 it does not. A request is cold when its agent had no
request since the start (its adapter is read from disk, then written into a
slot), warm otherwise; the opening burst (each client's first request, all
sent at once) is left out of the latency figures as warm-up. Reported against the issue's goals:

- throughput (completion tokens per second over the stream) with N agents
  against the same stream over 8: >= 0.8x for 1,000;
- cold time to first token against the warm median: <= warm p50 + 50 ms;
  p99 of both;
- resident set per registered idle agent beyond the budgeted cache share
  (nothing is cached before a request): <= 1 MB;
- start-up with 1,000 agents: < 10 s.

The server runs without the trainer, the Kafka side and the no-op probe (a
serving benchmark), with its default host adapter cache and without the
prefix cache (`--prefix-cache-mb`): its hits depend on how often an agent
repeats a prompt, which differs between 8 and 1,000 agents and would hide
what the adapters cost.

`--engine vllm` runs the same stream through the gateway on vLLM (a local
vLLM-CPU server the gateway starts and supervises, `engine.vllm.local`;
`--vllm-dtype`, `--max-cpu-loras`): reported, the embedded engine's goals do
not bind it. Start-up then includes the vLLM server's own, and the resident
set is the gateway's and its vLLM server's together.

Not here: the white-box engine figures (`benchmarks/`), the soak (`python -m benchmarks.soak`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from clora_feedback.bench.http_workload import StreamedRow, streamed_chat
from clora_feedback.bench.report import (
    Row,
    format_facts,
    format_table,
    machine_facts,
    median,
    percentile,
    verdict,
)
from clora_feedback.bench.roles import RoleProcess, free_port, wait_healthy, write_settings
from clora_feedback.lora.peft_io import save_peft_adapter
from clora_feedback.lora.weights import LoRALimits, random_lora_weights

PROMPTS = (
    "Summarise the ticket: my invoice shows two charges for one order.",
    "Which team handles a parcel stuck at the depot for a week?",
    "Write one sentence about resetting a forgotten password.",
    "Classify: the app crashes with error 502 when I upload a photo.",
)


@dataclass
class Run:
    """What one agent count measured."""

    agents: int
    import_s: float
    startup_s: float
    rss_idle_mb: float
    rss_after_mb: float
    tokens_per_s: float
    distinct_agents: int
    cold: int
    ttft_warm_p50_ms: float
    ttft_warm_p99_ms: float
    ttft_cold_p50_ms: float
    ttft_cold_p99_ms: float
    errors: int


def limits_of(model_dir: Path, targets: tuple[str, ...], rank: int) -> LoRALimits:
    """The projections' shapes of a Llama/Qwen2 `config.json` (what the adapters must fit)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    h, inter = int(cfg["hidden_size"]), int(cfg["intermediate_size"])
    heads, kv = int(cfg["num_attention_heads"]), int(cfg.get("num_key_value_heads", 0))
    hd = int(cfg.get("head_dim") or h // heads)
    kv = kv or heads
    shapes = {
        "q_proj": (h, heads * hd), "k_proj": (h, kv * hd), "v_proj": (h, kv * hd),
        "o_proj": (heads * hd, h), "gate_proj": (h, inter), "up_proj": (h, inter),
        "down_proj": (inter, h),
    }  # fmt: skip
    return LoRALimits(rank, targets, int(cfg["num_hidden_layers"]), shapes)


def write_adapters(root: Path, count: int, limits: LoRALimits) -> dict[str, Path]:
    """`count` random rank-8 PEFT adapters under `root` (kept between runs)."""
    out = {}
    for i in range(count):
        path = root / f"agent-{i:04d}"
        if not (path / "adapter_model.safetensors").is_file():
            weights = random_lora_weights(limits, rank=8, seed=i, std=0.02,
                                          target_modules=limits.target_modules)  # fmt: skip
            save_peft_adapter(weights, path, base_model="bench")
        out[path.name] = path
    return out


def rss_mb(pid: int) -> float:
    """Resident set of `pid` and its descendants (a vLLM server the gateway started)."""
    total = 0.0
    for member in [pid, *_descendants(pid)]:
        try:
            for line in Path(f"/proc/{member}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) / 1024
        except OSError:  # a helper that exited meanwhile
            continue
    return total


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (Linux: /proc/PID/task/*/children)."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            found += children
            todo += children
    return found


def zipf_stream(agents: list[str], count: int, seed: int, s: float = 1.1) -> list[str]:
    """`count` agent names drawn Zipf(s) over `agents` (rank order: a fixed shuffle)."""
    rng = random.Random(seed)
    ranked = agents[:]
    rng.shuffle(ranked)
    weights = [1.0 / (k**s) for k in range(1, len(ranked) + 1)]
    return rng.choices(ranked, weights, k=count)


async def drive(
    url: str, stream: list[str], clients: int, max_tokens: int
) -> tuple[list[tuple[str, StreamedRow, bool]], int, float]:
    """Send `stream` from `clients` concurrent clients; (agent, row, cold) per request."""
    queue = list(enumerate(stream))
    seen: set[str] = set()
    rows: list[tuple[str, StreamedRow, bool]] = []
    errors = 0

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal errors
        while queue:
            i, agent = queue.pop(0)
            cold = agent not in seen
            seen.add(agent)
            try:
                row = await streamed_chat(http, agent, PROMPTS[i % len(PROMPTS)], max_tokens)
            except Exception:  # counted: a benchmark reports errors, it does not stop
                errors += 1
                continue
            if i >= clients:  # the opening burst (every client's first request) is warm-up
                rows.append((agent, row, cold))

    start = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, timeout=600.0) as http:
        await asyncio.gather(*(client(http) for _ in range(clients)))
    return rows, errors, time.perf_counter() - start


def measure(
    args: argparse.Namespace, count: int, adapters: dict[str, Path], stream_seed: int
) -> Run:
    """Import, restart, measure the idle server, run the stream."""
    data = args.work_dir / f"data-{count}"
    if data.exists():
        import shutil

        shutil.rmtree(data)
    settings: dict[str, Any] = {
        "data_dir": str(data),
        "adapters_dir": str(data / "adapters"),
        "engine": {"max_loras": args.slots, "lora_target_modules": list(args.targets),
                   "max_num_seqs": 16, "prefix_cache_mb": args.prefix_cache_mb},
        "agents": [{"name": name, "adapter_path": str(path)} for name, path in adapters.items()],
        "trainer": {"enabled": False},
        "feedback": {"kafka": {"embedded_broker": False}},
        "retention": {"probe": False},
        "server": {"access_log": False},
    }  # fmt: skip
    if args.model:
        settings["engine"]["model"] = args.model
    if args.engine == "vllm":
        settings["engine"] |= {"kind": "vllm", "vllm": {
            "startup_timeout_s": 900, "max_cpu_loras": args.max_cpu_loras,
            "local": {"dtype": args.vllm_dtype, "log_dir": str(args.work_dir / "logs")},
        }}  # fmt: skip
    config = write_settings(args.work_dir / f"settings-{count}.json", settings)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = RoleProcess(f"serve-{count}", ["serve", "--config", str(config), "--port", str(port)],
                       args.work_dir / "logs")  # fmt: skip
    t0 = time.perf_counter()
    wait_healthy(url, proc.start(), timeout_s=1800)
    import_s = time.perf_counter() - t0
    proc.stop()
    t0 = time.perf_counter()
    wait_healthy(url, proc.start(), timeout_s=600)
    startup_s = time.perf_counter() - t0
    try:
        assert proc.proc is not None
        time.sleep(2.0)  # let the start settle (background tasks, first poll)
        rss_idle = rss_mb(proc.proc.pid)
        stream = zipf_stream(sorted(adapters), args.requests, stream_seed)
        rows, errors, wall_s = asyncio.run(drive(url, stream, args.clients, args.max_tokens))
        rss_after = rss_mb(proc.proc.pid)
    finally:
        proc.stop()
    warm = [(r.first - r.start) * 1e3 for _, r, cold in rows if not cold]
    cold = [(r.first - r.start) * 1e3 for _, r, c in rows if c]
    return Run(
        agents=count,
        import_s=round(import_s, 2),
        startup_s=round(startup_s, 2),
        rss_idle_mb=round(rss_idle, 1),
        rss_after_mb=round(rss_after, 1),
        tokens_per_s=round(sum(r.tokens for _, r, _ in rows) / wall_s, 2),
        distinct_agents=len({a for a, _, _ in rows}),
        cold=len(cold),
        ttft_warm_p50_ms=round(median(warm), 1),
        ttft_warm_p99_ms=round(percentile(warm, 99), 1),
        ttft_cold_p50_ms=round(median(cold), 1),
        ttft_cold_p99_ms=round(percentile(cold, 99), 1),
        errors=errors,
    )


def table(runs: list[Run], *, binding: bool = True) -> list[Row]:
    """The issue's goals, each against the 8-agent run of the same stream (`binding`
    False, as on vLLM: the figures are reported, every verdict reads `reported`)."""
    base = next(r for r in runs if r.agents == min(x.agents for x in runs))
    rows = _rows(runs, base)
    if not binding:
        rows = [
            Row(r.key, r.measurement, r.result, r.baseline, r.ratio, "-", "reported") for r in rows
        ]
    return rows


def _rows(runs: list[Run], base: Run) -> list[Row]:
    rows = []
    for run in runs:
        if run is base:
            continue
        ratio = run.tokens_per_s / base.tokens_per_s
        rows.append(Row(f"{run.agents}-tput", f"throughput, {run.agents} agents vs {base.agents} "
                        "(tokens/s)", f"{run.tokens_per_s:g}", f"{base.tokens_per_s:g}",
                        f"{ratio:.2f}x", ">= 0.8x", verdict(ratio >= 0.8)))  # fmt: skip
        per_agent = (run.rss_idle_mb - base.rss_idle_mb) / (run.agents - base.agents)
        rows.append(Row(f"{run.agents}-rss", f"RSS per idle agent, {run.agents} vs {base.agents} "
                        "(MB)", f"{per_agent:.3f}", f"{base.rss_idle_mb:g} MB idle", "-",
                        "<= 1 MB", verdict(per_agent <= 1.0)))  # fmt: skip
    for run in runs:
        extra = run.ttft_cold_p50_ms - run.ttft_warm_p50_ms
        rows.append(Row(f"{run.agents}-cold", f"TTFT cold p50 vs warm p50, {run.agents} agents "
                        f"({run.cold} cold; p99 cold {run.ttft_cold_p99_ms:g}, warm "
                        f"{run.ttft_warm_p99_ms:g} ms)", f"{run.ttft_cold_p50_ms:g} ms",
                        f"{run.ttft_warm_p50_ms:g} ms", f"{extra:+.0f} ms", "<= +50 ms",
                        verdict(extra <= 50)))  # fmt: skip
        rows.append(Row(f"{run.agents}-start", f"start-up with {run.agents} agents (s, to /health;"
                        f" first start with imports {run.import_s:g} s)", f"{run.startup_s:g}",
                        "-", "-", "< 10 s" if run.agents >= 1000 else "-",
                        verdict(run.startup_s < 10) if run.agents >= 1000 else "-"))  # fmt: skip
    return rows


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="clora bench agents", description=__doc__.split("\n")[0])
    parser.add_argument("--agents", default="8,100,1000", help="comma-separated agent counts")
    parser.add_argument("--requests", type=int, default=160, help="requests in the stream")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--slots", type=int, default=8, help="engine.max_loras")
    parser.add_argument("--targets", default="q_proj,v_proj", help="adapter projections")
    parser.add_argument(
        "--prefix-cache-mb",
        type=int,
        default=0,
        help="engine.prefix_cache_mb (default 0: off, so 8 agents repeating 4 prompts do not "
        "win by prefix-cache hits that 1,000 agents rarely get)",
    )
    parser.add_argument("--model", default=None, help="default: the embedded default model")
    parser.add_argument("--engine", choices=["embedded", "vllm"], default="embedded",
                        help="vllm: the gateway on a local vLLM-CPU server (reported)")  # fmt: skip
    parser.add_argument("--vllm-dtype", default="bfloat16", help="--engine vllm: its dtype")
    parser.add_argument("--max-cpu-loras", type=int, default=None,
                        help="--engine vllm: engine.vllm.max_cpu_loras")  # fmt: skip
    parser.add_argument("--work-dir", type=Path, default=Path("var/bench-agents"))
    parser.add_argument("--out", type=Path, default=None, help="write the runs as JSON here")
    args = parser.parse_args(argv)
    args.targets = tuple(args.targets.split(","))
    counts = sorted(int(n) for n in args.agents.split(","))
    facts = machine_facts()
    print(format_facts(facts), flush=True)
    model_dir = Path(args.model) if args.model else _default_model_dir()
    args.model = str(model_dir)
    limits = limits_of(model_dir, args.targets, 16)
    every = write_adapters(args.work_dir / "peft", max(counts), limits)
    runs = []
    for count in counts:
        adapters = dict(list(every.items())[:count])
        result = measure(args, count, adapters, stream_seed=0)
        print(json.dumps(asdict(result)), flush=True)
        runs.append(result)
    print(format_table(table(runs, binding=args.engine == "embedded")))
    facts["load average after (1, 5, 15 min)"] = machine_facts()["load average (1, 5, 15 min)"]
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"facts": facts, "runs": [asdict(r) for r in runs]},
                                       indent=1))  # fmt: skip
    return 0


def _default_model_dir() -> Path:
    from clora_feedback.config import DEFAULT_MODEL, Settings
    from clora_feedback.model.resolve import resolve_model_dir

    return resolve_model_dir(DEFAULT_MODEL, Settings().model_cache_dir)
