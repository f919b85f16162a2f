"""`clora bench agents`: its pure parts (the adapters it writes fit the model, the stream,
the goal table); the benchmark itself runs against a real gateway (docs/benchmarks.md)."""

from __future__ import annotations

from pathlib import Path

from clora_feedback.bench.agents import Run, limits_of, rss_mb, table, write_adapters, zipf_stream
from clora_feedback.lora.peft_io import load_peft_adapter


def test_adapters_fit_the_model_and_the_stream_is_zipf(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    limits = limits_of(tiny_model_dir, ("q_proj", "v_proj"), 16)
    paths = write_adapters(tmp_path, 3, limits)
    weights = load_peft_adapter(paths["agent-0002"], limits=limits)
    assert weights.rank == 8 and weights.target_modules == ("q_proj", "v_proj")
    stream = zipf_stream(sorted(paths), 400, seed=0)
    assert stream == zipf_stream(sorted(paths), 400, seed=0)  # the same stream for every run
    counts = sorted((stream.count(a) for a in paths), reverse=True)
    assert counts[0] > counts[1] > counts[2] > 0


def test_the_table_checks_the_issue_goals() -> None:
    def run(agents: int, tput: float, rss: float, cold: float, start: float) -> Run:
        return Run(agents, 1.0, start, rss, rss, tput, agents, 5, 100.0, 150.0, cold, cold, 0)

    rows = {r.key: r for r in table([run(8, 100.0, 3000.0, 120.0, 5.0),
                                     run(1000, 85.0, 3500.0, 400.0, 12.0)])}  # fmt: skip
    assert rows["1000-tput"].met == "yes" and rows["1000-tput"].ratio == "0.85x"
    assert rows["1000-rss"].met == "yes"  # 500 MB over 992 agents
    assert rows["8-cold"].met == "yes" and rows["1000-cold"].met == "no"
    assert rows["1000-start"].met == "no" and rows["8-start"].met == "-"
    # On vLLM the same rows are reported: no goal binds them.
    reported = table([run(8, 100.0, 3000.0, 120.0, 5.0), run(1000, 85.0, 3500.0, 400.0, 12.0)],
                     binding=False)  # fmt: skip
    assert {r.met for r in reported} == {"reported"} and {r.goal for r in reported} == {"-"}
    assert [r.ratio for r in reported] == [r.ratio for r in rows.values()]


def test_rss_counts_the_processes_a_gateway_started() -> None:
    import os
    import subprocess
    import sys
    import time

    child = subprocess.Popen([sys.executable, "-c", "b = bytearray(200 << 20); import time; time.sleep(30)"])  # fmt: skip
    try:
        deadline = time.monotonic() + 20
        while rss_mb(os.getpid()) < rss_mb_alone() + 150 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert rss_mb(os.getpid()) >= rss_mb_alone() + 150
    finally:
        child.kill()
        child.wait()


def rss_mb_alone() -> float:
    import os

    for line in Path(f"/proc/{os.getpid()}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")
