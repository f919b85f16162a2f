"""`clora demo` end to end on the tiny model: gateway, Kafka resolutions, webhook corrections, versions.

A short run (a couple of optimizer steps per agent) of the real demo: the
support agent's operator publishes resolutions to a real Tansu broker, the
coding agent's developer posts corrections to the webhook, the trainer
publishes versions, and the demo writes its curves, table and summary.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clora_feedback.demo.runner import DemoConfig, run_demo


@pytest.mark.slow
def test_demo_learns_from_kafka_and_webhook_feedback(tiny_model_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "out"
    summary = run_demo(
        DemoConfig(
            model=str(tiny_model_dir),
            data_dir=tmp_path / "var",
            out_dir=out,
            versions=2,
            minutes=3.0,
            users=2,
            batch=4,
            num_threads=1,
            progress=False,
        )
    )
    assert not summary["interrupted"]
    for name in ("support", "coding"):
        agent = summary["agents"][name]
        assert agent["requests"] > 0 and agent["feedback"] > 0
        assert agent["version"] >= 2, f"{name} published no versions: {agent}"
        assert (out / f"reward_{name}.png").stat().st_size > 1000
    table = (out / "versions.md").read_text()
    assert "| support | v1 |" in table and "| coding | v1 |" in table
    assert json.loads((out / "summary.json").read_text()) == summary


@pytest.mark.slow
def test_c_lora_experiment_runs_serial_and_concurrent(tiny_model_dir: Path, tmp_path: Path) -> None:
    """`clora bench experiments` on the tiny model: cold-start children, the table, the record."""
    from clora_feedback.bench.experiments import run

    out = tmp_path / "experiments"
    argv = ["--ns", "1,2", "--steps", "1", "--tasks-per-step", "1", "--threads", "1"]
    argv += ["--model", str(tiny_model_dir), "--max-model-len", "2048", "--out", str(out)]
    argv += ["--work", str(tmp_path / "work")]
    assert run(argv) == 0
    record = json.loads(out.with_suffix(".json").read_text())
    assert [r["n"] for r in record["rows"]] == [1, 2]
    assert len(record["serial_walls_s"]) == 2
    for row in record["rows"]:
        assert row["speedup"] > 0 and row["step_s"] > 0 and row["rollout_s"] > 0
        assert row["serial_makespan_s"] == pytest.approx(sum(record["serial_walls_s"][: row["n"]]))
    assert "| 2 |" in out.with_suffix(".md").read_text()
