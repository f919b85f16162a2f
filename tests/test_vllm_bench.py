"""Smoke run of `clora bench serve --engine vllm` on the session's vLLM server (marked `vllm`).

Every measurement runs and the table has its rows; never the figures (a tiny
random model on a shared CPU says nothing about speed).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from vllm_fixtures import VLLMServer

from clora_feedback.bench import run_bench

pytestmark = pytest.mark.vllm


def test_serve_bench_on_vllm_runs_every_measurement(
    vllm_server: VLLMServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "--engine",
        "vllm",
        "--vllm-url",
        vllm_server.url,
        "--model",
        str(vllm_server.model_dir),
    ]
    argv += ["--new-tokens", "4", "--streams", "2", "--latency-reps", "2", "--publishes", "1",
             "--throughput-reps", "1"]  # fmt: skip
    assert run_bench("serve", [*argv, "--json", str(tmp_path / "vllm.json")]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [r.split("|")[1].strip()[:2] for r in rows[1:]] == ["1.", "1.", "1.", "2.", "3.", "3."]
    results = json.loads((tmp_path / "vllm.json").read_text())
    keys = ("throughput_ratio", "adapters_ratio", "write_ms", "load_ms", "first_token_ms",
            "ttft_floor_ms")  # fmt: skip
    for key in keys:
        assert results[key] > 0
    assert results["added_p50_low_ms"] <= results["added_p50_ms"] <= results["added_p50_high_ms"]
    # the direct baseline's prompt is the one the gateway sent (a chat template, not 2 tokens)
    assert results["prompt_tokens"] > 8


def test_serve_bench_publish_only_runs_just_the_publish(
    vllm_server: VLLMServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--engine", "vllm", "--vllm-url", vllm_server.url, "--model",
            str(vllm_server.model_dir), "--publishes", "1", "--publish-only",
            "--json", str(tmp_path / "vllm.json")]  # fmt: skip
    assert run_bench("serve", argv) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [r.split("|")[1].strip()[:2] for r in rows[1:]] == ["3.", "3."]
    results = json.loads((tmp_path / "vllm.json").read_text())
    assert "throughput_ratio" not in results and results["load_ms"] > 0
