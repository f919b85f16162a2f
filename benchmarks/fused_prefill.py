"""`python -m benchmarks.fused_prefill`: what prompts started beside decoding rows cost them.

A release gate (or the no-op probe) starts prompts while an agent's rows decode.
The embedded engine runs such a step's prompt chunks and its decoding rows in one
forward (`EmbeddedEngine.fuse_prefill`), and lets background requests advance
only on a token credit while clients are served (`engine.background_tokens_per_step`).
This measures an agent's `--rows` greedy rows decoding `--tokens` tokens each
(EOS ignored): alone, then beside a trickle of short background requests one at a
time (a prompt of `--prompt-tokens` tokens from another adapter, `--answer-tokens`
tokens answered, as the gate sends them beside clients) at each credit rate of
`--background-tokens` (`none`: no credit, background advances every step), and
beside the same unlimited trickle unfused (a forward of its own for each prompt).
Repetitions alternate the shapes so drifting load hits each alike. Reported: the
rows' wall seconds per shape (median), the ratios to alone, the trickle's requests
done meanwhile, and the CPU's facts. Not a test: nothing asserts.

Not here: the gate's effect through the gateway (`clora bench release`, phase 4),
one row of another adapter (`python -m benchmarks.mixed_rows`).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time

from benchmarks.shapes import add_engine_options, finish

ALONE, UNFUSED = "alone", "beside a trickle, no credit, unfused"


def shapes(rates: list[float | None]) -> dict[str, tuple[float | None, bool]]:
    """Each shape's name -> (background tokens per step, None for no limit; fused)."""
    named: dict[str, tuple[float | None, bool]] = {ALONE: (None, True)}
    for rate in rates:
        named[f"beside a trickle, {_rate(rate)}"] = (rate, True)
    return named | {UNFUSED: (None, False)}


def _rate(rate: float | None) -> str:
    return "no credit" if rate is None else f"{rate:g} tokens/step"


def parse_rates(text: str) -> list[float | None]:
    return [None if part.strip() == "none" else float(part) for part in text.split(",")]


async def measure(args: argparse.Namespace) -> tuple[dict[str, list[float]], dict[str, int]]:
    """Seconds per repetition for each shape, and the trickle's requests per shape."""
    from clora_feedback.config import EngineConfig, Settings
    from clora_feedback.engine.embedded import EmbeddedEngine
    from clora_feedback.engine.types import GenerationRequest, SamplingParams
    from clora_feedback.lora.weights import random_lora_weights
    from clora_feedback.model.resolve import resolve_model_dir

    model_dir = resolve_model_dir(args.model, Settings().model_cache_dir)
    config = EngineConfig(
        model=str(model_dir), dtype=args.dtype, num_threads=args.threads,
        max_num_seqs=args.rows + 1, max_model_len=1024, prefix_cache_mb=0,
    )  # fmt: skip
    engine = EmbeddedEngine(model_dir, config)
    await engine.start()
    try:
        for seed, name in enumerate(("agent", "gate")):
            weights = random_lora_weights(engine.lora_limits, rank=8, seed=seed, std=0.02)
            engine.set_adapter(name, 1, weights)
        prompt = engine.tokenizer.encode("Write a short story about a dragon who learns to code.")
        words = "route this ticket to the team that owns payments and refunds please " * 40
        case = engine.tokenizer.encode(words)[: args.prompt_tokens]
        rows = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
        answer = SamplingParams(max_tokens=args.answer_tokens, temperature=0.0, ignore_eos=True)
        named = shapes(args.background_tokens)
        seconds: dict[str, list[float]] = {shape: [] for shape in named}
        trickled = dict.fromkeys(named, 0)
        for rep in range(args.reps + 1):  # the first repetition warms up
            for shape, (rate, fused) in named.items():
                engine.fuse_prefill = fused
                engine.background_tokens_per_step = float("inf") if rate is None else rate
                done = asyncio.Event()

                async def trickle(done: asyncio.Event, shape: str, rep: int) -> int:
                    n = 0
                    while not done.is_set():
                        rid = f"{rep}-{shape}-case{n}-{len(case)}"
                        request = GenerationRequest(rid, "gate", case, answer, background=True)
                        await engine.add_request(request).collect()
                        n += 1
                    return n

                background = (
                    asyncio.create_task(trickle(done, shape, rep)) if shape != ALONE else None
                )
                t0 = time.perf_counter()
                streams = [
                    engine.add_request(
                        GenerationRequest(f"{rep}-{shape}-{i}", "agent", prompt, rows)
                    )
                    for i in range(args.rows)
                ]
                await asyncio.gather(*(s.collect() for s in streams))
                elapsed = time.perf_counter() - t0
                done.set()
                count = await background if background is not None else 0
                if rep:
                    seconds[shape].append(elapsed)
                    trickled[shape] += count
        return seconds, trickled
    finally:
        await engine.stop()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.fused_prefill", description=__doc__)
    p.add_argument("--rows", type=int, default=4, help="The agent's decoding rows.")
    p.add_argument("--tokens", type=int, default=64, help="Tokens each row decodes.")
    p.add_argument("--prompt-tokens", type=int, default=96, help="Tokens of each trickled prompt.")
    p.add_argument("--answer-tokens", type=int, default=4, help="Tokens each trickled answer.")
    p.add_argument(
        "--background-tokens", type=parse_rates, default=[2.0, None],
        help="Comma-separated credit rates to measure (engine.background_tokens_per_step; "
        "`none`: no limit). Default: 2 (the default) and none.",
    )  # fmt: skip
    add_engine_options(p, dtype="auto")
    return p


def run(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    seconds, trickled = asyncio.run(measure(args))
    median = {shape: statistics.median(values) for shape, values in seconds.items()}
    ratios = {
        f"rows' throughput {shape.removeprefix('beside a trickle, ')} / alone": median[ALONE]
        / median[shape]
        for shape in median
        if shape != ALONE
    }
    print(f"| shape ({args.rows} rows, {args.tokens} tokens each) | seconds (median) | trickled |")
    print("|---|---|---|")
    for shape in median:
        print(f"| {shape} | {median[shape]:.2f} | {trickled[shape]} |")
    return finish(args, ratios, {"seconds": seconds, "trickled": trickled})


if __name__ == "__main__":
    sys.exit(run())
