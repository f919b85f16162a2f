"""Benchmarks behind `clora bench WHAT` that drive a running gateway (or its roles as
processes) from outside, as a user does: measured ratios printed as a table.

`run_bench(what, argv)` runs the `run(argv)` of `BENCHMARKS[what]`: `serve`
(the serving figures through HTTP, the gateway on the embedded engine or on
vLLM), `ingest` (feedback from a real broker into the store), `experiments`
(the C-LoRA experiment), `scaleout` (the roles as processes, 1 vs 2),
`learning` (held-out accuracy against wall time on task families the repo was
not tuned for, default trainer settings), `release` (the release path end to end:
time to a promoted version, a collapsed candidate rejected, a worse-live canary
aborted, and their exposure), `agents` (8, 100 and 1,000 agents with their own
adapters: throughput, cold and warm time to first token, start-up, memory per
idle agent). Benchmarks are programs, not tests:
their figures are recorded in `docs/benchmarks.md`.

Not here: the white-box benchmarks of engine and trainer internals (training
step, publish, precision, prefix cache, decode profile, the in-process engine
figures); they live outside the package, in the repository's `benchmarks/`
(`python -m benchmarks.train`), and this package never imports engine or
trainer internals (`tests/test_package.py`).
"""

from __future__ import annotations

import importlib
import os
import sys

from clora_feedback.cores import configure_waits, main_thread_alone

BENCHMARKS = {
    "serve": "serve_gateway",
    "ingest": "ingest",
    "experiments": "experiments",
    "scaleout": "scaleout",
    "learning": "learning",
    "release": "release",
    "agents": "agents",
}
"""The names `run_bench` accepts, and the module of this package that runs each."""

OMP_WAIT_POLICIES = ("product", "passive", "active", "inherit")
"""Values of `--omp-wait-policy`: `product` (the default): idle OpenMP workers spin briefly,
then sleep, as every `clora` command sets (`cores.configure_waits`); `passive`: they sleep at
once; `active`: they spin; `inherit`: as the environment says."""


def apply_omp_wait_policy(argv: list[str]) -> None:
    """Set the OpenMP wait policy `--omp-wait-policy` names (default `product`) before torch loads.

    OpenMP reads its variables once, when torch is first imported, so this must
    run first; once torch is imported nothing changes. Sleeping workers pay a
    wake-up per parallel region; spinning ones stall other processes on the same
    cores (see `clora_feedback.cores` and docs/benchmarks.md).
    """
    policy = "product"
    for i, arg in enumerate(argv):
        if arg == "--omp-wait-policy" and i + 1 < len(argv):
            policy = argv[i + 1]
        elif arg.startswith("--omp-wait-policy="):
            policy = arg.split("=", 1)[1]
    if policy == "inherit" or "torch" in sys.modules:
        return
    if policy == "product":
        configure_waits()
        return
    os.environ.pop("GOMP_SPINCOUNT", None)  # a spin count overrides the policy in libgomp
    os.environ["OMP_WAIT_POLICY"] = policy.upper()


def run_bench(what: str, argv: list[str]) -> int:
    """Run benchmark `what` with its own command-line options `argv`; returns an exit code."""
    if what not in BENCHMARKS:
        raise SystemExit(f"unknown benchmark {what!r}; choose from {', '.join(BENCHMARKS)}")
    if what == "serve":
        apply_omp_wait_policy(argv)
    module = importlib.import_module(f"clora_feedback.bench.{BENCHMARKS[what]}")
    with main_thread_alone():  # as `clora serve` computes (see `cores`)
        result: int = module.run(argv)
    return result
