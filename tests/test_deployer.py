"""The deployer: the engine serves what the registry's active pointer says, after every move.

Unit tests run on the tiny model's embedded engine without its step loop
(adapter changes are visible at once); the reporting test runs the gateway
app in FastAPI's TestClient, whose lifespan starts the engine and the deployer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from clora_feedback.config import AgentConfig, EngineConfig, Settings
from clora_feedback.engine.deployer import Deployer
from clora_feedback.engine.embedded import EmbeddedEngine
from clora_feedback.engine.types import EngineCapabilities
from clora_feedback.errors import AdapterError, CloraError, ConflictError, NotFoundError
from clora_feedback.gateway.adapters import build_adapters_router
from clora_feedback.gateway.agents import AgentRegistry
from clora_feedback.lora.peft_io import save_peft_adapter
from clora_feedback.lora.weights import LoRAWeights, random_lora_weights
from clora_feedback.service import register_initial
from clora_feedback.store.registry import AdapterRegistry
from clora_feedback.store.versions import AdapterRef


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> EmbeddedEngine:
    config = EngineConfig(model=str(tiny_model_dir), max_model_len=128, num_threads=1)
    return EmbeddedEngine(tiny_model_dir, config, model_name="tiny-base")


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[AdapterRegistry]:
    with AdapterRegistry(tmp_path / "adapters", tmp_path / "registry.db") as reg:
        yield reg


def _weights(engine: EmbeddedEngine, seed: int) -> LoRAWeights:
    return random_lora_weights(engine.lora_limits, rank=2, seed=seed)


def _publish(registry: AdapterRegistry, engine: EmbeddedEngine, agent: str, count: int) -> None:
    for version in range(1, count + 1):
        registry.publish(
            agent,
            _weights(engine, version),
            optimizer_state=None,
            base_model="tiny-base",
            parent=version - 1 or None,
            step=version,
            metrics={},
            feedback_window=None,
        )


def _train_publish(deployer: Deployer, registry: AdapterRegistry, agent: str, seed: int) -> int:
    """What the trainer does: reserve, hand the weights off, publish inside the hand-off."""
    active = registry.active(agent) if any(a.agent == agent for a in registry.agents()) else None
    version = registry.next_version(agent)
    weights = _weights(deployer.engine, seed)  # type: ignore[arg-type]
    with deployer.handoff(AdapterRef(agent, version, None, weights)):
        registry.publish(
            agent,
            weights,
            optimizer_state=None,
            base_model="tiny-base",
            parent=active.version if active else None,
            step=seed,
            metrics={},
            feedback_window=None,
            version=version,
        )
    return version


def _corrupt(registry: AdapterRegistry, agent: str, version: int) -> None:
    path = registry.get(agent, version).path / "adapter_model.safetensors"
    path.write_bytes(b"not a safetensors file")


async def test_start_serves_every_active_pointer(
    engine: EmbeddedEngine, registry: AdapterRegistry
) -> None:
    _publish(registry, engine, "start-a", 2)
    _publish(registry, engine, "start-b", 1)
    async with Deployer(engine, registry) as deployer:
        assert deployer.served() == {"start-a": 2, "start-b": 1}
        assert engine.adapter_version("start-a") == 2 and engine.adapter_version("start-b") == 1
        for agent in ("start-a", "start-b"):
            await deployer.deactivate(agent)
    assert engine.adapter_version("start-a") is None


async def test_a_version_that_fails_to_load_never_serves(
    engine: EmbeddedEngine, registry: AdapterRegistry, tmp_path: Path
) -> None:
    _publish(registry, engine, "corrupt", 2)
    _corrupt(registry, "corrupt", 1)
    deployer = Deployer(engine, registry)
    await deployer.start()
    try:
        with pytest.raises(CloraError):
            await deployer.activate("corrupt", 1, expected_active=2, reason="try the old one")
        assert registry.active("corrupt").version == 2  # type: ignore[union-attr]
        assert deployer.serving("corrupt") == 2 and engine.adapter_version("corrupt") == 2
        # A runtime load of a broken directory is refused before anything moves.
        with pytest.raises(CloraError):
            await deployer.adopt("corrupt", tmp_path / "missing")
        assert registry.agent("corrupt").latest_version == 2
        assert engine.adapter_version("corrupt") == 2
    finally:
        await deployer.deactivate("corrupt")
        await deployer.stop()


async def test_pointer_moved_by_another_process_is_followed(
    engine: EmbeddedEngine, registry: AdapterRegistry, tmp_path: Path
) -> None:
    _publish(registry, engine, "remote", 3)
    _corrupt(registry, "remote", 2)
    interval = 0.05
    async with Deployer(engine, registry, poll_interval_s=interval) as deployer:
        assert deployer.serving("remote") == 3
        # Another registry handle on the same files stands in for another process.
        with AdapterRegistry(tmp_path / "adapters", tmp_path / "registry.db") as other:
            other.rollback("remote", 1, reason="rolled back elsewhere")
            t0 = time.monotonic()
            while deployer.serving("remote") != 1:
                assert time.monotonic() - t0 < 40 * interval + 2.0, "the deployer did not follow"
                await asyncio.sleep(interval / 2)
            assert engine.adapter_version("remote") == 1
            # A version that cannot load here is not served; the previous one keeps serving.
            other.rollback("remote", 2, reason="to a corrupt version")
            await asyncio.sleep(10 * interval)
            assert deployer.serving("remote") == 1 and engine.adapter_version("remote") == 1
            other.rollback("remote", 3, reason="forward again")
            t0 = time.monotonic()
            while deployer.serving("remote") != 3:
                assert time.monotonic() - t0 < 40 * interval + 2.0, "the deployer did not follow"
                await asyncio.sleep(interval / 2)
        await deployer.deactivate("remote")


async def test_handoff_is_undone_when_the_registry_refuses(
    engine: EmbeddedEngine, registry: AdapterRegistry
) -> None:
    _publish(registry, engine, "refused", 1)
    deployer = Deployer(engine, registry)
    await deployer.sync("refused")
    registry.pin("refused")
    version = registry.next_version("refused")
    handoff = deployer.handoff(AdapterRef("refused", version, None, _weights(engine, 9)))
    with pytest.raises(ConflictError), handoff:
        assert engine.adapter_version("refused") == version  # served at once
        registry.publish(
            "refused",
            _weights(engine, 9),
            optimizer_state=None,
            base_model="tiny-base",
            parent=1,
            step=2,
            metrics={},
            feedback_window=None,
            version=version,
        )
    assert deployer.serving("refused") == 1 and engine.adapter_version("refused") == 1
    registry.unpin("refused")
    await deployer.deactivate("refused")


async def test_first_version_from_training_can_be_unloaded(
    engine: EmbeddedEngine, registry: AdapterRegistry
) -> None:
    """Bug: a configured agent whose first version came from training answered 404 on unload."""
    deployer = Deployer(engine, registry)
    agents = AgentRegistry(engine, deployer)
    await agents.start([AgentConfig(name="trained")])
    assert agents.resolve("trained").adapter_version == 0
    version = await asyncio.to_thread(_train_publish, deployer, registry, "trained", 1)
    assert agents.resolve("trained").adapter_version == version == 1
    await agents.unload_adapter("trained")  # no 404
    route = agents.resolve("trained")
    assert (route.engine_agent, route.adapter_version) == (None, 0)
    assert engine.adapter_version("trained") is None
    assert registry.active("trained") is None and registry.agent("trained").deactivated
    with pytest.raises(NotFoundError):
        await agents.unload_adapter("trained")


async def test_unloaded_adapter_stays_unloaded_after_restart(
    engine: EmbeddedEngine, registry: AdapterRegistry, tmp_path: Path
) -> None:
    """Bug: the pointer still named an unloaded adapter, so a restart reinstalled it."""
    path = tmp_path / "initial"
    save_peft_adapter(_weights(engine, 3), path, base_model="tiny-base")
    limits = engine.lora_limits
    register_initial(registry, "sticky", path, "tiny-base", limits)
    deployer = Deployer(engine, registry)
    agents = AgentRegistry(engine, deployer)
    await deployer.start()
    await agents.start([AgentConfig(name="sticky")])
    assert agents.resolve("sticky").adapter_version == 1
    await agents.unload_adapter("sticky")
    await deployer.stop()
    # Restart: the configured adapter_path is not imported again, nothing is reinstalled.
    register_initial(registry, "sticky", path, "tiny-base", limits)
    restarted = Deployer(engine, registry)
    agents = AgentRegistry(engine, restarted)
    async with restarted:
        await agents.start([AgentConfig(name="sticky")])
        assert restarted.serving("sticky") is None
        assert agents.resolve("sticky").adapter_version == 0
        assert engine.adapter_version("sticky") is None
        # A runtime load activates it again, as a new version whose parent is none.
        assert await agents.load_adapter("sticky", path) == 2
        assert registry.get("sticky", 2).parent is None
        await agents.unload_adapter("sticky")


def test_every_reporter_agrees_after_each_move(
    engine: EmbeddedEngine, tmp_path: Path, tiny_model_dir: Path
) -> None:
    from clora_feedback.gateway.app import create_app
    from clora_feedback.store.trajectories import AsyncTrajectoryStore

    path = tmp_path / "peft"
    save_peft_adapter(_weights(engine, 5), path, base_model="tiny-base")
    settings = Settings(
        data_dir=tmp_path / "data",
        engine=EngineConfig(model=str(tiny_model_dir), max_model_len=128),
        agents=[{"name": "agree"}],
    )
    registry = AdapterRegistry(tmp_path / "adapters", settings.registry_db)
    deployer = Deployer(engine, registry)
    app = create_app(
        settings, engine, AsyncTrajectoryStore(settings.trajectory_db), deployer=deployer
    )
    app.include_router(build_adapters_router(registry, deployer))

    def reported(client: TestClient) -> tuple[int, int | None, int, int]:
        models = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
        pointers = {a["agent"]: a for a in client.get("/v1/adapters").json()["data"]}
        reply = client.post(
            "/v1/chat/completions",
            json={
                "model": "agree",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2,
            },
        ).json()
        return (
            models["agree"]["clora"]["adapter_version"],
            pointers["agree"]["active_version"] if "agree" in pointers else None,
            reply["clora"]["adapter_version"],
            engine.adapter_version("agree") or 0,
        )

    with TestClient(app) as client:
        assert reported(client) == (0, None, 0, 0)
        _train_publish(deployer, registry, "agree", 11)  # the trainer's thread: publish
        assert reported(client) == (1, 1, 1, 1)
        load = {"lora_name": "agree", "lora_path": str(path), "load_inplace": True}
        assert client.post("/v1/load_lora_adapter", json=load).status_code == 200
        assert reported(client) == (2, 2, 2, 2)
        rollback = client.post("/v1/adapters/agree/rollback", json={"version": 1})
        assert rollback.status_code == 200, rollback.text
        assert reported(client) == (1, 1, 1, 1)
        unload = client.post("/v1/unload_lora_adapter", json={"lora_name": "agree"})
        assert unload.status_code == 200, unload.text
        assert reported(client) == (0, None, 0, 0)
    registry.close()


class _DirectoryEngine:
    """An engine that loads adapters from a directory, as vLLM does: records each path it is
    given (and whether a complete version lay there), optionally refuses one version."""

    capabilities = EngineCapabilities(
        per_token_versions=False, logprobs="raw", in_memory_adapters=False
    )

    model_name = "tiny-base"

    def __init__(self, limits: object) -> None:
        self.lora_limits = limits
        self.loaded: list[tuple[str, int, Path | None, bool]] = []
        self.fail_on: int | None = None

    async def load_adapter(self, ref: AdapterRef) -> None:
        if ref.version == self.fail_on:
            raise AdapterError(f"version {ref.version} does not load")
        complete = ref.path is not None and (ref.path / "manifest.json").is_file()
        self.loaded.append((ref.agent, ref.version, ref.path, complete))

    async def unload_adapter(self, agent: str) -> None:
        return None


async def test_adopt_gives_a_directory_engine_the_registrys_copy(
    engine: EmbeddedEngine, registry: AdapterRegistry, tmp_path: Path
) -> None:
    source = tmp_path / "upload"
    save_peft_adapter(_weights(engine, 5), source, base_model="tiny-base")
    vllm_like = _DirectoryEngine(engine.lora_limits)
    deployer = Deployer(vllm_like, registry)  # type: ignore[arg-type]
    assert await deployer.adopt("copied", source) == 1
    [(agent, version, path, complete)] = vllm_like.loaded
    assert (agent, version) == ("copied", 1) and complete
    assert path == registry.get("copied", 1).path and path != source  # the immutable copy
    assert registry.active("copied").version == 1  # type: ignore[union-attr]
    # A version the engine refuses: published first, then the pointer moves back.
    save_peft_adapter(_weights(engine, 6), source, base_model="tiny-base")
    vllm_like.fail_on = 2
    with pytest.raises(AdapterError):
        await deployer.adopt("copied", source)
    assert registry.active("copied").version == 1  # type: ignore[union-attr]
    assert registry.get("copied", 2).status == "rolled_back"
    assert deployer.serving("copied") == 1


@pytest.mark.postgres
async def test_a_publish_elsewhere_is_followed_by_notification(
    engine: EmbeddedEngine, tmp_path: Path, postgres_url: str
) -> None:
    """Polling is off in effect (an hour): only the NOTIFY can bring the new version."""
    root = tmp_path / "adapters"
    with AdapterRegistry(root, db=postgres_url) as mine:
        _publish(mine, engine, "notified", 1)
        deployer = Deployer(engine, mine, poll_interval_s=3600, listen_url=postgres_url)
        async with deployer:
            await asyncio.wait_for(deployer.listening.wait(), timeout=30)
            assert deployer.serving("notified") == 1
            # Another registry object on the same database stands in for another process.
            with AdapterRegistry(root, db=postgres_url, collect_on_open=False) as other:
                await asyncio.to_thread(
                    other.publish, "notified", _weights(engine, 2), optimizer_state=None,
                    base_model="tiny-base", parent=1, step=2, metrics={}, feedback_window=None,
                )  # fmt: skip
                # A safety bound so a broken build fails instead of hanging, not a timing claim.
                async with asyncio.timeout(30):
                    while deployer.serving("notified") != 2:
                        await asyncio.sleep(0.01)
                assert deployer.notifications["notified"] >= 1
                assert engine.adapter_version("notified") == 2
                await asyncio.to_thread(other.rollback, "notified", 1, reason="undo elsewhere")
                async with asyncio.timeout(30):
                    while deployer.serving("notified") != 1:
                        await asyncio.sleep(0.01)
                assert deployer.notifications["notified"] >= 2
            await deployer.deactivate("notified")
