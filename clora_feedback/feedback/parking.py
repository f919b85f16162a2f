"""Parked feedback: the per-agent cap, the index of what each parked event waits for, expiry.

A parked event names a completion (or conversation) that is not stored yet. It
is indexed under each of its targets (`parked_targets`), so a newly stored
trajectory finds the few events it may complete with one indexed lookup, and
leaving the parked state removes those rows again. The cap counts one agent's
parked events in a partial index and stops counting at the cap, so a full
tenant costs the same bounded query whatever its backlog.

Not here: the join itself and the rejoin pass that drives these (`store`); the
tables (`tables`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from clora_feedback.errors import OverloadedError, UnprocessableError
from clora_feedback.feedback import tables
from clora_feedback.schemas.feedback import Event
from clora_feedback.store.db import Tx
from clora_feedback.store.sql import in_chunks

Key = tuple[str, str]
"""An event's identity in the store: (agent, event_id)."""

# The parked events indexed under some targets (`IN` marks filled in per chunk). CROSS
# JOIN fixes the loop order: targets first, by key; left to the planner, it may walk
# every parked event (state index) and probe the targets, which is the backlog scan.
WAITING_FOR = (
    "SELECT DISTINCT e.agent, e.event_id, e.payload FROM parked_targets p "
    "CROSS JOIN feedback_events e ON e.agent = p.agent AND e.event_id = p.event_id "
    "WHERE p.target IN ({marks}) AND e.state = 'parked'"
)
# PostgreSQL has no `CROSS JOIN ... ON`; its planner drives the small side (the targets,
# by primary key) first without being told.
_PG_WAITING_FOR = WAITING_FOR.replace("CROSS JOIN", "JOIN")
EXPIRED = (
    "SELECT agent, event_id, payload FROM feedback_events "
    "WHERE state = 'parked' AND received_at < ? ORDER BY received_at LIMIT ?"
)
PARKED_COUNT = (
    "SELECT count(*) FROM (SELECT 1 FROM feedback_events "
    "WHERE agent = ? AND state = 'parked' LIMIT ?)"
)
_PG_PARKED_COUNT = PARKED_COUNT + " AS parked"  # PostgreSQL 15 names every FROM subquery


@dataclass(frozen=True)
class Rejected:
    """An event that cannot be applied, and why (goes to the dead-letter record)."""

    event_id: str
    payload: str
    reason: str
    code: str | None = None
    """The refusing error's code, e.g. `parked_limit` (None for most refusals)."""


@dataclass(frozen=True)
class ParkedLimit:
    """The most parked events one agent may have, and what becomes of an event beyond it."""

    per_agent: int
    """Parked events one agent may have at once (`feedback.max_parked_per_agent`)."""
    refuse: bool = False
    """True: raise `OverloadedError` (code `parked_limit`; nothing of the batch is applied).
    False: reject just that event, its reason starting `parked_limit:` (Kafka dead-letters it)."""
    retry_after_s: float = 2.0
    """The wait a refused sender is told: the next rejoin round may free places."""


@dataclass
class RejoinReport:
    """Outcome of one bounded rejoin pass (`FeedbackStore.rejoin`)."""

    joined: list[str] = field(default_factory=list)
    """Parked events joined now."""
    dead: list[Rejected] = field(default_factory=list)
    """Parked events that died (past the TTL, or invalid when joined), with their reasons."""
    trajectories_read: int = 0
    """Trajectories stored since the previous pass that this one read."""
    examined: int = 0
    """Parked events this pass loaded and tried (never the whole backlog)."""
    more: bool = False
    """A bound was reached: another pass has work now."""


def check_limit(conn: Tx, agent: str, parked: dict[str, int], limit: ParkedLimit) -> None:
    """Count one more parked event of `agent` in `parked` (per batch), or refuse it.

    Raises:
        OverloadedError: beyond the cap and `limit.refuse` (the caller rolls back).
        UnprocessableError: beyond the cap otherwise (that event alone is rejected).
    """
    if agent not in parked:
        query = PARKED_COUNT if conn.dialect == "sqlite" else _PG_PARKED_COUNT
        parked[agent] = conn.execute(query, (agent, limit.per_agent)).fetchone()[0]
    if parked[agent] < limit.per_agent:
        parked[agent] += 1
        return
    message = (
        f"agent {agent!r} already has {limit.per_agent} parked events waiting for their "
        "completions (feedback.max_parked_per_agent); send feedback after its completion "
        "is stored, or retry once parked events have joined or expired"
    )
    if limit.refuse:
        raise OverloadedError(message, retry_after_s=limit.retry_after_s, code="parked_limit")
    raise UnprocessableError(f"parked_limit: {message}", code="parked_limit")


def park(conn: Tx, event: Event) -> None:
    """Index a newly parked event under each of its targets."""
    conn.executemany(
        tables.INSERT_PARKED,
        [(k, event.agent, event.event_id) for k in tables.parked_keys(event)],
    )


def leave(conn: Tx, event: Event, state: str, reason: str | None, now: float) -> None:
    """Move a parked event to `state` (`joined` or `dead`) and drop its index rows."""
    key = (event.agent, event.event_id)
    conn.execute(
        "UPDATE feedback_events SET state = ?, reason = ?, updated_at = ? "
        "WHERE agent = ? AND event_id = ?",
        (state, reason, now, *key),
    )
    conn.executemany(
        "DELETE FROM parked_targets WHERE target = ? AND agent = ? AND event_id = ?",
        [(k, *key) for k in tables.parked_keys(event)],
    )


def waiting_for(
    conn: Tx, arrived: Sequence[tuple[int, str, str | None]]
) -> list[tuple[str, str, str]]:
    """(agent, event_id, payload) of the parked events indexed under newly stored trajectories."""
    keys = [tables.completion_key(c) for _, c, _ in arrived]
    keys += [tables.conversation_key(v) for *_, v in arrived if v is not None]
    rows: dict[Key, str] = {}
    query = WAITING_FOR if conn.dialect == "sqlite" else _PG_WAITING_FOR
    for chunk, marks in in_chunks(keys):
        for agent, event_id, payload in conn.execute(query.format(marks=marks), chunk):
            rows[(agent, event_id)] = payload
    return [(agent, event_id, payload) for (agent, event_id), payload in rows.items()]
