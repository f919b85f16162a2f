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


def test_the_verdict_is_the_trend_not_two_samples() -> None:
    """A resident set that swings with each training step but does not creep reads flat;
    one that creeps 10% over the window reads about 10%, whichever samples end it."""
    swing = [(60.0 * i, 4000.0 + (900.0 if i % 2 else 0.0)) for i in range(31)]
    flat = soak.growth([{"t_s": t, "rss_mb": y} for t, y in swing], 30)
    assert abs(flat["trend_pct"]) < 2 and flat["floor_growth_pct"] == 0.0
    creep = [(t, y + 0.1 * 4450.0 * max(0.0, t - 600) / 1200) for t, y in swing]
    crept = soak.growth([{"t_s": t, "rss_mb": y} for t, y in creep], 30)
    assert 8.0 < crept["trend_pct"] < 12.0, crept
