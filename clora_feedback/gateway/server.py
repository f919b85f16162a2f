"""How the gateway is served: uvicorn options from `ServerConfig`, and a header timeout.

uvicorn 0.54's h11 server times out only idle keep-alive connections, and only
after a first response: a client that opens a connection and sends half its
headers (or, after a response, starts a second request and stalls) holds the
connection forever. `HeaderTimeoutProtocol` is uvicorn's h11 protocol plus one
timer: armed when a connection opens and whenever bytes of a new request
arrive while its headers are incomplete, cancelled once h11 has the whole
request head; when it fires the connection is closed. Bodies are bounded by
`gateway.limits`, idle connections by uvicorn's own `timeout_keep_alive`.

`uvicorn_config(app, settings)` is the one place the server's options are set
(`clora serve` and anything else that serves the gateway in production).

Not here: the app (`gateway.app`), building the service (`clora_feedback.service`).
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from clora_feedback.config import ServerConfig, Settings


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
