"""Thin FastAPI routers: parse, authenticate, call a handler, wrap the result.

All behaviour lives in the handler classes (`chat`, `completions`, `admin`);
errors propagate as `CloraError` and are mapped in `errors`. Routes:

    POST /v1/chat/completions        ChatHandler
    POST /v1/completions             CompletionHandler
    POST /v1/responses               ResponsesHandler (over ChatHandler)
    GET  /v1/responses/{id}          ResponsesHandler (scoped by key)
    GET  /v1/responses/{id}/input_items  ResponsesHandler (scoped by key, paged)
    GET  /v1/models                  ModelsHandler
    GET  /v1/models/{id}             ModelsHandler (one entry of the list)
    POST /v1/load_lora_adapter       AdapterAdminHandler (admin)
    POST /v1/unload_lora_adapter     AdapterAdminHandler (admin)
    GET  /v1/trajectories            TrajectoryHandler (scoped by key)
    GET  /v1/trajectories/{id}       TrajectoryHandler (scoped by key)
    DELETE /v1/trajectories          TrajectoryHandler (admin): by agent or conversation_id
    GET  /health                     engine statistics (no key needed; agent names: admin key)
    GET  /metrics                    Prometheus text (admin key, when keys are configured)
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from clora_feedback.engine.base import Engine
from clora_feedback.errors import AuthenticationError, NotFoundError
from clora_feedback.gateway.agents import AgentRegistry
from clora_feedback.gateway.auth import (
    KeyAuthenticator,
    Principal,
    admin_principal,
    current_principal,
)
from clora_feedback.gateway.chat import ChatHandler
from clora_feedback.gateway.completions import CompletionHandler
from clora_feedback.gateway.handlers import (
    AdapterAdminHandler,
    ModelsHandler,
    TrajectoryHandler,
    health,
)
from clora_feedback.gateway.metrics import Metrics
from clora_feedback.gateway.offload import body_size
from clora_feedback.gateway.responses import ResponsesHandler
from clora_feedback.gateway.sse import ClientDisconnected
from clora_feedback.schemas.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
)
from clora_feedback.schemas.responses import ResponsesRequest
from clora_feedback.store.trajectories import AsyncTrajectoryStore

CLIENT_CLOSED_REQUEST = 499
"""Status logged for a request whose client left before the answer (nginx's convention)."""


@dataclass
class GatewayState:
    """Everything the routes need, built once by `create_app` (kept on `app.state.gateway`)."""

    engine: Engine
    store: AsyncTrajectoryStore
    agents: AgentRegistry
    authenticator: KeyAuthenticator
    metrics: Metrics
    chat: ChatHandler
    completions: CompletionHandler
    models: ModelsHandler
    adapters: AdapterAdminHandler
    trajectories: TrajectoryHandler
    feedback_bootstrap: Callable[[], str | None] = lambda: None
    """Where outside producers send feedback (`/health`, admin key); set by the service."""
    responses: ResponsesHandler = field(init=False)
    """The Responses API, over `chat` and `store` (built here, kept for every request)."""

    def __post_init__(self) -> None:
        self.responses = ResponsesHandler(self.chat, self.agents, self.store)


def _state(request: Request) -> GatewayState:
    state: GatewayState = request.app.state.gateway
    return state


async def _answer(work: Coroutine[Any, Any, Any]) -> Response:
    """A handler's result as a response; a vanished client gets an (unread) 499."""
    try:
        result = await work
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return result if isinstance(result, Response) else JSONResponse(result)


AnyKey = Annotated[Principal, Depends(current_principal)]
AdminKey = Annotated[Principal, Depends(admin_principal)]

router = APIRouter()


@router.post("/v1/chat/completions")
async def create_chat_completion(
    body: ChatCompletionRequest, request: Request, principal: AnyKey
) -> Response:
    chat = _state(request).chat
    return await _answer(chat.create(body, principal, request, size=body_size(request)))


@router.post("/v1/completions")
async def create_completion(
    body: CompletionRequest, request: Request, principal: AnyKey
) -> Response:
    return await _answer(_state(request).completions.create(body, principal, request))


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request, principal: AnyKey) -> Response:
    return await _answer(_state(request).responses.create(body, principal, request))


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, request: Request, principal: AnyKey) -> JSONResponse:
    return JSONResponse(await _state(request).responses.get(response_id, principal))


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(
    response_id: str,
    request: Request,
    principal: AnyKey,
    limit: int = 20,
    order: str = "desc",
    after: str | None = None,
    include: Annotated[list[str] | None, Query()] = None,  # accepted; nothing more to add
) -> JSONResponse:
    handler = _state(request).responses
    page = await handler.input_items(response_id, principal, limit=limit, order=order, after=after)
    return JSONResponse(page)


@router.get("/v1/models")
async def list_models(request: Request, principal: AnyKey) -> JSONResponse:
    return JSONResponse(_state(request).models.list(principal))


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, request: Request, principal: AnyKey) -> JSONResponse:
    """One entry of `GET /v1/models`: what this key may not see is as unknown (404)."""
    listed = _state(request).models.list(principal)["data"]
    found = next((m for m in listed if m["id"] == model_id), None)
    if found is None:
        raise NotFoundError(
            f"The model `{model_id}` does not exist. GET /v1/models lists the models served here.",
            param="model",
            code="model_not_found",
        )
    return JSONResponse(found)


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(
    body: LoadLoRAAdapterRequest, request: Request, principal: AdminKey
) -> Response:
    return PlainTextResponse(await _state(request).adapters.load(body))


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(
    body: UnloadLoRAAdapterRequest, request: Request, principal: AdminKey
) -> Response:
    return PlainTextResponse(await _state(request).adapters.unload(body))


@router.get("/v1/trajectories")
async def list_trajectories(
    request: Request,
    principal: AnyKey,
    agent: str | None = None,
    limit: Annotated[int, Query()] = 100,
    before: float | None = None,
) -> JSONResponse:
    handler = _state(request).trajectories
    return JSONResponse(await handler.list(principal, agent=agent, limit=limit, before=before))


@router.delete("/v1/trajectories")
async def delete_trajectories(
    request: Request,
    principal: AdminKey,
    agent: str | None = None,
    conversation_id: str | None = None,
) -> JSONResponse:
    """Delete an agent's or a conversation's trajectories (both given: their intersection).

    A deleted completion is as if never captured: it never becomes a training sample,
    and feedback naming it afterwards parks, then dies after `feedback.park_ttl_s`.
    """
    handler = _state(request).trajectories
    return JSONResponse(await handler.delete(agent=agent, conversation_id=conversation_id))


@router.get("/v1/trajectories/{completion_id}")
async def get_trajectory(completion_id: str, request: Request, principal: AnyKey) -> JSONResponse:
    return JSONResponse(await _state(request).trajectories.get(completion_id, principal))


@router.get("/health")
async def get_health(request: Request) -> JSONResponse:
    """Liveness for anyone (no key needed, a wrong one ignored); agent names and the
    feedback broker's address for the admin key only."""
    state = _state(request)
    try:
        admin = state.authenticator.authenticate(request.headers.get("authorization")).admin
    except AuthenticationError:
        admin = False
    bootstrap = state.feedback_bootstrap() if admin else None
    return JSONResponse(
        health(state.engine, state.agents, admin=admin, feedback_bootstrap=bootstrap)
    )


@router.get("/metrics")
async def get_metrics(request: Request, principal: AdminKey) -> PlainTextResponse:
    """Admin key when keys are configured: the labels name every agent."""
    state = _state(request)
    text = state.metrics.render(state.engine.stats())
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4")
