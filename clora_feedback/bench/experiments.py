"""The C-LoRA experiment: N learning experiments on one warm service vs one after another.

Each experiment is the tool-use workload (`clora_feedback.demo`: arithmetic
word problems, `calculator` + `final_answer`, reward 1.0 for the right number,
developer corrections of the first wrong turn) run for K synchronous
optimizer steps through the real gateway and continual trainer, as
`clora_feedback.demo.experiment.run_agent` does.

For every N in `--ns`:

- **concurrent**: one fresh process starts one service (one cold start:
  interpreter, model load, engine warm-up) and runs the N experiments at
  once, one agent each; rollouts share the engine's decode batches and the
  trainer takes turns between agents (`--batched-agents` > 1 lets it train
  several in one pass instead);
- **serial**: the same N experiments as N single-tenant processes, one after
  another, each with its own cold start, as a conventional stack would run
  them. The serial runs are done once for the largest N; serial(N) is the
  first N of them.

Per N, in the shape of C-LoRA's table: end-to-end throughput speedup
(serial makespan / concurrent makespan, i.e. experiments per hour), time to
the first finished experiment, mean experiment time (all N submitted at
t=0; completion time, queueing included), mean step time (rollout + train,
as each experiment waits for its new version) and mean rollout time, and
the final reward (mean training reward of the last step, mean and std over
the N experiments).

Run: `clora bench experiments [--ns 1,2,4,8] [--steps K] ...`; writes a
Markdown table, a JSON record and a PNG (speedup and step time vs N).

Not here: the workload and the learning loop (`clora_feedback.demo`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from clora_feedback.demo.experiment import (
    AgentRun,
    ExperimentConfig,
    run_concurrent,
    run_single,
)

C_LORA_SPEEDUP_N8 = 2.81
"""C-LoRA's end-to-end throughput speedup at N=8 (Qwen3-4B, one H200 node)."""


def _load_runs(path: Path) -> list[AgentRun]:
    return [AgentRun.from_dict(item) for item in json.loads(path.read_text())["runs"]]


def _child(args: argparse.Namespace) -> int:
    """Inside a child process: run one single-tenant experiment or N concurrent ones."""
    cfg = ExperimentConfig(**json.loads(args.config))
    model_dir = Path(args.model_dir)
    work = Path(args.work)
    if args.child == "single":
        runs = [run_single(model_dir, work, cfg, args.seed)]
    else:
        runs = run_concurrent(model_dir, work, cfg, list(range(args.n)))
    Path(args.out).write_text(json.dumps({"runs": [r.as_dict() for r in runs]}))
    return 0


def _spawn(argv: list[str], log_path: Path) -> tuple[float, float]:
    """Run a child to completion; (wall-clock launch time, wall seconds), cold start included."""
    env = dict(os.environ)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle OpenMP threads sleep on shared cores
    t0 = time.time()
    with log_path.open("w") as log:
        proc = subprocess.run(
            [sys.executable, "-m", "clora_feedback.bench.experiments", *argv],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            check=False,
        )
    wall = time.time() - t0
    if proc.returncode != 0:
        raise SystemExit(f"experiment child failed ({proc.returncode}); see {log_path}")
    return t0, wall


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    vals = [v for v in values if math.isfinite(v)]
    if not vals:
        return float("nan"), float("nan")
    return statistics.fmean(vals), statistics.stdev(vals) if len(vals) > 1 else 0.0


def _step_means(runs: Sequence[AgentRun]) -> tuple[float, float]:
    steps = [s for r in runs for s in r.steps]
    return statistics.fmean(s.step_s for s in steps), statistics.fmean(s.rollout_s for s in steps)


def summarize(
    n: int,
    concurrent: list[AgentRun],
    concurrent_t0: float,
    concurrent_wall: float,
    serial: list[tuple[AgentRun, float]],
) -> dict[str, Any]:
    """One table row: concurrent N vs the first N serial runs (each (run, process wall))."""
    serial = serial[:n]
    walls = [w for _, w in serial]
    completion = [sum(walls[: i + 1]) for i in range(n)]  # all submitted at t=0, one at a time
    serial_makespan = completion[-1]
    conc_done = [r.finished_at - concurrent_t0 for r in concurrent]
    step_c, roll_c = _step_means(concurrent)
    step_s, roll_s = _step_means([r for r, _ in serial])
    reward_c = _mean_std([r.steps[-1].reward for r in concurrent])
    reward_s = _mean_std([r.steps[-1].reward for r, _ in serial])
    return {
        "n": n,
        "speedup": serial_makespan / concurrent_wall,
        "serial_makespan_s": serial_makespan,
        "concurrent_makespan_s": concurrent_wall,
        "first_done_s": min(conc_done),
        "serial_first_done_s": completion[0],
        "mean_experiment_s": statistics.fmean(conc_done),
        "serial_mean_experiment_s": statistics.fmean(completion),
        "step_s": step_c,
        "serial_step_s": step_s,
        "rollout_s": roll_c,
        "serial_rollout_s": roll_s,
        "reward_mean": reward_c[0],
        "reward_std": reward_c[1],
        "serial_reward_mean": reward_s[0],
        "serial_reward_std": reward_s[1],
        "cold_start_s": statistics.fmean(r.cold_start_s for r in concurrent),
        "serial_cold_start_s": statistics.fmean(r.cold_start_s for r, _ in serial),
    }


def table(rows: Sequence[dict[str, Any]]) -> str:
    """The C-LoRA-shaped Markdown table (concurrent figure, serial figure in parentheses)."""
    head = (
        "| N | throughput speedup | first experiment done (s) | mean experiment time (s) "
        "| mean step time (s) | mean rollout time (s) | final reward (mean ± std) |\n"
        "|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"| {r['n']} | {r['speedup']:.2f}x | {r['first_done_s']:.0f} ({r['serial_first_done_s']:.0f}) "
            f"| {r['mean_experiment_s']:.0f} ({r['serial_mean_experiment_s']:.0f}) "
            f"| {r['step_s']:.1f} ({r['serial_step_s']:.1f}) "
            f"| {r['rollout_s']:.1f} ({r['serial_rollout_s']:.1f}) "
            f"| {r['reward_mean']:.2f} ± {r['reward_std']:.2f} "
            f"({r['serial_reward_mean']:.2f} ± {r['serial_reward_std']:.2f}) |"
        )
    return "\n".join(lines)


def goals(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The issue's goals, checked against the rows."""
    by_n = {r["n"]: r for r in rows}
    out = []
    if 8 in by_n:
        r = by_n[8]
        within = abs(r["reward_mean"] - r["serial_reward_mean"]) <= max(
            r["serial_reward_std"], 1e-9
        )
        out.append(
            f"N=8 speedup {r['speedup']:.2f}x vs C-LoRA's {C_LORA_SPEEDUP_N8}x: "
            f"{'met' if r['speedup'] > C_LORA_SPEEDUP_N8 else 'not met'}; final reward within one "
            f"serial std: {'yes' if within else 'no'}"
        )
    if 1 in by_n and 2 in by_n:
        growth = by_n[2]["rollout_s"] / by_n[1]["rollout_s"] - 1
        out.append(
            f"rollout time N=2 vs N=1: {growth:+.0%} (goal <= +15%): "
            f"{'met' if growth <= 0.15 else 'not met'}"
        )
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="clora bench experiments", description=__doc__.split("\n")[0])
    p.add_argument("--ns", default="1,2,4,8", help="Concurrency levels (comma list).")
    p.add_argument("--steps", type=int, default=3, help="Optimizer steps K per experiment.")
    p.add_argument(
        "--tasks-per-step", type=int, default=4, help="Problems per step per experiment."
    )
    p.add_argument("--batched-agents", type=int, default=1, help="Agents per training pass.")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores).")
    p.add_argument("--max-model-len", type=int, default=768, help="Engine context per sequence.")
    p.add_argument("--model", default="smollm2-135m-instruct", help="Base model name or directory.")
    p.add_argument("--model-cache", type=Path, default=None, help="Model cache (default var/models).")  # fmt: skip
    p.add_argument("--engine", choices=["embedded", "vllm"], default="embedded",
                   help="Serving engine; vllm needs --vllm-url (the trainer keeps its own copy).")  # fmt: skip
    p.add_argument("--vllm-url", action="append", default=None, help="vLLM server (repeatable).")
    p.add_argument("--out", type=Path, default=Path("docs/results/experiments"), help="Output prefix.")  # fmt: skip
    p.add_argument("--work", type=Path, default=None, help="Scratch directory (default: temporary).")  # fmt: skip
    # Child-process plumbing (not for users).
    p.add_argument("--child", choices=["single", "concurrent"], help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--n", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--child-out", dest="child_out", help=argparse.SUPPRESS)
    return p


def run(argv: Sequence[str]) -> int:
    """`clora bench experiments [options]`: run, print the table, write JSON/Markdown/PNG."""
    args = build_parser().parse_args(list(argv))
    if args.child:
        args.out = args.child_out
        return _child(args)
    from clora_feedback.config import Settings
    from clora_feedback.models.resolve import resolve_model_dir

    ns = sorted({int(x) for x in args.ns.split(",")})
    cfg = ExperimentConfig(
        workload="tool-use",
        steps=args.steps,
        tasks_per_step=args.tasks_per_step,
        samples_per_task=1,
        eval_tasks=0,
        temperature=0.8,
        lr=1e-3,
        corrections=True,
        batched_agents=args.batched_agents,
        num_threads=args.threads,
        max_model_len=args.max_model_len,
        vllm_urls=tuple(args.vllm_url or ()) if args.engine == "vllm" else (),
    )
    if args.engine == "vllm" and not cfg.vllm_urls:
        raise SystemExit("--engine vllm needs --vllm-url (start one: clora serve --engine vllm)")
    model_dir = resolve_model_dir(args.model, args.model_cache or Settings().model_cache_dir)
    work = args.work or Path(tempfile.mkdtemp(prefix="clora-bench-experiments-"))
    work.mkdir(parents=True, exist_ok=True)
    common = ["--config", json.dumps(asdict(cfg)), "--model-dir", str(model_dir)]

    serial: list[tuple[AgentRun, float]] = []
    for seed in range(max(ns)):
        out = work / f"serial-{seed}.json"
        _, wall = _spawn(
            ["--child", "single", "--seed", str(seed), "--work", str(work / f"serial-{seed}"),
             "--child-out", str(out), *common],
            work / f"serial-{seed}.log",
        )  # fmt: skip
        serial.append((_load_runs(out)[0], wall))
        print(f"serial experiment {seed}: {wall:.0f} s", flush=True)
    rows = []
    for n in ns:
        out = work / f"concurrent-{n}.json"
        t0, wall = _spawn(
            ["--child", "concurrent", "--n", str(n), "--work", str(work / f"concurrent-{n}"),
             "--child-out", str(out), *common],
            work / f"concurrent-{n}.log",
        )  # fmt: skip
        rows.append(summarize(n, _load_runs(out), t0, wall, serial))
        print(f"concurrent N={n}: {wall:.0f} s (speedup {rows[-1]['speedup']:.2f}x)", flush=True)
    _write(args.out, cfg, rows, serial)
    return 0


def _write(
    prefix: Path,
    cfg: ExperimentConfig,
    rows: list[dict[str, Any]],
    serial: list[tuple[AgentRun, float]],
) -> None:
    text = table(rows)
    checks = goals(rows)
    print("\n" + text + "\n\n" + "\n".join(checks))
    prefix.parent.mkdir(parents=True, exist_ok=True)
    prefix.with_suffix(".md").write_text(text + "\n\n" + "\n".join(f"- {c}" for c in checks) + "\n")
    record = {
        "config": asdict(replace(cfg)),
        "rows": rows,
        "serial_walls_s": [w for _, w in serial],
        "goals": checks,
    }
    prefix.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")
    try:
        from clora_feedback.demo.plots import speedup_plot

        speedup_plot(prefix.with_suffix(".png"), rows, reference=C_LORA_SPEEDUP_N8)
    except Exception as exc:  # the table and JSON are the record; a missing matplotlib is not fatal
        print(f"no plot: {exc}")


if __name__ == "__main__":
    raise SystemExit(run(sys.argv[1:]))
