"""The adapter registry: immutable on-disk adapter versions and each agent's active pointer.

Every published version of an agent's adapter is an immutable directory
`<adapters_dir>/<agent>/<version>/` (PEFT files loadable by
`peft.PeftModel.from_pretrained` and vLLM, optimizer state, and a manifest
written last; see `artifact`) plus one row in a database (SQLite: WAL,
`synchronous=FULL`; or PostgreSQL, shared by every process, with the adapter
directory on storage they all mount) that also holds each agent's active
pointer, pinned flag and the highest version number handed out.

Publishing is crash-safe: the version is written completely into a temp dir and
renamed into place (see `artifact`), and only then its row and the active
pointer are committed in one transaction. A version is visible (listed, loaded,
served) only once its row is committed; a directory without a row is a crash
leftover, deleted by `collect_garbage` (run on open) under the store lock that
every publish holds. Version numbers are reserved (committed) before any file
is written, so they are monotonic per agent but may skip one lost to a crash.
SQLite: one connection behind a lock serves all threads; WAL lets other processes
read. PostgreSQL: every pointer move reads the agent row `FOR UPDATE` inside its
transaction, so two processes can never both move it from the same expected value
(the second waits, then sees the first's move and is refused).
A `.store-id` file ties the adapter tree to its database (the `meta` row
`store_id`): a registry opened on another database's tree refuses rather than
collect that tree's versions.

A version's status is computed from the pointer and its rollback mark, never
stored (the rule, the tables and the row decoding are in `index`).

Provenance: given the served base's identity (`base_identity`, see
`provenance`), every version published here records it in its manifest, and
`load` / `check_loadable` refuse a version recorded on another base
(`BaseMismatchError`), `check_source` an adapter imported from outside.
Retention: `prune` marks versions pruned in the index (the commit point), then
deletes their payload and keeps their manifest; a crash in between is finished
by `collect_garbage`; a pruned version is never loaded or rolled back to
(`GoneError`, 410).

Deliberately not here: the value types and Protocol (see `versions`), the engine
(`clora_feedback.engine.deployer` makes it serve the active pointer), HTTP (see `clora_feedback.gateway.adapters`),
deciding when a version serves (see `clora_feedback.release`). Every pointer move here
also ends the agent's live release canary in its transaction (`releases.end_canaries`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from clora_feedback.errors import ConflictError, InvalidRequestError, StoreError
from clora_feedback.lifecycle import Closing
from clora_feedback.lora.peft_io import load_peft_adapter
from clora_feedback.lora.weights import LoRALimits, LoRAWeights
from clora_feedback.store import provenance
from clora_feedback.store.artifact import (
    OPTIMIZER_NAME,
    VersionDirs,
    read_manifest,
    read_version_dir,
    verify_version_dir,
    write_version_dir,
)
from clora_feedback.store.db import Database, Tx, is_postgres_url, open_database, sqlite_path
from clora_feedback.store.registry import rows as registry_rows
from clora_feedback.store.registry import schema as registry_schema
from clora_feedback.store.registry.index import (
    VERSION_COLUMNS,
    Pointer,
    finite_metrics,
    json_object,
    version_info,
)
from clora_feedback.store.registry.releases import end_canaries
from clora_feedback.store.versions import (
    AdapterStore,
    AgentInfo,
    VersionInfo,
    VersionStatus,
    check_agent_name,
    check_pointer_move,
)

if TYPE_CHECKING:
    from clora_feedback.store.provenance import BaseIdentity

__all__ = ["AdapterRegistry", "AdapterStore", "AgentInfo", "VersionInfo", "VersionStatus"]

log = logging.getLogger(__name__)


class AdapterRegistry(Closing):
    """Versions of every agent's adapter on disk, indexed by SQLite or PostgreSQL. Thread-safe.

    Methods block on disk (publish and load fsync or hash files): call them off
    the event loop (`asyncio.to_thread`).

    Args:
        root: the adapter store root (`Settings.adapters_dir`): the version directories,
            on storage every process of a deployment mounts; created if missing.
        db_path: the registry database file (default `<root>/registry.db`; the gateway
            should pass `Settings.data_dir / "registry.db"`).
        db: instead of `db_path`, a URL: a file path, `sqlite:///...` or
            `postgresql://...` (see `store.db`).
        collect_on_open: delete crash leftovers (temp dirs, uncommitted versions, the
            payload files of versions a crash left half-pruned) now.
        base_identity: the served base model's identity (`provenance.base_identity`,
            computed once by the composition root): recorded in every version published
            here, and checked before any version or imported adapter is loaded (None:
            neither, e.g. a CLI that only lists versions).

    Raises:
        StoreError: the database cannot be opened, was written by a newer schema,
            or `root` belongs to another registry database.
    """

    def __init__(
        self,
        root: Path,
        db_path: str | os.PathLike[str] | None = None,
        *,
        db: str | os.PathLike[str] | None = None,
        collect_on_open: bool = True,
        base_identity: BaseIdentity | None = None,
    ) -> None:
        if db is not None and db_path is not None:
            raise ValueError("pass the registry database as db_path or as db, not both")
        self.root = Path(root)
        self.base_identity = base_identity
        """The served base's identity (see Args), or None."""
        url = (
            db if db is not None else db_path if db_path is not None else self.root / "registry.db"
        )
        self.db_path = None if is_postgres_url(url) else sqlite_path(url)
        """The SQLite file (None on PostgreSQL)."""
        with self._translate("open"):
            self._dirs = VersionDirs(self.root)
        # FULL: publishes are rare and the active pointer must survive power loss too.
        self._db = open_database(url, sqlite_synchronous="FULL")
        self.db_url = self._db.display_url
        try:
            self._init_db()
            self._claim_root()
            if collect_on_open:
                self.collect_garbage()
        except BaseException:
            self._db.close()
            raise

    def close(self) -> None:
        self._db.close()

    @property
    def database(self) -> Database:
        """The registry's database (the trainer leases live in it too: `store.lease`)."""
        return self._db

    # -- plumbing -----------------------------------------------------------------

    def _init_db(self) -> None:
        with self._transaction("open") as conn:
            registry_schema.init_schema(conn, self.db_url)

    def _claim_root(self) -> None:
        """Tie `root` to this database, so garbage collection never deletes another's versions."""
        with self._dirs.lock(), self._transaction("open") as conn:
            registry_schema.claim_root(conn, self._dirs, self.db_url)

    @contextlib.contextmanager
    def _translate(self, action: str) -> Iterator[None]:
        """Translate OS errors once, at this boundary, into `StoreError` (the database's
        own errors arrive as `StoreError` from `store.db`)."""
        try:
            yield
        except OSError as exc:
            raise StoreError(f"adapter registry {action} failed ({self.root}): {exc}") from exc

    @contextlib.contextmanager
    def _transaction(self, action: str) -> Iterator[Tx]:
        with self._translate(action), self._db.write() as conn:
            yield conn

    @contextlib.contextmanager
    def _read(self, action: str = "read") -> Iterator[Tx]:
        with self._translate(action), self._db.read() as conn:
            yield conn

    def _to_info(self, row: tuple[Any, ...], agent_row: tuple[Any, ...]) -> VersionInfo:
        return version_info(row, Pointer.of(agent_row), self._dirs.path(row[0], row[1]))

    # -- publishing ---------------------------------------------------------------

    def next_version(self, agent: str) -> int:
        """Reserve and return a version number above every one handed out for `agent`.

        The deployer reserves one before the engine serves a version that is not yet
        written, so no published version can ever take that number.
        """
        check_agent_name(agent)
        with self._transaction("reserve") as conn:
            row = registry_rows.agent_row(conn, agent, lock=True)
            if row is None:
                # ON CONFLICT: on PostgreSQL another process may insert the agent meanwhile;
                # then this waits for it and numbers on from its row.
                if conn.execute(
                    "INSERT INTO agents (agent, last_version, created_at) VALUES (?, 1, ?) "
                    "ON CONFLICT (agent) DO NOTHING",
                    (agent, time.time()),
                ).rowcount:
                    return 1
                row = registry_rows.require_agent(conn, agent, lock=True)
            version = int(row[2]) + 1
            conn.execute("UPDATE agents SET last_version = ? WHERE agent = ?", (version, agent))
            return version

    def publish(
        self,
        agent: str,
        weights: LoRAWeights,
        *,
        optimizer_state: Mapping[str, torch.Tensor] | None,
        base_model: str,
        parent: int | None,
        step: int,
        metrics: Mapping[str, float],
        feedback_window: Mapping[str, Any] | None,
        activate: bool = True,
        version: int | None = None,
    ) -> VersionInfo:
        """Write a new immutable version and (by default) make it the active one.

        Args:
            agent: the agent.
            weights: the adapter; A [r, in] and B [out, r] per projection, saved as fp32.
            optimizer_state: tensors to resume training from (e.g. Adam moments [P], step [1]).
            base_model: base model name or path, recorded as `base_model_name_or_path`.
            parent: version trained from. With `activate` it must be the active version
                (None when the agent has none), so a step computed before a rollback
                can never undo the rollback.
            step: the agent's optimizer step count.
            metrics: loss and reward statistics of the step.
            feedback_window: which feedback trained this version (a JSON object).
            activate: move the active pointer to the new version in the same transaction.
            version: a number reserved earlier with `next_version` (so the engine can
                serve the weights under it while the files are written); default: reserve now.

        Returns:
            The committed version.

        Raises:
            ConflictError: the agent is pinned (`agent_pinned`) or, with `activate`,
                `parent` is not the active version (`parent_not_active`).
            NotFoundError: `parent` is not a published version of `agent`.
            InvalidRequestError: bad agent name, negative step, non-JSON feedback window.
            StoreError: writing the files or the database failed (nothing became visible).
        """
        return self._publish(
            agent,
            weights,
            optimizer_state=optimizer_state,
            base_model=base_model,
            meta={"parent": parent, "step": step, "source": None},
            metrics=metrics,
            feedback_window=feedback_window,
            activate=activate,
            reserved=version,
        )

    def register_initial(
        self,
        agent: str,
        path: Path,
        *,
        base_model: str | None = None,
        limits: LoRALimits | None = None,
    ) -> VersionInfo:
        """Import an agent's initial PEFT adapter as its first version (normally 1).

        Idempotent: when the agent already has versions nothing is imported and its
        active version is returned, so a restart keeps serving what training produced.

        Args:
            agent: the agent.
            path: a PEFT LoRA directory (validated, then re-written in canonical form).
            base_model: recorded base model; default: the adapter's `base_model_name_or_path`.
            limits: engine limits to validate against before the tensors are read.

        Raises:
            AdapterError: the directory is not a valid adapter or exceeds `limits`.
            ConflictError: the agent has versions but none is active.
        """
        check_agent_name(agent)
        with self._read() as conn:
            has_versions = conn.execute(
                "SELECT 1 FROM versions WHERE agent = ? LIMIT 1", (agent,)
            ).fetchone()
        if has_versions:
            current = self.active(agent)
            if current is None:
                raise ConflictError(
                    f"agent {agent!r} has versions but none is active", code="no_active_version"
                )
            return current
        config = self.check_source(path)
        weights = load_peft_adapter(Path(path), limits=limits)
        return self._publish(
            agent,
            weights,
            optimizer_state=None,
            base_model=base_model or str(config.get("base_model_name_or_path") or ""),
            meta={"parent": None, "step": 0, "source": str(Path(path).resolve())},
            metrics={},
            feedback_window=None,
            activate=True,
        )

    def _publish(
        self,
        agent: str,
        weights: LoRAWeights,
        *,
        optimizer_state: Mapping[str, torch.Tensor] | None,
        base_model: str,
        meta: dict[str, Any],
        metrics: Mapping[str, float],
        feedback_window: Mapping[str, Any] | None,
        activate: bool,
        reserved: int | None = None,
    ) -> VersionInfo:
        check_agent_name(agent)
        parent, step = meta["parent"], meta["step"]
        if step < 0:
            raise InvalidRequestError(f"step must be >= 0, got {step}", param="step")
        window = json_object(feedback_window, param="feedback_window")
        meta = {
            "agent": agent,
            **meta,
            "metrics": finite_metrics(metrics),
            "feedback_window": None if window is None else json.loads(window),
        }
        if self.base_identity is not None:
            meta["base"] = self.base_identity.as_manifest()
        with self._dirs.lock():
            # Checked before writing (a cheap failure) and again in the commit (the truth).
            with self._read("publish") as conn:
                registry_rows.check_publishable(conn, agent, parent, activate)
            version = meta["version"] = (
                self.next_version(agent)
                if reserved is None
                else self._check_reserved(agent, reserved)
            )
            with self._translate("publish"):
                manifest = self._dirs.place(
                    agent,
                    version,
                    lambda tmp: write_version_dir(
                        tmp,
                        weights,
                        optimizer_state=optimizer_state,
                        base_model=base_model,
                        meta=meta,
                    ),
                )
            try:
                self._commit_publish(manifest, window, activate)
            except BaseException:
                self._dirs.remove(agent, version)
                raise
        log.info(
            "agent %s: published version %d (parent %s, step %d)", agent, version, parent, step
        )
        return self.get(agent, version)

    def _check_reserved(self, agent: str, version: int) -> int:
        """A reserved number must have been handed out and not used by any version yet."""
        with self._read("publish") as conn:
            row = registry_rows.agent_row(conn, agent)
            used = conn.execute(
                "SELECT max(version) FROM versions WHERE agent = ?", (agent,)
            ).fetchone()[0]
        if row is None or version > int(row[2]) or (used is not None and version <= used):
            raise ConflictError(
                f"agent {agent!r}: version {version} was not reserved or is already taken",
                param="version",
                code="version_not_reserved",
            )
        return version

    def _commit_publish(self, manifest: dict[str, Any], window: str | None, activate: bool) -> None:
        """Insert the version row and move the active pointer, in one transaction."""
        agent, version = manifest["agent"], manifest["version"]
        with self._transaction("publish") as conn:
            registry_rows.check_publishable(conn, agent, manifest["parent"], activate, lock=True)
            conn.execute(
                f"INSERT INTO versions ({VERSION_COLUMNS}) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, NULL, NULL, NULL, NULL)",
                (
                    agent,
                    version,
                    manifest["parent"],
                    manifest["step"],
                    manifest["base_model"],
                    manifest["content_hash"],
                    json.dumps(manifest["metrics"], sort_keys=True),
                    window,
                    int(OPTIMIZER_NAME in manifest["files"]),
                    manifest["created_at"],
                ),
            )
            if activate:
                end_canaries(conn, agent, active=version, reason=f"v{version} was published")
                conn.execute(
                    "UPDATE agents SET active_version = ?, activated_by = 'publish', "
                    "activated_at = ? WHERE agent = ?",
                    (version, time.time(), agent),
                )
                registry_schema.notify_pointer_moved(conn, agent)

    def collect_garbage(self) -> list[Path]:
        """Delete crash leftovers: temp dirs and version dirs with no committed row.

        Safe while other processes publish (it takes the same store lock). Runs on open.

        Returns:
            The directories removed.
        """
        with self._dirs.lock():
            with self._read("collect") as conn:
                known = set(conn.execute("SELECT agent, version FROM versions").fetchall())
                pruned = conn.execute(
                    "SELECT agent, version FROM versions WHERE pruned_at IS NOT NULL"
                ).fetchall()
            with self._translate("collect"):
                removed = self._dirs.collect(known)
                # A prune killed between its index mark and its deletes: finish it.
                finished = [(a, v) for a, v in pruned if self._dirs.prune_payload(a, v)]
        for path in removed:
            log.warning("adapter registry: removed incomplete version directory %s", path)
        for agent, version in finished:
            log.warning("agent %s: finished pruning version %d's payload", agent, version)
        return removed

    # -- reading ------------------------------------------------------------------

    def agent(self, agent: str) -> AgentInfo:
        """One agent's summary.

        Raises:
            NotFoundError: the registry has never seen `agent`.
        """
        with self._read() as conn:
            row = registry_rows.require_agent(conn, agent)
            count, latest = conn.execute(
                "SELECT count(*), max(version) FROM versions WHERE agent = ?", (agent,)
            ).fetchone()
        return AgentInfo(
            agent=row[0],
            active_version=row[1],
            pinned=bool(row[3]),
            num_versions=count,
            latest_version=latest,
            activated_by=row[4],
            activated_at=row[5],
        )

    def agents(self) -> list[AgentInfo]:
        """Every agent the registry knows, by name."""
        with self._read() as conn:
            names = [r[0] for r in conn.execute("SELECT agent FROM agents ORDER BY agent")]
        return [self.agent(name) for name in names]

    def active(self, agent: str) -> VersionInfo | None:
        """The active version of `agent`; None when it has none (or is unknown)."""
        with self._read() as conn:
            row = registry_rows.agent_row(conn, agent)
            if row is None or row[1] is None:
                return None
            version_row = registry_rows.version_row(conn, agent, row[1])
        return None if version_row is None else self._to_info(version_row, row)

    def get(self, agent: str, version: int) -> VersionInfo:
        """One version.

        Raises:
            NotFoundError: unknown agent (`agent_not_found`) or version (`version_not_found`).
        """
        with self._read() as conn:
            row = registry_rows.require_agent(conn, agent)
            version_row = registry_rows.version_row(conn, agent, version)
        if version_row is None:
            raise registry_rows.version_not_found(agent, version)
        return self._to_info(version_row, row)

    def versions(self, agent: str) -> list[VersionInfo]:
        """All published versions of `agent`, oldest first.

        Raises:
            NotFoundError: unknown agent.
        """
        with self._read() as conn:
            row = registry_rows.require_agent(conn, agent)
            rows = conn.execute(
                f"SELECT {VERSION_COLUMNS} FROM versions WHERE agent = ? ORDER BY version",
                (agent,),
            ).fetchall()
        return [self._to_info(r, row) for r in rows]

    def manifest(self, agent: str, version: int) -> dict[str, Any]:
        """The version's `manifest.json`.

        Raises:
            NotFoundError: unknown agent or version.
            StoreError: the manifest is missing or unreadable.
        """
        return read_manifest(self.get(agent, version).path)

    def verify(self, agent: str, version: int) -> VersionInfo:
        """Recompute the version's content hash and compare it with the registry's.

        Raises:
            NotFoundError: unknown agent or version.
            GoneError: retention pruned its payload (`version_pruned`): nothing to verify.
            StoreError: a file is missing or changed (`content_hash_mismatch`).
        """
        info = self.get(agent, version)
        if info.pruned_at is not None:
            raise registry_rows.version_pruned(agent, version)
        verify_version_dir(
            info.path, info.content_hash, has_optimizer_state=info.has_optimizer_state
        )
        return info

    def load(
        self, agent: str, version: int, *, limits: LoRALimits | None = None
    ) -> tuple[LoRAWeights, dict[str, torch.Tensor] | None]:
        """Read a version's weights and optimizer state, after verifying its content hash.

        Args:
            agent: the agent.
            version: the version.
            limits: engine limits to validate the adapter against.

        Returns:
            (fp32 weights, optimizer tensors or None when the version has none).

        Raises:
            NotFoundError: unknown agent or version.
            GoneError: retention pruned its payload (`version_pruned`).
            BaseMismatchError: its manifest records another base model than the served one.
            StoreError: files missing or corrupted (hash mismatch).
            AdapterError: the adapter does not fit `limits`.
        """
        info = self.check_loadable(agent, version)
        verify_version_dir(
            info.path, info.content_hash, has_optimizer_state=info.has_optimizer_state
        )
        return read_version_dir(
            info.path, has_optimizer_state=info.has_optimizer_state, limits=limits
        )

    def check_loadable(self, agent: str, version: int) -> VersionInfo:
        """Refuse a version that cannot serve here: pruned, or made on another base.

        Reads the row and the manifest only (no tensors); `load` calls it, and so does
        the deployer before an engine reads a version's directory itself (vLLM).

        Raises:
            NotFoundError: unknown agent or version.
            GoneError: retention pruned its payload (`version_pruned`).
            BaseMismatchError: its manifest's base digests differ from `base_identity`.
        """
        info = self.get(agent, version)
        if info.pruned_at is not None:
            raise registry_rows.version_pruned(agent, version)
        what = f"agent {agent!r} version {version} ({info.path})"
        provenance.check_manifest(read_manifest(info.path), self.base_identity, what=what)
        return info

    def check_source(self, path: Path) -> dict[str, Any]:
        """`provenance.check_source` against this registry's `base_identity`: an adapter
        directory from outside, checked before it is imported; returns its PEFT config.

        Raises:
            AdapterError: the config is missing or malformed.
            BaseMismatchError: its manifest records another base model.
        """
        return provenance.check_source(Path(path), self.base_identity)

    def record_probe(self, agent: str, version: int, result: Mapping[str, Any]) -> bool:
        """Record the no-op probe's `result` (JSON) on a version, once.

        Returns:
            False when the version already had a result (another process probed it).
        """
        text = json_object(result, param="probe")
        with self._transaction("probe") as conn:
            return bool(
                conn.execute(
                    "UPDATE versions SET probe = ? WHERE agent = ? AND version = ? "
                    "AND probe IS NULL",
                    (text, agent, version),
                ).rowcount
            )

    def prune(self, agent: str, *, keep_last: int, keep: Collection[int] = ()) -> list[int]:
        """Delete the payload of `agent`'s versions retention does not keep; manifests stay.

        Kept: the `keep_last` newest versions, the active one (so a pinned agent's too),
        and `keep` (versions another part still needs, e.g. a canary). The versions are
        marked pruned in the index first, in one transaction holding the agent's row (so
        a rollback cannot race it), then their files are deleted; a crash in between
        leaves marked versions that nothing loads and the next open finishes.

        Returns:
            The versions pruned now, ascending.

        Raises:
            InvalidRequestError: `keep_last` < 1.
            NotFoundError: unknown agent.
        """
        if keep_last < 1:
            raise InvalidRequestError("retention must keep at least 1 version", param="keep_last")
        with self._dirs.lock():
            with self._transaction("prune") as conn:
                doomed = registry_rows.mark_pruned(conn, agent, keep_last, keep, time.time())
            with self._translate("prune"):
                for version in doomed:
                    self._dirs.prune_payload(agent, version)
        if doomed:
            log.info("agent %s: pruned the payload of versions %s", agent, doomed)
        return doomed

    def is_pinned(self, agent: str) -> bool:
        """Whether training of `agent` is frozen (False for an agent the registry never saw)."""
        with self._read() as conn:
            row = registry_rows.agent_row(conn, agent)
        return bool(row is not None and row[3])

    # -- moving the pointer, pinning --------------------------------------------------

    def rollback(
        self, agent: str, version: int, *, reason: str, expected_active: int | None = None
    ) -> VersionInfo:
        """Make `version` active again; every later version is kept and marked rolled back.

        Rolling "back" to a later, rolled-back version is allowed (it undoes a mistaken
        rollback): its own mark is cleared, the marks of others stay.

        Args:
            agent: the agent.
            version: the version to activate.
            reason: why (recorded on every version it marks).
            expected_active: refuse unless this is still the active version (compare-and-set
                for automatic rollbacks decided on a snapshot).

        Returns:
            The now-active version.

        Raises:
            NotFoundError: unknown agent or version.
            ConflictError: `version` is already active (`already_active`), or the active
                version is not `expected_active` (`active_changed`).
            GoneError: retention pruned the version's payload (`version_pruned`).
            InvalidRequestError: empty reason.
        """
        if not reason.strip():
            raise InvalidRequestError("a rollback needs a reason", param="reason")
        now = time.time()
        with self._transaction("rollback") as conn:
            active = registry_rows.require_agent(conn, agent, lock=True)[1]
            row = registry_rows.version_row(conn, agent, version)
            if row is None:
                raise registry_rows.version_not_found(agent, version)
            check_pointer_move(agent, active, version, expected_active)
            if row[VERSION_COLUMNS.split(", ").index("pruned_at")] is not None:
                raise registry_rows.version_pruned(agent, version)
            conn.execute(
                "UPDATE versions SET rolled_back_at = ?, rolled_back_reason = ? "
                "WHERE agent = ? AND version > ? AND rolled_back_at IS NULL",
                (now, reason, agent, version),
            )
            conn.execute(
                "UPDATE versions SET rolled_back_at = NULL, rolled_back_reason = NULL "
                "WHERE agent = ? AND version = ?",
                (agent, version),
            )
            end_canaries(conn, agent, active=version, reason=f"rolled back to v{version}")
            conn.execute(
                "UPDATE agents SET active_version = ?, activated_by = 'rollback', activated_at = ? "
                "WHERE agent = ?",
                (version, now, agent),
            )
            registry_schema.notify_pointer_moved(conn, agent)
        log.warning(
            "agent %s: rolled back from version %s to %d: %s", agent, active, version, reason
        )
        return self.get(agent, version)

    def deactivate(self, agent: str, *, expected_active: int) -> AgentInfo:
        """Point `agent` at no version: the base model serves it (an unload).

        A compare-and-set like `rollback`, in one transaction; the versions are kept,
        `activated_at` records the move and `activated_by` becomes None. A later
        `publish` (parent None) or `rollback` activates a version again.

        Raises:
            NotFoundError: unknown agent.
            ConflictError: the active version is not `expected_active` (`active_changed`).
        """
        with self._transaction("deactivate") as conn:
            active = registry_rows.require_agent(conn, agent, lock=True)[1]
            if active is None or active != expected_active:
                raise ConflictError(
                    f"agent {agent!r}: the active version is {active}, not {expected_active}",
                    code="active_changed",
                )
            end_canaries(conn, agent, active=None, reason="deactivated (the base model serves)")
            conn.execute(
                "UPDATE agents SET active_version = NULL, activated_by = NULL, activated_at = ? "
                "WHERE agent = ?",
                (time.time(), agent),
            )
            registry_schema.notify_pointer_moved(conn, agent)
        log.warning("agent %s: deactivated version %d (the base model serves it)", agent, active)
        return self.agent(agent)

    def pin(self, agent: str) -> AgentInfo:
        """Freeze training of `agent` (idempotent): `publish` refuses until `unpin`.

        Raises:
            NotFoundError: unknown agent.
        """
        return self._set_pinned(agent, True)

    def unpin(self, agent: str) -> AgentInfo:
        """Let training of `agent` publish again (idempotent).

        Raises:
            NotFoundError: unknown agent.
        """
        return self._set_pinned(agent, False)

    def _set_pinned(self, agent: str, pinned: bool) -> AgentInfo:
        with self._transaction("pin") as conn:
            registry_rows.require_agent(conn, agent, lock=True)
            conn.execute("UPDATE agents SET pinned = ? WHERE agent = ?", (int(pinned), agent))
        return self.agent(agent)
