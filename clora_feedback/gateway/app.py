"""Assemble the gateway: `create_app` wires parts together, `serve` runs uvicorn.

`create_app(settings, engine, store)` takes ready-made parts (tests pass a
tiny-model engine and a temp store) and returns a FastAPI app whose lifespan
starts the store and the engine, loads the configured agents' adapters, and
stops everything in reverse order on shutdown. `build_app_from_settings`
resolves the model directory and builds the embedded engine and the SQLite
store from `Settings`; `serve` runs that under uvicorn (the `clora serve` CLI
calls it).

Not here: command-line parsing (see `clora_feedback.cli`).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from clora_feedback import __version__
from clora_feedback.config import DEFAULT_MODEL, Settings
from clora_feedback.engine.base import Engine
from clora_feedback.gateway.admin import AdapterAdminHandler, ModelsHandler, TrajectoryHandler
from clora_feedback.gateway.agents import AgentRegistry, VersionSource
from clora_feedback.gateway.auth import KeyAuthenticator
from clora_feedback.gateway.chat import ChatHandler
from clora_feedback.gateway.completions import CompletionHandler
from clora_feedback.gateway.errors import install_error_handlers
from clora_feedback.gateway.metrics import HTTPMetricsMiddleware, Metrics
from clora_feedback.gateway.routes import GatewayState, router
from clora_feedback.store.trajectories import AsyncTrajectoryStore

log = logging.getLogger(__name__)


def create_app(
    settings: Settings,
    engine: Engine,
    store: AsyncTrajectoryStore,
    *,
    versions: VersionSource | None = None,
) -> FastAPI:
    """The gateway app over `engine` and `store` (both started by the app's lifespan).

    Args:
        settings: agents, API keys.
        engine: the serving engine (not yet started).
        store: the trajectory store (not yet started).
        versions: where adapter version numbers come from (default: in memory).
    """
    agents = AgentRegistry(engine, versions=versions)
    metrics = Metrics()
    state = GatewayState(
        engine=engine,
        store=store,
        agents=agents,
        authenticator=KeyAuthenticator(settings),
        metrics=metrics,
        chat=ChatHandler(engine, agents, store, metrics),
        completions=CompletionHandler(engine, agents, store, metrics),
        models=ModelsHandler(engine, agents),
        adapters=AdapterAdminHandler(agents),
        trajectories=TrajectoryHandler(store),
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await store.start()
        try:
            await engine.start()
            try:
                await agents.start(settings.agents)
                log.info("serving %s with agents %s", engine.model_name, agents.names())
                yield
            finally:
                await engine.stop()
        finally:
            await store.stop()

    app = FastAPI(title="clora-feedback", version=__version__, lifespan=lifespan)
    app.state.gateway = state
    app.state.authenticator = state.authenticator
    install_error_handlers(app)
    app.include_router(router)
    app.add_middleware(HTTPMetricsMiddleware, metrics=metrics)
    return app


def build_app_from_settings(settings: Settings) -> FastAPI:
    """Resolve the model, build the embedded engine and the SQLite store, and wire the app."""
    from clora_feedback.engine.embedded import EmbeddedEngine
    from clora_feedback.models.resolve import resolve_model_dir

    model_dir = resolve_model_dir(settings.engine.model, settings.model_cache_dir)
    # Clients name the base model as configured; a path is served under its directory name.
    name = DEFAULT_MODEL if settings.engine.model == DEFAULT_MODEL else model_dir.name
    engine = EmbeddedEngine(model_dir, settings.engine, model_name=name)
    store = AsyncTrajectoryStore(settings.trajectory_db)
    return create_app(settings, engine, store)


def serve(settings: Settings) -> None:
    """Build the app from `settings` and serve it with uvicorn until interrupted."""
    import uvicorn

    app = build_app_from_settings(settings)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level="info")
    uvicorn.Server(config).run()
