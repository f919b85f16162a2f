"""The operator console at `/console`: one page per question "is my agent learning, and is it safe?".

A login with the admin key (an HttpOnly, SameSite=Strict session cookie, a CSRF
token on every action, failed logins limited per address), the agents page
(search, sort, server-side paging, reward sparklines, requests and feedback per
minute, the recent reward, the engine replica), an agent's page (reward over time with version markers
and rollbacks, the versions table, rollback and pin/unpin with confirmation,
recent trajectories with their feedback) and a live feed of changes over
server-sent events. Every asset ships in `static/` (plain HTML, CSS and
JavaScript, charts drawn as inline SVG): no CDN, no build step.

Modules: `sessions` (login state), `views` (what the pages read), `live` (the
event feed), `routes` (the router; `build_console_router` is the entry point,
mounted by `clora_feedback.service.build_service`).

Not here: release-gate verdicts and canary arms (not recorded by the registry
yet), the admin JSON routes (`gateway.adapters`, whose actions the console calls).
"""

from clora_feedback.gateway.console.routes import build_console_router

__all__ = ["build_console_router"]
