"""Bounded requests and connections, and an access log without keys (issue 12 items 4, 8).

The server here is the production one: uvicorn built by `gateway.server.uvicorn_config`
(the header-timeout protocol, keep-alive and header-size limits, the access log on)
over the tiny-model gateway, on a loopback socket. Raw sockets send what no HTTP
client would: half a request head, a body longer than it says, a huge declared length.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from clora_feedback.config import EngineConfig, Settings
from clora_feedback.gateway.access import REDACTED, RedactingFilter, redact_query

HI = [{"role": "user", "content": "hi"}]
LIMIT = 8192
KEY = "sk-support-1234567890"


class _Server:
    def __init__(self, url: str, port: int) -> None:
        self.url = url
        self.port = port

    def raw(self, timeout: float = 30.0) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=timeout)


@contextmanager
def production_server(model_dir: Path, data_dir: Path, **settings: Any) -> Iterator[_Server]:
    """The gateway served exactly as `clora serve` serves it (`uvicorn_config`)."""
    import uvicorn

    from clora_feedback.engine.embedded import EmbeddedEngine
    from clora_feedback.gateway.app import create_app
    from clora_feedback.gateway.server import uvicorn_config
    from clora_feedback.service import gateway_deployer
    from clora_feedback.store.trajectories import AsyncTrajectoryStore

    engine_config = EngineConfig(model=str(model_dir), max_model_len=2048, num_threads=1)
    config = Settings(data_dir=data_dir, engine=engine_config, **settings)
    engine = EmbeddedEngine(model_dir, engine_config, model_name="tiny-base")
    app = create_app(
        config,
        engine,
        AsyncTrajectoryStore(config.trajectory_db),
        deployer=gateway_deployer(config, engine),
    )
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn_config(app, config, lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the gateway did not start")
        time.sleep(0.02)
    try:
        yield _Server(f"http://127.0.0.1:{port}", port)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


@pytest.fixture
def served(tiny_model_dir: Path, tmp_path: Path) -> Iterator[_Server]:
    with production_server(
        tiny_model_dir,
        tmp_path / "data",
        agents=[{"name": "support", "api_keys": [KEY]}],
        admin_api_key="sk-admin-0987654321",
        server={"max_body_bytes": LIMIT, "header_timeout_s": 0.5, "keep_alive_timeout_s": 30},
    ) as server:
        yield server


def _read_response(sock: socket.socket) -> bytes:
    """One HTTP response (head and a Content-Length body), without waiting for a close."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed before a response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "closed mid-body"
        body += chunk
    return head + b"\r\n\r\n" + body


def _read_all(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def _assert_413(response: httpx.Response) -> None:
    assert response.status_code == 413, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"]) == ("invalid_request_error", "request_too_large")


# -- body size ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"model": "support", "messages": HI, "max_tokens": 1}),
        ("/v1/completions", {"model": "support", "prompt": "x", "max_tokens": 1}),
        ("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/x"}),
    ],
)
def test_a_declared_length_over_the_limit_is_413(
    served: _Server, path: str, body: dict[str, Any]
) -> None:
    padded = {**body, "user": "x" * LIMIT}
    with httpx.Client(base_url=served.url, headers={"Authorization": f"Bearer {KEY}"}) as http:
        _assert_413(http.post(path, json=padded))
        assert http.post(path, json=body).status_code != 413  # under the limit: the route decides


def test_a_chunked_body_over_the_limit_is_413(served: _Server) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"model": "support", "prompt": "'
        for _ in range(LIMIT // 1024 + 2):
            yield b"x" * 1024
        yield b'"}'

    with httpx.Client(base_url=served.url, headers={"Authorization": f"Bearer {KEY}"}) as http:
        response = http.post(
            "/v1/completions", content=chunks(), headers={"content-type": "application/json"}
        )
    assert "content-length" not in response.request.headers  # really sent chunked
    _assert_413(response)


def test_413_comes_before_the_body_is_read(served: _Server) -> None:
    """A 16 MB declared prompt is refused on its headers: no byte of the body is sent."""
    with served.raw() as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + KEY.encode() + b"\r\n"
            b"Content-Length: 16777216\r\n\r\n"
        )
        answer = _read_response(sock)  # answered on the headers: no body byte was sent
    assert answer.startswith(b"HTTP/1.1 413 ")
    assert b'"code":"request_too_large"' in answer


def test_a_body_longer_than_it_says_is_not_read_past_the_limit(served: _Server) -> None:
    with served.raw() as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + KEY.encode() + b"\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        piece = b"x" * 4096
        for _ in range(4):
            sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
        answer = _read_response(sock)
    assert answer.startswith(b"HTTP/1.1 413 ")


# -- connections -------------------------------------------------------------------------


def test_half_sent_headers_are_closed_by_the_header_timeout(served: _Server) -> None:
    with served.raw(timeout=30) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-")
        # Without a header timeout this blocks until the socket timeout raises.
        assert _read_all(sock) == b""


def test_a_silent_connection_is_closed_by_the_header_timeout(served: _Server) -> None:
    with served.raw(timeout=30) as sock:
        assert _read_all(sock) == b""


def test_a_stalled_second_request_on_a_kept_alive_connection_is_closed(served: _Server) -> None:
    with served.raw(timeout=30) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        first = b""
        while b"\r\n\r\n" not in first or not first.rstrip().endswith(b"}"):
            first += sock.recv(65536)
        assert first.startswith(b"HTTP/1.1 200 ")
        sock.sendall(b"GET /health HTTP/1.1\r\nHo")  # keep-alive is 30 s: only the header
        assert _read_all(sock) == b""  # timeout can close this


def test_a_complete_request_is_served_on_a_slow_connection(served: _Server) -> None:
    with served.raw() as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert _read_all(sock).startswith(b"HTTP/1.1 200 ")


def test_uvicorn_options_come_from_settings() -> None:
    from clora_feedback.gateway.server import HeaderTimeoutProtocol, uvicorn_options

    options = uvicorn_options(
        Settings(
            server={"header_timeout_s": 3, "keep_alive_timeout_s": 7, "max_header_bytes": 4096}
        ).server
    )
    assert issubclass(options["http"], HeaderTimeoutProtocol)
    assert options["http"].header_timeout_s == 3
    assert (options["timeout_keep_alive"], options["h11_max_incomplete_event_size"]) == (7, 4096)


def test_keep_alive_outlasts_the_client_pools_idle_expiry() -> None:
    """The server must not close an idle connection at the moment a client pool reuses it.

    httpx (and the openai SDK on it) drops a pooled connection after 5 s idle; with
    uvicorn's own 5 s the two race, and a request sent as the server closes fails with
    "server disconnected" (seen in CI as an APIConnectionError after a 5 s wait).
    """
    import openai._constants

    pools = {
        "openai": openai._constants.DEFAULT_CONNECTION_LIMITS.keepalive_expiry,
        "httpx": httpx.Limits().keepalive_expiry,
    }
    keep_alive = Settings().server.keep_alive_timeout_s
    for client, expiry in pools.items():
        assert expiry is not None and keep_alive > 2 * expiry, (client, expiry, keep_alive)


# -- the access log ----------------------------------------------------------------------


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_keys_never_reach_the_access_log(served: _Server) -> None:
    records = _Records()
    loggers = [logging.getLogger(n) for n in ("", "uvicorn", "uvicorn.access", "uvicorn.error")]
    # Libraries imported earlier in the run may add their own access-log filters
    # (litellm does): set them aside, so the line checked is the one ours writes.
    access_logger = logging.getLogger("uvicorn.access")
    foreign = [f for f in access_logger.filters if not isinstance(f, RedactingFilter)]
    for f in foreign:
        access_logger.removeFilter(f)
    for logger in loggers:
        logger.addHandler(records)
    try:
        with httpx.Client(base_url=served.url) as http:
            http.get("/v1/models", params={"api_key": KEY})
            http.get("/v1/models", params={"key": KEY, "limit": "5"})
            http.get(f"/v1/models?{KEY}")
            http.get(f"/v1/models/{KEY}", headers={"Authorization": f"Bearer {KEY}"})
            http.get("/v1/trajectories", params={"token": KEY}, headers={"X-Api-Key": KEY})
    finally:
        for logger in loggers:
            logger.removeHandler(records)
        for f in foreign:
            access_logger.addFilter(f)
    access = [line for line in records.lines if '"GET /v1/' in line]
    assert len(access) == 5, records.lines  # the access log is on, one line per request
    assert any(f"api_key={REDACTED}" in line for line in access)
    assert any(f"key={REDACTED}&limit=5" in line for line in access)
    for line in records.lines:
        assert KEY not in line, line


def test_redaction_rules() -> None:
    assert redact_query("/v1/x") == "/v1/x"
    assert redact_query("/v1/x?api_key=sk-1&limit=3&agent=a&Token=t") == (
        f"/v1/x?api_key={REDACTED}&limit=3&agent=a&Token={REDACTED}"
    )
    assert redact_query("/v1/x?sk-bare&before=1.5") == f"/v1/x?{REDACTED}&before=1.5"
    scrub = RedactingFilter(["sk-long-key", "sk-long"]).scrub
    assert scrub("/v1/models/sk-long-key/x") == f"/v1/models/{REDACTED}/x"


# -- in-process servers (demo, experiments, benchmarks) ----------------------------------


async def _hello_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    headers = [(b"content-length", b"2")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": b"ok"})


def test_in_process_servers_have_the_header_timeout_of_their_settings() -> None:
    """The demo's `LocalServer` (and the benchmarks' `ThreadedServer`) are bounded like
    `clora serve`: before, they ran uvicorn's defaults and a stalled head hung forever."""
    from types import SimpleNamespace

    from clora_feedback.demo.server import LocalServer

    service = SimpleNamespace(app=_hello_app, settings=Settings(server={"header_timeout_s": 0.5}))
    with LocalServer(service) as server:  # type: ignore[arg-type]
        port = int(server.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert _read_all(sock).endswith(b"ok")
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            sock.sendall(b"GET / HTTP/1.1\r\nHo")
            assert _read_all(sock) == b""  # closed by the server, not the 30 s socket timeout
