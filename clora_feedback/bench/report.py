"""How the training and ingestion benchmarks report: result rows, a Markdown table, machine facts.

Also the two steps their command lines share: `quick_defaults` (the options a
`--quick` run shrinks) and `print_report` (the table and facts, and the `--json` file).

Every row compares a measurement with a baseline taken in the same run, so
the ratio is meaningful even on a machine shared with other work; the table
is Markdown so it can be pasted into `docs/benchmarks.md` as printed.

Not here: any measurement (see `train`, `ingest`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from collections.abc import Mapping, Sequence
from dataclasses import astuple, dataclass
from pathlib import Path
from typing import Any

COLUMNS = ("#", "measurement", "result", "baseline (same run)", "ratio", "goal", "met")
"""Header of every benchmark table (one cell per `Row` field, in order)."""


@dataclass(frozen=True)
class Row:
    """One line of a benchmark table.

    Attributes:
        key: short id (`1`, `2b`, ...) that the docs refer to.
        measurement: what was measured, and how.
        result: the figure under test.
        baseline: the reference figure from the same run.
        ratio: result against baseline, in the goal's terms.
        goal: the target, or `-` when the row is informative only.
        met: `yes`, `no`, or `-` (no goal).
    """

    key: str
    measurement: str
    result: str
    baseline: str
    ratio: str
    goal: str = "-"
    met: str = "-"


def verdict(ok: bool | None) -> str:
    """`yes`/`no` for a goal check, `-` when there is no goal."""
    return "-" if ok is None else ("yes" if ok else "no")


def format_table(rows: Sequence[Row]) -> str:
    """A Markdown table with a header and one line per row, columns padded to align."""
    cells = [list(COLUMNS)] + [[str(c) for c in astuple(r)] for r in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(COLUMNS))]

    def line(values: Sequence[str]) -> str:
        return "| " + " | ".join(v.ljust(w) for v, w in zip(values, widths, strict=True)) + " |"

    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(cells[0]), rule, *(line(c) for c in cells[1:])])


def read_table(text: str) -> list[list[str]]:
    """The stripped cells of every table line (`| ... |`) in `text`: `format_table` read back."""
    lines = [line for line in text.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in lines]


def check_shape(table: list[list[str]], keys: list[str]) -> list[str]:
    """What is wrong with a read-back `table` whose rows should be `keys`, in order (empty: nothing)."""
    problems = [] if table[:1] == [list(COLUMNS)] else [f"header {table[:1]}"]
    if [row[0] for row in table[2:]] != keys:
        problems.append(f"rows {[row[0] for row in table[2:]]}, expected {keys}")
    for row in table[2:]:
        if len(row) != len(COLUMNS) or row[-1] not in {"yes", "no", "-"} or "nan" in " ".join(row):
            problems.append(f"row {row}")
    return problems


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile, `q` in [0, 100]; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


MATMUL_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16")
"""The CPU flags that decide which matmul paths are fast (bf16 pays only with native bf16)."""


def machine_facts() -> dict[str, str]:
    """CPU, cores, load, versions: what a reader needs to judge the figures."""
    cpu = platform.processor() or platform.machine()
    flags: list[str] = []
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.readlines()
        names = [ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")]
        cpu = names[0] if names else cpu
        first = next((ln for ln in lines if ln.startswith("flags")), ":")
        flags = [f for f in first.split(":", 1)[1].split() if f in MATMUL_FLAGS]
    except OSError:
        pass
    facts = {
        "cpu": cpu,
        "cpu flags": " ".join(flags) or "none of " + ", ".join(MATMUL_FLAGS),
        "cores": str(os.cpu_count()),
        "load average (1, 5, 15 min)": ", ".join(f"{x:.2f}" for x in os.getloadavg()),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "(unset)"),
        "GOMP_SPINCOUNT": os.environ.get("GOMP_SPINCOUNT", "(unset)"),
    }
    torch = sys.modules.get("torch")
    if torch is not None:  # only when the benchmark uses it: ingestion does not import torch
        facts["torch"] = f"{torch.__version__} ({torch.get_num_threads()} threads)"
        from clora_feedback.hardware import cpu_features  # imports torch, already loaded here

        facts["kernels"] = cpu_features().describe()
    return facts


def format_facts(facts: dict[str, str]) -> str:
    return "\n".join(f"- {k}: {v}" for k, v in facts.items())


def quick_defaults(args: argparse.Namespace, **defaults: tuple[Any, Any]) -> None:
    """Fill each option named in `defaults` that was left unset (None) with its default:
    `name=(full run, --quick)`."""
    for name, (full, small) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, small if args.quick else full)


def print_report(
    table: Sequence[Row],
    facts: dict[str, str],
    json_path: Path | None,
    options: Mapping[str, Any],
    figures: Mapping[str, Any],
) -> None:
    """Print `table`, a blank line and `facts`; with `json_path` (`--json`), also write the
    raw run there: `{"args": options, "facts": facts, **figures}`."""
    print(format_table(table))
    print()
    print(format_facts(facts))
    if json_path is not None:
        raw = {"args": options, "facts": facts}
        json_path.write_text(json.dumps(raw | dict(figures), indent=1))
