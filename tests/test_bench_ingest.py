"""Smoke run of `clora bench ingest --quick`: every measurement ran and the table has its shape.

Never the figures (a shared CPU says nothing about speed).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clora_feedback.bench import ingest
from clora_feedback.bench.report import check_shape, read_table


def test_ingest_quick_runs_every_measurement(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    argv = ["--quick", "--events", "300", "--latency-events", "100"]
    assert ingest.run([*argv, "--json", str(tmp_path / "i.json")]) == 0
    assert check_shape(read_table(capsys.readouterr().out), ["1", "1b", "2", "2b"]) == []
    raw = json.loads((tmp_path / "i.json").read_text())
    assert len(raw["kafka_eps"]) == len(raw["apply_eps"]) == 1
    assert len(raw["latency_s"]) == 100 and min(raw["latency_s"]) > 0
    counters = raw["consumer"]
    assert counters["malformed"] == counters["rejected"] == counters["dead_lettered"] == 0
    assert counters["applied"] == 20 + 300 + 100  # warm-up, backlog, paced: every event joined
