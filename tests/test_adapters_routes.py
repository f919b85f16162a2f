"""Admin routes for adapter versions, and the `clora adapters` CLI that drives them.

Route behaviour (auth, listing, 404/409/400, rollback ordering between the
engine and the registry, which the deployer owns, pin) is tested with FastAPI's
TestClient on a minimal app. One end-to-end test runs the real gateway (tiny model, embedded engine)
under uvicorn with the router mounted, rolls back through the CLI, and checks
that the next completion is served by the rolled-back version.
"""

from __future__ import annotations

import argparse
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from clora_feedback.cli.adapters import add_adapters_parser, run_adapters
from clora_feedback.config import EngineConfig, Settings
from clora_feedback.engine.deployer import Deployer
from clora_feedback.engine.types import EngineCapabilities
from clora_feedback.errors import AdapterError, StoreError
from clora_feedback.gateway.adapters import build_adapters_router
from clora_feedback.gateway.auth import KeyAuthenticator
from clora_feedback.gateway.errors import install_error_handlers
from clora_feedback.lora.weights import LoRALimits, random_lora_weights
from clora_feedback.store.registry import AdapterRegistry
from clora_feedback.store.versions import AdapterRef

ADMIN = {"Authorization": "Bearer admin-key"}
TINY_SHAPES = {
    "q_proj": (64, 64),
    "k_proj": (64, 32),
    "v_proj": (64, 32),
    "o_proj": (64, 64),
    "gate_proj": (64, 128),
    "up_proj": (64, 128),
    "down_proj": (128, 64),
}
LIMITS = LoRALimits(16, tuple(TINY_SHAPES), 2, TINY_SHAPES)


def _fill(registry: AdapterRegistry, agent: str, count: int) -> None:
    for version in range(1, count + 1):
        registry.publish(
            agent,
            random_lora_weights(LIMITS, rank=2, seed=version, target_modules=("q_proj",)),
            optimizer_state=None,
            base_model="tiny-base",
            parent=version - 1 or None,
            step=version * 10,
            metrics={"loss": 1.0 / version, "reward_mean": 0.1 * version},
            feedback_window={"samples": 16},
        )


class Activations:
    """A fake engine behind the deployer: records the versions it is asked to serve,
    optionally refuses one."""

    capabilities = EngineCapabilities(
        per_token_versions=False, logprobs="raw", in_memory_adapters=False
    )

    model_name = "tiny-base"
    lora_limits = LIMITS

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []
        self.fail_on: int | None = None

    async def load_adapter(self, ref: AdapterRef) -> None:
        if ref.version == self.fail_on:
            raise AdapterError(f"version {ref.version} does not fit the engine")
        self.calls.append((ref.agent, ref.version))

    async def unload_adapter(self, agent: str) -> None:
        return None


def _app(registry: Any, activations: Activations) -> FastAPI:
    settings = Settings(
        admin_api_key="admin-key", agents=[{"name": "support", "api_keys": ["agent-key"]}]
    )
    app = FastAPI()
    app.state.authenticator = KeyAuthenticator(settings)
    install_error_handlers(app)
    deployer = Deployer(activations, registry)  # type: ignore[arg-type]
    app.include_router(build_adapters_router(registry, deployer))
    return app


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[AdapterRegistry]:
    with AdapterRegistry(tmp_path / "adapters", tmp_path / "registry.db") as reg:
        _fill(reg, "support", 3)
        _fill(reg, "sales", 1)
        yield reg


@pytest.fixture
def activations() -> Activations:
    return Activations()


@pytest.fixture
def client(registry: AdapterRegistry, activations: Activations) -> Iterator[TestClient]:
    with TestClient(_app(registry, activations)) as c:
        yield c


def test_admin_key_is_required(client: TestClient) -> None:
    assert client.get("/v1/adapters").status_code == 401
    denied = client.get("/v1/adapters", headers={"Authorization": "Bearer agent-key"})
    assert denied.status_code == 403
    assert denied.json()["error"]["code"] == "admin_required"
    assert client.post("/v1/adapters/support/pin").status_code == 401


def test_list_agents_and_versions(client: TestClient) -> None:
    agents = client.get("/v1/adapters", headers=ADMIN).json()
    assert agents["object"] == "list"
    assert [
        (a["agent"], a["active_version"], a["num_versions"], a["pinned"]) for a in agents["data"]
    ] == [
        ("sales", 1, 1, False),
        ("support", 3, 3, False),
    ]
    versions = client.get("/v1/adapters/support/versions", headers=ADMIN).json()
    assert (versions["agent"], versions["active_version"], versions["pinned"]) == (
        "support",
        3,
        False,
    )
    assert [(v["version"], v["status"], v["parent"], v["step"]) for v in versions["data"]] == [
        (1, "superseded", None, 10),
        (2, "superseded", 1, 20),
        (3, "active", 2, 30),
    ]
    assert versions["data"][1]["metrics"] == {"loss": 0.5, "reward_mean": 0.2}
    assert versions["data"][1]["manifest"] is None

    one = client.get("/v1/adapters/support/versions/2", headers=ADMIN).json()
    assert one["object"] == "adapter.version" and one["version"] == 2
    assert one["manifest"]["content_hash"] == one["content_hash"]
    assert one["manifest"]["feedback_window"] == {"samples": 16}


def test_unknown_agent_or_version_is_404(client: TestClient) -> None:
    for path in ("/v1/adapters/nobody/versions", "/v1/adapters/support/versions/9"):
        response = client.get(path, headers=ADMIN)
        assert response.status_code == 404
        error = response.json()["error"]
        assert error["type"] == "not_found_error" and error["message"]
    assert client.post("/v1/adapters/nobody/pin", headers=ADMIN).status_code == 404
    response = client.post("/v1/adapters/support/rollback", json={"version": 9}, headers=ADMIN)
    assert response.status_code == 404


def test_rollback_switches_engine_then_registry(
    client: TestClient, registry: AdapterRegistry, activations: Activations
) -> None:
    response = client.post(
        "/v1/adapters/support/rollback", json={"version": 1, "reason": "bad answers"}, headers=ADMIN
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert (body["previous_version"], body["active_version"], body["rolled_back"]) == (3, 1, [2, 3])
    assert body["reason"] == "bad answers"
    assert activations.calls == [("support", 1)]
    assert registry.get("support", 3).rolled_back_reason == "bad answers"

    again = client.post("/v1/adapters/support/rollback", json={"version": 1}, headers=ADMIN)
    assert again.status_code == 409 and again.json()["error"]["code"] == "already_active"
    assert activations.calls == [("support", 1)]  # refused before touching the engine

    # Without a reason a default one is recorded; rolling forward undoes the mistake.
    forward = client.post("/v1/adapters/support/rollback", json={"version": 3}, headers=ADMIN)
    assert forward.json()["reason"] and forward.json()["rolled_back"] == []
    assert registry.get("support", 3).status == "active"


def test_an_unloaded_agents_versions_say_inactive(
    client: TestClient, registry: AdapterRegistry
) -> None:
    registry.deactivate("support", expected_active=3)  # what an unload does
    versions = client.get("/v1/adapters/support/versions", headers=ADMIN).json()
    assert versions["active_version"] is None
    assert [v["status"] for v in versions["data"]] == ["inactive"] * 3
    one = client.get("/v1/adapters/support/versions/3", headers=ADMIN).json()
    assert one["status"] == "inactive"


def test_rollback_bad_bodies_are_400(client: TestClient) -> None:
    for body in ({"version": "1"}, {"version": 0}, {}, {"version": 1, "reason": "x" * 3000}):
        response = client.post("/v1/adapters/support/rollback", json=body, headers=ADMIN)
        assert response.status_code == 400, body
        assert response.json()["error"]["type"] == "invalid_request_error"


def test_engine_refusal_leaves_registry_unchanged(
    client: TestClient, registry: AdapterRegistry, activations: Activations
) -> None:
    activations.fail_on = 2
    response = client.post("/v1/adapters/support/rollback", json={"version": 2}, headers=ADMIN)
    assert response.status_code == 400
    active = registry.active("support")
    assert active is not None and active.version == 3


def test_registry_failure_switches_engine_back(
    registry: AdapterRegistry, activations: Activations
) -> None:
    class FailingRollback:
        def __getattr__(self, name: str) -> Any:
            return getattr(registry, name)

        def rollback(self, *args: Any, **kwargs: Any) -> Any:
            raise StoreError("disk full")

    with TestClient(_app(FailingRollback(), activations)) as client:
        response = client.post("/v1/adapters/support/rollback", json={"version": 1}, headers=ADMIN)
    assert response.status_code == 500
    assert activations.calls == [("support", 1), ("support", 3)]


def test_pin_and_unpin(client: TestClient, registry: AdapterRegistry) -> None:
    pinned = client.post("/v1/adapters/support/pin", headers=ADMIN).json()
    assert pinned["object"] == "adapter.agent" and pinned["pinned"] is True
    assert registry.is_pinned("support")
    versions = client.get("/v1/adapters/support/versions", headers=ADMIN).json()
    assert versions["pinned"] is True
    assert client.post("/v1/adapters/support/unpin", headers=ADMIN).json()["pinned"] is False
    assert not registry.is_pinned("support")


def _cli(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="clora")
    add_adapters_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(list(argv))


def test_cli_renders_tables_and_errors(
    client: TestClient, capsys: pytest.CaptureFixture[str]
) -> None:
    client.headers.update(ADMIN)
    assert run_adapters(_cli("adapters", "list"), client=client) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["AGENT", "ACTIVE", "VERSIONS", "LATEST", "PINNED", "ACTIVATED"]
    assert out[2].split()[:5] == ["support", "3", "3", "3", "no"]

    assert run_adapters(_cli("adapters", "versions", "support"), client=client) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "agent support: active version 3, not pinned"
    assert out[4].split()[:5] == ["3*", "active", "-", "2", "30"]  # no release record
    assert "loss=0.3333" in out[4]

    args = _cli("adapters", "rollback", "support", "2", "--reason", "too verbose")
    assert run_adapters(args, client=client) == 0
    out = capsys.readouterr().out
    assert "version 3 -> 2 (marked rolled back: 3)" in out and "too verbose" in out

    assert run_adapters(_cli("adapters", "pin", "support"), client=client) == 0
    assert "pinned: training frozen" in capsys.readouterr().out

    assert run_adapters(_cli("adapters", "show", "support", "9"), client=client) == 1
    assert "error (404 version_not_found)" in capsys.readouterr().err
    assert run_adapters(_cli("adapters", "list", "--json"), client=client) == 0
    assert '"object": "list"' in capsys.readouterr().out


def test_cli_unreachable_gateway(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, never listening: connection refused
        args = _cli("adapters", "list", "--url", f"http://127.0.0.1:{port}", "--api-key", "k")
        assert run_adapters(args) == 2
    assert "cannot reach the gateway" in capsys.readouterr().err


@contextmanager
def _serve(app: FastAPI) -> Iterator[str]:
    """Run `app` under uvicorn on a free loopback port in a thread; yields its URL."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", ws="none", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the gateway did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def test_cli_rollback_switches_the_serving_engine(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from openai import OpenAI

    from clora_feedback.engine.embedded import EmbeddedEngine
    from clora_feedback.gateway.app import create_app
    from clora_feedback.store.trajectories import AsyncTrajectoryStore

    engine_config = EngineConfig(model=str(tiny_model_dir), max_model_len=256, num_threads=1)
    settings = Settings(
        data_dir=tmp_path / "data",
        engine=engine_config,
        admin_api_key="admin-key",
        agents=[{"name": "support"}],
    )
    engine = EmbeddedEngine(tiny_model_dir, engine_config, model_name="tiny-base")
    registry = AdapterRegistry(tmp_path / "adapters", tmp_path / "data" / "registry.db")
    _fill(registry, "support", 2)
    deployer = Deployer(engine, registry)  # serves the active version 2 from start-up

    app = create_app(
        settings, engine, AsyncTrajectoryStore(settings.trajectory_db), deployer=deployer
    )
    app.include_router(build_adapters_router(registry, deployer))
    with _serve(app) as url:
        openai = OpenAI(base_url=f"{url}/v1", api_key="admin-key", max_retries=0)

        def served_version() -> int:
            completion = openai.chat.completions.create(
                model="support", messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
            return int(completion.model_extra["clora"]["adapter_version"])

        assert served_version() == 2
        args = _cli("adapters", "rollback", "support", "1", "--url", url, "--api-key", "admin-key")
        assert run_adapters(args) == 0, capsys.readouterr().err
        assert "version 2 -> 1" in capsys.readouterr().out
        assert engine.adapter_version("support") == 1
        assert served_version() == 1
    registry.close()


@pytest.mark.parametrize("version", ["99999999999999999999", str(2**63), "0", "-1"])
def test_out_of_range_versions_in_the_path_are_400(client: TestClient, version: str) -> None:
    """SQLite's integers are 64-bit: a larger version is the caller's error, never a 500."""
    response = client.get(f"/v1/adapters/support/versions/{version}", headers=ADMIN)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", "version")


@pytest.mark.parametrize("version", [99999999999999999999, 2**63, -(2**63) - 1])
def test_out_of_range_rollback_versions_are_400(client: TestClient, version: int) -> None:
    response = client.post(
        "/v1/adapters/support/rollback", json={"version": version}, headers=ADMIN
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", "version")


def test_the_largest_version_is_a_plain_404(client: TestClient) -> None:
    top = 2**63 - 1
    assert client.get(f"/v1/adapters/support/versions/{top}", headers=ADMIN).status_code == 404
    rollback = client.post("/v1/adapters/support/rollback", json={"version": top}, headers=ADMIN)
    assert rollback.status_code == 404
