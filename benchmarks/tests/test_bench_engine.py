"""Smoke runs of `python -m benchmarks.serve` on the tiny model: every measurement runs, the
table has its rows, and the decode-step profile.

Never the figures: a tiny random model on a shared CPU says nothing about speed.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from benchmarks import serve
from clora_feedback.model.tiny import build_tiny_model_dir


def test_serve_bench_quick_runs_every_measurement(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model_dir = build_tiny_model_dir(tmp_path / "tiny", seed=0, max_position_embeddings=1024)
    argv = ["--quick", "--model", str(model_dir), "--new-tokens", "4"]
    argv += ["--agent-tokens", "3"]
    argv += ["--gateway-reps", "3", "--json", str(tmp_path / "serve.json"), "--threads", "1"]
    threads = torch.get_num_threads()
    try:
        assert serve.run(argv) == 0
    finally:
        torch.set_num_threads(threads)  # --threads is process-wide
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ")]
    assert [r.split("|")[1].strip()[:2] for r in rows[1:]] == [
        "1.",
        "2.",
        "3.",
        "3.",
        "3.",
        "3.",
        "4.",
    ]
    assert "nan" not in out and "WARNING" not in out
    results = json.loads((tmp_path / "serve.json").read_text())["results"]
    for key in ("mixed_ratio", "multiplex_ratio", "decode_speedup_single", "speedup_batch8"):
        assert results[key] > 0
    assert results["gateway_http_ms"] > 0


def test_decode_profile_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model_dir = build_tiny_model_dir(tmp_path / "tiny", seed=0, max_position_embeddings=1024)
    assert serve.run(["--decode-profile", "--model", str(model_dir), "--reps", "1"]) == 0
    out = capsys.readouterr().out
    for case in ("decode_mixed_permuted", "lora_mixed_rank8", "mixed_vs_one_decode"):
        assert f"| {case} |" in out
    assert "nan" not in out and "inf" not in out


def _run_shape_bench(
    run: Callable[[list[str]], int], tmp_path: Path, capsys: pytest.CaptureFixture[str], tokens: int
) -> str:
    """Run a batch-shape benchmark on the tiny model at one thread; its output."""
    model_dir = build_tiny_model_dir(tmp_path / "tiny", seed=0, max_position_embeddings=1024)
    argv = ["--model", str(model_dir), "--rows", "2", "--tokens", str(tokens), "--reps", "1"]
    threads = torch.get_num_threads()
    try:
        assert run([*argv, "--threads", "1", "--json", str(tmp_path / "r.json")]) == 0
    finally:
        torch.set_num_threads(threads)
    record = json.loads((tmp_path / "r.json").read_text())
    assert all(v > 0 for v in record["ratios"].values())
    return capsys.readouterr().out


def test_mixed_rows_bench_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks import mixed_rows

    out = _run_shape_bench(mixed_rows.run, tmp_path, capsys, tokens=3)
    assert "another adapter / same adapter" in out and "cpu" in out


def test_fused_prefill_bench_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks import fused_prefill

    out = _run_shape_bench(fused_prefill.run, tmp_path, capsys, tokens=6)
    assert "2 tokens/step / alone" in out and "unfused / alone" in out and "cpu" in out
