"""What a batch of a shape the process has not seen costs a swap step, fp32 against bf16.

On a CPU torch runs bf16 GEMMs through oneDNN, which builds (JIT-compiles) a kernel
for every new problem shape and caches it; fp32 GEMMs run on MKL's prebuilt
kernels. A trainer whose batches change length builds kernels on most steps. This
makes `--batches` batches of `--tickets` support tickets whose widths (the longest
row) all differ, then per batch and dtype times a swap step on it twice in a row:
the first run is the step on a new shape, the second the same step with every
kernel built. Prints per dtype the medians of both and of their difference, the
dtypes alternating per batch.

    python3 -m scripts.new_shape_cost [--batches 6] [--tickets 8]

Not a test (nothing asserts) and not a benchmark: it says how much of
`python -m benchmarks.precision`'s step row (whose steps see a new batch each) is
kernel building.
"""

from __future__ import annotations

import argparse
import random
import statistics
from pathlib import Path

import torch

from benchmarks.precision import Task, _identity, fresh_step_seconds, policies_by_dtype, rollout
from clora_feedback.bench.report import format_facts, machine_facts
from clora_feedback.config import DEFAULT_MODEL
from clora_feedback.model.resolve import resolve_model_dir
from clora_feedback.train.state import AgentTrainState
from clora_feedback.train.step import PGSample


def _width(samples: list[PGSample]) -> int:
    return max(len(s.prompt_ids) + len(s.completion_ids) for s in samples)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--model-cache", type=Path, default=Path("var/models"))
    p.add_argument("--tickets", type=int, default=8)
    p.add_argument("--batches", type=int, default=6)
    p.add_argument("--rank", type=int, default=8)
    args = p.parse_args()
    model_dir = resolve_model_dir(args.model, args.model_cache)
    policies = policies_by_dtype(model_dir, args.rank)
    p32 = policies["float32"]
    task = Task.build(p32, seed=0, train=200, held_out=1)
    start = AgentTrainState.create("x", *_identity(p32, args.rank))
    picks, batches, widths = random.Random(0), list[list[PGSample]](), set[int]()
    for attempt in range(50 * (args.batches + 1)):
        if len(batches) == args.batches + 1:
            break
        gen = torch.Generator().manual_seed(attempt)
        samples = rollout(p32, start, picks.sample(task.train, args.tickets), task, gen)
        if _width(samples) not in widths:
            widths.add(_width(samples))
            batches.append(samples)
    warm, batches = batches[0], batches[1:]
    for policy in policies.values():  # every shape-independent first-time cost, paid here
        fresh_step_seconds(policy, args.rank, pg=warm)
    first: dict[str, list[float]] = {name: [] for name in policies}
    again: dict[str, list[float]] = {name: [] for name in policies}
    for i, samples in enumerate(batches):
        for name in list(policies) if i % 2 == 0 else list(policies)[::-1]:
            first[name].append(fresh_step_seconds(policies[name], args.rank, pg=samples))
            again[name].append(fresh_step_seconds(policies[name], args.rank, pg=samples))
    print(f"{len(batches)} batches of {args.tickets} rows, widths {sorted(widths)}")
    print("| dtype | new shape (s) | same shape again (s) | new - again (ms, median) |")
    print("|---|---|---|---|")
    for name in policies:
        extra = statistics.median(a - b for a, b in zip(first[name], again[name], strict=True))
        print(
            f"| {name} | {statistics.median(first[name]):.3f} "
            f"| {statistics.median(again[name]):.3f} | {extra * 1e3:.0f} |"
        )
    ratio = {
        kind: statistics.median(runs["float32"]) / statistics.median(runs["bfloat16"])
        for kind, runs in (("new shape", first), ("again", again))
    }
    print(f"bf16 step vs fp32: new shape {ratio['new shape']:.2f}x, again {ratio['again']:.2f}x")
    facts = machine_facts()
    facts["cpu capability (torch)"] = torch.backends.cpu.get_cpu_capability()
    print(format_facts(facts))


if __name__ == "__main__":
    main()
