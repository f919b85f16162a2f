"""Smoke test of `python -m benchmarks.soak` on the tiny random model: it serves and trains,
samples the resident set and writes its summary; the figures are not checked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks import soak
from clora_feedback.model.tiny import build_tiny_model_dir


@pytest.mark.slow  # the whole service (gateway, trainer, webhook) for a few seconds
def test_soak_samples_and_summarises(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model_dir = build_tiny_model_dir(tmp_path / "tiny", seed=0, max_position_embeddings=2048)
    out = tmp_path / "soak.jsonl"
    argv = ["--model", str(model_dir), "--agents", "2", "--users", "2", "--minutes", "0.15",
            "--interval", "2", "--tensor-every", "2", "--out", str(out)]  # fmt: skip
    threads = torch.get_num_threads()
    try:
        assert soak.main(argv) == 0
    finally:
        torch.set_num_threads(threads)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    samples, summary = lines[:-1], lines[-1]["summary"]
    assert len(samples) >= 3 and all(s["rss_mb"] > 0 for s in samples)
    assert summary["agents"] == 2 and summary["requests"] > 0
    assert summary["rss_end_mb"] > 0 and "growth_pct" in summary
    assert '"summary"' in capsys.readouterr().out
