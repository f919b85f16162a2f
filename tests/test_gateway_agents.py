"""The agent registry (routing, adapter versions) and the vLLM-style adapter routes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

from clora_feedback.config import AgentConfig, EngineConfig
from clora_feedback.engine.deployer import Deployer
from clora_feedback.engine.embedded import EmbeddedEngine
from clora_feedback.engine.types import SamplingParams
from clora_feedback.errors import AdapterError, InvalidRequestError, NotFoundError
from clora_feedback.gateway.agents import AgentRegistry, Route
from clora_feedback.gateway.metrics import Metrics
from clora_feedback.gateway.serving import Serving
from clora_feedback.lora.peft_io import save_peft_adapter
from clora_feedback.lora.weights import random_lora_weights
from clora_feedback.store.registry import AdapterRegistry
from clora_feedback.store.trajectories import AsyncTrajectoryStore

if TYPE_CHECKING:
    from conftest import GatewayFactory


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> EmbeddedEngine:
    # Not started: adapters install without the step loop running.
    return EmbeddedEngine(
        tiny_model_dir, EngineConfig(model=str(tiny_model_dir), max_model_len=64), model_name="base"
    )


@pytest.fixture(scope="module")
def adapter_dir(engine: EmbeddedEngine, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("adapters") / "a1"
    save_peft_adapter(
        random_lora_weights(engine.lora_limits, rank=4, seed=1), path, base_model="tiny"
    )
    return path


@pytest.fixture(scope="module")
def too_big_adapter(engine: EmbeddedEngine, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("adapters") / "big"
    rank = engine.lora_limits.max_rank * 2
    save_peft_adapter(
        random_lora_weights(engine.lora_limits, rank=rank, seed=2), path, base_model="tiny"
    )
    return path


@pytest.fixture
def deployer(engine: EmbeddedEngine, tmp_path: Path) -> Iterator[Deployer]:
    """A deployer over the module's engine and a fresh registry (what serves is its)."""
    registry = AdapterRegistry(tmp_path / "adapters", tmp_path / "registry.db")
    yield Deployer(engine, registry)
    registry.close()


async def test_versions_are_monotonic_per_agent(deployer: Deployer, adapter_dir: Path) -> None:
    assert [await deployer.adopt("a", adapter_dir) for _ in range(3)] == [1, 2, 3]
    assert await deployer.adopt("b", adapter_dir) == 1
    for agent in ("a", "b"):
        await deployer.deactivate(agent)


async def test_routing_of_base_configured_and_unknown_models(
    engine: EmbeddedEngine, deployer: Deployer, adapter_dir: Path
) -> None:
    registry = AgentRegistry(engine, deployer)
    await registry.start([AgentConfig(name="plain"), AgentConfig(name="tuned")])
    await registry.load_adapter("tuned", adapter_dir)
    try:
        base = registry.resolve("base")
        assert (base.agent, base.engine_agent, base.adapter_version) == (None, None, 0)
        plain = registry.resolve("plain")
        assert (plain.agent, plain.engine_agent, plain.adapter_version) == ("plain", None, 0)
        tuned = registry.resolve("tuned")
        assert (tuned.agent, tuned.engine_agent, tuned.adapter_version) == ("tuned", "tuned", 1)
        with pytest.raises(NotFoundError) as info:
            registry.resolve("ghost")
        assert (info.value.param, info.value.code) == ("model", "model_not_found")
    finally:
        await deployer.deactivate("tuned")


async def test_a_canary_arm_that_ended_before_the_run_started_serves_the_serving_version(
    tiny_model_dir: Path, adapter_dir: Path, tmp_path: Path
) -> None:
    """Bug class: a request routed to a canary arm whose release ended (promoted or
    aborted, the arm unloaded) while its prompt was built got 404 "no adapter is loaded
    for agent 'tuned@canary'". It now runs on the agent's serving version, and the route
    it returns (for the response and the trajectory) says so."""
    engine = EmbeddedEngine(
        tiny_model_dir, EngineConfig(model=str(tiny_model_dir), max_model_len=64), model_name="base"
    )
    adapters = AdapterRegistry(tmp_path / "adapters", tmp_path / "registry.db")
    registry = AgentRegistry(engine, Deployer(engine, adapters))
    store = AsyncTrajectoryStore(tmp_path / "t.db")
    serving = Serving(engine, registry, store, Metrics())
    await engine.start()
    try:
        await registry.start([AgentConfig(name="tuned")])
        await registry.load_adapter("tuned", adapter_dir)
        registry.canary_route = lambda agent, key: ("tuned@canary", 9)  # an arm not loaded
        routed = registry.resolve("tuned", sticky="k")
        assert (routed.engine_agent, routed.adapter_version) == ("tuned@canary", 9)
        sampling = SamplingParams(max_tokens=3, ignore_eos=True)
        route, _, run = serving.start(
            routed, id_prefix="chatcmpl", prompts=[[1, 2, 3]], sampling=sampling, n=1
        )
        assert (route.agent, route.engine_agent, route.adapter_version) == ("tuned", "tuned", 1)
        (choice,) = await run.run()
        assert choice.versions == [1, 1, 1]  # served by the agent's own adapter
        registry.canary_route = None
        with pytest.raises(NotFoundError):  # no arm involved: the agent's own refusal stands
            serving.start(
                Route("ghost", "ghost", "ghost", 1),
                id_prefix="chatcmpl",
                prompts=[[1, 2, 3]],
                sampling=sampling,
                n=1,
            )
    finally:
        await engine.stop()
        await store.stop()
        adapters.close()


async def test_load_replace_unload_cycle(
    engine: EmbeddedEngine, deployer: Deployer, adapter_dir: Path
) -> None:
    registry = AgentRegistry(engine, deployer)
    await registry.start([AgentConfig(name="cfg")])
    assert await registry.load_adapter("cfg", adapter_dir) == 1
    with pytest.raises(InvalidRequestError) as info:
        await registry.load_adapter("cfg", adapter_dir)
    assert info.value.code == "lora_already_loaded"
    assert await registry.load_adapter("cfg", adapter_dir, replace=True) == 2
    assert engine.adapter_version("cfg") == 2
    await registry.unload_adapter("cfg")
    assert engine.adapter_version("cfg") is None
    assert (
        registry.resolve("cfg").engine_agent is None
    )  # configured agents fall back to the base model
    assert await registry.load_adapter("cfg", adapter_dir) == 3  # versions never go back

    assert await registry.load_adapter("runtime", adapter_dir) == 1
    await registry.unload_adapter("runtime")
    with pytest.raises(NotFoundError):
        registry.resolve("runtime")  # runtime-only agents disappear with their adapter
    with pytest.raises(NotFoundError):
        await registry.unload_adapter("runtime")
    await registry.unload_adapter("cfg")


async def test_bad_adapters_leave_serving_untouched(
    engine: EmbeddedEngine,
    deployer: Deployer,
    adapter_dir: Path,
    too_big_adapter: Path,
    tmp_path: Path,
) -> None:
    registry = AgentRegistry(engine, deployer)
    await registry.load_adapter("x", adapter_dir)
    for bad in (too_big_adapter, tmp_path / "missing"):
        with pytest.raises(AdapterError):
            await registry.load_adapter("x", bad, replace=True)
    assert engine.adapter_version("x") == 1
    with pytest.raises(InvalidRequestError):
        await registry.load_adapter("base", adapter_dir)
    await registry.unload_adapter("x")


async def test_agent_named_like_the_base_model_is_refused(
    engine: EmbeddedEngine, deployer: Deployer
) -> None:
    with pytest.raises(InvalidRequestError):
        await AgentRegistry(engine, deployer).start([AgentConfig(name="base")])


# -- HTTP: /v1/load_lora_adapter and /v1/unload_lora_adapter ------------------------------


def test_adapter_routes_behave_like_vllm(
    start_gateway: GatewayFactory, adapter_dir: Path, too_big_adapter: Path
) -> None:
    gateway = start_gateway()
    client = gateway.openai()
    with gateway.http() as http:
        ok = http.post(
            "/v1/load_lora_adapter", json={"lora_name": "new-agent", "lora_path": str(adapter_dir)}
        )
        assert ok.status_code == 200
        assert ok.text == "Success: LoRA adapter 'new-agent' added successfully."
        models = {m.id: m for m in client.models.list()}
        assert set(models) == {"tiny-base", "new-agent"}
        assert models["new-agent"].model_extra["clora"] == {
            "agent": "new-agent",
            "adapter_version": 1,
        }
        reply = client.chat.completions.create(
            model="new-agent", messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        extension = reply.model_extra["clora"]
        assert (extension["agent"], extension["adapter_version"]) == ("new-agent", 1)
        assert set(reply.choices[0].model_extra["clora"]["token_versions"]) == {1}

        again = http.post(
            "/v1/load_lora_adapter", json={"lora_name": "new-agent", "lora_path": str(adapter_dir)}
        )
        assert again.status_code == 400
        assert again.json()["error"]["code"] == "lora_already_loaded"
        inplace = http.post(
            "/v1/load_lora_adapter",
            json={"lora_name": "new-agent", "lora_path": str(adapter_dir), "load_inplace": True},
        )
        assert inplace.status_code == 200
        assert gateway.engine.adapter_version("new-agent") == 2

        for body in (
            {"lora_name": "other", "lora_path": "/does/not/exist"},
            {"lora_name": "other", "lora_path": str(too_big_adapter)},
            {"lora_name": "other"},
        ):
            bad = http.post("/v1/load_lora_adapter", json=body)
            assert bad.status_code == 400, body
            assert bad.json()["error"]["type"] == "invalid_request_error"

        gone = http.post("/v1/unload_lora_adapter", json={"lora_name": "new-agent"})
        assert (gone.status_code, gone.text) == (
            200,
            "Success: LoRA adapter 'new-agent' removed successfully.",
        )
        missing = http.post("/v1/unload_lora_adapter", json={"lora_name": "new-agent"})
        assert missing.status_code == 404
        assert missing.json()["error"]["param"] == "lora_name"
    with pytest.raises(Exception) as info:
        client.chat.completions.create(
            model="new-agent", messages=[{"role": "user", "content": "hi"}], max_tokens=1
        )
    assert getattr(info.value, "status_code", None) == 404


def test_configured_adapter_loads_at_startup(
    start_gateway: GatewayFactory, adapter_dir: Path
) -> None:
    gateway = start_gateway(
        agents=[{"name": "support", "adapter_path": str(adapter_dir)}, {"name": "fresh"}]
    )
    models = {
        m.id: m.model_extra["clora"]["adapter_version"] for m in gateway.openai().models.list()
    }
    assert models == {"tiny-base": 0, "support": 1, "fresh": 0}
    health = httpx.get(f"{gateway.url}/health").json()
    assert health["status"] == "ok" and health["engine"]["adapters"] == {"support": 1}
