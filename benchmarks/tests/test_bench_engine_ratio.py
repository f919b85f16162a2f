"""Smoke run of `python -m benchmarks.engine_ratio` on the tiny model: a row per dtype."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import engine_ratio
from clora_feedback.model.tiny import build_tiny_model_dir


def test_engine_ratio_reports_each_dtype(tmp_path: Path) -> None:
    model = build_tiny_model_dir(tmp_path / "tiny", seed=0)
    out = tmp_path / "ratio.json"
    argv = ["--model", str(model), "--prompts", "2", "--tokens", "4", "--json", str(out)]
    assert engine_ratio.run(argv) == 0
    figures = json.loads(out.read_text())["figures"]
    assert set(figures) == {"float32", "bfloat16"}
    assert figures["float32"]["max"] < 1e-4  # one pass's values in fp32: ratio 1
