"""`python -m benchmarks.fused_pass`: the training pass's fused pieces against the composites.

`clora_feedback.train.fused` computes RMSNorm, SwiGLU and the head's
log-probabilities with a hand-written backward (same values, fewer ops; the
head's backward product in the compute dtype), and the frozen projections'
input gradients the faster of one product or two column halves on this CPU
(`train.gemm`), and each projection with its LoRA as one function (the LoRA
added in place, its input gradient summed into the base one's buffer). This
times one swap step (`train_step`) three ways, alternated per repetition:
`fused` (as the trainer runs), `one product` (every frozen projection's input
gradient one product again) and `composites` (autograd's composites for the
projections and their LoRA, and the reference composites of
`clora_feedback.model.decoder` in place of the other pieces); in each compute
dtype, on two batches of `--tickets` support tickets: one sampled first token
each (the batch of `benchmarks.precision`'s step row) and supervised targets
of `--target-tokens` tokens each (the shape of corrections). Reported: median
seconds per step, and composites / fused and one product / fused per batch and
dtype. Prints the CPU model and flags. Not a test: nothing asserts.

Not here: bf16 against fp32 (`python -m benchmarks.precision`).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.nn.functional as F

from benchmarks.precision import Task, _identity, fresh_step_seconds, rollout
from benchmarks.shapes import add_dtypes_option, finish, print_medians
from clora_feedback.config import DEFAULT_MODEL, DEFAULT_TARGET_MODULES, Settings
from clora_feedback.model import decoder
from clora_feedback.model.resolve import resolve_model_dir
from clora_feedback.train import forward, fused
from clora_feedback.train.policy import COMPUTE_DTYPES, DecoderPolicy
from clora_feedback.train.state import AgentTrainState
from clora_feedback.train.step import SFTSample

VARIANTS = ("fused", "one product", "composites")


def _swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _head_logprobs(
    hidden: torch.Tensor, head: torch.Tensor, _: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    return decoder.gather_logprobs(hidden, head, targets)


def _lora_composite(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    pieces: list[fused.LoRAPiece],
) -> torch.Tensor:
    """`fused.lora_linear` as autograd composes it: the base projection, then each
    segment's LoRA product, summed out of place."""
    parts = [
        xs @ a.t() @ bt if a is not None and bt is not None else xs.new_zeros(n, weight.shape[0])
        for xs, (n, a, bt) in zip(x.split([n for n, _, _ in pieces]), pieces, strict=True)
    ]
    return F.linear(x, weight, bias) + torch.cat(parts)


def _one_product(grad: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return grad @ weight


def _variant(name: str) -> contextlib.AbstractContextManager[Any]:
    """The training pass as `name` computes it (see the module docstring)."""
    if name == "one product":
        return mock.patch.object(fused, "input_gradient", _one_product)
    if name == "composites":
        return mock.patch.multiple(
            forward,
            frozen_linear=F.linear,
            lora_linear=_lora_composite,
            rms_norm=decoder.rms_norm,
            swiglu=_swiglu,
            head_logprobs=_head_logprobs,
        )
    return contextlib.nullcontext()


def measure(args: argparse.Namespace) -> dict[str, list[float]]:
    """Seconds per step for each (batch, dtype, variant), the variants alternating."""
    model_dir = resolve_model_dir(args.model, Settings().model_cache_dir)

    def load(dtype: torch.dtype) -> DecoderPolicy:
        return DecoderPolicy.from_dir(
            model_dir, max_lora_rank=8, target_modules=DEFAULT_TARGET_MODULES, dtype=dtype
        )

    policies = {name: load(COMPUTE_DTYPES[name]) for name in args.dtypes}
    p32 = policies.get("float32") or load(torch.float32)  # samples the first-token batch
    task = Task.build(p32, seed=0, train=args.tickets, held_out=1)
    start = AgentTrainState.create("x", *_identity(p32, 8))
    first_tokens = rollout(p32, start, task.train, task, torch.Generator().manual_seed(0))
    targets = [SFTSample(prompt, prompt[-args.target_tokens :]) for prompt, _ in task.train]
    batches: dict[str, dict[str, Any]] = {
        "first tokens": {"pg": first_tokens},
        f"{args.target_tokens}-token targets": {"sft": targets},
    }
    seconds: dict[str, list[float]] = {}
    for rep in range(args.reps + 1):  # the first repetition warms up
        for variant in VARIANTS if rep % 2 == 0 else VARIANTS[::-1]:
            with _variant(variant):
                for batch_name, fields in batches.items():
                    for name, policy in policies.items():
                        step_s = fresh_step_seconds(policy, 8, **fields)
                        if rep:
                            key = f"{batch_name}, {name}, {variant}"
                            seconds.setdefault(key, []).append(step_s)
    return seconds


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.fused_pass", description=__doc__)
    p.add_argument("--tickets", type=int, default=8, help="Rows per step.")
    p.add_argument("--target-tokens", type=int, default=32, help="Tokens per supervised target.")
    p.add_argument("--model", default=DEFAULT_MODEL, help="Base model (default: the default).")
    p.add_argument("--reps", type=int, default=5, help="Measured repetitions per variant.")
    add_dtypes_option(p, "Compute dtypes to time")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all).")
    p.add_argument("--json", type=Path, default=None, help="Also write the figures here.")
    return p


def run(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    seconds = measure(args)
    median = print_medians(seconds, f"step ({args.tickets} rows)")
    ratios = {
        f"{key.removesuffix(', fused')}: {other} / fused": median[key.removesuffix("fused") + other]
        / value
        for key, value in median.items()
        if key.endswith(", fused")
        for other in VARIANTS[1:]
    }
    return finish(args, ratios, {"seconds": seconds})


if __name__ == "__main__":
    sys.exit(run())
