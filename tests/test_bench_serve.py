"""Smoke runs of `clora bench serve` on the tiny model: every measurement runs, the tables have their rows.

Never the figures: a tiny random model on a shared CPU says nothing about speed.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch

from clora_feedback.bench import run_bench
from clora_feedback.models.tiny import build_tiny_model_dir


def test_serve_bench_quick_runs_every_measurement(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model_dir = build_tiny_model_dir(tmp_path / "tiny", seed=0, max_position_embeddings=1024)
    argv = ["--in-process", "--quick", "--model", str(model_dir), "--new-tokens", "4"]
    argv += ["--agent-tokens", "3"]
    argv += ["--gateway-reps", "3", "--json", str(tmp_path / "serve.json"), "--threads", "1"]
    threads = torch.get_num_threads()
    try:
        assert run_bench("serve", argv) == 0
    finally:
        torch.set_num_threads(threads)  # --threads is process-wide
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ")]
    assert [r.split("|")[1].strip()[:2] for r in rows[1:]] == [
        "1.",
        "2.",
        "3.",
        "3.",
        "3.",
        "3.",
        "4.",
    ]
    assert "nan" not in out and "WARNING" not in out
    results = json.loads((tmp_path / "serve.json").read_text())["results"]
    for key in ("mixed_ratio", "multiplex_ratio", "decode_speedup_single", "speedup_batch8"):
        assert results[key] > 0
    assert results["gateway_http_ms"] > 0


def test_serve_bench_through_http_against_another_server(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The serving figures through the gateway, side by side with another OpenAI server
    (here a second gateway on its own engine): PEFT adapters loaded over HTTP on both."""
    from clora_feedback.bench.gateway import _uvicorn_thread
    from clora_feedback.config import EngineConfig, Settings
    from clora_feedback.engine.embedded import EmbeddedEngine
    from clora_feedback.gateway.app import create_app
    from clora_feedback.store.trajectories import AsyncTrajectoryStore

    model_dir = build_tiny_model_dir(tmp_path / "tiny", seed=0, max_position_embeddings=2048)
    config = EngineConfig(model=str(model_dir), max_loras=8, max_lora_rank=16, num_threads=1)
    other = tmp_path / "other"
    settings = Settings(data_dir=other, adapters_dir=other / "adapters", engine=config)
    engine = EmbeddedEngine(model_dir, config)
    app = create_app(settings, engine, AsyncTrajectoryStore(settings.trajectory_db))
    threads = torch.get_num_threads()
    try:
        with _uvicorn_thread(app) as url:
            argv = ["--quick", "--model", str(model_dir), "--new-tokens", "4", "--reps", "1"]
            argv += ["--agent-tokens", "3"]
            argv += ["--dtypes", "float32", "--threads", "1", "--json", str(tmp_path / "s.json")]
            argv += ["--against", url, "--against-label", "other", "--against-dtype", "float32"]
            assert run_bench("serve", argv) == 0
            listed = httpx.get(f"{url}/v1/models").json()["data"]
    finally:
        torch.set_num_threads(threads)
    captured = capsys.readouterr()
    out = captured.out
    assert "[other, repetition 0]" in captured.err  # a line per target and repetition
    rows = [line.split("|")[1].strip() for line in out.splitlines() if line.startswith("| ")]
    assert [r[:2] for r in rows if r[:1].isdigit()] == [
        "1.",
        "2.",
        "3.",
        "4.",
        "5.",
        "6.",
        "1.",
        "2.",
        "3.",
        "6.",
    ]
    assert "nan" not in out and "completion tokens together" not in out
    saved = json.loads((tmp_path / "s.json").read_text())
    results = saved["results"]
    for target in ("embedded float32", "other"):
        for figure in ("single", "prompts8", "mixed", "one", "mixed_ratio", "episodes_ratio"):
            assert results[f"{target}:{figure}"] > 0
        # 8 agents x 2 turns x 3 tokens on both sides; turn 2 re-sends turn 1's prompt, which
        # (after the warm-up served the system prompt) the prefix cache supplies
        assert results[f"{target}:episodes_tokens"] == 8 * 2 * 3
        assert results[f"{target}:episodes_cache_hits_serial"] > 0
        assert results[f"{target}:episodes_cache_hits_together"] > 0
        serial = saved["runs"][target]["episodes_serial"][0]
        assert serial["cache"]["clora_engine_prefix_cache_misses_total"] > 0  # fresh tickets
    assert results["embedded float32:vs:mixed"] > 0
    assert results["embedded float32:vs:episodes_together"] > 0
    assert [m["id"] for m in listed if m["parent"] is not None] == []  # adapters unloaded again


def test_decode_profile_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model_dir = build_tiny_model_dir(tmp_path / "tiny", seed=0, max_position_embeddings=1024)
    assert run_bench("serve", ["--decode-profile", "--model", str(model_dir), "--reps", "1"]) == 0
    out = capsys.readouterr().out
    for case in ("decode_mixed_permuted", "lora_mixed_rank8", "mixed_vs_one_decode"):
        assert f"| {case} |" in out
    assert "nan" not in out and "inf" not in out


def test_prefix_cache_counters_parsed_from_either_server() -> None:
    """The gateway's block counters and vLLM's token counters (summed over label sets)."""
    from clora_feedback.bench.http_workload import EpisodeRun, parse_counters

    gateway = parse_counters(
        "# HELP clora_engine_prefix_cache_hits_total x\n"
        "# TYPE clora_engine_prefix_cache_hits_total counter\n"
        "clora_engine_prefix_cache_hits_total 30\n"
        "clora_engine_prefix_cache_misses_total 10.0\n"
        "clora_engine_prefix_cache_bytes 123\n"
    )
    assert gateway == {
        "clora_engine_prefix_cache_hits_total": 30.0,
        "clora_engine_prefix_cache_misses_total": 10.0,
    }
    assert EpisodeRun(1.0, [], gateway).cache_hit_fraction == 0.75
    vllm = parse_counters(
        'vllm:prefix_cache_queries_total{engine="0",model_name="m a"} 200.0\n'
        'vllm:prefix_cache_queries_total{engine="1",model_name="m a"} 200.0\n'
        'vllm:prefix_cache_hits_total{engine="0",model_name="m a"} 100.0\n'
    )
    assert EpisodeRun(1.0, [], vllm).cache_hit_fraction == 0.25
    assert EpisodeRun(1.0, [], {}).cache_hit_fraction is None
