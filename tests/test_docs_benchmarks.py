"""docs/benchmarks.md's current table: one line per row, and every command in it runs a
benchmark that exists (`clora bench NAME`, or `python -m benchmarks.NAME` from a checkout)."""

from __future__ import annotations

import re
from pathlib import Path

from clora_feedback.bench import BENCHMARKS

REPO = Path(__file__).resolve().parent.parent
PAGE = REPO / "docs" / "benchmarks.md"


def _rows() -> list[list[str]]:
    table = PAGE.read_text().split("## Current figures", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in table.splitlines() if line.startswith("|")]
    cells = [[c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]] for line in lines]
    return cells[2:]  # below the header and its rule


def test_every_row_has_its_five_cells() -> None:
    rows = _rows()
    assert len(rows) >= 10
    for row in rows:
        assert len(row) == 5 and all(row), row
        assert re.fullmatch(r"20\d\d-\d\d-\d\d", row[2]), row


def test_every_command_runs_a_benchmark_that_exists() -> None:
    for row in _rows():
        command = row[4]
        clora = re.findall(r"clora bench (\w+)", command)
        module = re.findall(r"python -m benchmarks\.(\w+)", command)
        assert clora or module, row
        assert all(name in BENCHMARKS for name in clora), command
        assert all((REPO / "benchmarks" / f"{name}.py").is_file() for name in module), command
