"""`python -m benchmarks.engine_ratio`: how far the trainer's logprobs sit from the engine's.

The clipped objective reads exp(trainer logprob - behaviour logprob) per token; on a
fresh sample (trained on before the adapter changes) it should be 1. This samples
`--prompts` chat prompts of `--tokens` tokens each from the embedded engine at
temperature 0.7 and top_p 0.9 with a random rank-8 adapter (std `--std`, all seven
projections), then scores the same tokens with the trainer's pass on the engine's own
base tensors (`DecoderPolicy.shared_with`, as `clora serve` trains), for each
`--dtypes` entry (engine and trainer alike, as `auto` sets them). Reported: |log r|
mean, p99 and max per dtype, and the share of tokens outside the clip range (0.2).
Prints the CPU model and flags. Not a test: nothing asserts.

In fp32 both passes give the same values; in bf16 they round at different points
(the engine's decode kernels, its bf16 KV cache and logits, against the trainer's
packed pass), so the ratio carries bf16's noise.

Not here: bf16 against fp32 training (`python -m benchmarks.precision`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

import torch

from benchmarks.shapes import add_dtypes_option
from clora_feedback.bench.report import machine_facts
from clora_feedback.config import DEFAULT_MODEL, EngineConfig, Settings
from clora_feedback.engine.embedded import EmbeddedEngine
from clora_feedback.engine.types import GenerationRequest, SamplingParams
from clora_feedback.lora.weights import random_lora_weights
from clora_feedback.model.resolve import resolve_model_dir
from clora_feedback.train.forward import PackedBatch, TrainLoRA
from clora_feedback.train.policy import DecoderPolicy
from clora_feedback.train.state import LoRALayout

PROMPTS = (
    "Write a haiku about the sea.",
    "Explain recursion to a child.",
    "List three uses of copper.",
    "What is a LoRA adapter?",
    "Summarise the plot of Hamlet in two sentences.",
    "How do I reset my password?",
    "Translate 'good morning' into French and Spanish.",
    "Give me a tip for writing unit tests.",
)
CLIP = 0.2


async def log_ratios(model_dir: Path, dtype: str, args: argparse.Namespace) -> torch.Tensor:
    """trainer logprob - engine logprob of every sampled token, engine and trainer in `dtype`."""
    engine = EmbeddedEngine(model_dir, EngineConfig(dtype=dtype, max_num_seqs=4, max_loras=2))
    weights = random_lora_weights(engine.lora_limits, seed=3, std=args.std, rank=8)
    params = SamplingParams(
        max_tokens=args.tokens, temperature=0.7, top_p=0.9, seed=11, ignore_eos=True
    )
    samples: list[tuple[list[int], list[int], list[float]]] = []
    await engine.start()
    try:
        engine.set_adapter("agent", 1, weights)
        for i, text in enumerate(PROMPTS[: args.prompts]):
            prompt = engine.tokenizer.encode(text)
            tokens: list[int] = []
            logprobs: list[float] = []
            async for out in engine.add_request(
                GenerationRequest(f"r{i}", "agent", prompt, params)
            ):
                tokens += [t.token_id for t in out.tokens]
                logprobs += [t.logprob for t in out.tokens]
            samples.append((prompt, tokens, logprobs))
    finally:
        await engine.stop()
    policy = DecoderPolicy.shared_with(engine)
    targets = tuple(policy.lora_limits.target_modules)
    layout = LoRALayout.build(policy.lora_limits, weights.rank, weights.alpha, targets)
    lora = TrainLoRA([layout], [layout.from_weights(weights)], torch.tensor([0]))
    with torch.no_grad():
        return torch.cat(
            [
                policy.token_logprobs(PackedBatch.build([(prompt, tokens)]), lora)
                - torch.tensor(logprobs)
                for prompt, tokens, logprobs in samples
            ]
        )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.engine_ratio", description=__doc__)
    p.add_argument("--model", default=DEFAULT_MODEL, help="Base model (default: the default).")
    p.add_argument("--prompts", type=int, default=8, help=f"Prompts (at most {len(PROMPTS)}).")
    p.add_argument("--tokens", type=int, default=32, help="Tokens sampled per prompt.")
    p.add_argument("--std", type=float, default=0.02, help="The random adapter's weight std.")
    add_dtypes_option(p, "Engine and trainer dtypes")
    p.add_argument("--json", type=Path, default=None, help="Also write the figures here.")
    return p


def run(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    model_dir = resolve_model_dir(args.model, Settings().model_cache_dir)
    figures: dict[str, dict[str, float]] = {}
    print(f"| engine and trainer dtype ({args.prompts} prompts x {args.tokens} tokens) "
          "| \\|log r\\| mean | p99 | max | outside 1 ± 0.2 |")  # fmt: skip
    print("|---|---|---|---|---|")
    for dtype in args.dtypes:
        log_r = asyncio.run(log_ratios(model_dir, dtype, args))
        size = log_r.abs()
        row = {
            "mean": float(size.mean()),
            "p99": float(size.quantile(0.99)),
            "max": float(size.max()),
            "outside": float(((log_r.exp() - 1).abs() > CLIP).float().mean()),
        }
        print(
            f"| {dtype} | {row['mean']:.4f} | {row['p99']:.4f} | {row['max']:.4f} "
            f"| {row['outside']:.1%} |"
        )
        figures[dtype] = row
    facts = machine_facts()
    for key, fact in facts.items():
        print(f"- {key}: {fact}")
    if args.json is not None:
        record = {"figures": figures, "facts": facts, "args": vars(args)}
        args.json.write_text(json.dumps(record, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(run())
