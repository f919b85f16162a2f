"""Benchmarks behind `clora bench WHAT`: measured ratios printed as a table.

`run_bench(what, argv)` runs module `clora_feedback.bench.<what>`'s
`run(argv)`: `serve` (serving engine and gateway), `train`, `ingest` and
`experiments` (the C-LoRA experiment), `scaleout` (the roles as processes, 1 vs 2), `precision` (bf16 vs fp32
training compute), `learning` (held-out accuracy against wall time on task families
the repo was not tuned for, default trainer settings).
Benchmarks are programs, not tests: their figures are recorded in
`docs/benchmarks.md`.
"""

from __future__ import annotations

import importlib
import os
import sys

BENCHMARKS = ("serve", "train", "ingest", "experiments", "scaleout", "precision", "learning")
"""The names `run_bench` accepts."""

OMP_WAIT_POLICIES = ("passive", "active", "inherit")
"""Values of `--omp-wait-policy` (`inherit`: leave OMP_WAIT_POLICY as the environment has it)."""


def apply_omp_wait_policy(argv: list[str]) -> None:
    """Set OMP_WAIT_POLICY from `--omp-wait-policy` (default passive) before torch loads.

    OpenMP reads the variable once, when torch is first imported, so this must
    run first. PASSIVE makes idle OpenMP threads sleep instead of spinning;
    with other processes on the cores, spinning threads stall each other
    (see docs/benchmarks.md). Too late once torch is imported: then nothing changes.
    """
    policy = "passive"
    for i, arg in enumerate(argv):
        if arg == "--omp-wait-policy" and i + 1 < len(argv):
            policy = argv[i + 1]
        elif arg.startswith("--omp-wait-policy="):
            policy = arg.split("=", 1)[1]
    if policy != "inherit" and "torch" not in sys.modules:
        os.environ["OMP_WAIT_POLICY"] = policy.upper()


def run_bench(what: str, argv: list[str]) -> int:
    """Run benchmark `what` with its own command-line options `argv`; returns an exit code."""
    if what not in BENCHMARKS:
        raise SystemExit(f"unknown benchmark {what!r}; choose from {', '.join(BENCHMARKS)}")
    if what == "serve":
        apply_omp_wait_policy(argv)
    module = importlib.import_module(f"clora_feedback.bench.{what}")
    result: int = module.run(argv)
    return result
