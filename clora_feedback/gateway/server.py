"""How the gateway is served: uvicorn options from `ServerConfig`, and a header timeout.

uvicorn 0.54's h11 server times out only idle keep-alive connections, and only
after a first response: a client that opens a connection and sends half its
headers (or, after a response, starts a second request and stalls) holds the
connection forever. `HeaderTimeoutProtocol` is uvicorn's h11 protocol plus one
timer: armed when a connection opens and whenever bytes of a new request
arrive while its headers are incomplete, cancelled once h11 has the whole
request head; when it fires the connection is closed. Bodies are bounded by
`gateway.limits`, idle connections by uvicorn's own `timeout_keep_alive`.

`uvicorn_options(server)` is the one place the server's options are set:
`uvicorn_config(app, settings)` for `clora serve`, and `ThreadedServer` for the
demo, the experiments and the benchmarks, which serve the same app on a free
loopback port from a background thread with the same bounds.

Not here: the app (`gateway.app`), building the service (`clora_feedback.service`).
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from clora_feedback.config import ServerConfig, Settings
from clora_feedback.errors import EngineError
from clora_feedback.lifecycle import Lifecycle


class HeaderTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol, closing connections whose request head stalls."""

    header_timeout_s: float = 10.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        # IDLE on their side: h11 is still waiting for (the rest of) a request head.
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            if self._header_timer is None:
                self._arm_header_timer()
        else:
            self._cancel_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timed_out)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timed_out(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.logger.debug("closing a connection whose request headers did not arrive in time")
            self.transport.close()


def header_timeout_protocol(timeout_s: float) -> type[HeaderTimeoutProtocol]:
    """A `HeaderTimeoutProtocol` class with its own timeout (uvicorn builds one per connection)."""
    return type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,), {"header_timeout_s": timeout_s})


def uvicorn_options(server: ServerConfig) -> dict[str, Any]:
    """`uvicorn.Config` keyword arguments for `server`'s bounds and timeouts."""
    return {
        "http": header_timeout_protocol(server.header_timeout_s),
        "timeout_keep_alive": server.keep_alive_timeout_s,
        "h11_max_incomplete_event_size": server.max_header_bytes,
        "timeout_graceful_shutdown": server.graceful_shutdown_timeout_s,
        "access_log": server.access_log,
        "ws": "none",
    }


def uvicorn_config(app: Any, settings: Settings, **overrides: Any) -> uvicorn.Config:
    """The `uvicorn.Config` serving `app` at `settings.host:port` with `settings.server`."""
    options: dict[str, Any] = {
        "host": settings.host,
        "port": settings.port,
        "log_level": "info",
        **uvicorn_options(settings.server),
        **overrides,
    }
    return uvicorn.Config(app, **options)


class ThreadedServer(Lifecycle):
    """`app` served by uvicorn on a free 127.0.0.1 port from a daemon thread.

    The options are `uvicorn_options(server)` (header timeout, keep-alive, header
    size, shutdown grace), so an in-process server is bounded like `clora serve`;
    `overrides` replace single options (the log level, say). Off the main thread
    uvicorn installs no signal handlers: Ctrl-C stays with the caller.

    Attributes:
        url: `http://127.0.0.1:<port>` once started ("" before).
    """

    def __init__(
        self,
        app: Any,
        server: ServerConfig | None = None,
        *,
        name: str = "clora-gateway",
        start_timeout_s: float = 300.0,
        **overrides: Any,
    ) -> None:
        self.url = ""
        self._options: dict[str, Any] = {
            "log_level": "warning",
            "lifespan": "on",
            **uvicorn_options(server or ServerConfig()),
            **overrides,
        }
        self._app = app
        self._name = name
        self._start_timeout_s = start_timeout_s
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = None

    def start(self) -> str:
        """Bind a free port, start uvicorn, wait for the app's lifespan to start; the URL.

        Raises:
            EngineError: uvicorn stopped, or the lifespan did not start in time.
        """
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        server = uvicorn.Server(uvicorn.Config(self._app, **self._options))
        thread = threading.Thread(
            target=server.run, kwargs={"sockets": [sock]}, daemon=True, name=self._name
        )
        thread.start()
        deadline = time.monotonic() + self._start_timeout_s
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                server.should_exit = True
                sock.close()
                raise EngineError("the gateway did not start (see the log above)")
            time.sleep(0.02)
        self._server, self._thread, self._sock = server, thread, sock
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        return self.url

    def stop(self, timeout_s: float = 60.0) -> None:
        """Ask uvicorn to exit (the app's shutdown runs) and wait for it; idempotent."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
        if self._sock is not None:
            self._sock.close()
        self._server = self._thread = self._sock = None
