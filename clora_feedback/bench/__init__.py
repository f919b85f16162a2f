"""Benchmarks behind `clora bench WHAT`: measured ratios printed as a table.

`run_bench("serve", argv)` runs the serving benchmarks (`clora_feedback.bench.serve`).
Benchmarks are programs, not tests: they are never collected by pytest and
their figures are recorded in `docs/benchmarks.md`.
"""

from __future__ import annotations

BENCHMARKS = ("serve",)
"""The names `run_bench` accepts."""


def run_bench(what: str, argv: list[str]) -> int:
    """Run benchmark `what` with its own command-line options `argv`; returns an exit code."""
    if what == "serve":
        from clora_feedback.bench.serve import main

        return main(argv)
    raise SystemExit(f"unknown benchmark {what!r}; choose from {', '.join(BENCHMARKS)}")
