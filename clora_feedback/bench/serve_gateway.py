"""`clora bench serve`: the serving figures a user sees, through HTTP, side by side in one run.

Each target is an OpenAI-compatible server driven by the same client
(`http_workload`): `clora serve` on the embedded engine in a process of its
own, on loopback, once per `--dtypes` entry, and optionally any other
server (`--against URL`, e.g. vLLM-CPU). Each target gets 8 random rank-8
PEFT adapters on all seven projections (`save_peft_adapter`), loaded with
`POST /v1/load_lora_adapter`. Every request is a streamed chat completion,
greedy, EOS ignored, `--new-tokens` tokens:

1. single stream on the base model: completion tokens / wall time;
2. 8 different prompts on the base model at once: tokens / wall time;
3. 8 rows on 8 different adapters (row i: adapter i, prompt i): decode
   steps/s of the batch (its longest row's tokens after the first, over the
   time after its first content chunk; prefill excluded, see `http_workload`);
4. the same 8 rows and prompts on one adapter, the same steps/s; ratio 3 / 4;
6. 8 agents together vs one after another: agent i (adapter i) holds a
   2-turn support chat, `--agent-tokens` tokens per turn (default 32, 16
   with `--quick`: short replies after a long prompt, so prefill is a real
   part of the work, not pure decode). Every agent has the same ~220-token
   support-agent system prompt (`SYSTEM_PROMPT`) and its own question; turn 2
   sends the conversation so far as chat messages (system, user, the
   assistant's turn-1 text as streamed, a follow-up user message), as a chat
   client does. The 8 episodes run all at once, then the same 8 one after
   another (or the other way round, alternating by repetition); the figure
   is serial wall time / together wall time. Each question carries a ticket
   number fresh for every repetition and side, so no run reuses another
   run's conversation, while the system prompt is warm for every adapter
   (served once in the warm-up), as on a server that has answered that
   agent before. Next to it: both wall times and the prefix-cache hit
   fraction of each side, from the server's `/metrics` (the gateway's
   `clora_engine_prefix_cache_{hits,misses}_total`, 16-token blocks;
   vLLM's `vllm:prefix_cache_{hits,queries}_total`, tokens; none if the
   server exposes neither). Both sides must generate the same completion
   tokens (8 x 2 x `--agent-tokens`); a note says so otherwise.

Repetitions go round the targets (every target's figures in turn, then the
next repetition; a line per target and repetition goes to stderr as it ends), the mixed and one-adapter batches and the two sides of 6
swap order every repetition, and each ratio is the median of per-repetition
ratios, so load that drifts during the run hits every side alike.

Next to each figure, the roofline: bytes a decode step must move (every base
weight once in the served dtype, each row's KV cache at its mean length, and
each distinct adapter's A and B at its real rank) times the measured steps/s,
against the machine's ~27 GB/s copy bandwidth.

Not a test: nothing here asserts, and pytest never collects it.
Not here: the in-process engine benchmarks (`python -m benchmarks.serve`, outside the
package); `--engine vllm` runs `vllm_serve`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from clora_feedback.bench import OMP_WAIT_POLICIES
from clora_feedback.bench.http_workload import (
    EpisodeRun,
    StreamedBatch,
    base_model,
    batch,
    episodes,
    load_adapters,
    unload_adapters,
)
from clora_feedback.bench.report import machine_facts
from clora_feedback.config import DEFAULT_MODEL, EngineConfig
from clora_feedback.model.config import ModelConfig

PROMPTS = tuple(
    f"Customer {i}: my order #{1000 + i} arrived with a {part} missing. What should I do?"
    for i, part in enumerate(("pedal", "chain", "saddle", "bell", "light", "lock", "pump", "tube"))
)
ROWS = len(PROMPTS)
SYSTEM_PROMPT = (
    "You are Riley, the customer support agent of Northwind Cycles, an online bicycle shop. "
    "Answer in plain English, in at most five sentences, and be precise and friendly. "
    "Policies: orders ship within two working days; a missing or damaged part is replaced "
    "free of charge if it is reported within 30 days of delivery; returns are accepted within "
    "30 days if the item is unused and in its original packaging; refunds reach the customer "
    "within five working days of the return arriving at the warehouse. "
    "Before promising anything, ask for the order number and, for damage, a photo. "
    "Never promise a delivery date for a replacement part before the warehouse has confirmed "
    "stock. Never share another customer's data. If the customer is upset, acknowledge it in one "
    "sentence first. For safety questions about brakes, steering or the frame, tell the customer "
    "to stop riding the bike until a mechanic has checked it. "
    "When you cannot solve the problem, offer to hand the ticket to a human colleague, who answers "
    "within one working day. Always end with exactly one concrete next step for the customer."
)
"""The system prompt every agent of figure 6 shares (218 tokens on the default model)."""
FOLLOW_UPS = tuple(
    f"The order number is #{1000 + i} and I attached a photo of the open box. When will the "
    f"new {part} arrive, and do I have to send anything back?"
    for i, part in enumerate(("pedal", "chain", "saddle", "bell", "light", "lock", "pump", "tube"))
)
SIDES = {"together": 1, "serial": 2}  # figure 6's two sides, and their digit in ticket numbers
ADAPTER_RANK = 8
GATEWAY_MAX_RANK = 16  # the gateways' engine.max_lora_rank
MEMORY_BANDWIDTH_GBPS = 27.0  # copy bandwidth of the reference machines (docs/benchmarks.md)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
FIGURES = ("single", "prompts8", "mixed", "one")


@dataclass(frozen=True)
class Options:
    """What to run.

    Attributes:
        model: model spec (the default name or a HF directory).
        cache_dir: model cache.
        dtypes: the embedded engine's dtypes, one gateway each.
        against: URL of another OpenAI server to drive with the same workload.
        against_label: its name in the table.
        against_dtype: the dtype it serves (for its roofline bytes).
        new_tokens: tokens per request.
        agent_tokens: tokens per agent turn (figure 6).
        reps: repetitions round the targets (medians kept).
        threads: torch threads of the embedded engines (None: all cores).
        json_path: also write the results here.
    """

    model: str
    cache_dir: Path
    dtypes: tuple[str, ...]
    against: str | None
    against_label: str
    against_dtype: str
    new_tokens: int
    agent_tokens: int
    reps: int
    threads: int | None
    json_path: Path | None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="clora bench serve", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="Fewer tokens and repetitions.")
    p.add_argument("--model", default=DEFAULT_MODEL, help="Model spec (default: %(default)s).")
    p.add_argument("--cache-dir", type=Path, default=Path("var/models"), help="Model cache.")
    p.add_argument("--threads", type=int, default=None, help="Engine threads (default: all).")
    p.add_argument("--new-tokens", type=int, default=None, help="Tokens per request.")
    p.add_argument("--agent-tokens", type=int, default=None, help="Tokens per agent turn (6.).")
    p.add_argument("--json", type=Path, default=None, help="Also write results as JSON.")
    p.add_argument(
        "--engine", default="embedded", choices=["embedded", "vllm"],
        help="`vllm`: the gateway on vLLM instead (`clora_feedback.bench.vllm_serve`).",
    )  # fmt: skip
    p.add_argument(
        "--omp-wait-policy", default="product", choices=OMP_WAIT_POLICIES,
        help="OpenMP idle threads: a brief spin, then sleep (product), sleep (passive), spin "
        "(active) or as the environment says (inherit). Applied by `run_bench` before torch "
        "loads.",
    )  # fmt: skip
    p.add_argument("--dtypes", default="float32,bfloat16", help="Embedded engine dtypes.")
    p.add_argument("--against", default=None, help="Another OpenAI server's base URL.")
    p.add_argument("--against-label", default="vLLM-CPU", help="Its name in the table.")
    p.add_argument(
        "--against-dtype", default="bfloat16", choices=sorted(DTYPE_BYTES), help="Its dtype."
    )
    p.add_argument("--reps", type=int, default=None, help="Repetitions round the targets.")
    return p


def options_from(args: argparse.Namespace, *, quick: bool) -> Options:
    dtypes = tuple(d.strip() for d in str(args.dtypes).split(",") if d.strip())
    for d in dtypes:
        if d not in DTYPE_BYTES:
            raise SystemExit(f"unknown dtype {d!r} in --dtypes")
    return Options(
        model=args.model,
        cache_dir=args.cache_dir,
        dtypes=dtypes,
        against=args.against,
        against_label=args.against_label,
        against_dtype=args.against_dtype,
        new_tokens=args.new_tokens or (32 if quick else 64),
        agent_tokens=args.agent_tokens or (16 if quick else 32),
        reps=args.reps or (2 if quick else 4),
        threads=args.threads,
        json_path=args.json,
    )


@dataclass
class Target:
    """One server under test and what was measured on it."""

    label: str
    url: str
    dtype: str
    adapters: list[str] = field(default_factory=list)
    base: str = ""
    runs: dict[str, list[StreamedBatch]] = field(default_factory=dict)
    episodes: dict[str, list[EpisodeRun]] = field(default_factory=dict)

    def rate(self, figure: str, rep: int) -> float:
        run = self.runs[figure][rep]
        return run.decode_steps_per_s if figure in ("mixed", "one") else run.tokens_per_s

    def median(self, figure: str) -> float:
        return statistics.median(self.rate(figure, i) for i in range(len(self.runs[figure])))

    def episode_ratios(self) -> list[float]:
        """Figure 6 per repetition: serial wall time / together wall time."""
        pairs = zip(self.episodes["serial"], self.episodes["together"], strict=True)
        return [s.wall_s / t.wall_s for s, t in pairs]


def agent_turns(agent: int, ticket: str) -> list[str]:
    """Agent `agent`'s two user turns in figure 6, its question tagged with `ticket`."""
    return [f"Ticket {ticket}. {PROMPTS[agent]}", FOLLOW_UPS[agent]]


def progress(t: Target) -> str:
    """One line of `t`'s latest repetition (stderr), so a run cut short still shows its figures."""
    rep = len(t.runs["single"]) - 1
    figures = ", ".join(f"{f} {t.rate(f, rep):.2f}" for f in FIGURES)
    together, serial = t.episodes["together"][rep], t.episodes["serial"][rep]
    hits = [r.cache_hit_fraction for r in (serial, together)]
    cache = "" if None in hits else f", prefix-cache hits {hits[0]:.0%} / {hits[1]:.0%}"
    return (
        f"[{t.label}, repetition {rep}] {figures}; 6.: {serial.wall_s:.1f} s / "
        f"{together.wall_s:.1f} s = {serial.wall_s / together.wall_s:.2f}x "
        f"({serial.tokens} / {together.tokens} completion tokens{cache}); "
        f"load {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )


def decode_step_bytes(
    config: ModelConfig, dtype: str, rows: int, span: int, adapters: int, rank: int
) -> int:
    """Bytes a decode step must move: base weights once, each row's KV, each adapter at its rank."""
    c, size = config, DTYPE_BYTES[dtype]
    shapes = c.projection_shapes()
    layer = sum(fan_in * fan_out for fan_in, fan_out in shapes.values())
    norms = 2 * c.hidden_size
    weights = c.num_layers * (layer + norms) + c.vocab_size * c.hidden_size + c.hidden_size
    kv = 2 * c.num_layers * c.num_kv_heads * c.head_dim * span
    lora = c.num_layers * sum(rank * (fan_in + fan_out) for fan_in, fan_out in shapes.values())
    return size * (weights + rows * kv + adapters * lora)


async def _measure_target(http: httpx.AsyncClient, t: Target, o: Options) -> None:
    """One repetition of every figure on `t` (mixed and one swap order by repetition)."""
    rep = len(t.runs.get("single", []))
    plan: list[tuple[str, list[tuple[str, str]]]] = [
        ("single", [(t.base, PROMPTS[0])]),
        ("prompts8", [(t.base, p) for p in PROMPTS]),
    ]
    adapters = [("mixed", list(zip(t.adapters, PROMPTS, strict=True))),
                ("one", [(t.adapters[0], p) for p in PROMPTS])]  # fmt: skip
    plan += adapters if rep % 2 == 0 else adapters[::-1]
    for figure, requests in plan:
        t.runs.setdefault(figure, []).append(await batch(http, requests, o.new_tokens))
    sides = list(SIDES.items()) if rep % 2 == 0 else list(SIDES.items())[::-1]
    for side, digit in sides:
        ticket = f"{rep:04d}-{digit}"  # fixed width: the same token count on both sides
        chats = [(a, agent_turns(i, ticket)) for i, a in enumerate(t.adapters)]
        run = await episodes(
            http, chats, SYSTEM_PROMPT, o.agent_tokens, together=side == "together"
        )
        t.episodes.setdefault(side, []).append(run)


async def _run_targets(targets: list[Target], peft: dict[str, Path], o: Options) -> None:
    clients = [httpx.AsyncClient(base_url=t.url, timeout=900) for t in targets]
    try:
        for http, t in zip(clients, targets, strict=True):
            tag = f"{os.getpid()}-{int(time.time())}"
            names = {f"bench{i}-{tag}": path for i, path in enumerate(peft.values())}
            await load_adapters(http, names)
            t.adapters = list(names)
            t.base = await base_model(http)
            await batch(http, list(zip(t.adapters, PROMPTS, strict=True)), 4)  # warm-up
            await batch(http, [(t.base, PROMPTS[0])], 4)
            warm = [(a, agent_turns(i, "9999-0")[:1]) for i, a in enumerate(t.adapters)]
            await episodes(http, warm, SYSTEM_PROMPT, 4, together=True)  # system prompt served
        for _ in range(o.reps):
            for http, t in zip(clients, targets, strict=True):
                await _measure_target(http, t, o)
                print(progress(t), file=sys.stderr, flush=True)
    finally:
        for http, t in zip(clients, targets, strict=True):
            await unload_adapters(http, t.adapters)
            await http.aclose()


async def measure(o: Options) -> tuple[list[Target], ModelConfig]:
    """Start a gateway per dtype, write the adapters, and take every figure on every target.

    Each gateway is `clora serve` in a process of its own, as users run it: in this
    process its event loop would share the GIL with the benchmark's client, which caps
    what one stream can show.
    """
    from clora_feedback.bench.roles import RoleProcess, free_port, wait_healthy, write_settings
    from clora_feedback.lora.peft_io import save_peft_adapter
    from clora_feedback.lora.weights import LoRALimits, random_lora_weights
    from clora_feedback.model.resolve import resolve_model_dir

    logging.getLogger("httpx").setLevel(logging.WARNING)
    model_dir = resolve_model_dir(o.model, o.cache_dir)
    config = ModelConfig.from_dir(model_dir)
    targets: list[Target] = []
    with tempfile.TemporaryDirectory(prefix="clora-bench-serve-") as scratch, contextlib.ExitStack() as stack:  # fmt: skip
        work = Path(scratch)
        for dtype in o.dtypes:
            data = work / f"gw-{dtype}"
            settings = write_settings(
                data / "settings.json", gateway_settings(model_dir, data, dtype, o)
            )
            port = free_port()
            args = ["serve", "--config", str(settings), "--port", str(port)]
            gateway = RoleProcess(f"gateway-{dtype}", args, work / "logs", passive=False)
            stack.callback(gateway.stop)
            url = f"http://127.0.0.1:{port}"
            wait_healthy(url, gateway.start(), timeout_s=600)
            targets.append(Target(f"embedded {dtype}", url, dtype))
        targeted = tuple(EngineConfig().lora_target_modules)  # the gateways' (the default)
        limits = LoRALimits(
            GATEWAY_MAX_RANK, targeted, config.num_layers, config.projection_shapes()
        )
        async with httpx.AsyncClient(base_url=targets[0].url) as http:
            base = await base_model(http)  # every gateway serves the same model
        peft = {}
        for i in range(ROWS):
            weights = random_lora_weights(limits, rank=ADAPTER_RANK, seed=i, std=0.05)
            peft[f"a{i}"] = work / "peft" / f"a{i}"
            save_peft_adapter(weights, peft[f"a{i}"], base_model=base)
        if o.against is not None:
            targets.append(Target(o.against_label, o.against, o.against_dtype))
        await _run_targets(targets, peft, o)
    return targets, config


def gateway_settings(model_dir: Path, data_dir: Path, dtype: str, o: Options) -> dict[str, Any]:
    """A gateway as `clora serve` builds it on `dtype`: serving only (no trainer, no broker),
    as a settings file's contents."""
    engine = {
        "model": str(model_dir), "dtype": dtype, "num_threads": o.threads, "max_loras": 8,
        "max_lora_rank": GATEWAY_MAX_RANK, "max_num_seqs": 16, "max_model_len": 2048,
    }  # fmt: skip
    return {
        "data_dir": str(data_dir), "adapters_dir": str(data_dir / "adapters"), "engine": engine,
        "agents": [], "feedback": {"kafka": {"embedded_broker": False}},
        "trainer": {"enabled": False}, "release": {"enabled": False},
        "retention": {"probe": False}, "server": {"access_log": False},
    }  # fmt: skip


def _median_ratio(a: Target, b: Target, fa: str, fb: str | None = None) -> float:
    fb = fb or fa
    n = min(len(a.runs[fa]), len(b.runs[fb]))
    return statistics.median(a.rate(fa, i) / b.rate(fb, i) for i in range(n))


def table(targets: list[Target], config: ModelConfig, o: Options) -> tuple[str, dict[str, float]]:
    """The figures of every target, their rooflines and ratios, as Markdown (and flat values)."""
    values: dict[str, float] = {}
    span = 40 + o.new_tokens // 2  # ~prompt (chat template included) + mean generated
    header = "| figure | " + " | ".join(t.label for t in targets) + " |"
    lines = [header, "|---" * (len(targets) + 1) + "|"]
    labels = {
        "single": f"1. single stream, {o.new_tokens} tokens (tok/s)",
        "prompts8": "2. 8 different prompts, base model (tok/s)",
        "mixed": "3. 8 rows on 8 adapters (decode steps/s)",
        "one": "4. the same 8 rows on one adapter (decode steps/s)",
    }
    shape = {"single": (1, 0), "prompts8": (ROWS, 0), "mixed": (ROWS, ROWS), "one": (ROWS, 1)}
    for figure in FIGURES:
        cells = []
        for t in targets:
            rate = t.median(figure)
            rows, adapters = shape[figure]
            step = decode_step_bytes(config, t.dtype, rows, span, adapters, ADAPTER_RANK)
            steps = rate / rows if figure in ("single", "prompts8") else rate
            gbps = step * steps / 1e9
            key = f"{t.label}:{figure}"
            values |= {key: rate, f"{key}:step_mb": step / 1e6, f"{key}:gbps": gbps}
            cells.append(
                f"{rate:.1f} ({step / 1e6:.0f} MB/step: {gbps:.1f} GB/s = "
                f"{gbps / MEMORY_BANDWIDTH_GBPS:.0%})"
            )
        lines.append(f"| {labels[figure]} | " + " | ".join(cells) + " |")
    cells = []
    for t in targets:
        ratio = _median_ratio(t, t, "mixed", "one")
        values[f"{t.label}:mixed_ratio"] = ratio
        cells.append(f"**{ratio:.2f}x**")
    lines.append("| 5. 8 adapters vs 1 adapter, same batch (3 / 4; goal >= 0.9x) | " + " | ".join(cells) + " |")  # fmt: skip
    lines.append(f"| {episode_label(o)} | " + " | ".join(episode_cells(targets, values)) + " |")
    out = ["\n".join(lines)]
    if o.against is not None and len(targets) > 1:
        other = targets[-1]
        vs_lines = ["| embedded vs " + other.label + " (median of per-repetition ratios) | "
                + " | ".join(t.label for t in targets[:-1]) + " |",
                "|---" * len(targets) + "|"]  # fmt: skip
        for figure in ("single", "prompts8", "mixed"):
            cells = []
            for t in targets[:-1]:
                ratio = _median_ratio(t, other, figure)
                values[f"{t.label}:vs:{figure}"] = ratio
                cells.append(f"**{ratio:.2f}x**")
            vs_lines.append(f"| {labels[figure]} (goal >= 1.0x) | " + " | ".join(cells) + " |")
        cells = []
        for t in targets[:-1]:
            pairs = zip(other.episodes["together"], t.episodes["together"], strict=True)
            ratio = statistics.median(b.wall_s / a.wall_s for b, a in pairs)
            values[f"{t.label}:vs:episodes_together"] = ratio
            cells.append(f"**{ratio:.2f}x**")
        vs_lines.append(
            f"| 6. 8 agents together, wall time ({other.label} / embedded) | "
            + " | ".join(cells)
            + " |"
        )
        out.append("\n".join(vs_lines))
    notes = episode_notes(targets, o)
    if notes:
        out.append("\n".join(notes))
    return "\n\n".join(out), values


def episode_label(o: Options) -> str:
    return (
        f"6. 8 agents x 2 turns x {o.agent_tokens} tokens, one after another / together "
        "(wall time; goal >= 4x)"
    )


def episode_cells(targets: list[Target], values: dict[str, float]) -> list[str]:
    """Figure 6 of each target: the ratio, both wall times, both prefix-cache hit fractions."""
    cells = []
    for t in targets:
        ratio = statistics.median(t.episode_ratios())
        together = statistics.median(r.wall_s for r in t.episodes["together"])
        serial = statistics.median(r.wall_s for r in t.episodes["serial"])
        key = f"{t.label}:episodes"
        values |= {f"{key}_ratio": ratio, f"{key}_together_s": together, f"{key}_serial_s": serial}
        values[f"{key}_tokens"] = float(t.episodes["together"][0].tokens)
        hits = []
        for side in SIDES:
            fractions = [r.cache_hit_fraction for r in t.episodes[side]]
            if all(f is not None for f in fractions):
                values[f"{key}_cache_hits_{side}"] = statistics.median(
                    f for f in fractions if f is not None
                )
                hits.append(f"{values[f'{key}_cache_hits_{side}']:.0%}")
        cache = f"; prefix-cache hits {' / '.join(hits)}" if hits else "; no prefix-cache counters"
        cells.append(f"**{ratio:.2f}x** ({serial:.1f} s vs {together:.1f} s{cache})")
    return cells


def episode_notes(targets: list[Target], o: Options) -> list[str]:
    """Where figure 6's two sides did not do the same work (completion or prompt tokens)."""
    expected = ROWS * 2 * o.agent_tokens
    notes = []
    for t in targets:
        pairs = zip(t.episodes["together"], t.episodes["serial"], strict=True)
        for rep, (a, b) in enumerate(pairs):
            if not a.tokens == b.tokens == expected:
                notes.append(
                    f"NOTE: {t.label}, repetition {rep}: figure 6 generated {a.tokens} completion "
                    f"tokens together and {b.tokens} one after another (asked: {expected})"
                )
            if a.prompt_tokens != b.prompt_tokens:
                notes.append(
                    f"NOTE: {t.label}, repetition {rep}: figure 6 prompts were {a.prompt_tokens} "
                    f"tokens together and {b.prompt_tokens} one after another (the turn-1 replies "
                    "differ, so turn 2's prompts do)"
                )
    return notes


def report(o: Options, facts: dict[str, str]) -> int:
    """Run every target, print the tables and the machine facts."""
    start = time.perf_counter()
    targets, config = asyncio.run(measure(o))
    facts["load average at end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    facts["benchmark wall time"] = f"{time.perf_counter() - start:.0f} s"
    facts["settings"] = (
        f"{o.model}, {o.new_tokens} new tokens/request ({o.agent_tokens}/turn in 6.), "
        f"{o.reps} repetition(s), "
        f"8 random rank-{ADAPTER_RANK} PEFT adapters (all 7 projections) per target"
        + (f", against {o.against}" if o.against else "")
    )
    text, values = table(targets, config, o)
    print(text)
    print()
    for key, value in facts.items():
        print(f"- {key}: {value}")
    if o.json_path is not None:
        raw: dict[str, dict[str, object]] = {}
        for t in targets:
            raw[t.label] = {
                f: [r.decode_steps_per_s if f in ("mixed", "one") else r.tokens_per_s
                    for r in t.runs[f]] for f in FIGURES
            }  # fmt: skip
            raw[t.label] |= {
                f"episodes_{side}": [
                    {"wall_s": r.wall_s, "tokens": r.tokens, "prompt_tokens": r.prompt_tokens,
                     "cache": r.cache} for r in t.episodes[side]
                ] for side in SIDES
            }  # fmt: skip
        o.json_path.write_text(
            json.dumps({"facts": facts, "results": values, "runs": raw}, indent=2)
        )
    return 0


def run(argv: list[str]) -> int:
    """`clora bench serve ARGV` (`--engine vllm`: `vllm_serve.run`)."""
    engine = argparse.ArgumentParser(add_help=False)
    engine.add_argument("--engine", default="embedded", choices=["embedded", "vllm"])
    if engine.parse_known_args(argv)[0].engine == "vllm":  # its own options: dispatch first
        from clora_feedback.bench.vllm_serve import run as run_vllm

        return run_vllm(argv)
    args = build_parser().parse_args(argv)
    return report(options_from(args, quick=bool(args.quick)), machine_facts())
