"""Learning proofs: run an experiment over several seeds, serial and concurrent, and report it.

`run_proof` runs `ExperimentConfig` for every seed in the requested modes
(`serial`: one fresh single-tenant service per seed, one after another;
`concurrent`: one service, one agent per seed, all at once), then writes

- `<out>.json`: every run (per-step rewards and timings, held-out
  evaluations), enough to regenerate the table and the figure;
- `<out>.md`: the results table (mean ± std over seeds) and the checks;
- `<out>.png`: training reward per step (mean ± std) and held-out accuracy.

`main(argv, defaults)` is the command line the scripts in `examples/` share.

Not here: the learning loop (`experiment`), the workloads (`workloads`).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import Any

from clora_feedback.demo.experiment import (
    AgentRun,
    ExperimentConfig,
    run_concurrent,
    run_serial,
    summarize,
)

MODES = ("serial", "concurrent")


def _ms(mean: float, std: float, digits: int = 2) -> str:
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


def proof_table(results: dict[str, list[AgentRun]]) -> str:
    """Markdown: per mode, held-out accuracy before/after, training reward first/last, times."""
    lines = [
        "| mode | seeds | held-out before | held-out after | training reward, step 1 "
        "| training reward, last 3 steps | mean step time (s) | run time (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for mode, runs in results.items():
        s = summarize(runs)
        lines.append(
            f"| {mode} | {len(runs)} | {_ms(s['eval_before_mean'], s['eval_before_std'])} "
            f"| {_ms(s['eval_after_mean'], s['eval_after_std'])} "
            f"| {_ms(s['train_reward_first_mean'], s['train_reward_first_std'])} "
            f"| {_ms(s['train_reward_last3_mean'], s['train_reward_last3_std'])} "
            f"| {s['step_s_mean']:.1f} | {s['duration_s_mean']:.0f} |"
        )
    return "\n".join(lines)


def checks(results: dict[str, list[AgentRun]], goal: float | None) -> list[str]:
    """The issue's checks: the accuracy goal, and concurrent within one serial std of serial."""
    out = []
    for mode, runs in results.items():
        s = summarize(runs)
        if goal is not None:
            met = s["eval_after_mean"] >= goal
            out.append(
                f"{mode}: held-out accuracy {s['eval_before_mean']:.0%} -> {s['eval_after_mean']:.0%} "
                f"(goal >= {goal:.0%}): {'met' if met else 'not met'}"
            )
        else:
            rise = s["eval_after_mean"] - s["eval_before_mean"]
            out.append(f"{mode}: held-out accuracy {rise:+.0%} over the baseline")
    if "serial" in results and "concurrent" in results:
        a, b = summarize(results["serial"]), summarize(results["concurrent"])
        diff = b["eval_after_mean"] - a["eval_after_mean"]
        within = abs(diff) <= a["eval_after_std"] or diff >= 0
        out.append(
            f"no reward loss: concurrent final accuracy {diff:+.2f} vs serial "
            f"(serial std {a['eval_after_std']:.2f}): {'yes' if within else 'no'}"
        )
    return out


def run_proof(
    cfg: ExperimentConfig,
    seeds: Sequence[int],
    modes: Sequence[str],
    out: Path,
    model_dir: Path,
    *,
    work: Path | None = None,
    goal: float | None = None,
    title: str = "",
) -> dict[str, list[AgentRun]]:
    """Run every mode, write `out`.json/.md/.png, print the table; returns the runs by mode."""
    work = work or Path(tempfile.mkdtemp(prefix="clora-proof-"))
    results: dict[str, list[AgentRun]] = {}
    for mode in modes:
        t0 = time.time()

        def progress(agent: str, record: Any, mode: str = mode) -> None:
            print(
                f"[{mode} {agent}] step {record.step:>2} reward {record.reward:.2f} "
                f"v{record.version} rollout {record.rollout_s:.1f}s train {record.train_s:.1f}s",
                flush=True,
            )

        runner = run_serial if mode == "serial" else run_concurrent
        results[mode] = runner(model_dir, work / mode, cfg, list(seeds), on_step=progress)
        print(f"{mode}: {time.time() - t0:.0f} s", flush=True)
    write_proof(out, cfg, results, goal=goal, title=title)
    return results


def write_proof(
    out: Path,
    cfg: ExperimentConfig,
    results: dict[str, list[AgentRun]],
    *,
    goal: float | None,
    title: str,
) -> None:
    """Write the JSON record, the Markdown table and the figure for `results`."""
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "config": asdict(cfg),
        "results": {m: [r.as_dict() for r in runs] for m, runs in results.items()},
    }
    out.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    text = proof_table(results) + "\n\n" + "\n".join(f"- {c}" for c in checks(results, goal))
    out.with_suffix(".md").write_text(text + "\n")
    print("\n" + text)
    try:
        from clora_feedback.demo.plots import learning_curves

        learning_curves(
            out.with_suffix(".png"),
            title or f"{cfg.workload}: {len(next(iter(results.values())))} seeds",
            {m: [[s.reward for s in r.steps] for r in runs] for m, runs in results.items()},
            {m: [r.evals for r in runs] for m, runs in results.items()},
        )
    except Exception as exc:  # the JSON and the table are the record
        print(f"no figure: {exc}")


def load_proof(path: Path) -> tuple[ExperimentConfig, dict[str, list[AgentRun]]]:
    """Read a `<out>.json` record back (to redraw or re-tabulate without rerunning)."""
    data = json.loads(path.read_text())
    cfg = ExperimentConfig(**data["config"])
    return cfg, {m: [AgentRun.from_dict(r) for r in runs] for m, runs in data["results"].items()}


def main(argv: Sequence[str], defaults: ExperimentConfig, *, goal: float | None, title: str) -> int:
    """The command line of `examples/*.py`: seeds, modes, steps and output prefix."""
    p = argparse.ArgumentParser(description=title)
    p.add_argument("--seeds", default="0,1,2", help="Comma list of seeds (one experiment each).")
    p.add_argument("--modes", default="serial,concurrent", help="serial, concurrent or both.")
    p.add_argument("--out", type=Path, required=True, help="Output prefix (.json/.md/.png).")
    p.add_argument("--model", default="smollm2-135m-instruct", help="Base model name or directory.")
    p.add_argument("--model-cache", type=Path, default=None, help="Model cache (default var/models).")  # fmt: skip
    p.add_argument("--work", type=Path, default=None, help="Scratch directory (default: temporary).")  # fmt: skip
    p.add_argument("--replot", action="store_true", help="Redraw from <out>.json; run nothing.")
    p.add_argument("--merge", type=Path, action="append", default=[], metavar="JSON",
                   help="With --replot: read these records (e.g. a serial and a concurrent run).")  # fmt: skip
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="Override an ExperimentConfig field, e.g. --set steps=10.")  # fmt: skip
    args = p.parse_args(list(argv))
    if args.replot:
        cfg, results = load_proof(args.out.with_suffix(".json")) if not args.merge else (None, {})
        for path in args.merge:
            cfg_i, more = load_proof(path)
            if cfg is not None and cfg_i != cfg:
                raise SystemExit(f"{path} was run with a different configuration")
            cfg = cfg_i
            results.update(more)
        assert cfg is not None
        write_proof(args.out, cfg, results, goal=goal, title=title)
        return 0
    types = {f.name: f.type for f in fields(ExperimentConfig)}
    overrides: dict[str, Any] = {}
    for item in args.set:
        name, _, value = item.partition("=")
        kind = str(types.get(name, ""))
        if not kind:
            raise SystemExit(f"unknown field {name!r}; fields: {', '.join(types)}")
        overrides[name] = (
            value.lower() in ("1", "true", "yes") if kind == "bool"
            else int(value) if kind.startswith("int") else float(value) if kind == "float"
            else value
        )  # fmt: skip
    cfg = replace(defaults, **overrides)
    modes = [m for m in args.modes.split(",") if m]
    if any(m not in MODES for m in modes):
        raise SystemExit(f"modes must be among {MODES}")
    from clora_feedback.config import Settings
    from clora_feedback.model.resolve import resolve_model_dir

    model_dir = resolve_model_dir(args.model, args.model_cache or Settings().model_cache_dir)
    seeds = [int(s) for s in args.seeds.split(",")]
    from clora_feedback.cores import main_thread_alone

    with main_thread_alone():  # the engine thread's pool is the process's only one
        run_proof(cfg, seeds, modes, args.out, model_dir, work=args.work, goal=goal, title=title)
    return 0
