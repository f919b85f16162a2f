"""One composition root: each role's builder, flags that only become settings, one path for
initial adapters, and the ingest knobs that `clora serve` and `clora ingest` both read.

Unit level: the builders run on the tiny model and nothing is started (a trainer
worker's leases, an ingest worker's consumer and a gateway's engine stay idle).
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from typing import Any

import pytest

import clora_feedback
from clora_feedback.cli.ingest import ingest_settings
from clora_feedback.cli.main import build_parser, main
from clora_feedback.config import AgentConfig, Settings, load_settings
from clora_feedback.errors import InvalidRequestError
from clora_feedback.gateway.agents import AgentRegistry
from clora_feedback.gateway.app import create_app
from clora_feedback.service import build_ingest_worker, build_trainer_worker

PACKAGE = Path(clora_feedback.__file__).parent
BUILT_HERE_ONLY = ("FeedbackStore", "AdapterRegistry", "TrajectoryStore", "DefaultRewardPolicy")
OTHER_OPENERS = ("service", "store", "feedback", "demo", "bench")
"""The composition root, the stores' own packages, and the demo and the benchmarks."""


def _constructs(path: Path) -> set[str]:
    calls = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
            if name in BUILT_HERE_ONLY:
                calls.add(name)
    return calls


def test_only_the_composition_root_builds_stores_registries_and_the_reward_policy() -> None:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if any(rel.startswith(o + "/") for o in OTHER_OPENERS):
            continue
        if _constructs(path):
            found[rel] = sorted(_constructs(path))
    assert found == {}


def test_create_app_requires_a_deployer() -> None:
    parameter = inspect.signature(create_app).parameters["deployer"]
    assert parameter.default is inspect.Parameter.empty


async def test_configured_agents_register_without_loading_an_adapter(tmp_path: Path) -> None:
    """Initial adapters are the composition root's (`_register_initial`), never the table's."""

    class Deployer:
        def __init__(self) -> None:
            self.adopted: list[str] = []

        async def adopt(self, name: str, path: Path) -> int:
            self.adopted.append(name)
            return 1

    class Engine:
        model_name = "base"

    deployer = Deployer()
    agents = AgentRegistry(Engine(), deployer)  # type: ignore[arg-type]
    await agents.start([AgentConfig(name="support", adapter_path=tmp_path / "initial")])
    assert deployer.adopted == []
    assert [a.name for a in agents._agents.values()] == ["support"]


def test_load_settings_lays_nested_overrides_over_file_and_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "settings.json"
    config.write_text('{"engine": {"max_loras": 4, "model": "from-file"}, "port": 9000}')
    monkeypatch.setenv("CLORA_ENGINE__MAX_LORA_RANK", "8")
    settings = load_settings(config, port=None, engine={"model": "flag", "kind": None})
    assert (settings.engine.model, settings.engine.max_loras) == ("flag", 4)
    assert (settings.engine.max_lora_rank, settings.port) == (8, 9000)


def test_serve_flags_become_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Settings] = []
    monkeypatch.setattr("clora_feedback.service.serve", seen.append)
    argv = ["serve", "--model", "/m/dir", "--engine", "vllm", "--vllm-url", "http://a:1"]
    assert main([*argv, "--vllm-url", "http://b:2", "--port", "8123"]) == 0
    engine = seen[0].engine
    assert (engine.model, engine.kind, engine.vllm.urls) == ("/m/dir", "vllm", ["http://a:1", "http://b:2"])  # fmt: skip
    assert seen[0].port == 8123


def test_ingest_flags_become_feedback_settings(tmp_path: Path) -> None:
    args = build_parser().parse_args(
        ["ingest", "--db", str(tmp_path / "t.db"), "--bootstrap", "k:9092", "--agents", "a,b",
         "--rejoin-interval-s", "0.5", "--session-timeout-ms", "4000",
         "--heartbeat-interval-ms", "700", "--commit-delay-s", "0.25", "--group-id", "g"]
    )  # fmt: skip
    settings = ingest_settings(args)
    kafka = settings.feedback.kafka
    assert settings.trajectory_db == tmp_path / "t.db"
    assert settings.feedback.rejoin_interval_s == 0.5
    assert (kafka.bootstrap_servers, kafka.group_id) == ("k:9092", "g")
    assert (kafka.session_timeout_ms, kafka.heartbeat_interval_ms) == (4000, 700)
    assert kafka.commit_delay_s == 0.25
    assert [a.name for a in settings.agents] == ["a", "b"]


def test_ingest_worker_reads_its_knobs_from_settings(tmp_path: Path) -> None:
    settings = Settings(
        data_dir=tmp_path,
        agents=[{"name": "a"}],  # type: ignore[list-item]
        feedback={  # type: ignore[arg-type]
            "rejoin_interval_s": 0.5,
            "kafka": {
                "bootstrap_servers": "127.0.0.1:1",
                "session_timeout_ms": 4000,
                "heartbeat_interval_ms": 700,
                "commit_delay_s": 0.25,
                "group_id": "g",
            },
        },
    )
    worker = build_ingest_worker(settings)
    try:
        consumer: Any = worker.consumer
        assert consumer.group_id == "g" and consumer.commit_delay_s == 0.25
        assert consumer._client_args["session_timeout_ms"] == 4000
        assert consumer._client_args["heartbeat_interval_ms"] == 700
        assert consumer.ingest.rejoin_interval_s == 0.5
    finally:
        worker.stores.close()
    with pytest.raises(InvalidRequestError):
        build_ingest_worker(Settings(data_dir=tmp_path))


def test_trainer_worker_trains_the_configured_agents_under_its_lease_owner(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    settings = load_settings(
        None,
        data_dir=tmp_path,
        adapters_dir=tmp_path / "adapters",
        engine={"model": str(tiny_model_dir)},
        agents=[{"name": "a"}],
        trainer={"lease_owner": "me"},
    )
    worker = build_trainer_worker(settings)
    try:
        assert worker.owner == "me"
        assert worker.model_name == tiny_model_dir.name
        assert worker.trainer._agents() == []  # no rewards yet
    finally:
        worker.stores.close()
        worker.registry.close()
