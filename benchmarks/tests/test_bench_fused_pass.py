"""Smoke run of `python -m benchmarks.fused_pass` on the tiny model: every row, never the figures."""

from __future__ import annotations

import json
from pathlib import Path

import torch.nn.functional as F

from benchmarks import fused_pass
from clora_feedback.model import decoder
from clora_feedback.model.tiny import build_tiny_model_dir
from clora_feedback.train import forward, fused, gemm


def test_fused_pass_times_every_variant_in_both_dtypes_and_restores_the_pieces(
    tmp_path: Path,
) -> None:
    model = build_tiny_model_dir(tmp_path / "tiny", seed=0, max_position_embeddings=2048)
    out = tmp_path / "fused.json"
    argv = ["--model", str(model), "--reps", "1", "--tickets", "2", "--target-tokens", "4"]
    assert fused_pass.run([*argv, "--json", str(out)]) == 0
    seconds = json.loads(out.read_text())["seconds"]
    assert len(seconds) == 2 * 2 * 3 and all(len(v) == 1 for v in seconds.values())
    assert forward.rms_norm is not decoder.rms_norm  # the composites were put back only inside
    assert forward.frozen_linear is not F.linear
    assert fused.input_gradient is gemm.input_gradient
