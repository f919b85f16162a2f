"""API keys: who is calling, and what they may touch.

Keys come from `Settings`: each agent's `api_keys` and one `admin_api_key`,
sent as `Authorization: Bearer <key>`. With no key configured anywhere the
gateway is open and every caller acts as admin (the local-development default).

Rules, checked by `Principal`:
- an agent key may use only its own agents' models and see only their
  trajectories; another agent's model (and the bare base model) answers 404
  `model_not_found` exactly as an unknown name does, and another agent's
  trajectory 404 as a missing id, so a key learns nothing about other agents;
- the admin key may use every model and the management routes (adapter
  load/unload, trajectories of any agent).

Not here: rate limits, key rotation, keys stored anywhere but the settings.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from fastapi import Request

from clora_feedback.config import Settings
from clora_feedback.errors import AuthenticationError, NotFoundError, PermissionDeniedError


@dataclass(frozen=True)
class Principal:
    """The caller behind one request.

    Attributes:
        admin: may use every model and the management routes.
        agents: agents this caller may use (ignored for admins).
    """

    admin: bool
    agents: frozenset[str] = frozenset()

    def can_use_agent(self, agent: str | None) -> bool:
        """Whether this caller may generate with `agent` (None = the bare base model)."""
        return self.admin or (agent is not None and agent in self.agents)

    def check_model(self, model: str, agent: str | None) -> None:
        """Raise `model_not_found(model)` unless this caller may use `model` (served as
        `agent`): another key's model answers exactly as an unknown one, so no key can
        learn which agents exist."""
        if not self.can_use_agent(agent):
            raise model_not_found(model)

    def check_admin(self) -> None:
        """Raise `PermissionDeniedError` unless this caller holds the admin key."""
        if not self.admin:
            raise PermissionDeniedError("this route needs the admin API key", code="admin_required")

    def check_trajectory(self, agent: str | None, completion_id: str) -> None:
        """404 (not 403) for another agent's trajectory: its existence stays private."""
        if not self.can_use_agent(agent):
            raise NotFoundError(
                f"no completion {completion_id!r}", param="id", code="completion_not_found"
            )


def model_not_found(model: str) -> NotFoundError:
    """The one answer for a model this caller cannot use, whether it exists or not."""
    return NotFoundError(
        f"The model `{model}` does not exist. GET /v1/models lists the agents served here.",
        param="model",
        code="model_not_found",
    )


OPEN_ACCESS = Principal(admin=True)
"""The principal of every request when no keys are configured."""


class KeyAuthenticator:
    """Maps bearer keys to principals; built once from `Settings`."""

    def __init__(self, settings: Settings) -> None:
        self._admin_key = settings.admin_api_key
        by_key: dict[str, set[str]] = {}
        for agent in settings.agents:
            for key in agent.api_keys:
                by_key.setdefault(key, set()).add(agent.name)
        self._agents_by_key = {key: frozenset(names) for key, names in by_key.items()}
        self.enabled = settings.auth_enabled

    def authenticate(self, authorization: str | None) -> Principal:
        """The principal for an `Authorization` header value.

        Raises:
            AuthenticationError: auth is on and the header is missing, malformed
                or holds an unknown key.
        """
        if not self.enabled:
            return OPEN_ACCESS
        if not authorization:
            raise AuthenticationError(
                "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'.",
                code="missing_api_key",
            )
        scheme, _, key = authorization.partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise AuthenticationError(
                "Authorization must be 'Bearer <key>'.", code="invalid_api_key"
            )
        # Constant-time comparisons: the key table is tiny, and timing must not leak key prefixes.
        if self._admin_key is not None and hmac.compare_digest(
            key.encode(), self._admin_key.encode()
        ):
            return Principal(admin=True)
        for known, agents in self._agents_by_key.items():
            if hmac.compare_digest(key.encode(), known.encode()):
                return Principal(admin=False, agents=agents)
        raise AuthenticationError("Incorrect API key provided.", code="invalid_api_key")


async def current_principal(request: Request) -> Principal:
    """FastAPI dependency: the caller of this request (`app.state.authenticator` decides)."""
    authenticator: KeyAuthenticator = request.app.state.authenticator
    return authenticator.authenticate(request.headers.get("authorization"))


async def admin_principal(request: Request) -> Principal:
    """FastAPI dependency for management routes: the caller, who must be admin."""
    principal = await current_principal(request)
    principal.check_admin()
    return principal
