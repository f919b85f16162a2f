"""How `clora bench learning` records and reports: evaluation points, per-task runs, tables, plot.

The tables are Markdown so they paste into `docs/results.md` as printed; the
JSON record holds every evaluation (answer classes and a few wrong replies
included) so a figure can be re-read without rerunning; the plot draws held-out
accuracy against wall time, one panel per task, each point labelled with the
version that answered.

Not here: any measurement (`learning`), the task generators (`learning_tasks`).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from clora_feedback.bench.report import format_facts, machine_facts

_CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")
"""The CPU flags that decide the engine's and trainer's kernels (reported when present)."""


@dataclass
class EvalPoint:
    """One held-out evaluation.

    Attributes:
        t_s: wall seconds since the users started (0: before any feedback).
        version: the version served when the evaluation started.
        versions: (lowest, highest) version that answered a held-out prompt.
        accuracy: share of held-out prompts answered right (greedy).
        top_class: the most common answer class (`answer_class`) and its share.
        classes: count of every answer class.
        live_accuracy: the users' accuracy since the previous evaluation (sampled replies).
        requests: training requests whose feedback was sent, so far.
        events: feedback events sent so far.
        eval_s: wall seconds the evaluation took.
        wrong: up to three (request, reply) pairs it got wrong.
    """

    t_s: float
    version: int
    versions: tuple[int, int]
    accuracy: float
    top_class: tuple[str, float]
    classes: dict[str, int]
    live_accuracy: float | None
    requests: int
    events: int
    eval_s: float
    wrong: list[tuple[str, str]] = field(default_factory=list)


@dataclass
class TaskRun:
    """One family's run: its evaluations and what the registry published."""

    task: str
    signals: str
    feedback_mode: str
    train_pairs: int
    held_out_pairs: int
    held_out: int
    cold_start_s: float = 0.0
    wall_s: float = 0.0
    requests: int = 0
    events: int = 0
    rejected: int = 0
    errors: int = 0
    evals: list[EvalPoint] = field(default_factory=list)
    versions: list[dict[str, Any]] = field(default_factory=list)

    def first_reaching(self, accuracy: float) -> EvalPoint | None:
        return next((e for e in self.evals if e.accuracy >= accuracy), None)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TaskRun:
        """Inverse of `dataclasses.asdict` (the JSON record `write` leaves)."""
        evals = [
            EvalPoint(**{**e, "versions": tuple(e["versions"]), "top_class": tuple(e["top_class"]),
                         "wrong": [tuple(w) for w in e["wrong"]]})
            for e in data["evals"]
        ]  # fmt: skip
        return cls(**{**data, "evals": evals})


def task_table(run: TaskRun) -> str:
    """Markdown: one line per evaluation of one task."""
    lines = [
        f"**{run.task}** ({run.signals}; {run.train_pairs} training pairs, "
        f"{run.held_out} held-out prompts over {run.held_out_pairs} unseen pairs)",
        "",
        "| t (s) | version | held-out accuracy | top answer (share) | live accuracy | requests | events |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in run.evals:
        answered = f"v{p.version}" if p.versions[0] == p.versions[1] == p.version else (
            f"v{p.version} (answered by v{p.versions[0]}-v{p.versions[1]})"
        )  # fmt: skip
        live = "-" if p.live_accuracy is None else f"{p.live_accuracy:.2f}"
        lines.append(
            f"| {p.t_s:.0f} | {answered} | {p.accuracy:.3f} | {p.top_class[0]} ({p.top_class[1]:.2f}) "
            f"| {live} | {p.requests} | {p.events} |"
        )
    return "\n".join(lines)


def summary_table(runs: Sequence[TaskRun]) -> str:
    """Markdown: one line per task (before, best, last, time to 90%, versions, throughput)."""
    lines = [
        "| task | feedback | held-out before | best (t, version) | last (t, version) "
        "| first >= 0.90 | versions | requests | events | wall (s) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        before, last = r.evals[0], r.evals[-1]
        best = max(r.evals, key=lambda e: e.accuracy)
        hit = r.first_reaching(0.9)
        reached = "never" if hit is None else f"{hit.t_s:.0f} s (v{hit.version})"
        lines.append(
            f"| {r.task} | {r.feedback_mode} | {before.accuracy:.3f} "
            f"| {best.accuracy:.3f} ({best.t_s:.0f} s, v{best.version}) "
            f"| {last.accuracy:.3f} ({last.t_s:.0f} s, v{last.version}) | {reached} "
            f"| {len(r.versions)} | {r.requests} | {r.events} | {r.wall_s:.0f} |"
        )
    return "\n".join(lines)


def cpu_facts() -> dict[str, str]:
    """`report.machine_facts` plus the CPU flags that choose kernels and torch's view of them."""
    facts = machine_facts()
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), [])
    except OSError:
        flags = []
    facts["cpu flags (kernel-relevant)"] = " ".join(f for f in _CPU_FLAGS if f in flags) or "-"
    torch = sys.modules.get("torch")
    if torch is not None:
        facts["cpu capability (torch)"] = str(torch.backends.cpu.get_cpu_capability())
    return facts


def code_version() -> str:
    """The checkout's commit, and how many package files differ from it (figures move with
    uncommitted trainer changes); `-` outside a git checkout."""
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
            check=True, timeout=10,
        ).stdout.strip()  # fmt: skip
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "clora_feedback"], cwd=root,
            capture_output=True, text=True, check=True, timeout=10,
        ).stdout.splitlines()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "-"
    return f"{head} + {len(dirty)} uncommitted package files" if dirty else head


def plot(path: Path, runs: Sequence[TaskRun]) -> Path:
    """Held-out accuracy against wall time, one panel per task, each point labelled by version."""
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(4.2 * len(runs), 3.6), squeeze=False)
    for ax, run in zip(axes[0], runs, strict=True):
        ts, acc = [e.t_s / 60 for e in run.evals], [e.accuracy for e in run.evals]
        ax.plot(ts, acc, marker="o", linewidth=1.5)
        for t, a, e in zip(ts, acc, run.evals, strict=True):
            ax.annotate(f"v{e.version}", (t, a), textcoords="offset points", xytext=(0, 5),
                        fontsize=7, ha="center")  # fmt: skip
        ax.axhline(0.9, color="grey", linestyle=":", linewidth=1)
        end = max([run.wall_s / 60, *ts]) or 1.0  # the run went on after its last evaluation
        ax.set(
            title=run.task,
            xlabel="wall time (min)",
            ylim=(-0.05, 1.08),
            xlim=(-0.03 * end, 1.03 * end),
        )
    axes[0][0].set_ylabel("held-out accuracy (greedy)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def replot(record_path: Path, prefix: Path) -> str:
    """Tables and plot again from a JSON record `write` left (no rerun)."""
    record = json.loads(record_path.read_text())
    runs = [TaskRun.from_dict(t) for t in record["tasks"]]
    return write(prefix, record["config"], runs, record["facts"])


def write(
    prefix: Path, config: dict[str, Any], runs: Sequence[TaskRun], facts: dict[str, str]
) -> str:
    """Print and write the tables (PREFIX.md), the record (PREFIX.json) and the plot (PREFIX.png)."""
    text = "\n\n".join([summary_table(runs), *(task_table(r) for r in runs), format_facts(facts)])
    print("\n" + text, flush=True)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    prefix.with_suffix(".md").write_text(text + "\n")
    record = {"config": config, "facts": facts, "tasks": [asdict(r) for r in runs]}
    prefix.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    try:
        plot(prefix.with_suffix(".png"), runs)
    except ImportError as exc:  # the tables and the JSON are the record
        print(f"no plot ({exc}): pip install matplotlib")
    return text
