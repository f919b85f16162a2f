"""`/metrics` stays bounded whatever the number of agents (issue 27).

Agent-labelled families keep rows for the agents with the most completions and
fold the rest into `agent="_other"` (counters still add up to the total;
gauges drop the rest); `clora_agents` counts them. Unit tests on `Metrics`.
"""

from __future__ import annotations

import re
from pathlib import Path

from clora_feedback.engine.types import EngineStats
from clora_feedback.gateway.metrics import OTHER_AGENTS, Family, Metrics


def _stats(agents: int) -> EngineStats:
    return EngineStats(
        running=0,
        waiting=0,
        max_num_seqs=16,
        max_waiting=64,
        steps=0,
        generated_tokens=0,
        adapters={f"agent-{i:04d}": 1 for i in range(agents)},
    )


def _rows(text: str, name: str) -> list[str]:
    return [line for line in text.splitlines() if re.match(rf"{name}[{{ ]", line)]


def test_a_thousand_agents_render_the_top_ones_and_one_other_row() -> None:
    metrics = Metrics(top_agents=5)
    for i in range(1000):  # agent-0000 busiest, then -0001, ...
        for _ in range(1 + (1000 - i) // 100):
            metrics.observe_completion(f"agent-{i:04d}", "chat", prompt_tokens=10, generated=2)
    trainer_rows = {f"agent-{i:04d}": 1.0 for i in range(1000)}
    metrics.add_source(
        lambda: [
            Family("clora_trainer_steps_total", "counter", "Steps.", ("agent",), trainer_rows),
            Family("clora_trainer_version", "gauge", "Version.", ("agent",), trainer_rows),
        ]
    )
    text = metrics.render(_stats(1000))

    completions = _rows(text, "clora_completions_total")
    labelled = {re.search(r'agent="([^"]+)"', line).group(1) for line in completions}  # type: ignore[union-attr]
    assert labelled == {f"agent-{i:04d}" for i in range(5)} | {OTHER_AGENTS}
    total = sum(float(line.rsplit(" ", 1)[1]) for line in completions)
    assert total == sum(metrics.completions.values())  # the fold keeps the sum
    assert len(_rows(text, "clora_prompt_tokens_total")) == 6
    assert len(_rows(text, "clora_trainer_steps_total")) == 6  # a source's counter folds too
    assert float(_rows(text, "clora_trainer_steps_total")[0].rsplit(" ", 1)[1]) == 995.0
    assert len(_rows(text, "clora_trainer_version")) == 5  # a gauge keeps only the top
    assert len(_rows(text, "clora_engine_adapter_version")) == 5
    assert 'clora_agents{state="served"} 1000' in text
    assert 'clora_agents{state="labelled"} 5' in text
    assert len(text.splitlines()) < 120  # O(top_agents), not O(agents)


def test_top_zero_keeps_only_aggregates_and_few_agents_keep_their_names() -> None:
    metrics = Metrics(top_agents=0)
    metrics.observe_completion("support", "chat", prompt_tokens=3, generated=1)
    text = metrics.render(_stats(1))
    assert 'clora_completions_total{agent="_other",endpoint="chat"} 1' in text
    assert "support" not in text

    few = Metrics()  # the default keeps every agent of a small fleet by name
    few.observe_completion("support", "chat", prompt_tokens=3, generated=1)
    few.observe_completion("sales", "completions", prompt_tokens=3, generated=1)
    text = few.render(_stats(0))
    assert 'clora_completions_total{agent="support",endpoint="chat"} 1' in text
    assert 'clora_completions_total{agent="sales",endpoint="completions"} 1' in text
    assert OTHER_AGENTS not in text


def test_the_app_takes_the_bound_from_the_settings(tiny_model_dir: Path, tmp_path: Path) -> None:
    from clora_feedback.config import EngineConfig, ServerConfig, Settings
    from clora_feedback.engine.deployer import Deployer
    from clora_feedback.engine.embedded import EmbeddedEngine
    from clora_feedback.gateway.app import create_app
    from clora_feedback.store.registry import AdapterRegistry
    from clora_feedback.store.trajectories import AsyncTrajectoryStore

    settings = Settings(data_dir=tmp_path, server=ServerConfig(metrics_top_agents=3))
    engine = EmbeddedEngine(tiny_model_dir, EngineConfig(max_num_seqs=1, max_model_len=64))
    registry = AdapterRegistry(tmp_path / "adapters", tmp_path / "registry.db")
    try:
        app = create_app(
            settings,
            engine,
            AsyncTrajectoryStore(tmp_path / "t.db"),
            deployer=Deployer(engine, registry),
        )
        assert app.state.gateway.metrics.top_agents == 3
    finally:
        registry.close()
