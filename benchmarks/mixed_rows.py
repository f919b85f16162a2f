"""`python -m benchmarks.mixed_rows`: what one row of another adapter costs the rows beside it.

The release gate (and a canary) put a second adapter of an agent into decode
batches that otherwise hold one adapter per agent. This measures the price of
that in the embedded engine: `--rows` greedy rows of one adapter decode
`--tokens` tokens each (EOS ignored), alone and then with one more row, either
of the same adapter or of another one; repetitions alternate the three shapes
so drifting load hits each alike. Reported: wall seconds per shape (median) and
the ratios same / alone and other / same (what the other adapter costs beyond
one more row). Prints the CPU model and flags. Not a test: nothing asserts.

Not here: 8 rows on 8 adapters against 8 on one (`python -m benchmarks.serve`),
the gate's effect through the gateway (`clora bench release`, phase 4).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time

from benchmarks.shapes import add_engine_options, finish

SHAPES = ("alone", "one more row, same adapter", "one more row, another adapter")


async def measure(args: argparse.Namespace) -> dict[str, list[float]]:
    """Seconds per repetition for each shape, the shapes alternating."""
    from clora_feedback.config import EngineConfig, Settings
    from clora_feedback.engine.embedded import EmbeddedEngine
    from clora_feedback.engine.types import GenerationRequest, SamplingParams
    from clora_feedback.lora.weights import random_lora_weights
    from clora_feedback.model.resolve import resolve_model_dir

    model_dir = resolve_model_dir(args.model, Settings().model_cache_dir)
    config = EngineConfig(
        model=str(model_dir), dtype=args.dtype, num_threads=args.threads,
        max_num_seqs=args.rows + 1, max_model_len=512,
    )  # fmt: skip
    engine = EmbeddedEngine(model_dir, config)
    await engine.start()
    try:
        for seed, name in enumerate(("mine", "other")):
            weights = random_lora_weights(engine.lora_limits, rank=8, seed=seed, std=0.02)
            engine.set_adapter(name, 1, weights)
        prompt = engine.tokenizer.encode("Write a short story about a dragon who learns to code.")
        sampling = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
        extra = {SHAPES[0]: [], SHAPES[1]: ["mine"], SHAPES[2]: ["other"]}
        seconds: dict[str, list[float]] = {shape: [] for shape in SHAPES}
        for rep in range(args.reps + 1):  # the first repetition warms up
            for shape in SHAPES:
                agents = ["mine"] * args.rows + extra[shape]
                t0 = time.perf_counter()
                streams = [
                    engine.add_request(GenerationRequest(f"{rep}-{shape}-{i}", a, prompt, sampling))
                    for i, a in enumerate(agents)
                ]
                await asyncio.gather(*(s.collect() for s in streams))
                if rep:
                    seconds[shape].append(time.perf_counter() - t0)
        return seconds
    finally:
        await engine.stop()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.mixed_rows", description=__doc__)
    p.add_argument("--rows", type=int, default=4, help="Rows of the one adapter.")
    p.add_argument("--tokens", type=int, default=64, help="Tokens each row decodes.")
    add_engine_options(p, dtype="float32")
    return p


def run(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    seconds = asyncio.run(measure(args))
    median = {shape: statistics.median(values) for shape, values in seconds.items()}
    ratios = {
        "one more row, same adapter / alone": median[SHAPES[1]] / median[SHAPES[0]],
        "one more row, another adapter / same adapter": median[SHAPES[2]] / median[SHAPES[1]],
    }
    print(
        f"| shape ({args.rows} rows of one adapter, {args.tokens} tokens each) | seconds (median) |"
    )
    print("|---|---|")
    for shape in SHAPES:
        print(f"| {shape} | {median[shape]:.2f} |")
    return finish(args, ratios, {"seconds": seconds})


if __name__ == "__main__":
    sys.exit(run())
