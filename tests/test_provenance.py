"""Provenance: versions record the base model's digests; every load path refuses another base.

The served base is the tiny model; "another base" is the same directory with one
part changed (a weight byte, the tokenizer, the chat template), so shapes match
and only the digests can tell. Load paths: `registry.load` (rollback, reconcile,
another process), the deployer's rollback and watcher, the runtime route
`POST /v1/load_lora_adapter`, and a configured `adapter_path` at start-up. The
no-op probe runs on the embedded engine with its step loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from clora_feedback.config import EngineConfig, Settings
from clora_feedback.engine.deployer import Deployer
from clora_feedback.engine.embedded import EmbeddedEngine
from clora_feedback.engine.probe import NoopProbe
from clora_feedback.engine.types import EngineCapabilities
from clora_feedback.errors import BaseMismatchError
from clora_feedback.gateway.adapters import build_adapters_router
from clora_feedback.gateway.app import create_app
from clora_feedback.lora.peft_io import save_peft_adapter
from clora_feedback.lora.weights import LoRAWeights, random_lora_weights
from clora_feedback.store.artifact import MANIFEST_NAME
from clora_feedback.store.provenance import BaseIdentity, base_identity
from clora_feedback.store.registry import AdapterRegistry
from clora_feedback.store.trajectories import AsyncTrajectoryStore


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> EmbeddedEngine:
    config = EngineConfig(model=str(tiny_model_dir), max_model_len=128, num_threads=1)
    return EmbeddedEngine(tiny_model_dir, config, model_name="tiny-base")


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path) -> BaseIdentity:
    return base_identity(tiny_model_dir, "tiny-base")


def _variant(src: Path, dst: Path, part: str) -> Path:
    """A copy of the model directory with one part changed."""
    shutil.copytree(src, dst)
    if part == "weights":
        file = next(dst.glob("*.safetensors"))
        data = bytearray(file.read_bytes())
        start = 8 + struct.unpack("<Q", bytes(data[:8]))[0]
        data[start + 1] ^= 0xFF  # inside the first sampled window
        file.write_bytes(bytes(data))
    elif part == "tokenizer":
        tok = json.loads((dst / "tokenizer.json").read_text())
        tok["added_tokens"] = [*tok.get("added_tokens", []), {"id": 9999, "content": "<x>"}]
        (dst / "tokenizer.json").write_text(json.dumps(tok))
    elif (dst / "chat_template.jinja").is_file():
        (dst / "chat_template.jinja").write_text("{{ messages }}")
    else:
        config = json.loads((dst / "tokenizer_config.json").read_text())
        config["chat_template"] = "{{ messages }}"
        (dst / "tokenizer_config.json").write_text(json.dumps(config))
    return dst


def _weights(engine: EmbeddedEngine, seed: int) -> LoRAWeights:
    return random_lora_weights(engine.lora_limits, rank=2, seed=seed)


def _publish(registry: AdapterRegistry, weights: LoRAWeights, parent: int | None) -> int:
    return registry.publish(
        "a", weights, optimizer_state=None, base_model="tiny-base", parent=parent, step=1,
        metrics={}, feedback_window=None,
    ).version  # fmt: skip


@pytest.fixture
def registry(tmp_path: Path, store_url: str, served: BaseIdentity) -> Iterator[AdapterRegistry]:
    with AdapterRegistry(tmp_path / "adapters", db=store_url, base_identity=served) as reg:
        yield reg


def test_identity_is_stable_cheap_and_sees_each_part(
    tiny_model_dir: Path, tmp_path: Path, served: BaseIdentity
) -> None:
    again = base_identity(tiny_model_dir, "tiny-base")
    assert again.as_manifest() == served.as_manifest()
    assert served.tokenizer is not None and served.chat_template is not None
    assert served.seconds < 0.5, served.seconds
    for part in ("weights", "tokenizer", "chat_template"):
        other = base_identity(_variant(tiny_model_dir, tmp_path / part, part), "tiny-base")
        differs = [p for p in ("weights", "tokenizer", "chat_template")
                   if getattr(other, p) != getattr(served, p)]  # fmt: skip
        assert differs == [part]


def test_manifest_records_the_base_and_another_base_refuses_to_load(
    registry: AdapterRegistry,
    engine: EmbeddedEngine,
    tiny_model_dir: Path,
    tmp_path: Path,
    store_url: str,
) -> None:
    version = _publish(registry, _weights(engine, 1), None)
    manifest = registry.manifest("a", version)
    assert manifest["base"]["weights"] == registry.base_identity.weights  # type: ignore[union-attr]
    assert manifest["lora"]["rank"] == 2 and manifest["lora"]["target_modules"]
    registry.load("a", version, limits=engine.lora_limits)
    other = base_identity(_variant(tiny_model_dir, tmp_path / "tok", "tokenizer"), "other")
    # Another process on the same registry, serving another base (e.g. a reconcile there).
    with AdapterRegistry(
        tmp_path / "adapters", db=store_url, base_identity=other, collect_on_open=False
    ) as elsewhere:
        with pytest.raises(BaseMismatchError) as caught:
            elsewhere.load("a", version)
        assert caught.value.differs == ("tokenizer",)
        assert "tokenizer" in caught.value.message and caught.value.http_status == 400


def test_old_manifest_without_digests_loads_with_a_warning(
    registry: AdapterRegistry, engine: EmbeddedEngine, caplog: pytest.LogCaptureFixture
) -> None:
    version = _publish(registry, _weights(engine, 1), None)
    path = registry.get("a", version).path / MANIFEST_NAME
    manifest = json.loads(path.read_text())
    del manifest["base"]
    path.write_text(json.dumps(manifest))  # the manifest is not in the content hash
    with caplog.at_level(logging.WARNING):
        registry.load("a", version)
    assert "no base model digests" in caplog.text


def _mismatched_copy(registry: AdapterRegistry, version: int, tmp_path: Path) -> Path:
    """A version directory copied out, its manifest claiming another base's weights."""
    copy = tmp_path / "copied"
    shutil.copytree(registry.get("a", version).path, copy)
    manifest = json.loads((copy / MANIFEST_NAME).read_text())
    manifest["base"]["weights"] = "0" * 64
    (copy / MANIFEST_NAME).write_text(json.dumps(manifest))
    return copy


async def test_every_deployer_path_refuses_and_the_previous_version_keeps_serving(
    tmp_path: Path, engine: EmbeddedEngine, served: BaseIdentity, caplog: pytest.LogCaptureFixture
) -> None:
    registry = AdapterRegistry(tmp_path / "adapters", base_identity=served)
    v1 = _publish(registry, _weights(engine, 1), None)
    v2 = _publish(registry, _weights(engine, 2), v1)
    deployer = Deployer(engine, registry)
    await deployer.start()
    try:
        assert deployer.serving("a") == v2
        # Rollback to a version recorded on another base: refused before the engine changes.
        manifest_path = registry.get("a", v1).path / MANIFEST_NAME
        manifest = json.loads(manifest_path.read_text())
        manifest["base"]["chat_template"] = "f" * 64
        manifest_path.write_text(json.dumps(manifest))
        with pytest.raises(BaseMismatchError, match="chat template"):
            await deployer.activate("a", v1, expected_active=v2, reason="test")
        assert deployer.serving("a") == v2 and engine.adapter_version("a") == v2
        assert registry.active("a").version == v2  # type: ignore[union-attr]
        # A runtime load (the route's path) of a copied directory from another base.
        with pytest.raises(BaseMismatchError, match="base weights"):
            await deployer.adopt("a", _mismatched_copy(registry, v2, tmp_path))
        assert deployer.serving("a") == v2 and registry.agent("a").latest_version == v2
        # The pointer moved by another process to the bad version: logged, not served.
        registry.rollback("a", v1, reason="elsewhere", expected_active=v2)
        with caplog.at_level(logging.ERROR):
            await deployer.reconcile()
        assert deployer.serving("a") == v2 and "chat template" in caplog.text
        # A plain PEFT directory: its base name is only a hint; shapes decide.
        plain = tmp_path / "plain"
        save_peft_adapter(_weights(engine, 3), plain, base_model="someone/else")
        registry.rollback("a", v2, reason="back", expected_active=v1)
        await deployer.reconcile()
        with caplog.at_level(logging.WARNING):
            v3 = await deployer.adopt("a", plain)
        assert deployer.serving("a") == v3 and "a hint only" in caplog.text
        assert registry.manifest("a", v3)["base"]["weights"] == served.weights
    finally:
        await deployer.stop()
        registry.close()


def test_configured_adapter_path_from_another_base_is_refused_at_start_up(
    tmp_path: Path, engine: EmbeddedEngine, served: BaseIdentity
) -> None:
    with AdapterRegistry(tmp_path / "src", base_identity=served) as source:
        v1 = _publish(source, _weights(engine, 1), None)
        copy = _mismatched_copy(source, v1, tmp_path)
    with AdapterRegistry(tmp_path / "adapters", base_identity=served) as registry:
        with pytest.raises(BaseMismatchError):
            registry.register_initial("b", copy, limits=engine.lora_limits)
        assert registry.agents() == []


def test_runtime_route_refuses_another_base_with_400(
    tmp_path: Path, tiny_model_dir: Path, served: BaseIdentity
) -> None:
    config = EngineConfig(model=str(tiny_model_dir), max_model_len=128, num_threads=1)
    eng = EmbeddedEngine(tiny_model_dir, config, model_name="tiny-base")
    registry = AdapterRegistry(tmp_path / "adapters", base_identity=served)
    good = tmp_path / "good"
    save_peft_adapter(_weights(eng, 1), good, base_model="tiny-base")
    settings = Settings(data_dir=tmp_path / "data", engine=config)
    deployer = Deployer(eng, registry, on_stop=registry.close)
    app = create_app(
        settings, eng, AsyncTrajectoryStore(tmp_path / "t.db"), deployer=deployer,
        routers=[build_adapters_router(registry, deployer)],
    )  # fmt: skip
    with TestClient(app) as client:
        ok = client.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(good)})
        assert ok.status_code == 200
        bad = _mismatched_copy(registry, 1, tmp_path)
        refused = client.post(
            "/v1/load_lora_adapter",
            json={"lora_name": "a", "lora_path": str(bad), "load_inplace": True},
        )
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["code"] == "base_mismatch" and "base weights" in error["message"]
        assert deployer.serving("a") == 1


SUBTLE = 0.01
"""LoRA factor std that moves the tiny model's probe logprobs but none of its greedy tokens."""


async def test_probe_flags_a_noop_adapter_and_not_a_real_one(
    tmp_path: Path, tiny_model_dir: Path, served: BaseIdentity
) -> None:
    config = EngineConfig(model=str(tiny_model_dir), max_model_len=128, num_threads=1)
    eng = EmbeddedEngine(tiny_model_dir, config, model_name="tiny-base")
    registry = AdapterRegistry(tmp_path / "adapters", base_identity=served)
    probe = NoopProbe(eng, registry)
    deployer = Deployer(eng, registry, on_installed=probe.schedule)
    real = random_lora_weights(eng.lora_limits, rank=4, seed=1, std=0.5)
    noop = LoRAWeights(
        rank=real.rank,
        alpha=real.alpha,
        tensors={k: (a, b * 0) for k, (a, b) in real.tensors.items()},
    )
    await eng.start()
    try:
        await deployer.start()
        _publish(registry, noop, None)
        await deployer.reconcile()
        await probe.idle()
        _publish(registry, real, 1)
        await deployer.reconcile()
        await probe.idle()
        # A small real change: the base's greedy words at other probabilities (an agent
        # trained on its own domain answers generic prompts so) is no no-op.
        _publish(registry, random_lora_weights(eng.lora_limits, rank=4, seed=2, std=SUBTLE), 2)
        await deployer.reconcile()
        await probe.idle()
        first, second, third = registry.versions("a")
        assert first.noop is True and second.noop is False
        assert first.probe is not None and first.probe["prompts"] == 4
        assert first.probe["max_logprob_change"] <= probe.tolerance
        assert third.probe is not None and third.probe["same_tokens"] is True, third.probe
        assert third.noop is False and third.probe["max_logprob_change"] > probe.tolerance
        started = time.perf_counter()
        assert await probe.probe("a", 2) is None  # probed once, never again
        print(f"probe: {first.probe['seconds']:.3f} s (base outputs included), "
              f"{second.probe['seconds']:.3f} s; recheck {time.perf_counter() - started:.4f} s")  # fmt: skip
        app_router = build_adapters_router(registry, deployer)
        listed = [r for r in app_router.routes if getattr(r, "path", "").endswith("/versions")]
        assert listed  # the listing's wire model carries `noop` (checked in the next test)
    finally:
        await deployer.stop()
        await probe.stop()
        await eng.stop()
        registry.close()


def test_versions_listing_shows_noop_and_pruned(
    tmp_path: Path, engine: EmbeddedEngine, served: BaseIdentity
) -> None:
    from fastapi import FastAPI

    registry = AdapterRegistry(tmp_path / "adapters", base_identity=served)
    for parent in (None, 1, 2):
        _publish(registry, _weights(engine, 1), parent)
    registry.record_probe("a", 3, {"noop": True, "prompts": 4})
    assert not registry.record_probe("a", 3, {"noop": False})  # recorded once
    registry.prune("a", keep_last=1)
    from clora_feedback.gateway.auth import KeyAuthenticator

    app = FastAPI()
    app.state.authenticator = KeyAuthenticator(Settings(data_dir=tmp_path / "data"))
    app.include_router(build_adapters_router(registry))
    with TestClient(app) as client:
        data = client.get("/v1/adapters/a/versions").json()["data"]
    assert [(v["payload_pruned"], v["noop"]) for v in data] == [
        (True, None),
        (True, None),
        (False, True),
    ]
    registry.close()


class _PathEngine:
    """Loads adapters from their directory, as vLLM does (records what it was given)."""

    capabilities = EngineCapabilities(
        per_token_versions=False, logprobs="raw", in_memory_adapters=False
    )

    model_name = "tiny-base"

    def __init__(self, limits: object) -> None:
        self.lora_limits = limits
        self.loaded: list[int] = []

    async def load_adapter(self, ref: object) -> None:
        self.loaded.append(ref.version)  # type: ignore[attr-defined]

    async def unload_adapter(self, agent: str) -> None:
        return None


async def test_an_engine_that_reads_the_directory_is_checked_from_the_manifest(
    tmp_path: Path, engine: EmbeddedEngine, served: BaseIdentity, caplog: pytest.LogCaptureFixture
) -> None:
    registry = AdapterRegistry(tmp_path / "adapters", base_identity=served)
    v1 = _publish(registry, _weights(engine, 1), None)
    v2 = _publish(registry, _weights(engine, 2), v1)
    vllm_like = _PathEngine(engine.lora_limits)
    deployer = Deployer(vllm_like, registry)  # type: ignore[arg-type]
    await deployer.reconcile()
    assert vllm_like.loaded == [v2]
    manifest_path = registry.get("a", v1).path / MANIFEST_NAME
    manifest = json.loads(manifest_path.read_text())
    manifest["base"]["tokenizer"] = "e" * 64
    manifest_path.write_text(json.dumps(manifest))
    registry.rollback("a", v1, reason="elsewhere")  # another process moved the pointer
    with caplog.at_level(logging.ERROR):
        await deployer.reconcile()
    assert vllm_like.loaded == [v2] and deployer.serving("a") == v2
    assert "tokenizer" in caplog.text
    registry.close()


async def test_a_trainer_handoff_is_probed_too(
    tmp_path: Path, tiny_model_dir: Path, served: BaseIdentity
) -> None:
    from clora_feedback.store.versions import AdapterRef

    config = EngineConfig(model=str(tiny_model_dir), max_model_len=128, num_threads=1)
    eng = EmbeddedEngine(tiny_model_dir, config, model_name="tiny-base")
    registry = AdapterRegistry(tmp_path / "adapters", base_identity=served)
    probe = NoopProbe(eng, registry)
    deployer = Deployer(eng, registry, on_installed=probe.schedule)
    await eng.start()
    try:
        await deployer.start()
        weights = random_lora_weights(eng.lora_limits, rank=4, seed=3, std=0.5)

        def train_publish() -> None:  # what the trainer's thread does
            version = registry.next_version("a")
            with deployer.handoff(AdapterRef("a", version, None, weights)):
                registry.publish(
                    "a", weights, optimizer_state=None, base_model="tiny-base", parent=None,
                    step=1, metrics={}, feedback_window=None, version=version,
                )  # fmt: skip

        await asyncio.to_thread(train_publish)
        for _ in range(200):
            if registry.get("a", 1).probe is not None:
                break
            await asyncio.sleep(0.02)
        assert registry.get("a", 1).noop is False
    finally:
        await deployer.stop()
        await probe.stop()
        await eng.stop()
        registry.close()


def test_the_service_wires_identity_probe_and_retention(
    tmp_path: Path, tiny_model_dir: Path, served: BaseIdentity
) -> None:
    from clora_feedback.config import RetentionConfig, TrainerConfig
    from clora_feedback.service import build_service

    settings = Settings(
        data_dir=tmp_path / "var",
        adapters_dir=tmp_path / "adapters",
        engine=EngineConfig(model=str(tiny_model_dir), max_model_len=256, num_threads=1),
        trainer=TrainerConfig(enabled=False),
        retention=RetentionConfig(keep_last=1, interval_s=0.1),
    )
    service = build_service(settings)
    assert service.registry.base_identity is not None
    assert service.registry.base_identity.weights == served.weights  # the name is informative
    plain = tmp_path / "plain"
    save_peft_adapter(_weights(service.engine, 1), plain, base_model="tiny-base")  # type: ignore[arg-type]
    with TestClient(service.app) as client:
        for _ in range(2):
            body = {"lora_name": "a", "lora_path": str(plain), "load_inplace": True}
            assert client.post("/v1/load_lora_adapter", json=body).status_code == 200
        bad = _mismatched_copy(service.registry, 2, tmp_path)
        body = {"lora_name": "a", "lora_path": str(bad), "load_inplace": True}
        refused = client.post("/v1/load_lora_adapter", json=body)
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "base_mismatch"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the retention pass and the probe, in the background
            listed = client.get("/v1/adapters/a/versions").json()["data"]
            if listed[0]["payload_pruned"] and listed[1]["noop"] is not None:
                break
            time.sleep(0.1)
        assert [v["payload_pruned"] for v in listed] == [True, False]
        assert listed[1]["noop"] is False and listed[1]["status"] == "active"
        metrics = client.get("/metrics").text
        assert "clora_retention_pruned_versions_total 1" in metrics
        assert 'clora_probe_versions_total{result="changed"}' in metrics
        rollback = client.post("/v1/adapters/a/rollback", json={"version": 1})
        assert rollback.status_code == 410 and rollback.json()["error"]["code"] == "version_pruned"
