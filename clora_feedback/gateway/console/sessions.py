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

`LoginLimiter` bounds guessing: each client address may fail
`console.login_failures_per_minute` logins in a sliding minute; its next
attempt in that minute is refused (429, `Retry-After` = seconds until its
oldest failure leaves the window) before the key is looked at. A successful
login clears the address's failures. The address is the connection's peer,
so behind a proxy every client shares the proxy's budget.

Not here: checking the key (`gateway.auth.KeyAuthenticator`), the routes (`routes`).
"""

from __future__ import annotations

import hmac
import math
import secrets
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

from clora_feedback.errors import AuthenticationError, OverloadedError, PermissionDeniedError

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


class LoginLimiter:
    """Failed console logins per client address in a sliding window; thread-safe, bounded.

    Args:
        failures: failed logins an address may make per window.
        window_s: the window's length in seconds.
        max_addresses: most addresses tracked; one more forgets the least recently failed.
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(
        self,
        failures: int,
        *,
        window_s: float = 60.0,
        max_addresses: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._failures = failures
        self._window_s = window_s
        self._max = max_addresses
        self._clock = clock
        self._seen: OrderedDict[str, deque[float]] = OrderedDict()
        self._lock = threading.Lock()

    def check(self, address: str) -> None:
        """Raise `OverloadedError` (429, `retry_after_s`) when `address` used up its failures."""
        now = self._clock()
        with self._lock:
            times = self._seen.get(address)
            while times and times[0] <= now - self._window_s:
                times.popleft()
            if times is None or len(times) < self._failures:
                return
            wait = times[0] + self._window_s - now
        raise OverloadedError(
            f"too many failed console logins from this address; retry in {math.ceil(wait)} s",
            retry_after_s=max(1.0, float(math.ceil(wait))),
            code="too_many_login_attempts",
        )

    def failed(self, address: str) -> None:
        """Count a failed login of `address`."""
        with self._lock:
            times = self._seen.pop(address, None) or deque(maxlen=self._failures)
            times.append(self._clock())
            self._seen[address] = times  # most recently failed last
            while len(self._seen) > self._max:
                self._seen.popitem(last=False)

    def succeeded(self, address: str) -> None:
        """Forget `address`'s failures (the admin key was right)."""
        with self._lock:
            self._seen.pop(address, None)
