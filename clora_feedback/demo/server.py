"""Run a built service app in this process: uvicorn on a background thread, a free loopback port.

The demo and the experiments talk to the gateway exactly as an outside agent
would (HTTP, the official `openai` client, the feedback webhook), while
keeping the engine, the stores and the trainer reachable in-process for
measurements (`server.service.trainer`, `server.service.registry`, ...).

Not here: building the app (see `clora_feedback.service`), the workloads.
"""

from __future__ import annotations

import socket
import threading
import time
from types import TracebackType
from typing import TYPE_CHECKING, Any

from clora_feedback.errors import EngineError

if TYPE_CHECKING:  # the service (and torch) load only where a server is built
    from clora_feedback.service import Service


class LocalServer:
    """A built service served by uvicorn on 127.0.0.1; `with LocalServer(service) as server: ...`.

    Attributes:
        service: what `build_service` built (trainer, registry, ... for measurements).
        app: the served app (its lifespan starts the engine, stores, trainer, ...).
        url: `http://127.0.0.1:<port>`.
        base_url: `url + "/v1"`, for OpenAI clients.
    """

    def __init__(self, service: Service, *, start_timeout_s: float = 300.0):
        self.service = service
        self.app = service.app
        self.url = ""
        self.base_url = ""
        self._start_timeout_s = start_timeout_s
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = None

    def start(self) -> None:
        """Bind a free port, start uvicorn, and wait until the app's lifespan has started."""
        import uvicorn

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        config = uvicorn.Config(
            self.app,
            log_level="warning",
            ws="none",
            http="h11",
            lifespan="on",
            timeout_keep_alive=60,
        )
        server = uvicorn.Server(config)  # off the main thread uvicorn leaves signals (Ctrl-C) to us
        thread = threading.Thread(
            target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="clora-gateway"
        )
        thread.start()
        deadline = time.monotonic() + self._start_timeout_s
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                sock.close()
                raise EngineError("the gateway did not start (see the log above)")
            time.sleep(0.02)
        self._server, self._thread, self._sock = server, thread, sock
        self.url = f"http://127.0.0.1:{port}"
        self.base_url = f"{self.url}/v1"

    def stop(self) -> None:
        """Ask uvicorn to exit (runs the app's shutdown: trainer, consumer, engine) and wait."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=60)
        if self._sock is not None:
            self._sock.close()
        self._server = self._thread = self._sock = None

    def __enter__(self) -> LocalServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
