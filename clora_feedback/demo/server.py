"""Run a built service app in this process: uvicorn on a background thread, a free loopback port.

The demo and the experiments talk to the gateway exactly as an outside agent
would (HTTP, the official `openai` client, the feedback webhook), while
keeping the engine, the stores and the trainer reachable in-process for
measurements (`server.service.trainer`, `server.service.registry`, ...).

Not here: building the app (see `clora_feedback.service`), the workloads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from clora_feedback.lifecycle import Lifecycle

if TYPE_CHECKING:  # the service (and torch) load only where a server is built
    from clora_feedback.service import Service


class LocalServer(Lifecycle):
    """A built service served by uvicorn on 127.0.0.1; `with LocalServer(service) as server: ...`.

    Attributes:
        service: what `build_service` built (trainer, registry, ... for measurements).
        app: the served app (its lifespan starts the engine, stores, trainer, ...).
        url: `http://127.0.0.1:<port>`.
        base_url: `url + "/v1"`, for OpenAI clients.
    """

    def __init__(self, service: Service, *, start_timeout_s: float = 300.0):
        from clora_feedback.gateway.server import ThreadedServer

        self.service = service
        self.app = service.app
        self.url = ""
        self.base_url = ""
        # The served bounds are the service's own `server` settings, as under `clora serve`;
        # connections stay open across an experiment's pauses.
        self._server = ThreadedServer(
            self.app,
            service.settings.server if service.settings is not None else None,
            start_timeout_s=start_timeout_s,
            timeout_keep_alive=60,
        )

    def start(self) -> None:
        """Bind a free port, start uvicorn, and wait until the app's lifespan has started."""
        self.url = self._server.start()
        self.base_url = f"{self.url}/v1"

    def stop(self) -> None:
        """Ask uvicorn to exit (runs the app's shutdown: trainer, consumer, engine) and wait."""
        self._server.stop()
