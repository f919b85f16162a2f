"""The trainer's publish log says what it counts (issue 25 item 9).

A step's rows are policy-gradient rows and supervised rows (a preference pair
adds no row of its own); the log once summed both as "N samples", so 32 under
`max_batch: 16` read as a broken bound. It names each count apart.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from test_trainer import World, engine  # noqa: F401  (the module's tiny engine fixture)

from clora_feedback.engine.embedded import EmbeddedEngine


def test_the_publish_log_counts_each_kind_of_row_apart(
    engine: EmbeddedEngine,  # noqa: F811
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    world = World(tmp_path, engine)
    world.serve_and_reward("delta", 1.0)
    world.serve_and_reward("delta", 0.5)
    with caplog.at_level(logging.INFO, logger="clora_feedback.train.trainer"):
        (result,) = world.trainer.run_round()
    world.close()
    (line,) = [
        r.getMessage() for r in caplog.records if r.getMessage().startswith("agent delta: v1 ")
    ]
    counts = (
        f"{result.num_pg} policy-gradient + {result.num_sft} supervised rows, "
        f"{result.num_pairs} pairs"
    )
    assert counts in line and "samples" not in line
