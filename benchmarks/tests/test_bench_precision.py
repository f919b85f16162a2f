"""Smoke run of `python -m benchmarks.precision --quick`: never the figures, every row and curve."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import precision
from clora_feedback.train.policy import COMPUTE_DTYPES


def test_bench_precision_quick_runs_both_dtypes(tmp_path: Path) -> None:
    """`python -m benchmarks.precision --quick`: every row printed, curves for both dtypes and all seeds."""
    out = tmp_path / "precision.json"
    assert precision.run(["--quick", "--seeds", "2", "--steps", "1", "--json", str(out)]) == 0
    raw = json.loads(out.read_text())
    assert {c["dtype"] for c in raw["curves"]} == set(COMPUTE_DTYPES)
    assert len(raw["curves"]) == 4 and all(len(c["step_s"]) == 1 for c in raw["curves"])
    assert all(len(c["held_out_p"]) == 2 for c in raw["curves"])
    assert raw["flops"] > 0 and set(raw["gemm"]) == set(COMPUTE_DTYPES)
    assert 0.8 < raw["ratios"]["min"] <= raw["ratios"]["max"] < 1.2
    assert {d: len(t) for d, t in raw["sft_times"].items()} == dict.fromkeys(COMPUTE_DTYPES, 1)
