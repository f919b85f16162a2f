"""`python -m benchmarks.serve [--quick]`: in-process engine benchmarks, as ratios.

`clora bench serve` measures the serving figures a user sees, through HTTP,
optionally side by side with another OpenAI server (`--against URL`): see
`clora_feedback.bench.serve_gateway`. Here, in process, four measurements, each
a ratio taken within one run on one machine (so the machine's speed cancels
out), printed as a Markdown table:

1. mixed adapters: 8 concurrent requests on 8 different random rank-16
   adapters (all 7 target projections) vs the same 8 requests on one adapter,
   tokens/s (goal >= 0.9x);
2. multiplexing: 8 agents' multi-turn episodes served together by one engine
   vs one agent after another, wall time (goal >= 4x);
3. engine efficiency: single-stream and batch-8 decode tokens/s (and tokens/s
   with prefill) vs Hugging Face `generate()` on the same model, dtype,
   prompt, new tokens and threads (goal >= 1.5x),
   plus the weight + KV bytes a decode step reads per second against the
   machine's ~27 GB/s memory bandwidth;
4. gateway overhead: median latency the HTTP layer adds to a one-token
   completion (see `benchmarks.gateway`).

Each engine measurement is repeated and its median kept; every request is
greedy with EOS ignored, so all runs do identical work. Not a test: nothing
here asserts, and pytest never collects it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.workload import concurrent, episodes
from clora_feedback.bench import OMP_WAIT_POLICIES
from clora_feedback.bench.report import machine_facts
from clora_feedback.config import DEFAULT_MODEL, EngineConfig
from clora_feedback.engine.embedded import EmbeddedEngine
from clora_feedback.lora.weights import random_lora_weights

PROMPT = (
    "You are a support agent for a bicycle shop. A customer writes: my rear derailleur "
    "skips gears when I pedal hard uphill. What should I check first, and how?"
)
AGENTS = tuple(f"agent{i}" for i in range(8))
MEMORY_BANDWIDTH_GBPS = (
    27.0  # measured copy bandwidth of the reference machine (docs/benchmarks.md)
)


@dataclass(frozen=True)
class Options:
    """What to run and how long.

    Attributes:
        model: model spec (the default name or a HF directory).
        cache_dir: model cache (where the default model is converted once).
        dtype: engine (and baseline) dtype.
        threads: torch threads (None: torch's default, all cores).
        new_tokens: tokens generated per request (benchmarks 1 and 3).
        agent_tokens: tokens generated per agent turn (multiplexing).
        turns: requests per agent episode (multiplexing).
        reps: repetitions of each engine measurement (median kept).
        gateway_reps: measured request pairs for the gateway overhead.
        skip_hf: skip the transformers baseline.
        skip_gateway: skip the gateway overhead.
        json_path: also write the results here.
        decode_profile: only the decode-step profile (`decode_profile`), `reps` x 3 times.
    """

    model: str
    cache_dir: Path
    dtype: str
    threads: int | None
    new_tokens: int
    agent_tokens: int
    turns: int
    reps: int
    gateway_reps: int
    skip_hf: bool
    skip_gateway: bool
    json_path: Path | None
    decode_profile: bool = False


def parse_options(argv: list[str]) -> Options:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.serve", description=__doc__.split("\n")[0])  # fmt: skip
    parser.add_argument(
        "--quick", action="store_true", help="Fewer tokens and repetitions (~1.5 min)."
    )
    parser.add_argument("--model", default=DEFAULT_MODEL, help="Model spec (default: %(default)s).")
    parser.add_argument("--cache-dir", type=Path, default=Path("var/models"), help="Model cache.")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all).")
    parser.add_argument("--new-tokens", type=int, default=None, help="Tokens per request.")
    parser.add_argument("--agent-tokens", type=int, default=None, help="Tokens per agent turn.")
    parser.add_argument("--gateway-reps", type=int, default=None, help="HTTP/in-process pairs.")
    parser.add_argument("--skip-hf", action="store_true", help="Skip the transformers baseline.")
    parser.add_argument("--skip-gateway", action="store_true", help="Skip the HTTP overhead.")
    parser.add_argument("--json", type=Path, default=None, help="Also write results as JSON.")
    parser.add_argument(
        "--omp-wait-policy",
        default="product",
        choices=OMP_WAIT_POLICIES,
        help="OpenMP idle threads: a brief spin, then sleep (product, default), sleep "
        "(passive), spin (active) or as the environment says (inherit). Applied before "
        "torch loads (`python -m`).",
    )
    parser.add_argument("--reps", type=int, default=None, help="Repetitions (default 1, 3).")
    parser.add_argument(
        "--decode-profile",
        action="store_true",
        help="Only the in-process decode-step profile of mixed adapters "
        "(`benchmarks.decode_profile`).",
    )
    args = parser.parse_args(argv)
    quick = bool(args.quick)
    return Options(
        model=args.model,
        cache_dir=args.cache_dir,
        dtype=args.dtype,
        threads=args.threads,
        new_tokens=args.new_tokens or (32 if quick else 64),
        agent_tokens=args.agent_tokens or (32 if quick else 96),
        turns=1 if quick else 2,
        reps=args.reps or (1 if quick else 3),
        gateway_reps=args.gateway_reps or (20 if quick else 100),
        skip_hf=args.skip_hf,
        skip_gateway=args.skip_gateway,
        json_path=args.json,
        decode_profile=bool(args.decode_profile),
    )


@dataclass
class Results:
    """Figures gathered by `run`, keyed by name (see `table`)."""

    values: dict[str, float]
    notes: list[str]


async def bench_adapters(engine: EmbeddedEngine, prompt: list[int], o: Options, r: Results) -> None:
    """1. mixed adapters vs one adapter; 2. multiplexing; both on the same 8 agents."""
    for i, agent in enumerate(AGENTS):
        engine.set_adapter(agent, 1, random_lora_weights(engine.lora_limits, rank=16, seed=i))
    one = [AGENTS[0]] * len(AGENTS)
    await concurrent(engine, AGENTS, prompt, 4)  # warm-up: load every slot
    pairs = []
    for _ in range(o.reps):  # back to back, so drifting machine load hits both alike
        single = await concurrent(engine, one, prompt, o.new_tokens)
        pairs.append((await concurrent(engine, AGENTS, prompt, o.new_tokens), single))
    mixed, single = sorted(pairs, key=lambda p: p[0].tokens_per_s)[len(pairs) // 2]
    r.values |= {
        "mixed_tok_s": mixed.tokens_per_s,
        "one_adapter_tok_s": single.tokens_per_s,
        "mixed_ratio": statistics.median(m.tokens_per_s / s.tokens_per_s for m, s in pairs),
        "mixed_decode_tok_s": mixed.decode_tokens_per_s,
        "one_adapter_decode_tok_s": single.decode_tokens_per_s,
        "mixed_decode_ratio": statistics.median(
            m.decode_tokens_per_s / s.decode_tokens_per_s for m, s in pairs
        ),
    }
    distinct = {tuple(t.token_ids) for t in mixed.requests}
    if len(distinct) < 2:
        r.notes.append("WARNING: all 8 adapters generated the same text; adapters not applied?")
    serial_s, serial_tokens = await episodes(
        engine, AGENTS, prompt, o.agent_tokens, o.turns, together=False
    )
    together_s, together_tokens = await episodes(
        engine, AGENTS, prompt, o.agent_tokens, o.turns, together=True
    )
    r.values |= {
        "serial_s": serial_s,
        "together_s": together_s,
        "multiplex_ratio": serial_s / together_s,
        "multiplex_tokens": float(together_tokens),
    }
    if serial_tokens != together_tokens:
        r.notes.append("WARNING: serial and concurrent episodes generated different token counts")


def decode_bytes_per_step(engine: EmbeddedEngine, batch: int, span: int) -> int:
    """Bytes a base-model decode step must read: every weight once, each row's KV cache."""
    model = engine.model.base
    tensors = [
        model.lm_head,
        model.final_norm,
        *(t for layer in model.layers for t in layer.values()),
    ]
    weights = sum(t.numel() * t.element_size() for t in tensors)
    c = model.config
    kv = 2 * c.num_layers * c.num_kv_heads * c.head_dim * span * model.dtype.itemsize
    return weights + batch * kv


async def bench_efficiency(
    engine: EmbeddedEngine, model_dir: Path | None, prompt: list[int], o: Options, r: Results
) -> None:
    """3. the engine (base model) vs transformers `generate()`, single stream and batch 8.

    Engine and baseline runs alternate, and each ratio is the median of the
    per-repetition ratios, so load that drifts during the run hits both sides.
    `model_dir=None` skips the baseline.
    """
    hf = None
    if model_dir is not None:
        from benchmarks.baseline import HFBaseline

        hf = HFBaseline(model_dir, getattr(torch, o.dtype))
        hf.generate(prompt, 1, 4)  # warm-up
    await concurrent(engine, [None], prompt, 4)
    span = len(prompt) + o.new_tokens // 2  # mean cache length during decoding
    for name, b in (("single", 1), ("batch8", 8)):
        runs, ratios, decode_ratios, baseline = [], [], [], []
        for _ in range(o.reps):
            run = await concurrent(engine, [None] * b, prompt, o.new_tokens)
            runs.append(run)
            if hf is not None:
                wall, decode = hf.rates(prompt, b, o.new_tokens)
                baseline.append((wall, decode))
                ratios.append(run.tokens_per_s / wall)
                decode_ratios.append(run.decode_tokens_per_s / decode)
        run = sorted(runs, key=lambda x: x.decode_tokens_per_s)[len(runs) // 2]
        step_bytes = decode_bytes_per_step(engine, b, span)
        steps_per_s = run.decode_tokens_per_s / b
        r.values |= {
            f"engine_{name}_tok_s": run.tokens_per_s,
            f"engine_{name}_decode_tok_s": run.decode_tokens_per_s,
            f"engine_{name}_step_ms": 1e3 / steps_per_s,
            f"engine_{name}_gbps": step_bytes * steps_per_s / 1e9,
            f"engine_{name}_step_mb": step_bytes / 1e6,
        }
        if baseline:
            r.values |= {
                f"hf_{name}_tok_s": statistics.median(w for w, _ in baseline),
                f"hf_{name}_decode_tok_s": statistics.median(d for _, d in baseline),
                f"speedup_{name}": statistics.median(ratios),
                f"decode_speedup_{name}": statistics.median(decode_ratios),
            }


async def measure(o: Options) -> Results:
    """Load the model once and take every measurement."""
    from clora_feedback.model.resolve import resolve_model_dir

    r = Results({}, [])
    model_dir = resolve_model_dir(o.model, o.cache_dir)
    config = EngineConfig(
        model=str(model_dir), dtype=o.dtype, num_threads=o.threads, max_loras=8, max_lora_rank=16
    )
    t0 = time.perf_counter()
    engine = EmbeddedEngine(model_dir, config)
    r.values["engine_load_s"] = time.perf_counter() - t0
    chat = [{"role": "user", "content": PROMPT}]
    tok = engine.tokenizer
    text = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    prompt = list(tok.encode(str(text), add_special_tokens=False))
    r.values["prompt_tokens"] = float(len(prompt))
    await engine.start()
    try:
        await bench_efficiency(engine, None if o.skip_hf else model_dir, prompt, o, r)
        await bench_adapters(engine, prompt, o, r)
        if not o.skip_gateway:
            from benchmarks.gateway import gateway_overhead

            with tempfile.TemporaryDirectory(prefix="clora-bench-") as scratch:
                g = await gateway_overhead(engine, Path(scratch), PROMPT, o.gateway_reps)
            r.values |= {
                "gateway_http_ms": g.http_ms,
                "gateway_engine_ms": g.engine_ms,
                "gateway_overhead_ms": g.overhead_ms,
                "gateway_overhead_p90_ms": g.overhead_p90_ms,
            }
    finally:
        await engine.stop()
    return r


def table(r: Results, o: Options) -> str:
    """The results as a Markdown table (rows only for what was measured)."""
    v = r.values
    rows = [
        (
            "1. mixed adapters: 8 requests on 8 adapters vs 8 on one (tokens/s)",
            f"**{v['mixed_ratio']:.2f}x** ({v['mixed_tok_s']:.0f} vs {v['one_adapter_tok_s']:.0f}; "
            f"decode only {v['mixed_decode_ratio']:.2f}x)",
            ">= 0.9x",
        ),
        (
            f"2. multiplexing: 8 agents x {o.turns} turns x {o.agent_tokens} tokens, together "
            "vs one after another (wall time)",
            f"**{v['multiplex_ratio']:.2f}x** ({v['together_s']:.1f} s vs {v['serial_s']:.1f} s)",
            ">= 4x",
        ),
    ]
    for name, label in (("single", "single stream"), ("batch8", "batch 8")):
        decode = f"{v[f'engine_{name}_decode_tok_s']:.1f} tok/s"
        wall = f"{v[f'engine_{name}_tok_s']:.1f}"
        if f"speedup_{name}" in v:
            result = (
                f"**{v[f'decode_speedup_{name}']:.2f}x** ({decode} vs HF "
                f"{v[f'hf_{name}_decode_tok_s']:.1f}); with prefill {v[f'speedup_{name}']:.2f}x "
                f"({wall} vs {v[f'hf_{name}_tok_s']:.1f})"
            )
        else:
            result = f"{decode}; with prefill {wall} tok/s"
        rows.append((f"3. decode tokens/s vs transformers generate(), {label}", result, ">= 1.5x"))
        rows.append(
            (
                f"3. decode bandwidth, {label} ({v[f'engine_{name}_step_mb']:.0f} MB/step)",
                f"{v[f'engine_{name}_gbps']:.1f} GB/s = "
                f"{v[f'engine_{name}_gbps'] / MEMORY_BANDWIDTH_GBPS:.0%} of {MEMORY_BANDWIDTH_GBPS:.0f} GB/s "
                f"({v[f'engine_{name}_step_ms']:.1f} ms/step)",
                "",
            )
        )
    if "gateway_overhead_ms" in v:
        rows.append(
            (
                "4. gateway overhead, one-token completion (median of HTTP - in process)",
                f"**{v['gateway_overhead_ms']:.1f} ms** (p90 {v['gateway_overhead_p90_ms']:.1f}; "
                f"HTTP {v['gateway_http_ms']:.1f} vs engine {v['gateway_engine_ms']:.1f} ms)",
                "",
            )
        )
    lines = ["| benchmark | result | goal |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    return "\n".join([*lines, "", *r.notes])


def run(argv: list[str]) -> int:
    """`python -m benchmarks.serve ARGV`: run everything, print the table and machine facts."""
    o = parse_options(argv)
    if o.threads:
        torch.set_num_threads(o.threads)
    facts = machine_facts()
    if o.decode_profile:
        from benchmarks.decode_profile import profile
        from benchmarks.decode_profile import table as profile_table
        from clora_feedback.model.resolve import resolve_model_dir

        values = profile(resolve_model_dir(o.model, o.cache_dir), o.dtype, o.reps * 3)
        print(profile_table(values, o.dtype))
        facts["load average at end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
        for key, value in facts.items():
            print(f"- {key}: {value}")
        return 0
    start = time.perf_counter()
    r = asyncio.run(measure(o))
    facts["load average at end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    facts["benchmark wall time"] = f"{time.perf_counter() - start:.0f} s"
    facts["settings"] = (
        f"{o.model}, {o.dtype}, {o.new_tokens} new tokens/request "
        f"({o.agent_tokens}/turn in 2.), "
        f"{int(r.values['prompt_tokens'])} prompt tokens, {o.reps} rep(s)"
    )
    print(table(r, o))
    print()
    for key, value in facts.items():
        print(f"- {key}: {value}")
    if o.json_path is not None:
        o.json_path.write_text(json.dumps({"facts": facts, "results": r.values}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(run(sys.argv[1:]))
