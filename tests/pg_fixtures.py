"""A real PostgreSQL server for the tests marked `postgres`: one fresh database per test.

The server is the one `$CLORA_TEST_POSTGRES_URL` names (a role with CREATEDB or a
superuser, e.g. `postgresql://clora:clora@127.0.0.1:5432/postgres`); when unset,
the local cluster `scripts/postgres.sh` set up (it writes its URL to
`var/postgres.url`). When no server is reachable the tests FAIL, saying how to
start one: CI always runs them, and a silent skip would hide a broken backend.
Deselect them locally with `-m "not postgres"`.

- `postgres_url`: a URL to an empty database created for the test, dropped after it
  (`DROP DATABASE ... WITH (FORCE)`, so a pool a failed test left open cannot block it).
- `store_url`: parametrised over the two backends: a SQLite file path under
  `tmp_path`, or a `postgres_url`; the PostgreSQL case carries the `postgres` marker.

Not here: the stores (`clora_feedback.store.db` opens either URL), the vLLM server
(`vllm_fixtures`).
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest

REPO = Path(__file__).resolve().parent.parent
URL_FILE = REPO / "var" / "postgres.url"
DEFAULT_URL = "postgresql://clora:clora@127.0.0.1:5432/clora"  # what scripts/postgres.sh creates
HOW_TO_START = (
    "start one with `sudo bash scripts/postgres.sh` (installs and starts Debian's "
    "postgresql, creates the role and writes var/postgres.url), or set "
    "CLORA_TEST_POSTGRES_URL to a server URL whose role may CREATE DATABASE; "
    'deselect these tests locally with -m "not postgres"'
)


def server_url() -> str:
    """The test server's URL: the environment, then var/postgres.url, then the script's default."""
    url = os.environ.get("CLORA_TEST_POSTGRES_URL", "").strip()
    if not url and URL_FILE.is_file():
        url = URL_FILE.read_text(encoding="utf-8").strip()
    return url or DEFAULT_URL


def with_database(url: str, database: str) -> str:
    """`url` pointing at `database` instead (credentials, host and query kept)."""
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, f"/{database}", parts.query, parts.fragment))


def _redacted(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def _admin(url: str) -> Any:
    """An autocommit connection to the server (CREATE/DROP DATABASE refuse a transaction)."""
    import psycopg

    try:
        return psycopg.connect(url, autocommit=True, connect_timeout=10)
    except psycopg.Error as exc:
        reason = str(exc).strip()
    # Outside the except block: the failure reads as one message, not a chained traceback.
    pytest.fail(
        f"no PostgreSQL server reachable at {_redacted(url)} ({reason}): {HOW_TO_START}",
        pytrace=False,
    )


@pytest.fixture(scope="session")
def postgres_server_url() -> str:
    """The server URL, checked once per session: connects and may create databases."""
    url = server_url()
    conn = _admin(url)
    try:
        row = conn.execute(
            "SELECT rolcreatedb OR rolsuper FROM pg_roles WHERE rolname = current_user"
        ).fetchone()
    finally:
        conn.close()
    if not row or not row[0]:
        pytest.fail(f"the role in {_redacted(url)} may not CREATE DATABASE: {HOW_TO_START}")
    return url


@pytest.fixture
def postgres_url(postgres_server_url: str) -> Iterator[str]:
    """A URL to a fresh, empty database for this test; dropped after it."""
    name = f"clora_test_{uuid.uuid4().hex[:16]}"
    conn = _admin(postgres_server_url)
    try:
        conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        conn.close()
    try:
        yield with_database(postgres_server_url, name)
    finally:
        _drop(postgres_server_url, name)


def _drop(server_url: str, name: str) -> None:
    """Drop the test's database. FORCE ends sessions a failed test left open; it is
    refused while a backend this role may not signal (an autovacuum worker) is still
    on the database, which leaves within moments: retry, then drop without FORCE."""
    import psycopg

    conn = _admin(server_url)
    try:
        for _ in range(20):
            try:
                conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
                return
            except (psycopg.errors.InsufficientPrivilege, psycopg.errors.ObjectInUse):
                time.sleep(0.25)
        conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
    finally:
        conn.close()


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Each backend in turn: a SQLite file under tmp_path, or a fresh PostgreSQL database."""
    if request.param == "sqlite":
        return str(tmp_path / "store.db")
    return str(request.getfixturevalue("postgres_url"))


def mark_postgres_tests(items: list[pytest.Item]) -> None:
    """Give every test that asks for `postgres_url` directly the `postgres` marker."""
    for item in items:
        if "postgres_url" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.postgres)
