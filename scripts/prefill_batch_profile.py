"""What one forward for all of a step's prompt chunks buys: 8 agents arriving together.

In process, on the default model (fp32 by default, 2 threads): an
`EmbeddedEngine` with 8 random rank-8 adapters (all seven projections), each
agent's ~220-token support system prompt already in the prefix cache (served
once per adapter, as on a server that has answered those agents before).
Then 8 requests at once, one per agent, each the system prompt plus a
question with a fresh ticket number (so its ~40-token tail is not cached),
`--new-tokens` tokens each (default 1: the time to every agent's first
token), with `EmbeddedEngine.batch_prefill` on (the chunks run as one
`SlottedDecoder.prefill_many` forward) and off (one forward per sequence),
interleaved; wall seconds from the first submit to the last finish, the
minimum and median over `--reps` pairs.

    OMP_WAIT_POLICY=PASSIVE python3 scripts/prefill_batch_profile.py [--reps 7] [--new-tokens 1]

Not a test: nothing here asserts. Not here: the forward (`clora_feedback.engine.decoder`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from pathlib import Path

import torch

from clora_feedback.bench.serve_gateway import SYSTEM_PROMPT
from clora_feedback.config import EngineConfig
from clora_feedback.engine.embedded import EmbeddedEngine
from clora_feedback.engine.types import GenerationRequest, SamplingParams
from clora_feedback.lora.weights import random_lora_weights
from clora_feedback.model.resolve import resolve_model_dir

AGENTS = 8


async def _together(engine: EmbeddedEngine, ticket: str, new_tokens: int) -> tuple[float, int]:
    """Every agent's request at once; (wall seconds, prompt tokens of the batch)."""
    tok = engine.tokenizer
    sampling = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    requests = [
        GenerationRequest(
            f"r-{ticket}-{i}",
            f"agent{i}",
            tok.encode(
                f"{SYSTEM_PROMPT}\nTicket {ticket}-{i}: my order {i} arrived damaged, what now?"
            ),
            sampling,
        )
        for i in range(AGENTS)
    ]
    start = time.perf_counter()
    streams = [engine.add_request(r) for r in requests]
    await asyncio.gather(*(s.collect() for s in streams))
    return time.perf_counter() - start, sum(len(r.prompt_token_ids) for r in requests)


async def _main(args: argparse.Namespace) -> None:
    model_dir = resolve_model_dir(args.model, Path(args.cache_dir))
    config = EngineConfig(model=str(model_dir), dtype=args.dtype, max_loras=AGENTS)
    engine = EmbeddedEngine(model_dir, config)
    await engine.start()
    try:
        for i in range(AGENTS):
            weights = random_lora_weights(engine.lora_limits, rank=8, seed=i, std=0.05)
            engine.set_adapter(f"agent{i}", 1, weights)
        await _together(engine, "warm-0", 1)  # the system prompt cached for every adapter
        await _together(engine, "warm-1", 1)
        walls: dict[bool, list[float]] = {True: [], False: []}
        prompt_tokens = 0
        for rep in range(args.reps):
            for batched in (True, False) if rep % 2 == 0 else (False, True):
                engine.batch_prefill = batched
                wall, prompt_tokens = await _together(
                    engine, f"{rep:03d}-{int(batched)}", args.new_tokens
                )
                walls[batched].append(wall)
        stats = engine.stats()
    finally:
        await engine.stop()
    print(f"prompt tokens of a batch: {prompt_tokens}; engine stats: {stats}")
    print(
        "| 8 agents at once | one forward per step (batch_prefill) | one forward per sequence | speedup |"
    )
    print("|---|---|---|---|")
    for name, pick in (("minimum", min), ("median", statistics.median)):
        on, off = pick(walls[True]), pick(walls[False])
        print(
            f"| {name} wall, {args.new_tokens} new token(s) each | {on * 1e3:.0f} ms | {off * 1e3:.0f} ms | {off / on:.2f}x |"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--new-tokens", type=int, default=1)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--cache-dir", default="var/models")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"threads {args.threads}, {args.dtype}, load {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    asyncio.run(_main(args))
    print(f"load at end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
