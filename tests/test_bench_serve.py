"""Smoke run of `clora bench serve` on the tiny model: every figure runs, the tables have their rows.

Never the figures: a tiny random model on a shared CPU says nothing about speed.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch

from clora_feedback.bench import run_bench


def test_serve_bench_through_http_against_another_server(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The serving figures through the gateway, side by side with another OpenAI server
    (here a second gateway on its own engine): PEFT adapters loaded over HTTP on both."""
    from conftest import run_gateway

    model_dir = tiny_model_dir
    other = {"max_loras": 8, "max_lora_rank": 16}
    threads = torch.get_num_threads()
    try:
        with run_gateway(model_dir, tmp_path / "other", engine=other) as gateway:
            url = gateway.url
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
