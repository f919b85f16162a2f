"""`clora demo` end to end on the tiny model: gateway, Kafka resolutions, webhook corrections, versions.

A short run (a couple of optimizer steps per agent) of the real demo: the
support agent's operator publishes resolutions to a real Tansu broker, the
coding agent's developer posts corrections to the webhook, the trainer
publishes versions, and the demo writes its curves, table and summary.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
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
            think_s=0.0,
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
    argv = ["--ns", "1,2", "--steps", "2", "--tasks-per-step", "1", "--threads", "1"]
    argv += ["--model", str(tiny_model_dir), "--max-model-len", "2048", "--out", str(out)]
    argv += ["--work", str(tmp_path / "work"), "--schedule", "lockstep"]
    assert run(argv) == 0
    record = json.loads(out.with_suffix(".json").read_text())
    assert [r["n"] for r in record["rows"]] == [1, 2]
    assert len(record["serial_walls_s"]) == 2
    for row in record["rows"]:
        assert row["speedup"] > 0 and row["step_s"] > 0 and row["rollout_s"] > 0
        assert row["serial_makespan_s"] == pytest.approx(sum(record["serial_walls_s"][: row["n"]]))
        assert row["calibration"]["n"] == row["n"] and row["calibration"]["one_s"] > 0
        assert row["bound"] == pytest.approx(row["serial_makespan_s"] / row["ideal_s"])
        assert row["of_bound"] == pytest.approx(row["ideal_s"] / row["concurrent_makespan_s"])
    assert "| 2 |" in out.with_suffix(".md").read_text()
    # Lockstep: no agent starts step 2 before every agent's step 1 is live.
    runs = json.loads((tmp_path / "work" / "concurrent-2.json").read_text())["runs"]
    first, second = ([r["steps"][k] for r in runs] for k in (0, 1))
    assert min(s["started_at"] for s in second) >= max(s["ended_at"] for s in first)


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow
def test_ctrl_c_stops_the_demo_cleanly_and_still_writes_results(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """SIGINT to the demo's process group, as a terminal's Ctrl-C sends it: exit 0, results
    written and marked interrupted, the broker it started gone."""
    pytest.importorskip("matplotlib")
    data, out = tmp_path / "var", tmp_path / "out"
    argv = [sys.executable, "-m", "clora_feedback.cli", "demo", "--model", str(tiny_model_dir)]
    argv += ["--data-dir", str(data), "--out", str(out), "--no-progress", "--minutes", "5"]
    # No version target: only the Ctrl-C (or 5 minutes) may end it, however fast it trains.
    argv += ["--users", "1", "--batch", "2", "--threads", "1", "--versions", "0", "--think", "0.2"]
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        # As from a terminal: a run started in the background (`cmd &` in a script) inherits
        # SIGINT ignored, and Python then never turns Ctrl-C into KeyboardInterrupt.
        preexec_fn=_default_sigint,
    )
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + 120
    try:
        for line in proc.stdout:  # the first live line: users are sending, the trainer runs
            lines.append(line)
            # "[   0 s] support  requests ...": one plain line per new version, no terminal.
            if " requests " in line or time.monotonic() > deadline:
                break
        time.sleep(2.0)
        os.killpg(proc.pid, signal.SIGINT)
        rest, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    output = "".join(lines) + rest
    assert proc.returncode == 0, output
    assert "interrupted: stopping" in output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] is True
    assert (out / "versions.md").exists()
    assert not _processes_mentioning(str(data)), "the demo's broker outlived it"
    # Without a terminal: one plain line per new version of an agent, no cursor codes.
    live = re.findall(r"^\[\s*\d+ s\] (\w+) .* version v(\d+) ", output, re.M)
    assert live and len(live) == len(set(live)), live
    assert "\x1b[" not in output


def _processes_mentioning(text: str) -> list[int]:
    """Pids whose command line contains `text` (Linux /proc)."""
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if text.encode() in cmdline.read_bytes():
                pids.append(int(cmdline.parent.name))
        except OSError:  # the process ended while we looked
            continue
    return pids
