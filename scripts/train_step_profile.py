"""Where a training step's time goes, fp32 against bf16 compute: torch's profiler per op.

Builds the batch `benchmarks.precision` steps on (support-triage rows of the default
model, one sampled first token each, rewards from the simulated operator), then runs
`train_step` in each compute dtype, alternated: `--warm` unprofiled steps, then
`--reps` timed ones (the median wall), then one step under `torch.profiler`. Prints,
per dtype, the ops by self CPU time (the top `--top`), and the share of the step in
the big GEMMs (`aten::mm`/`addmm`/`bmm`/`linear`'s kernels) against everything else.

    python3 -m scripts.train_step_profile [--tickets 8] [--reps 3] [--top 25] [--shapes]

Not a test: nothing here asserts. Not a benchmark either (`python -m benchmarks.precision`
reports the step ratio): this says which ops to look at.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.precision import Task, _identity, fresh_step_seconds, policies_by_dtype, rollout
from clora_feedback.bench.report import format_facts, machine_facts
from clora_feedback.config import DEFAULT_MODEL
from clora_feedback.model.resolve import resolve_model_dir
from clora_feedback.train.state import AgentTrainState

GEMMS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::_mkldnn_", "mkldnn", "aten::matmul")


def _is_gemm(key: str) -> bool:
    return key.startswith(GEMMS)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--model-cache", type=Path, default=Path("var/models"))
    p.add_argument("--tickets", type=int, default=8)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--warm", type=int, default=1)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--shapes", action="store_true", help="also the GEMMs by input shape")
    args = p.parse_args()
    model_dir = resolve_model_dir(args.model, args.model_cache)
    policies = policies_by_dtype(model_dir, args.rank)
    p32 = policies["float32"]
    task = Task.build(p32, seed=0, train=args.tickets, held_out=1)
    samples = rollout(
        p32,
        AgentTrainState.create("x", *_identity(p32, args.rank)),
        task.train,
        task,
        torch.Generator().manual_seed(0),
    )
    for policy in policies.values():
        for _ in range(args.warm):
            fresh_step_seconds(policy, args.rank, pg=samples)
    walls: dict[str, list[float]] = {name: [] for name in policies}
    for i in range(args.reps):
        for name in list(policies) if i % 2 == 0 else list(policies)[::-1]:
            walls[name].append(fresh_step_seconds(policies[name], args.rank, pg=samples))
    medians = {name: statistics.median(w) for name, w in walls.items()}
    for name, policy in policies.items():
        prof = profile(activities=[ProfilerActivity.CPU], record_shapes=args.shapes)
        fresh_step_seconds(policy, args.rank, pg=samples, prof=prof)
        events = prof.key_averages()
        total = sum(e.self_cpu_time_total for e in events)
        gemm = sum(e.self_cpu_time_total for e in events if _is_gemm(e.key))
        print(f"\n## {name}: step median {medians[name]:.3f} s over {args.reps}")
        print(f"GEMM ops {gemm / total:.0%} of self CPU time, the rest {1 - gemm / total:.0%}")
        print(events.table(sort_by="self_cpu_time_total", row_limit=args.top))
        if args.shapes:
            by_shape = [e for e in prof.key_averages(group_by_input_shape=True) if _is_gemm(e.key)]
            by_shape.sort(key=lambda e: -e.self_cpu_time_total)
            for e in by_shape[: args.top]:
                print(
                    f"{e.key:12s} {e.count:5d} x {e.self_cpu_time_total / 1e3 / e.count:8.3f} ms"
                    f" = {e.self_cpu_time_total / 1e3:8.1f} ms  {e.input_shapes}"
                )
    ratio = medians["float32"] / medians["bfloat16"]
    print(f"\nbf16 step vs fp32: {ratio:.2f}x")
    facts = machine_facts()
    facts["cpu capability (torch)"] = torch.backends.cpu.get_cpu_capability()
    print(format_facts(facts))


if __name__ == "__main__":
    main()
