"""Keys never reach the access log: query values and configured keys are redacted.

uvicorn's access logger (`uvicorn.access`) writes each request's path with
its query string, so a key sent as `?api_key=sk-...` (which the gateway
refuses: keys go in `Authorization`) would be written to disk. A
`RedactingFilter` on that logger rewrites every record before any handler
sees it, whatever handlers an operator configures:

- a query value is kept only for the parameters the gateway itself defines
  (`SAFE_QUERY_PARAMS`); every other value, and a bare name, becomes `[REDACTED]`;
- any configured API key appearing anywhere in the line (a path segment, a
  query name) becomes `[REDACTED]` as well.

Not here: what the trajectory store keeps (an agent name, never a key; see
`gateway.capture`), authentication itself (`gateway.auth`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from urllib.parse import unquote_plus

from clora_feedback.config import Settings

REDACTED = "[REDACTED]"
ACCESS_LOGGER = "uvicorn.access"
SAFE_QUERY_PARAMS = frozenset({"agent", "limit", "before", "after", "order", "version", "include"})
"""Query parameters the gateway defines; their values carry no secrets and help debugging."""


def redact_query(target: str) -> str:
    """`/v1/models?api_key=sk-1&limit=5` -> `/v1/models?api_key=[REDACTED]&limit=5`."""
    path, sep, query = target.partition("?")
    if not sep:
        return target
    parts: list[str] = []
    for pair in query.split("&"):
        name, has_value, _ = pair.partition("=")
        if unquote_plus(name).strip().lower() not in SAFE_QUERY_PARAMS:
            parts.append(f"{name}={REDACTED}" if has_value else REDACTED)
        else:
            parts.append(pair)
    return f"{path}?{'&'.join(parts)}"


class RedactingFilter(logging.Filter):
    """Rewrites a record's message arguments (and message) with secrets redacted."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        super().__init__()
        # Longest first, so a key that contains another is replaced whole.
        self._secrets = sorted({s for s in secrets if s}, key=len, reverse=True)

    def scrub(self, text: str) -> str:
        """`text` with query values redacted and every known secret replaced."""
        text = redact_query(text) if "?" in text else text
        for secret in self._secrets:
            text = text.replace(secret, REDACTED)
        return text

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(self.scrub(a) if isinstance(a, str) else a for a in record.args)
        if isinstance(record.msg, str):
            record.msg = self.scrub(record.msg)
        return True


def configured_secrets(settings: Settings) -> list[str]:
    """Every key in `settings`: the admin key and each agent's keys."""
    keys = [key for agent in settings.agents for key in agent.api_keys]
    if settings.admin_api_key:
        keys.append(settings.admin_api_key)
    return keys


def install_access_log_redaction(settings: Settings) -> RedactingFilter:
    """Put one `RedactingFilter` for `settings`' keys on uvicorn's access logger
    (replacing one an earlier app in this process installed)."""
    logger = logging.getLogger(ACCESS_LOGGER)
    for old in [f for f in logger.filters if isinstance(f, RedactingFilter)]:
        logger.removeFilter(old)
    redactor = RedactingFilter(configured_secrets(settings))
    logger.addFilter(redactor)
    return redactor
