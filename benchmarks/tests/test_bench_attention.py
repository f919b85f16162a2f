"""Smoke run of `python -m benchmarks.attention`: every shape, stream and way, never the figures."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import attention


def test_attention_times_every_way_at_every_shape(tmp_path: Path) -> None:
    out = tmp_path / "attention.json"
    argv = ["--shapes", "1x9,2x5", "--streams", "2x6+4x3", "--reps", "1", "--json", str(out)]
    assert attention.run(argv) == 0
    record = json.loads(out.read_text())
    assert len(record["seconds"]) == 2 * len(attention.WAYS)
    assert len(record["streams"]) == 2 * len(attention.STREAM_WAYS)  # fp32 and bf16
    assert set(record["ratios"]) == {
        "1x9: flash via fp32 / plain bf16",
        "2x5: flash via fp32 / plain bf16",
        "2x6+4x3 float32: composites / one function",
        "2x6+4x3 bfloat16: composites / one function",
    }
