"""Trainer leases (`clora_feedback.store.lease`) on both backends: exclusivity, renewal,
expiry takeover, fair share, release, and the registry schema's upgrade to version 2.

Every lease call here passes `now` explicitly, so expiry is decided by the values the
test gives, never by how long the test took.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from clora_feedback.store.lease import TrainerLeases
from clora_feedback.store.registry import AdapterRegistry, index

AGENTS = ["a", "b", "c", "d"]
TTL = 15.0


@pytest.fixture
def registries(tmp_path: Path, store_url: str) -> Iterator[tuple[AdapterRegistry, AdapterRegistry]]:
    """Two registry objects on one database, as two trainer processes would open it."""
    with (
        AdapterRegistry(tmp_path / "adapters", db=store_url) as one,
        AdapterRegistry(tmp_path / "adapters", db=store_url, collect_on_open=False) as two,
    ):
        yield one, two


def _pair(registries: tuple[AdapterRegistry, AdapterRegistry]) -> tuple[TrainerLeases, ...]:
    one, two = registries
    return (
        TrainerLeases(one.database, owner="t1", ttl_s=TTL),
        TrainerLeases(two.database, owner="t2", ttl_s=TTL),
    )


def test_one_trainer_takes_every_agent_and_renews(registries) -> None:
    t1, _ = _pair(registries)
    assert t1.refresh(AGENTS, now=100.0) == set(AGENTS)
    # Renewed at 110: still held at 120 (past the first expiry at 115).
    assert t1.refresh(AGENTS, now=110.0) == set(AGENTS)
    assert t1.holds("a", now=120.0)
    assert not t1.holds("a", now=126.0)  # expired: 110 + 15 < 126
    assert t1.owners(now=120.0) == dict.fromkeys(AGENTS, "t1")


def test_a_held_lease_is_exclusive(registries) -> None:
    t1, t2 = _pair(registries)
    t1.refresh(["a"], now=100.0)
    # t2 is alive too (share 1 of 1 agent each), but `a` is held and unexpired.
    assert t2.refresh(["a"], now=101.0) == set()
    assert t1.holds("a", now=101.0) and not t2.holds("a", now=101.0)
    assert t1.refresh(["a"], now=102.0) == {"a"}


def test_two_trainers_split_the_agents_fairly(registries) -> None:
    t1, t2 = _pair(registries)
    assert t1.refresh(AGENTS, now=100.0) == set(AGENTS)  # alone: all of them
    assert t2.refresh(AGENTS, now=100.5) == set()  # all held; t2's heartbeat now counts
    assert t1.refresh(AGENTS, now=101.0) == {"a", "b"}  # over its share of 2: releases two
    assert t2.refresh(AGENTS, now=101.5) == {"c", "d"}
    owners = t1.owners(now=102.0)
    assert sorted(owners) == AGENTS and set(owners.values()) == {"t1", "t2"}
    assert t1.refresh(AGENTS, now=103.0) == {"a", "b"}  # stable afterwards
    assert t2.refresh(AGENTS, now=103.5) == {"c", "d"}


def test_a_dead_trainers_agents_are_taken_after_expiry(registries) -> None:
    t1, t2 = _pair(registries)
    t1.refresh(AGENTS, now=100.0)
    t2.refresh(AGENTS, now=100.0)
    t1.refresh(AGENTS, now=100.0)
    assert t2.refresh(AGENTS, now=100.0) == {"c", "d"}
    # t1 dies (stops renewing). Before its TTL has passed nothing moves...
    assert t2.refresh(AGENTS, now=114.0) == {"c", "d"}
    # ...after it, its heartbeat and leases have expired: t2 is the only live trainer.
    assert t2.refresh(AGENTS, now=115.5) == set(AGENTS)
    assert t2.owners(now=116.0) == dict.fromkeys(AGENTS, "t2")


def test_release_hands_over_at_once(registries) -> None:
    t1, t2 = _pair(registries)
    t1.refresh(AGENTS, now=100.0)
    t1.release()
    assert t2.refresh(AGENTS, now=100.1) == set(AGENTS)
    assert not t1.holds("a", now=100.1)


def test_an_agent_no_longer_wanted_is_released(registries) -> None:
    t1, t2 = _pair(registries)
    t1.refresh(["a", "b"], now=100.0)
    assert t1.refresh(["a"], now=101.0) == {"a"}
    assert t2.owners(now=101.0) == {"a": "t1"}


def test_held_is_empty_before_the_first_refresh(registries) -> None:
    t1, _ = _pair(registries)
    assert t1.held() == set() and t1.due()
    t1.refresh(["a"])  # the database's clock
    assert t1.held() == {"a"} and not t1.due()


def test_a_version_1_sqlite_registry_is_upgraded(tmp_path: Path) -> None:
    db = tmp_path / "registry.db"
    with AdapterRegistry(tmp_path / "adapters", db):
        pass
    with sqlite3.connect(db) as conn:  # make it look like a version 1 file
        conn.execute("DROP TABLE trainer_leases")
        conn.execute("DROP TABLE trainer_heartbeats")
        conn.execute("UPDATE schema_version SET version = 1")
    with AdapterRegistry(tmp_path / "adapters", db) as reg:
        assert TrainerLeases(reg.database, owner="t", ttl_s=TTL).refresh(["a"]) == {"a"}
    with sqlite3.connect(db) as conn:
        versions = conn.execute("SELECT version FROM schema_version").fetchall()
    assert versions == [(index.SCHEMA_VERSION,)] and index.SCHEMA_VERSION == 3


def test_a_version_1_postgresql_registry_is_upgraded(tmp_path: Path, postgres_url: str) -> None:
    import psycopg

    with AdapterRegistry(tmp_path / "adapters", db=postgres_url):
        pass
    with psycopg.connect(postgres_url) as conn:  # make it look like a version 1 database
        conn.execute("DROP TABLE trainer_leases, trainer_heartbeats")
        conn.execute("UPDATE clora_schema SET version = 1 WHERE component = 'registry'")
    with AdapterRegistry(tmp_path / "adapters", db=postgres_url) as reg:
        assert TrainerLeases(reg.database, owner="t", ttl_s=TTL).refresh(["a"]) == {"a"}
    with psycopg.connect(postgres_url) as conn:
        row = conn.execute("SELECT version FROM clora_schema WHERE component = 'registry'")
        assert row.fetchone() == (index.SCHEMA_VERSION,)
