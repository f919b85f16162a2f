"""The README's routes table names every route the gateway serves, and only those (issue 25 item 9).

The served routes are `gateway.openapi.ROUTE_STATUSES` (a test in
`test_openapi_routes.py` keeps every mounted route in it); the console's own
sub-routes (its static files and JSON API) are the console page's business and
are left out of the table.
"""

from __future__ import annotations

import re
from pathlib import Path

from clora_feedback.gateway.openapi import ROUTE_STATUSES

README = Path(__file__).resolve().parent.parent / "README.md"
_ROUTE = re.compile(r"`(GET|POST|DELETE|PUT|PATCH) (/[^`?\s]*)[^`]*`")


def _normal(method: str, path: str) -> str:
    return f"{method} {re.sub(r'{[^}]*}', '{}', path)}"


def _table_routes() -> set[str]:
    text = README.read_text()
    section = text.split("\n## Routes\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return {_normal(m, p) for row in rows for m, p in _ROUTE.findall(row.split(" | ", 1)[0])}


def test_every_served_route_is_in_the_readme_table() -> None:
    served = {
        _normal(*key.split(" ", 1))
        for key in ROUTE_STATUSES
        if not key.split(" ", 1)[1].startswith("/console/")
    }
    documented = _table_routes()
    assert not served - documented, f"add to the README's routes table: {served - documented}"
    assert not documented - served, f"not served, yet in the README: {documented - served}"
