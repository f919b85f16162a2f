"""`python -m benchmarks.prefix [--quick]`: time to first token of a conversation, prefix cache on vs off.

One agent (a random rank-8 adapter on the default model) holds a multi-turn
chat: a long system prompt, then each turn's prompt is the chat template over
every message so far (the assistant's replies decoded to text and rendered
again, as the gateway does). Two engines in one process serve the same
conversation, one with `engine.prefix_cache_mb` = 0, alternately per
repetition so drifting load hits both; the ratios are off/on:

1. multi-turn: summed time to first token of turns 2..T (turn 1 is cold on both:
   the cache is cleared before each repetition);
2. repeated system prompt: turn 1 of a second conversation (another question
   after the same system prompt) on the now warm cache.

Each request is greedy, EOS ignored, alone in its engine, so time to first
token is that turn's prefill. Both engines must generate the same tokens (a
note says so otherwise). Not a test: nothing here asserts.

Not here: the cache itself (`clora_feedback.engine.prefix_cache`), serving
throughput (`python -m benchmarks.serve`, `clora bench serve`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from clora_feedback.bench import OMP_WAIT_POLICIES, apply_omp_wait_policy
from clora_feedback.config import DEFAULT_MODEL

if TYPE_CHECKING:
    from clora_feedback.engine.embedded import EmbeddedEngine

AGENT = "support"
SYSTEM = (
    "You are the support agent of a bicycle shop. Be precise and brief. The shop sells road, "
    "gravel and city bikes, repairs every brand, and offers a free safety check within 30 days "
    "of purchase. Opening hours are Monday to Saturday, 9 to 18. Never promise a repair date "
    "before a mechanic has seen the bike. For warranty claims ask for the order number and a "
    "photo of the damage. Drivetrain questions: ask about the number of gears, the age of the "
    "chain and whether the noise happens under load. Brake questions: ask whether the brakes "
    "are rim or disc, mechanical or hydraulic. Always end with one concrete next step. "
) * 2
QUESTIONS = (
    "My rear derailleur skips gears when I pedal hard uphill. What should I check first?",
    "It is an 11-speed chain, about 3000 km old. Could that be it?",
    "How do I measure chain wear without a special tool?",
    "And if the cassette is worn too, can I replace only the chain?",
    "Can you do it this week, and what would it cost roughly?",
    "One more thing: the front brake squeals when it is wet. Normal?",
)
OTHER_OPENER = "My front tyre keeps losing pressure overnight. Where do I start?"


@dataclass(frozen=True)
class Options:
    """What to run.

    Attributes:
        model: model spec (the default name or a HF directory).
        cache_dir: model cache.
        dtype: engine dtype.
        threads: torch threads (None: all cores).
        turns: turns per conversation (at most `len(QUESTIONS)`).
        reply_tokens: tokens the assistant generates per turn.
        reps: repetitions (median of the per-repetition ratios kept).
        json_path: also write the results here.
    """

    model: str
    cache_dir: Path
    dtype: str
    threads: int | None
    turns: int
    reply_tokens: int
    reps: int
    json_path: Path | None


def parse_options(argv: list[str]) -> Options:
    doc = (__doc__ or "").split("\n")[0]
    parser = argparse.ArgumentParser(prog="python -m benchmarks.prefix", description=doc)
    parser.add_argument("--quick", action="store_true", help="Fewer turns and repetitions.")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="Model spec (default: %(default)s).")
    parser.add_argument("--cache-dir", type=Path, default=Path("var/models"), help="Model cache.")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all).")
    parser.add_argument("--turns", type=int, default=None, help="Turns per conversation.")
    parser.add_argument("--reply-tokens", type=int, default=None, help="Tokens per reply.")
    parser.add_argument("--reps", type=int, default=None, help="Repetitions.")
    parser.add_argument("--json", type=Path, default=None, help="Also write results as JSON.")
    parser.add_argument("--omp-wait-policy", default="product", choices=OMP_WAIT_POLICIES)
    args = parser.parse_args(argv)
    quick = bool(args.quick)
    return Options(
        model=args.model,
        cache_dir=args.cache_dir,
        dtype=args.dtype,
        threads=args.threads,
        turns=min(args.turns or (4 if quick else 6), len(QUESTIONS)),
        reply_tokens=args.reply_tokens or (24 if quick else 48),
        reps=args.reps or (1 if quick else 3),
        json_path=args.json,
    )


async def conversation(
    engine: EmbeddedEngine, opener: str, turns: int, reply_tokens: int
) -> tuple[list[float], list[int]]:
    """One chat of `turns` turns starting with `opener`, `reply_tokens` per reply.

    Returns:
        each turn's time to first token (s) and every generated token id.
    """
    from benchmarks.workload import timed_request

    tok = engine.tokenizer
    messages = [{"role": "system", "content": SYSTEM}]
    firsts: list[float] = []
    generated: list[int] = []
    for turn in range(turns):
        messages.append({"role": "user", "content": opener if turn == 0 else QUESTIONS[turn]})
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt = list(tok.encode(str(text), add_special_tokens=False))
        run = await timed_request(engine, AGENT, prompt, reply_tokens)
        firsts.append(run.first - run.start)
        generated += run.token_ids
        reply = str(tok.decode(run.token_ids, skip_special_tokens=True))
        messages.append({"role": "assistant", "content": reply})
    return firsts, generated


async def measure(o: Options) -> tuple[dict[str, float], list[str]]:
    """Both engines, `o.reps` alternating repetitions; returns (values, notes)."""
    from clora_feedback.config import EngineConfig
    from clora_feedback.engine.embedded import EmbeddedEngine
    from clora_feedback.lora.weights import random_lora_weights
    from clora_feedback.model.resolve import resolve_model_dir

    model_dir = resolve_model_dir(o.model, o.cache_dir)
    engines = {}
    for name, mb in (("off", 0), ("on", EngineConfig().prefix_cache_mb)):
        config = EngineConfig(
            model=str(model_dir),
            dtype=o.dtype,
            num_threads=o.threads,
            max_num_seqs=2,
            max_loras=1,
            max_lora_rank=8,
            prefix_cache_mb=mb,
        )
        engines[name] = EmbeddedEngine(model_dir, config)
    weights = random_lora_weights(engines["on"].lora_limits, rank=8, seed=0)
    notes: list[str] = []
    multi, system, hit_rates = [], [], []
    for engine in engines.values():
        engine.set_adapter(AGENT, 1, weights)
        await engine.start()
    try:
        for engine in engines.values():  # warm-up: load the slot, first-call costs
            await conversation(engine, OTHER_OPENER, 1, 4)
        cache = engines["on"].prefix_cache
        if cache is None:
            raise RuntimeError("the cache-on engine has no prefix cache")
        for _ in range(o.reps):
            cache.clear()  # turn 1 starts cold on both engines
            before = cache.stats()
            runs = {
                name: await conversation(e, QUESTIONS[0], o.turns, o.reply_tokens)
                for name, e in engines.items()
            }
            after = cache.stats()
            again = {
                name: (await conversation(e, OTHER_OPENER, 1, o.reply_tokens))[0][0]
                for name, e in engines.items()
            }
            (off, off_tokens), (on, on_tokens) = runs["off"], runs["on"]
            if off_tokens != on_tokens:
                notes.append("WARNING: the engines generated different tokens")
            multi.append((sum(off[1:]), sum(on[1:])))
            system.append((again["off"], again["on"]))
            looked = after.hits + after.misses - before.hits - before.misses
            hit_rates.append((after.hits - before.hits) / max(looked, 1))
    finally:
        for engine in engines.values():
            await engine.stop()
    return {
        "multi_turn_ratio": statistics.median(a / b for a, b in multi),
        "multi_turn_off_s": statistics.median(a for a, _ in multi),
        "multi_turn_on_s": statistics.median(b for _, b in multi),
        "system_prompt_ratio": statistics.median(a / b for a, b in system),
        "system_prompt_off_ms": 1e3 * statistics.median(a for a, _ in system),
        "system_prompt_on_ms": 1e3 * statistics.median(b for _, b in system),
        "block_hit_rate": statistics.median(hit_rates),
    }, notes


def table(v: dict[str, float], o: Options) -> str:
    rows = [
        (
            f"multi-turn: time to first token of turns 2..{o.turns}, summed, cache off vs on",
            f"**{v['multi_turn_ratio']:.2f}x** ({v['multi_turn_off_s']:.2f} s vs "
            f"{v['multi_turn_on_s']:.2f} s; {v['block_hit_rate']:.0%} of prompt blocks reused)",
        ),
        (
            "repeated system prompt: first turn of a new conversation, cache off vs on",
            f"**{v['system_prompt_ratio']:.2f}x** ({v['system_prompt_off_ms']:.0f} ms vs "
            f"{v['system_prompt_on_ms']:.0f} ms)",
        ),
    ]
    lines = ["| benchmark | result |", "|---|---|", *(f"| {a} | {b} |" for a, b in rows)]
    return "\n".join(lines)


def run(argv: list[str]) -> int:
    """`python -m benchmarks.prefix ARGV`: measure and print the table."""
    apply_omp_wait_policy(argv)  # before torch loads
    o = parse_options(argv)
    if o.threads:
        import torch

        torch.set_num_threads(o.threads)
    start = time.perf_counter()
    values, notes = asyncio.run(measure(o))
    print(table(values, o))
    print()
    for note in notes:
        print(note)
    print(
        f"- settings: {o.model}, {o.dtype}, {o.turns} turns x {o.reply_tokens} reply tokens, "
        f"{o.reps} rep(s); wall {time.perf_counter() - start:.0f} s; "
        f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    if o.json_path is not None:
        o.json_path.write_text(json.dumps(values, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(run(sys.argv[1:]))
