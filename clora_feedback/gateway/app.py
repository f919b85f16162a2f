"""Assemble the gateway: `create_app` wires ready-made parts into one FastAPI app.

`create_app(settings, engine, store, deployer=...)` takes ready-made parts
(tests pass a tiny-model engine, a temp store and
`service.gateway_deployer`) and returns a FastAPI app whose lifespan starts
the store and the engine, registers the configured agents, starts the
deployer (which makes the engine serve the registry's active versions) and
the other components, and stops everything in reverse order on shutdown.

Not here: building the parts from `Settings` (the registry, the deployer, the
configured agents' initial adapters) and running uvicorn (the composition root,
`clora_feedback.service.build_gateway` and `serve`; the gateway never imports
it), command-line parsing (`clora_feedback.cli.main`).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Protocol

from fastapi import APIRouter, FastAPI

from clora_feedback import __version__
from clora_feedback.config import Settings
from clora_feedback.engine.base import Engine
from clora_feedback.engine.deployer import Deployer
from clora_feedback.gateway.access import install_access_log_redaction
from clora_feedback.gateway.agents import AgentRegistry
from clora_feedback.gateway.auth import KeyAuthenticator
from clora_feedback.gateway.chat import ChatHandler
from clora_feedback.gateway.completions import CompletionHandler
from clora_feedback.gateway.errors import install_error_handlers
from clora_feedback.gateway.handlers import AdapterAdminHandler, ModelsHandler, TrajectoryHandler
from clora_feedback.gateway.limits import BodyLimitMiddleware
from clora_feedback.gateway.metrics import HTTPMetricsMiddleware, Metrics
from clora_feedback.gateway.openapi import install_openapi
from clora_feedback.gateway.routes import GatewayState, router
from clora_feedback.store.trajectories import AsyncTrajectoryStore

log = logging.getLogger(__name__)


class Component(Protocol):
    """A long-running part started after the engine and stopped before it."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


def create_app(
    settings: Settings,
    engine: Engine,
    store: AsyncTrajectoryStore,
    *,
    deployer: Deployer,
    agents: AgentRegistry | None = None,
    routers: Sequence[APIRouter] = (),
    components: Sequence[Component] = (),
) -> FastAPI:
    """The gateway app over `engine` and `store` (both started by the app's lifespan).

    Args:
        settings: agents, API keys, `server.max_body_bytes`.
        engine: the serving engine (not yet started).
        store: the trajectory store (not yet started).
        deployer: makes `engine` serve the registry's active pointers; started before
            `components`.
        agents: a prepared agent registry (default: a new one over `engine` and `deployer`).
        routers: more routes (feedback, adapters), mounted after the OpenAI ones.
        components: started in order once the agents are loaded, stopped in reverse.
    """
    agents = agents or AgentRegistry(engine, deployer)
    metrics = Metrics(top_agents=settings.server.metrics_top_agents)
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
                started: list[Component] = []
                try:
                    for component in (agents.deployer, *components):
                        await component.start()
                        started.append(component)
                    log.info("serving %s with agents %s", engine.model_name, agents.names())
                    yield
                finally:
                    for component in reversed(started):
                        await component.stop()
            finally:
                await engine.stop()
        finally:
            await store.stop()

    app = FastAPI(title="clora-feedback", version=__version__, lifespan=lifespan)
    app.state.gateway = state
    app.state.authenticator = state.authenticator
    install_error_handlers(app)
    app.include_router(router)
    for extra in routers:
        app.include_router(extra)
    install_openapi(app)
    install_access_log_redaction(settings)
    # Added first, so it runs inside the metrics middleware: a refused body is still counted.
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=settings.server.max_body_bytes)
    app.add_middleware(HTTPMetricsMiddleware, metrics=metrics)
    return app
