"""The console's routes: the page, its assets, login/logout, JSON reads, actions, live events.

    GET  /console                               the page (one HTML file; the script routes by #hash)
    GET  /console/static/{name}                 console.js, console.css (shipped in the package)
    GET  /console/api/session                   who is logged in, and the CSRF token
    POST /console/api/login                     {"key": admin key} -> session cookie
    POST /console/api/logout                    forget the session (CSRF)
    GET  /console/api/agents                    a page of agent rows (?q, sort, order, offset, limit)
    GET  /console/api/agents/{agent}            versions, rewards over time, timeline
    GET  /console/api/agents/{agent}/trajectories   recent completions with their feedback
    POST /console/api/agents/{agent}/rollback   {"version": N} (CSRF)
    POST /console/api/agents/{agent}/pin        (CSRF)
    POST /console/api/agents/{agent}/unpin      (CSRF)
    GET  /console/api/events                    server-sent events (`live`)

Every `/console/api` route but login needs the session cookie (401
`console_login_required` without one); every POST but login also needs the
session's `X-CSRF-Token` header (403 `csrf_token_invalid`). Login takes the
admin key in the JSON body: a wrong key is 401, an agent's key 403
(`admin_required`), as on the admin routes; after
`console.login_failures_per_minute` of those from one client address in a
minute, its next attempts are 429 `too_many_login_attempts` with `Retry-After`
until the oldest failure is a minute old (`sessions.LoginLimiter`). With no keys configured at all the
gateway is open (see `gateway.auth`), and so is the console: `GET
/console/api/session` then starts a session without a login (the CSRF token
still guards every action against other sites' pages).

The actions call `gateway.adapters.rollback_adapter` and `set_pinned`, the
code of `POST /v1/adapters/{agent}/rollback|pin|unpin`: the deployer loads
the version before the pointer moves, exactly as there.

Not here: sessions (`sessions`), what the pages read (`views`), the feed (`live`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from importlib import resources
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import HTMLResponse
from pydantic import BaseModel, Field

from clora_feedback.config import ConsoleConfig
from clora_feedback.engine.deployer import Deployer
from clora_feedback.errors import AuthenticationError, CloraError, NotFoundError
from clora_feedback.gateway.adapters import rollback_adapter, set_pinned
from clora_feedback.gateway.auth import KeyAuthenticator
from clora_feedback.gateway.console.live import ChangeFeed
from clora_feedback.gateway.console.sessions import (
    COOKIE_NAME,
    CSRF_HEADER,
    ConsoleSession,
    LoginLimiter,
    SessionStore,
)
from clora_feedback.gateway.console.views import MAX_PAGE, ConsoleViews, FeedbackReader
from clora_feedback.gateway.sse import SSEResponse
from clora_feedback.schemas.admin import AgentAdaptersObject, RollbackRequest, RollbackResult
from clora_feedback.store.trajectories import AsyncTrajectoryStore
from clora_feedback.store.versions import AdapterStore

CONSOLE_ROLLBACK_REASON = "rolled back by an operator in the console"
ASSETS = {"console.js": "text/javascript; charset=utf-8", "console.css": "text/css; charset=utf-8"}
_PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
    "img-src 'self' data:; connect-src 'self'; form-action 'self'; base-uri 'none'; "
    "frame-ancestors 'none'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


class LoginRequest(BaseModel):
    """`POST /console/api/login`."""

    key: str = Field(..., min_length=1, max_length=4096, description="The admin API key.")


class SessionInfo(BaseModel):
    """A live console session, as its page sees it (never the cookie's value or the key)."""

    object: str = "console.session"
    csrf_token: str = Field(..., description=f"Send it as `{CSRF_HEADER}` on every POST.")
    expires_at: float = Field(..., description="Seconds since the epoch.")
    open: bool = Field(..., description="No keys are configured: the gateway needs no login.")
    show_text: bool = Field(..., description="`console.show_text`: trajectories carry text.")


def _asset(name: str) -> bytes:
    return resources.files("clora_feedback.gateway.console").joinpath("static", name).read_bytes()


def build_console_router(
    config: ConsoleConfig,
    registry: AdapterStore,
    feedback: FeedbackReader,
    trajectories: AsyncTrajectoryStore,
    serving: Callable[[], Sequence[str]],
    deployer: Deployer | None = None,
    replica_of: Callable[[str], str | None] | None = None,
    releases: Callable[[str], Mapping[int, Any]] | None = None,
) -> APIRouter:
    """The console router; mount it with `app.include_router(...)` on a gateway app.

    Args:
        config: `Settings.console`.
        registry: the adapter registry the admin routes use.
        feedback: the feedback store (rewards over time, event counts).
        trajectories: the gateway's trajectory store.
        serving: the names of the agents the gateway serves.
        deployer: moves pointers on rollback (None: the registry alone, as the admin routes).
        replica_of: the engine's `Engine.replica_of` (None: no replica column).
        releases: agent -> its versions' release records (the Release column; None: off).
    """
    sessions = SessionStore(config.session_ttl_s, config.max_sessions)
    limiter = LoginLimiter(config.login_failures_per_minute)
    views = ConsoleViews(
        registry, feedback, trajectories, serving,
        show_text=config.show_text, replica_of=replica_of, releases=releases,
    )  # fmt: skip
    feed = ChangeFeed(registry, feedback, config.poll_interval_s)
    router = APIRouter(prefix="/console", tags=["console"])

    def info(session: ConsoleSession, request: Request) -> SessionInfo:
        authenticator: KeyAuthenticator = request.app.state.authenticator
        return SessionInfo(
            csrf_token=session.csrf_token,
            expires_at=session.expires_at,
            open=not authenticator.enabled,
            show_text=config.show_text,
        )

    def start(response: Response, request: Request) -> ConsoleSession:
        session = sessions.create()
        response.set_cookie(
            COOKIE_NAME,
            session.id,
            max_age=int(config.session_ttl_s),
            path="/console",
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",
        )
        response.headers["Cache-Control"] = "no-store"
        return session

    async def current(request: Request) -> ConsoleSession:
        return sessions.get(request.cookies.get(COOKIE_NAME))

    async def acting(request: Request) -> ConsoleSession:
        session = sessions.get(request.cookies.get(COOKIE_NAME))
        session.check_csrf(request.headers.get(CSRF_HEADER))
        return session

    @router.get("", response_class=HTMLResponse)
    async def page() -> Response:
        return Response(_asset("index.html"), media_type="text/html; charset=utf-8",
                        headers=_PAGE_HEADERS)  # fmt: skip

    @router.get("/static/{name}")
    async def asset(name: str) -> Response:
        if name not in ASSETS:
            raise NotFoundError(f"no console asset {name!r}", param="name")
        headers = {"X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"}
        return Response(_asset(name), media_type=ASSETS[name], headers=headers)

    @router.get("/api/session")
    async def session(request: Request, response: Response) -> SessionInfo:
        authenticator: KeyAuthenticator = request.app.state.authenticator
        cookie = request.cookies.get(COOKIE_NAME)
        if not authenticator.enabled:
            try:
                return info(sessions.get(cookie), request)
            except AuthenticationError:  # open gateway: no login, a session all the same
                return info(start(response, request), request)
        return info(sessions.get(cookie), request)

    @router.post("/api/login")
    async def login(body: LoginRequest, request: Request, response: Response) -> SessionInfo:
        authenticator: KeyAuthenticator = request.app.state.authenticator
        address = request.client.host if request.client is not None else "unknown"
        limiter.check(address)
        try:
            authenticator.authenticate(f"Bearer {body.key}").check_admin()
        except CloraError:
            limiter.failed(address)
            raise
        limiter.succeeded(address)
        sessions.delete(request.cookies.get(COOKIE_NAME))  # a fresh id after every login
        return info(start(response, request), request)

    @router.post("/api/logout")
    async def logout(request: Request, response: Response) -> dict[str, Any]:
        session = await acting(request)
        sessions.delete(session.id)
        response.delete_cookie(COOKIE_NAME, path="/console", httponly=True, samesite="strict")
        return {"object": "console.logout", "logged_out": True}

    @router.get("/api/agents", dependencies=[Depends(current)])
    async def agents(
        q: str = "",
        sort: str = "name",
        order: str = "asc",
        offset: Annotated[int, Query(ge=0)] = 0,
        limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 25,
    ) -> dict[str, Any]:
        return await views.agents_page(
            query=q, sort=sort, descending=order == "desc", offset=offset, limit=limit
        )

    @router.get("/api/agents/{agent}", dependencies=[Depends(current)])
    async def agent_detail(agent: str) -> dict[str, Any]:
        return await views.agent_detail(agent)

    @router.get("/api/agents/{agent}/trajectories", dependencies=[Depends(current)])
    async def agent_trajectories(
        agent: str, limit: Annotated[int, Query(ge=1, le=100)] = 20
    ) -> dict[str, Any]:
        return await views.trajectories(agent, limit=limit)

    @router.post("/api/agents/{agent}/rollback", dependencies=[Depends(acting)])
    async def rollback(agent: str, body: RollbackRequest) -> RollbackResult:
        if not (body.reason or "").strip():
            body = body.model_copy(update={"reason": CONSOLE_ROLLBACK_REASON})
        return await rollback_adapter(registry, deployer, agent, body)

    @router.post("/api/agents/{agent}/pin", dependencies=[Depends(acting)])
    async def pin(agent: str) -> AgentAdaptersObject:
        return await set_pinned(registry, agent, True)

    @router.post("/api/agents/{agent}/unpin", dependencies=[Depends(acting)])
    async def unpin(agent: str) -> AgentAdaptersObject:
        return await set_pinned(registry, agent, False)

    @router.get("/api/events", dependencies=[Depends(current)])
    async def events(request: Request, last_event_id: str | None = None) -> SSEResponse:
        resume = request.headers.get("last-event-id") or last_event_id
        return SSEResponse(feed.stream(resume))

    return router
