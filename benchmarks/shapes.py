"""What the in-process benchmarks share: the batch-shape ones' (`mixed_rows`, `fused_prefill`)
common options and closing lines (ratios, the CPU's facts, the optional JSON record), a
`--dtypes` option (`fused_pass`, `engine_ratio`) and the table of median times
(`fused_pass`, `attention`).

Not here: the shapes each one measures.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from clora_feedback.bench.report import machine_facts
from clora_feedback.config import DEFAULT_MODEL


def add_dtypes_option(p: argparse.ArgumentParser, help_text: str) -> None:
    """`--dtypes`: compute dtypes, comma-separated (default: every one), unknown names refused."""
    from clora_feedback.train.policy import COMPUTE_DTYPES

    def names(text: str) -> list[str]:
        chosen = text.split(",")
        unknown = sorted(set(chosen) - set(COMPUTE_DTYPES))
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {unknown} (known: {list(COMPUTE_DTYPES)})")
        return chosen

    p.add_argument(
        "--dtypes",
        type=names,
        default=list(COMPUTE_DTYPES),
        help=f"{help_text}, comma-separated (default: {','.join(COMPUTE_DTYPES)}).",
    )


def add_engine_options(p: argparse.ArgumentParser, *, dtype: str) -> None:
    """`--model`, `--reps`, `--dtype` (default `dtype`), `--threads`, `--json`."""
    p.add_argument("--model", default=DEFAULT_MODEL, help="Base model (default: the default).")
    p.add_argument("--reps", type=int, default=3, help="Measured repetitions per shape.")
    p.add_argument("--dtype", default=dtype, help="engine.dtype (float32, bfloat16, auto).")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all).")
    p.add_argument("--json", type=Path, default=None, help="Also write the figures here.")


def print_medians(
    seconds: dict[str, list[float]], header: str, *, unit: str = "s"
) -> dict[str, float]:
    """Print `| header | unit (median of n) |` and one row per key; returns the medians (s)."""
    median = {key: statistics.median(values) for key, values in seconds.items()}
    reps = max((len(values) for values in seconds.values()), default=0)
    scale = {"s": 1.0, "ms": 1e3}[unit]
    print(f"| {header} | {unit} (median of {reps}) |")
    print("|---|---|")
    for key, value in median.items():
        print(f"| {key} | {value * scale:.3f} |")
    return median


def finish(args: argparse.Namespace, ratios: dict[str, float], record: dict[str, Any]) -> int:
    """Print the ratios and the machine's facts; write `record` with them to `--json`."""
    for name, value in ratios.items():
        print(f"- {name}: {value:.2f}x")
    facts = machine_facts()
    for key, fact in facts.items():
        print(f"- {key}: {fact}")
    if args.json is not None:
        record = record | {"ratios": ratios, "facts": facts, "args": vars(args)}
        args.json.write_text(json.dumps(record, indent=2, default=str))
    return 0
