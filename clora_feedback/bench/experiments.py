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
as each experiment waits for its new version), mean rollout and training
time, and the final reward (mean training reward of the last step, mean and
std over the N experiments).

**This machine's bound.** From the same run: the serial runs give each
experiment's rollout time R and training time T per step (T: feedback sent
to new version live, wall) and its overhead C outside the steps (interpreter,
imports, model load, shutdown: process wall minus the steps); after the
concurrent experiments, on the same warm service, `calibrate_rollouts`
replays one step's rollouts of one agent alone and of all N at once, whose
ratio is the rollout multiplier m(N) (1 would be free batching, N none).
With rollouts multiplexed at that measured efficiency and training
serialized across tenants, N experiments of K steps on one service take at
best

    ideal(N) = C + K * (m(N) * R + N * T)

against the serial makespan S(N) = N * (C + K * (R + T)) (measured), so the
speedup bound is S(N) / ideal(N), and the achieved speedup as a fraction of
it is ideal(N) / concurrent makespan. The calibration's own time is left out
of the concurrent makespan. A schedule can beat the bound only by overlapping
training with rollouts, which on a CPU means both find idle cores.

The trainer runs at serving's CPU priority here (`--trainer-nice 0`, the
service's default lowers it by 10): in these synchronous loops no request of
an experiment waits on the cores while its step trains (single-tenant or
lockstep), so a lower priority would only hand the cores to unrelated
processes of a shared machine and inflate the training time measured.

`--serial-runs M` (< max N) runs only M serial experiments and estimates
S(N) for larger N as N times their mean wall (marked `~` in the table).

Run: `clora bench experiments [--ns 1,2,4,8] [--steps K] [--schedule lockstep] ...`;
writes a Markdown table, a JSON record and a PNG (speedup and step time vs N).

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
    SCHEDULES,
    AgentRun,
    ExperimentConfig,
    RolloutCalibration,
    run_concurrent_calibrated,
    run_single,
)

C_LORA_SPEEDUP_N8 = 2.81
"""C-LoRA's end-to-end throughput speedup at N=8 (Qwen3-4B, one H200 node)."""


GOAL_FRACTION_OF_BOUND = 0.9
"""Issue 13 goal 5: the achieved speedup is at least this fraction of the bound."""


def _load_runs(path: Path) -> list[AgentRun]:
    return [AgentRun.from_dict(item) for item in json.loads(path.read_text())["runs"]]


def _load_calibration(path: Path) -> RolloutCalibration | None:
    item = json.loads(path.read_text()).get("calibration")
    if item is None:
        return None
    return RolloutCalibration(item["n"], item["one_s"], item["together_s"], item["wall_s"])


def ideal_concurrent_s(
    n: int, steps: int, rollout_s: float, train_s: float, multiplier: float, overhead_s: float
) -> float:
    """Best time for N experiments of `steps` steps on one service: rollouts multiplexed.

    `overhead_s` (C) once, then per step one multiplexed rollout round
    (`multiplier` m(N) times one experiment's rollout time R) and N trainings
    of T one after another: C + K * (m(N) * R + N * T).
    """
    return overhead_s + steps * (multiplier * rollout_s + n * train_s)


def serial_costs(serial: Sequence[tuple[AgentRun, float]]) -> dict[str, float]:
    """Means over serial runs: rollout R and training T per step, overhead C per process."""
    steps = [s for r, _ in serial for s in r.steps]
    return {
        "rollout_s": statistics.fmean(s.rollout_s for s in steps),
        "train_s": statistics.fmean(s.train_s for s in steps),
        "overhead_s": statistics.fmean(w - sum(s.step_s for s in r.steps) for r, w in serial),
        "steps": statistics.fmean(len(r.steps) for r, _ in serial),
    }


def _child(args: argparse.Namespace) -> int:
    """Inside a child process: run one single-tenant experiment or N concurrent ones."""
    item = json.loads(args.config)
    cfg = ExperimentConfig(**(item | {"vllm_urls": tuple(item.get("vllm_urls", ()))}))
    model_dir = Path(args.model_dir)
    work = Path(args.work)
    record: dict[str, Any] = {}
    if args.child == "single":
        runs = [run_single(model_dir, work, cfg, args.seed)]
    else:
        runs, calibration = run_concurrent_calibrated(model_dir, work, cfg, list(range(args.n)))
        record["calibration"] = calibration.as_dict()
    record["runs"] = [r.as_dict() for r in runs]
    Path(args.out).write_text(json.dumps(record))
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
    calibration: RolloutCalibration | None = None,
) -> dict[str, Any]:
    """One table row: concurrent N vs the first N serial runs (each (run, process wall)).

    `concurrent_wall` is the concurrent process's wall time without its calibration.
    With fewer than N serial runs, the serial figures are N times their mean (estimated).
    """
    serial = serial[:n]
    walls = [w for _, w in serial]
    estimated = len(walls) < n
    if estimated:
        walls = [statistics.fmean(walls)] * n
    completion = [sum(walls[: i + 1]) for i in range(n)]  # all submitted at t=0, one at a time
    serial_makespan = completion[-1]
    conc_done = [r.finished_at - concurrent_t0 for r in concurrent]
    step_c, roll_c = _step_means(concurrent)
    step_s, roll_s = _step_means([r for r, _ in serial])
    reward_c = _mean_std([r.steps[-1].reward for r in concurrent])
    reward_s = _mean_std([r.steps[-1].reward for r, _ in serial])
    costs = serial_costs(serial)
    bound: dict[str, Any] = {"multiplier": None, "ideal_s": None, "bound": None, "of_bound": None}
    if calibration is not None:
        ideal = ideal_concurrent_s(
            n,
            round(costs["steps"]),
            costs["rollout_s"],
            costs["train_s"],
            calibration.multiplier,
            costs["overhead_s"],
        )
        bound = {
            "multiplier": calibration.multiplier,
            "calibration": calibration.as_dict(),
            "ideal_s": ideal,
            "bound": serial_makespan / ideal,
            "of_bound": ideal / concurrent_wall,
        }
    train_c = statistics.fmean(s.train_s for r in concurrent for s in r.steps)
    trainer_steps = [s.trainer_step_s for r, _ in serial for s in r.steps if s.trainer_step_s]
    return {
        "n": n,
        "serial_estimated": estimated,
        "serial_runs": len(serial),
        **bound,
        "serial_train_s": costs["train_s"],
        "serial_overhead_s": costs["overhead_s"],
        "serial_trainer_compute_s": statistics.fmean(trainer_steps) if trainer_steps else None,
        "train_s": train_c,
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
    """The C-LoRA-shaped Markdown table (concurrent figure, serial figure in parentheses),
    with this machine's bound: rollout multiplier m(N), bound, achieved fraction of it."""
    head = (
        "| N | throughput speedup | bound | of bound | rollout multiplier m(N) "
        "| first experiment done (s) | mean experiment time (s) "
        "| mean step time (s) | mean rollout time (s) | mean train time (s) "
        "| final reward (mean ± std) |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|"
    )

    def fmt(value: float | None, spec: str, suffix: str = "") -> str:
        return "-" if value is None else f"{value:{spec}}{suffix}"

    lines = [head]
    for r in rows:
        est = "~" if r.get("serial_estimated") else ""
        lines.append(
            f"| {r['n']} | {est}{r['speedup']:.2f}x | {est}{fmt(r.get('bound'), '.2f', 'x')} "
            f"| {fmt(r.get('of_bound'), '.0%')} | {fmt(r.get('multiplier'), '.2f')} "
            f"| {r['first_done_s']:.0f} ({r['serial_first_done_s']:.0f}) "
            f"| {r['mean_experiment_s']:.0f} ({est}{r['serial_mean_experiment_s']:.0f}) "
            f"| {r['step_s']:.1f} ({r['serial_step_s']:.1f}) "
            f"| {r['rollout_s']:.1f} ({r['serial_rollout_s']:.1f}) "
            f"| {r['train_s']:.1f} ({r['serial_train_s']:.1f}) "
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
    for r in rows:
        if r.get("of_bound") is not None:
            out.append(
                f"N={r['n']}: {r['speedup']:.2f}x of a {r['bound']:.2f}x bound = "
                f"{r['of_bound']:.0%} (goal >= {GOAL_FRACTION_OF_BOUND:.0%}): "
                f"{'met' if r['of_bound'] >= GOAL_FRACTION_OF_BOUND else 'not met'}"
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
    p.add_argument("--schedule", choices=SCHEDULES, default="lockstep",
                   help="When a concurrent agent starts its next step (see clora_feedback.demo.experiment).")  # fmt: skip
    p.add_argument("--trainer-nice", type=int, default=0,
                   help="Trainer thread's niceness over serving's (0: see the module docstring).")  # fmt: skip
    p.add_argument("--serial-runs", type=int, default=None,
                   help="Serial experiments to run (default: the largest N); fewer estimate S(N).")  # fmt: skip
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
    from clora_feedback.model.resolve import resolve_model_dir

    ns = sorted({int(x) for x in args.ns.split(",")})
    cfg = ExperimentConfig(
        workload="tool-use",
        steps=args.steps,
        tasks_per_step=args.tasks_per_step,
        samples_per_task=1,
        eval_tasks=0,
        temperature=0.8,
        corrections=True,
        batched_agents=args.batched_agents,
        num_threads=args.threads,
        max_model_len=args.max_model_len,
        vllm_urls=tuple(args.vllm_url or ()) if args.engine == "vllm" else (),
        schedule=args.schedule,
        trainer_nice=args.trainer_nice,
    )
    if args.engine == "vllm" and not cfg.vllm_urls:
        raise SystemExit("--engine vllm needs --vllm-url (start one: clora serve --engine vllm)")
    model_dir = resolve_model_dir(args.model, args.model_cache or Settings().model_cache_dir)
    work = args.work or Path(tempfile.mkdtemp(prefix="clora-bench-experiments-"))
    work.mkdir(parents=True, exist_ok=True)
    common = ["--config", json.dumps(asdict(cfg)), "--model-dir", str(model_dir)]

    serial: list[tuple[AgentRun, float]] = []
    for seed in range(min(args.serial_runs or max(ns), max(ns))):
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
        calibration = _load_calibration(out)
        wall -= calibration.wall_s if calibration is not None else 0.0
        rows.append(summarize(n, _load_runs(out), t0, wall, serial, calibration))
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
