"""The release states of adapter versions: candidate -> passed | failed | invalid -> canary -> promoted | aborted.

One row per version that entered the release path (`releases`: state, the canary's
share and the serving version it was compared with, the evidence of every verdict
as JSON, when it last changed), beside the registry's `versions` rows in the same
database, so a state moves by compare-and-set in one transaction like the active
pointer. The table is new in the schema and created if missing on every open
(older code ignores it), so the registry's schema version stays 3 (`index.release_schema`).

States (`ReleaseState`):

- `candidate`: the trainer published it; it serves nothing.
- `skipped`: a newer candidate arrived before the gate took this one (never judged).
- `passed` / `failed` / `inconclusive` / `invalid`: the offline gate's verdict (failed:
  shown worse, rejected, kept on disk; inconclusive: neither shown not worse nor shown
  worse, never serves, not rejected; invalid: could not decide, never serves).
- `canary`: serving `share` of its agent's requests beside the serving version; at
  most one per agent (checked in the transaction that starts it).
- `promoted`: the active pointer moved to it (`promote`: the pointer's compare-and-set
  and the state in one transaction); `aborted`: its canary was stopped.

Every move of the pointer (`promote`, and the registry's `rollback`, `deactivate` and
activating `publish`) ends the agent's live canary in its own transaction
(`end_canaries`: `aborted`, stage `operator`, reason `superseded`; the version the pointer
moves to becomes `promoted`), so no process keeps routing to a canary judged against a
serving version that no longer serves.

`failed` and `aborted` are *rejected*: the trainer stops continuing from a rejected
version and anything trained from it (see `train.trainer`).

Not here: deciding (`clora_feedback.release`), the engine (the deployer), the
pointer's other moves (`core`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, get_args

from clora_feedback.errors import ConflictError, InvalidRequestError
from clora_feedback.schemas.admin import ReleaseState
from clora_feedback.store.registry import rows
from clora_feedback.store.registry.index import VERSION_COLUMNS, json_object
from clora_feedback.store.registry.schema import notify_pointer_moved

if TYPE_CHECKING:
    from clora_feedback.store.registry.core import AdapterRegistry

__all__ = ["REJECTED", "ReleaseBook", "ReleaseRecord", "ReleaseState", "end_canaries"]

STATES: tuple[str, ...] = get_args(ReleaseState)
REJECTED: frozenset[str] = frozenset({"failed", "aborted"})
"""States that reject a version: the trainer does not continue from it."""

_PRUNED_AT = VERSION_COLUMNS.split(", ").index("pruned_at")


@dataclass(frozen=True)
class ReleaseRecord:
    """Where one version is on the release path."""

    agent: str
    """The agent."""
    version: int
    """The version."""
    state: ReleaseState
    """See the module docstring."""
    share: float | None
    """The canary's share of the agent's requests (set while and after it was a canary)."""
    serving: int | None
    """The serving version it was last compared with (0: the base model)."""
    evidence: Mapping[str, Any]
    """Per stage (`gate`, `canary`, `operator`): the verdict's statistics and reason."""
    updated_at: float
    """When the state last changed, seconds since the epoch."""

    @property
    def rejected(self) -> bool:
        return self.state in REJECTED


_COLUMNS = "agent, version, state, share, serving, evidence, updated_at"


def _record(row: tuple[Any, ...]) -> ReleaseRecord:
    return ReleaseRecord(row[0], row[1], row[2], row[3], row[4], json.loads(row[5]), row[6])


def end_canaries(conn: Any, agent: str, *, active: int | None, reason: str) -> list[int]:
    """End `agent`'s live canaries inside the transaction that moves its pointer to `active`:
    each becomes `aborted` (stage `operator`, `reason`: superseded), except `active` itself,
    which becomes `promoted` (it serves everyone now). Returns the aborted versions.
    """
    found = conn.execute(
        "SELECT version FROM releases WHERE agent = ? AND state = 'canary'", (agent,)
    ).fetchall()
    aborted = []
    for (version,) in found:
        evidence = {"reason": reason, "by": "operator", "code": "superseded"}
        state = "promoted" if version == active else "aborted"
        text = json.dumps(evidence, sort_keys=True)
        ReleaseBook._set(conn, agent, version, state, "operator", text, {"canary"}, None, None)
        if state == "aborted":
            aborted.append(int(version))
    return aborted


class ReleaseBook:
    """The release states of one registry's versions (thread-safe, blocking: call off the loop).

    Args:
        registry: the adapter registry whose database holds the table.
    """

    def __init__(self, registry: AdapterRegistry) -> None:
        self.registry = registry
        self._db = registry.database

    # -- reading ------------------------------------------------------------------------

    def get(self, agent: str, version: int) -> ReleaseRecord | None:
        with self._db.read() as conn:
            row = conn.execute(
                f"SELECT {_COLUMNS} FROM releases WHERE agent = ? AND version = ?",
                (agent, version),
            ).fetchone()
        return None if row is None else _record(row)

    def of_agent(self, agent: str) -> dict[int, ReleaseRecord]:
        """Every release record of `agent`, by version."""
        with self._db.read() as conn:
            found = conn.execute(
                f"SELECT {_COLUMNS} FROM releases WHERE agent = ? ORDER BY version", (agent,)
            ).fetchall()
        return {r[1]: _record(r) for r in found}

    def in_state(self, state: ReleaseState) -> list[ReleaseRecord]:
        """Every version now in `state`, by agent and version (e.g. the live canaries)."""
        with self._db.read() as conn:
            found = conn.execute(
                f"SELECT {_COLUMNS} FROM releases WHERE state = ? ORDER BY agent, version",
                (state,),
            ).fetchall()
        return [_record(r) for r in found]

    def newest_undecided(self) -> list[ReleaseRecord]:
        """Every `invalid` or `inconclusive` version that is its agent's newest release record
        (what the release loop may evaluate again, on more cases), by agent."""
        with self._db.read() as conn:
            found = conn.execute(
                f"SELECT {_COLUMNS} FROM releases r WHERE state IN ('invalid', 'inconclusive') "
                "AND version = "
                "(SELECT max(version) FROM releases n WHERE n.agent = r.agent) ORDER BY agent",
            ).fetchall()
        return [_record(r) for r in found]

    def canary(self, agent: str) -> ReleaseRecord | None:
        """The agent's live canary, if one runs."""
        with self._db.read() as conn:
            row = conn.execute(
                f"SELECT {_COLUMNS} FROM releases WHERE agent = ? AND state = 'canary'", (agent,)
            ).fetchone()
        return None if row is None else _record(row)

    def kept(self, agent: str) -> set[int]:
        """Versions retention must keep for the release path: waiting for the gate, passed, or a
        live canary (`store.retention`'s `keep` hook)."""
        with self._db.read() as conn:
            found = conn.execute(
                "SELECT version FROM releases WHERE agent = ? "
                "AND state IN ('candidate', 'passed', 'canary')",
                (agent,),
            ).fetchall()
        return {int(r[0]) for r in found}

    def rejected(self, agent: str, versions: set[int]) -> set[int]:
        """Which of `versions` are rejected (`failed` or `aborted`)."""
        if not versions:
            return set()
        found = self.of_agent(agent)
        return {v for v in versions if v in found and found[v].rejected}

    # -- moving -------------------------------------------------------------------------

    def record(
        self,
        agent: str,
        version: int,
        state: ReleaseState,
        *,
        stage: str | None = None,
        evidence: Mapping[str, Any] | None = None,
        expect: Collection[str | None] | None = None,
        share: float | None = None,
        serving: int | None = None,
    ) -> bool:
        """Set `version`'s state (a compare-and-set when `expect` is given).

        Args:
            stage: the evidence key (`gate`, `canary`, `operator`); merged with earlier stages.
            evidence: this stage's statistics and reason (JSON).
            expect: states it must be in now, None in it standing for no record yet
                (None: any, or no record yet).
            share, serving: set when given.

        Returns:
            False when `expect` did not hold (nothing changed).

        Raises:
            NotFoundError: unknown agent or version.
            InvalidRequestError: unknown state or evidence that is not JSON.
        """
        if state not in STATES:
            raise InvalidRequestError(f"unknown release state {state!r}", param="state")
        text = json_object(evidence or {}, param="evidence")
        with self._db.write() as conn:
            rows.require_agent(conn, agent, lock=True)
            if rows.version_row(conn, agent, version) is None:
                raise rows.version_not_found(agent, version)
            return ReleaseBook._set(
                conn, agent, version, state, stage, text, expect, share, serving
            )

    @staticmethod
    def _set(
        conn: Any,
        agent: str,
        version: int,
        state: str,
        stage: str | None,
        text: str | None,
        expect: Collection[str | None] | None,
        share: float | None,
        serving: int | None,
    ) -> bool:
        row = conn.execute(
            f"SELECT {_COLUMNS} FROM releases WHERE agent = ? AND version = ?", (agent, version)
        ).fetchone()
        current = None if row is None else _record(row)
        if expect is not None and (None if current is None else current.state) not in expect:
            return False
        merged = dict(current.evidence) if current is not None else {}
        if stage is not None and text is not None:
            merged[stage] = json.loads(text)
        blob = json.dumps(merged, sort_keys=True, allow_nan=False)
        now = time.time()
        if current is None:
            conn.execute(
                "INSERT INTO releases (agent, version, state, share, serving, evidence, "
                "updated_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (agent, version, state, share, serving, blob, now),
            )
        else:
            conn.execute(
                "UPDATE releases SET state = ?, share = ?, serving = ?, evidence = ?, "
                "updated_at = ? WHERE agent = ? AND version = ?",
                (
                    state,
                    current.share if share is None else share,
                    current.serving if serving is None else serving,
                    blob,
                    now,
                    agent,
                    version,
                ),
            )
        return True

    def start_canary(
        self, agent: str, version: int, *, share: float, serving: int, evidence: Mapping[str, Any]
    ) -> None:
        """Make a `passed` version the agent's canary (at most one per agent).

        Raises:
            ConflictError: another canary runs (`canary_running`), the version is not
                `passed` (`not_passed`), or the serving version moved (`active_changed`).
        """
        text = json_object(evidence, param="evidence")
        with self._db.write() as conn:
            active = rows.require_agent(conn, agent, lock=True)[1]
            if (active or 0) != serving:
                raise ConflictError(
                    f"agent {agent!r}: serving is v{active or 0}, not v{serving}",
                    code="active_changed",
                )
            running = conn.execute(
                "SELECT version FROM releases WHERE agent = ? AND state = 'canary'", (agent,)
            ).fetchone()
            if running is not None:
                raise ConflictError(
                    f"agent {agent!r}: v{running[0]} is already a canary", code="canary_running"
                )
            if not ReleaseBook._set(
                conn, agent, version, "canary", "canary", text, {"passed"}, share, serving
            ):
                raise ConflictError(
                    f"agent {agent!r} v{version} has not passed the gate", code="not_passed"
                )

    def promote(
        self,
        agent: str,
        version: int,
        *,
        expected_active: int | None,
        stage: str,
        evidence: Mapping[str, Any],
    ) -> None:
        """Move the active pointer to `version` and mark it promoted, in one transaction.

        The pointer's `activated_by` becomes `publish` (a version goes live by the release
        path); versions between are left as they are; another live canary of the agent is
        `aborted` (superseded) in the same transaction. A pinned agent is promoted by an
        operator only (`stage` `operator`).

        Raises:
            NotFoundError: unknown agent or version.
            GoneError: its payload was pruned.
            ConflictError: the active version is not `expected_active` (`active_changed`),
                `version` is rejected (`version_rejected`) or already active, or the agent
                is pinned and `stage` is not `operator` (`agent_pinned`).
        """
        text = json_object(evidence, param="evidence")
        with self._db.write() as conn:
            pointer = rows.require_agent(conn, agent, lock=True)
            active = pointer[1]
            row = rows.version_row(conn, agent, version)
            if row is None:
                raise rows.version_not_found(agent, version)
            if pointer[3] and stage != "operator":
                raise ConflictError(
                    f"agent {agent!r} is pinned: only an operator promotes it", code="agent_pinned"
                )
            if active != expected_active:
                raise ConflictError(
                    f"agent {agent!r}: the active version is {active}, not {expected_active}",
                    code="active_changed",
                )
            if active == version:
                raise ConflictError(f"v{version} is already active", code="already_active")
            if row[_PRUNED_AT] is not None:
                raise rows.version_pruned(agent, version)
            states = set(STATES) - REJECTED
            if not self._set(conn, agent, version, "promoted", stage, text, states, None, active):
                current = conn.execute(
                    "SELECT state FROM releases WHERE agent = ? AND version = ?", (agent, version)
                ).fetchone()
                if current is not None:
                    raise ConflictError(
                        f"agent {agent!r} v{version} was {current[0]}; roll back to it instead",
                        code="version_rejected",
                    )
                self._set(conn, agent, version, "promoted", stage, text, None, None, active)
            end_canaries(conn, agent, active=version, reason=f"v{version} was promoted ({stage})")
            conn.execute(
                "UPDATE agents SET active_version = ?, activated_by = 'publish', "
                "activated_at = ? WHERE agent = ?",
                (version, time.time(), agent),
            )
            notify_pointer_moved(conn, agent)
