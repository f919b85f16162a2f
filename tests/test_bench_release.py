"""`clora bench release` runs end to end on the tiny model and writes its result's shape (a
smoke test: the figures are the real model's, in docs/benchmarks.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clora_feedback.bench.release import run


@pytest.mark.slow
def test_release_bench_runs_its_four_phases(tiny_model_dir: Path, tmp_path: Path) -> None:
    argv = ["--model", str(tiny_model_dir), "--minutes", "0.2", "--users", "2", "--think", "0.1",
            "--held-out", "4", "--canary-timeout", "5", "--gate-pairs", "3", "--gate-window", "1",
            "--other-clients", "2", "--other-max-tokens", "8", "--out", str(tmp_path / "out"),
            "--work", str(tmp_path / "work")]  # fmt: skip
    assert run(argv) == 0
    result = json.loads((tmp_path / "out" / "release.json").read_text())
    assert result["held_out"] and result["held_out"][0]["version"] == 0
    for phase in ("collapsed", "worse_live"):
        assert {"version", "state", "served_by_it", "requests_meanwhile"} <= set(result[phase])
    assert result["collapsed"]["version"] < result["worse_live"]["version"]
    cost = result["gate_cost"]  # shape and sanity only: the figures come from real runs
    assert [w["gate"] for w in cost["windows"]] == [False, True] * 3 and cost["pairs"] == 3
    assert all(w["seconds"] > 0 and w["tokens"] >= 0 for w in cost["windows"])
    assert cost["tokens_per_s_without"] > 0 and cost["ratio"] > 0
    assert cost["evaluations"] >= 3 and sum(cost["states"].values()) == cost["evaluations"]
