"""PNG figures for the demo, the learning experiments and the C-LoRA benchmark (matplotlib, Agg).

matplotlib is an optional dependency (`pip install -e ".[demo]"`); every
function imports it lazily and raises a clear error when it is missing, so
the rest of the package never needs it.

Not here: measuring anything; these functions only draw what they are given.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from clora_feedback.errors import CloraError


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as exc:
        raise CloraError(
            'plots need matplotlib: pip install -e ".[demo]" (or pip install matplotlib)',
            code="matplotlib_missing",
        ) from exc
    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    return plt


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over the last `window` values (shorter at the start)."""
    out: list[float] = []
    total = 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def reward_curve(
    path: Path,
    agent: str,
    rewards: Sequence[float],
    versions: Sequence[tuple[int, int]],
    *,
    window: int = 32,
    title: str | None = None,
) -> Path:
    """One agent's live reward: each feedback event, its moving average, version changes.

    Args:
        path: PNG to write.
        agent: the agent's name.
        rewards: reward of each feedback event, in arrival order.
        versions: (event index, version) where a new version went live.
        window: moving-average window, in events.
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    x = list(range(1, len(rewards) + 1))
    ax.scatter(x, rewards, s=6, alpha=0.25, color="tab:gray", label="reward per completion")
    ax.plot(
        x, moving_average(rewards, window), color="tab:blue", label=f"moving average ({window})"
    )
    for index, version in versions:
        ax.axvline(index, color="tab:green", alpha=0.25, linewidth=1)
        ax.text(index, 1.02, f"v{version}", fontsize=7, ha="center", color="tab:green")
    ax.set_xlabel("feedback events")
    ax.set_ylabel("reward")
    ax.set_ylim(-0.05, 1.1)
    ax.set_title(title or f"{agent}: reward from live feedback")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _mean_std(rows: Sequence[Sequence[float]]) -> tuple[list[float], list[float]]:
    length = min(len(r) for r in rows)
    means, stds = [], []
    for i in range(length):
        column = [r[i] for r in rows]
        means.append(statistics.fmean(column))
        stds.append(statistics.stdev(column) if len(column) > 1 else 0.0)
    return means, stds


def learning_curves(
    path: Path,
    title: str,
    curves: Mapping[str, Sequence[Sequence[float]]],
    evals: Mapping[str, Sequence[Sequence[tuple[int, float]]]],
) -> Path:
    """Training reward per step (mean and std over seeds) and held-out accuracy, per mode.

    Args:
        path: PNG to write.
        title: figure title.
        curves: mode -> one reward-per-step list per seed.
        evals: mode -> one [(step, held-out accuracy)] list per seed.
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    colors = {"serial": "tab:blue", "concurrent": "tab:orange"}
    for mode, rows in curves.items():
        if not rows:
            continue
        mean, std = _mean_std(rows)
        steps = list(range(1, len(mean) + 1))
        color = colors.get(mode)
        ax.plot(steps, mean, color=color, label=f"{mode}: training reward")
        ax.fill_between(
            steps,
            [m - s for m, s in zip(mean, std, strict=True)],
            [m + s for m, s in zip(mean, std, strict=True)],
            color=color,
            alpha=0.15,
        )
        points = evals.get(mode) or []
        if points:
            by_step: dict[int, list[float]] = {}
            for run in points:
                for step, acc in run:
                    by_step.setdefault(step, []).append(acc)
            xs = sorted(by_step)
            ys = [statistics.fmean(by_step[s]) for s in xs]
            es = [statistics.stdev(by_step[s]) if len(by_step[s]) > 1 else 0.0 for s in xs]
            ax.errorbar(xs, ys, yerr=es, fmt="o--", color=color, capsize=3,
                        label=f"{mode}: held-out accuracy (greedy)")  # fmt: skip
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("reward / accuracy")
    ax.set_ylim(-0.05, 1.05)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def speedup_plot(
    path: Path, rows: Sequence[Mapping[str, float]], *, reference: float | None
) -> Path:
    """C-LoRA-style figure: throughput speedup and mean step time against N.

    Args:
        path: PNG to write.
        rows: one mapping per N with `n`, `speedup`, `step_s`, `rollout_s` (and
            optionally `serial_step_s`).
        reference: a published speedup to draw at N=8 (C-LoRA's 2.81), or None.
    """
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    ns = [int(r["n"]) for r in rows]
    left.plot(ns, [r["speedup"] for r in rows], "o-", label="this project (concurrent vs serial)")
    left.plot(ns, ns, ":", color="gray", label="ideal (N x)")
    if reference is not None:
        left.plot([8], [reference], "s", color="tab:red", label=f"C-LoRA at N=8 ({reference}x)")
    left.set_xlabel("N concurrent experiments")
    left.set_ylabel("end-to-end throughput speedup")
    left.set_xscale("log", base=2)
    left.set_xticks(ns, [str(n) for n in ns])
    left.grid(alpha=0.3)
    left.legend(fontsize=8)
    right.plot(ns, [r["step_s"] for r in rows], "o-", label="mean step time")
    right.plot(ns, [r["rollout_s"] for r in rows], "o--", label="mean rollout time")
    right.set_xlabel("N concurrent experiments")
    right.set_ylabel("seconds")
    right.set_xscale("log", base=2)
    right.set_xticks(ns, [str(n) for n in ns])
    right.grid(alpha=0.3)
    right.legend(fontsize=8)
    top = max([r["step_s"] for r in rows] + [1.0])
    right.set_ylim(0, top * 1.15 if math.isfinite(top) else None)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
