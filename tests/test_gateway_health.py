"""`GET /health` and the embedded broker's port (issue 25 items 3 and 7).

- Without the admin key (no key, an agent key, a wrong key) `/health` answers
  liveness and engine numbers only: no agent names, versions or counts. The
  admin key sees the adapters served and the feedback broker's bootstrap address.
- The embedded Kafka-protocol broker listens on `feedback.kafka.embedded_broker_port`:
  a set port that is busy stops the start with an error naming that setting;
  unset, it is Kafka's 9092 when free, else a free port (shown in `/health`).
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from conftest import GatewayFactory, serve_app

from clora_feedback.config import FeedbackConfig, KafkaConfig, Settings
from clora_feedback.errors import CloraError, ConfigError
from clora_feedback.feedback.broker import LocalBroker, free_port, probe_metadata
from clora_feedback.feedback.pipeline import FeedbackPipeline
from clora_feedback.feedback.rewards import DefaultRewardPolicy
from clora_feedback.feedback.store import FeedbackStore
from clora_feedback.lora.peft_io import save_peft_adapter
from clora_feedback.lora.weights import random_lora_weights
from clora_feedback.store.trajectories import TrajectoryStore

ADMIN = "sk-admin-health"
AGENT = "sk-support-health"
SETTING = "feedback.kafka.embedded_broker_port"


@contextmanager
def _held_port() -> Iterator[int]:
    """A loopback port something else listens on."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        yield int(sock.getsockname()[1])


def _health(url: str, key: str | None) -> dict[str, object]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    response = httpx.get(f"{url}/health", headers=headers, timeout=10)
    assert response.status_code == 200
    body: dict[str, object] = response.json()
    return body


def test_health_names_agents_to_the_admin_key_only(
    start_gateway: GatewayFactory, tmp_path: Path
) -> None:
    gateway = start_gateway(
        admin_api_key=ADMIN,
        agents=[{"name": "support", "api_keys": [AGENT]}, {"name": "secret-sales"}],
    )
    adapter = tmp_path / "adapter"
    weights = random_lora_weights(gateway.engine.lora_limits, rank=2, seed=3)
    save_peft_adapter(weights, adapter, base_model="tiny")
    with gateway.http(headers={"Authorization": f"Bearer {ADMIN}"}) as http:
        loaded = http.post(
            "/v1/load_lora_adapter", json={"lora_name": "secret-sales", "lora_path": str(adapter)}
        )
        assert loaded.status_code == 200, loaded.text
    for key in (None, AGENT, "sk-wrong"):
        body = _health(gateway.url, key)
        assert body["status"] == "ok" and body["model"] == "tiny-base"
        assert "secret-sales" not in str(body) and "support" not in str(body)
        assert "agents" not in body and "adapters" not in body["engine"]  # type: ignore[operator]
    admin = _health(gateway.url, ADMIN)
    assert admin["engine"]["adapters"] == {"secret-sales": 1}  # type: ignore[index]
    assert admin["agents"] == 2


@pytest.mark.slow  # a real Kafka-protocol broker
def test_a_busy_fixed_port_is_refused_before_spawning() -> None:
    with _held_port() as port:
        broker = LocalBroker(port=port)
        with pytest.raises(CloraError) as info:
            broker.start()
    assert info.value.code == "broker_port_in_use" and str(port) in info.value.message
    assert broker.pid is None


@pytest.mark.slow  # a real Kafka-protocol broker
def test_a_busy_preferred_port_falls_back_to_a_free_one() -> None:
    with _held_port() as port, LocalBroker(preferred_port=port) as broker:
        host, _, bound = broker.bootstrap.partition(":")
        assert host == "127.0.0.1" and int(bound) != port
        assert probe_metadata(host, int(bound))


@pytest.fixture
def feedback_store(tmp_path: Path) -> Iterator[FeedbackStore]:
    trajectories = TrajectoryStore(tmp_path / "t.db")
    store = FeedbackStore(
        tmp_path / "t.db", trajectories=trajectories, policy=DefaultRewardPolicy(FeedbackConfig())
    )
    yield store
    store.close()
    trajectories.close()


def _pipeline(store: FeedbackStore, tmp_path: Path, port: int | None) -> FeedbackPipeline:
    config = FeedbackConfig(kafka=KafkaConfig(embedded_broker_port=port))
    return FeedbackPipeline(config, store, lambda: {"support"}, broker_dir=tmp_path / "kafka")


@pytest.mark.slow  # a real Kafka-protocol broker
async def test_the_pipeline_names_the_setting_when_its_port_is_busy(
    feedback_store: FeedbackStore, tmp_path: Path
) -> None:
    with _held_port() as port:
        pipeline = _pipeline(feedback_store, tmp_path, port)
        with pytest.raises(ConfigError) as info:
            await pipeline.start()
        await pipeline.stop()
    assert SETTING in info.value.message and str(port) in info.value.message


@pytest.mark.slow  # a real Kafka-protocol broker
async def test_the_pipeline_listens_on_the_set_port(
    feedback_store: FeedbackStore, tmp_path: Path
) -> None:
    port = free_port()
    pipeline = _pipeline(feedback_store, tmp_path, port)
    await pipeline.start()
    try:
        assert pipeline.bootstrap == f"127.0.0.1:{port}"
        assert probe_metadata("127.0.0.1", port)
    finally:
        await pipeline.stop()
    assert pipeline.bootstrap is None


def test_the_default_port_is_kafkas() -> None:
    assert KafkaConfig().embedded_broker_port is None
    assert "9092" in (KafkaConfig.model_fields["embedded_broker_port"].description or "")


@pytest.mark.slow  # a real Kafka-protocol broker
def test_health_shows_the_broker_to_the_admin_key(tiny_model_dir: Path, tmp_path: Path) -> None:
    from clora_feedback.service import build_service

    port = free_port()
    settings = Settings(
        data_dir=tmp_path / "var",
        adapters_dir=tmp_path / "adapters",
        engine={"model": str(tiny_model_dir), "max_model_len": 256, "num_threads": 1},  # type: ignore[arg-type]
        agents=[{"name": "support", "api_keys": [AGENT]}],  # type: ignore[list-item]
        admin_api_key=ADMIN,
        trainer={"enabled": False},  # type: ignore[arg-type]
        feedback={"kafka": {"embedded_broker_port": port}},  # type: ignore[arg-type]
    )
    service = build_service(settings)
    with serve_app(service.app, service.engine) as gateway:
        admin = _health(gateway.url, ADMIN)
        anonymous = _health(gateway.url, None)
    assert admin["feedback"] == {"kafka_bootstrap": f"127.0.0.1:{port}"}
    assert "feedback" not in anonymous
