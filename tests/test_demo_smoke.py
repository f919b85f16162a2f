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
