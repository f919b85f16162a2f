"""Smoke run of `python -m benchmarks.train --quick`, and the staleness simulator.

The smoke runs check that every measurement ran and the table has its shape,
never the figures (a tiny random model and a shared CPU say nothing about
speed). The simulator is deterministic, so its properties are checked exactly.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import train
from benchmarks.staleness import EARLY, POLICIES, TRAIN_BATCH, FeedbackStream, simulate
from clora_feedback.bench.report import check_shape, read_table


def test_train_quick_runs_every_measurement(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert train.run(["--quick", "--json", str(tmp_path / "train.json")]) == 0
    table = read_table(capsys.readouterr().out)
    loads = [f"5{x}-{m}" for x in "abc" for m in ("arch", "total")]
    assert check_shape(table, ["1", "2", "2b", "3", "3b", "3c", "4", "4b", "6", "7", *loads]) == []
    raw = json.loads((tmp_path / "train.json").read_text())
    for tenancy in (raw["tenancy"], raw["small"]):
        assert len(tenancy["batched_s"]) == len(tenancy["serial_s"]) == 1
        assert len(tenancy["swap_s"]) == len(tenancy["step_s"]) == 4  # a swap step per agent
    assert len(raw["prefix"]["shared_s"]) == len(raw["prefix"]["per_row_s"]) == 1
    assert len(raw["publish"]["latency_s"]) == 1
    assert all(raw["interference"]["gaps_s"][c] for c in ("off", "hand-off", "durable"))
    assert raw["interference"]["publishes"]["off"] == 0
    assert raw["interference"]["publishes"]["durable"] > 0


def test_staleness_simulation_pairs_policies_on_one_stream() -> None:
    stream = FeedbackStream(rate_per_s=0.1, duration_s=3000.0)
    baseline, early = (simulate(stream, p) for p in POLICIES)
    assert simulate(stream, EARLY) == early  # deterministic
    # Train-batch admission: mini-batch j of a batch trains after j publishes of the
    # same batch, all after its samples' rewards arrived, so the mean is at least 1.5.
    assert baseline.mean_architectural >= 1.5
    # Mini-batches of 4 either way: one version per 4 trained samples in both.
    assert baseline.steps * 4 == baseline.trained and early.steps * 4 == early.trained
    # At low load early admission trains a sample before any other step ends, mostly.
    assert early.mean_architectural < 0.2 < baseline.mean_architectural
    assert early.mean_total < baseline.mean_total
    assert TRAIN_BATCH.admission.full_batch and not EARLY.admission.full_batch
