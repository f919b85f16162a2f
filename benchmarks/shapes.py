"""What the in-process batch-shape benchmarks share (`mixed_rows`, `fused_prefill`): their
common options and their closing lines (ratios, the CPU's facts, the optional JSON record).

Not here: the shapes each one measures.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from clora_feedback.bench.report import machine_facts
from clora_feedback.config import DEFAULT_MODEL


def add_engine_options(p: argparse.ArgumentParser, *, dtype: str) -> None:
    """`--model`, `--reps`, `--dtype` (default `dtype`), `--threads`, `--json`."""
    p.add_argument("--model", default=DEFAULT_MODEL, help="Base model (default: the default).")
    p.add_argument("--reps", type=int, default=3, help="Measured repetitions per shape.")
    p.add_argument("--dtype", default=dtype, help="engine.dtype (float32, bfloat16, auto).")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all).")
    p.add_argument("--json", type=Path, default=None, help="Also write the figures here.")


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
