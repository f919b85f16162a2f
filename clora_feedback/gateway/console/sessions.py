"""Console sessions: server-side random ids behind an HttpOnly, SameSite=Strict cookie.

A login (`POST /console/api/login` with the admin key in the JSON body) creates
a `ConsoleSession`: a random id (the cookie's value, 256 bits) and a random CSRF
token the page sends back in the `X-CSRF-Token` header of every action. The
key itself is checked once and never stored, echoed or put in a URL; the id
alone proves the login until it expires (`console.session_ttl_s`) or the
operator logs out.

Sessions live in this process's memory: a restart logs everyone out, and
several gateway replicas need sticky routing for the console (the JSON admin
routes stay stateless). `SessionStore` is thread-safe and bounded
(`console.max_sessions`, oldest evicted first).

Not here: checking the key (`gateway.auth.KeyAuthenticator`), the routes (`routes`).
"""

from __future__ import annotations

import hmac
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from clora_feedback.errors import AuthenticationError, PermissionDeniedError

COOKIE_NAME = "clora_console"
CSRF_HEADER = "X-CSRF-Token"


@dataclass(frozen=True)
class ConsoleSession:
    """One console login."""

    id: str
    """The cookie's value: random, unguessable, never shown to the page's scripts."""
    csrf_token: str
    """Sent back by the page in `X-CSRF-Token` on every action."""
    expires_at: float
    """Seconds since the epoch after which the session is forgotten."""

    def check_csrf(self, token: str | None) -> None:
        """Raise `PermissionDeniedError` unless `token` is this session's CSRF token."""
        if not token or not hmac.compare_digest(token.encode(), self.csrf_token.encode()):
            raise PermissionDeniedError(
                f"this console action needs the session's {CSRF_HEADER} header; reload the page",
                code="csrf_token_invalid",
            )


class SessionStore:
    """Console sessions by id, each until its expiry; thread-safe.

    Args:
        ttl_s: how long a session lasts after login.
        max_sessions: most sessions held; creating one more evicts the oldest.
        clock: seconds since the epoch (tests pass their own).
    """

    def __init__(
        self, ttl_s: float, max_sessions: int, *, clock: Callable[[], float] = time.time
    ) -> None:
        self._ttl_s = ttl_s
        self._max = max_sessions
        self._clock = clock
        self._sessions: OrderedDict[str, ConsoleSession] = OrderedDict()
        self._lock = threading.Lock()

    def create(self) -> ConsoleSession:
        """A new session (call only after the admin key was checked)."""
        session = ConsoleSession(
            id=secrets.token_urlsafe(32),
            csrf_token=secrets.token_urlsafe(32),
            expires_at=self._clock() + self._ttl_s,
        )
        with self._lock:
            self._sessions[session.id] = session
            while len(self._sessions) > self._max:
                self._sessions.popitem(last=False)
        return session

    def get(self, session_id: str | None) -> ConsoleSession:
        """The live session `session_id` names.

        Raises:
            AuthenticationError: no cookie, an unknown id, or an expired session.
        """
        session = None
        if session_id:
            with self._lock:
                session = self._sessions.get(session_id)
                if session is not None and session.expires_at <= self._clock():
                    del self._sessions[session_id]
                    session = None
        if session is None:
            raise AuthenticationError(
                "log in to the console with the admin key first", code="console_login_required"
            )
        return session

    def delete(self, session_id: str | None) -> None:
        """Forget a session (logout); unknown ids are ignored."""
        if session_id:
            with self._lock:
                self._sessions.pop(session_id, None)

    def __len__(self) -> int:
        return len(self._sessions)
