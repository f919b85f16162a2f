"""Retention: prune old adapter payloads and expire old trajectories, on a schedule.

One pass (`Retention.run_once`, also `clora adapters prune`):

- adapters: for every agent, `AdapterRegistry.prune(keep_last=..., keep=...)`
  deletes the payload (PEFT files, optimizer state) of versions outside the
  `retention.keep_last` newest, the active (serving) one, and whatever `keep`
  names for the agent (the hook for versions another part still needs: a canary
  arm, a gated candidate). Manifests and registry rows stay, so the history is
  complete; listings say `payload_pruned`; loading or rolling back to a pruned
  version is refused (410). A kill -9 part-way is finished by the next open
  (see `AdapterRegistry.prune`).
- trajectories: with `retention.trajectory_ttl_s`, those captured longer ago
  are deleted (`TrajectoryStore.delete(before=...)`, bounded transactions).

`Retention` runs one pass every `retention.interval_s` inside `clora serve` (a
component with `start`/`stop`); each pass runs in a worker thread.

Not here: the mechanisms (`registry.prune`, `trajectories.delete`), the
admin delete route (`gateway.routes`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from clora_feedback.config import RetentionConfig
from clora_feedback.errors import CloraError
from clora_feedback.lifecycle import BackgroundTask
from clora_feedback.store.registry import AdapterRegistry
from clora_feedback.store.trajectories import TrajectoryStore

log = logging.getLogger(__name__)


@dataclass
class RetentionReport:
    """What one pass did."""

    pruned: dict[str, list[int]] = field(default_factory=dict)
    """Versions whose payload was pruned now, by agent (agents with none left out)."""
    trajectories_deleted: int = 0
    """Trajectories deleted by the TTL."""
    seconds: float = 0.0
    """Wall time of the pass."""


class Retention(BackgroundTask):
    """Runs retention passes in the background.

    Args:
        registry: the adapter registry to prune.
        config: `retention` settings.
        trajectories: the trajectory store to expire (None: adapters only).
        keep: extra versions to keep, per agent (e.g. a canary arm); default none.
    """

    task_name = "clora-retention"

    def __init__(
        self,
        registry: AdapterRegistry,
        config: RetentionConfig,
        *,
        trajectories: TrajectoryStore | None = None,
        keep: Callable[[str], Collection[int]] | None = None,
    ) -> None:
        self.registry = registry
        self.config = config
        self.trajectories = trajectories
        self.keep = keep
        self.last: RetentionReport | None = None
        """The last pass's report."""
        self.totals = {"passes": 0, "pruned_versions": 0, "trajectories_deleted": 0}
        """Counts since start (`/metrics`: `clora_retention_*_total`)."""

    def _should_run(self) -> bool:
        return self.config.enabled

    async def _run(self) -> None:
        while True:
            try:
                self.last = await asyncio.to_thread(self.run_once)
            except CloraError as exc:  # e.g. the database is briefly unreachable
                log.error("retention pass failed: %s", exc.message)
            await asyncio.sleep(self.config.interval_s)

    def run_once(self, *, now: float | None = None) -> RetentionReport:
        """One pass over every agent and, with a TTL, the trajectories. Blocking."""
        started = time.perf_counter()
        report = RetentionReport()
        for info in self.registry.agents():
            keep = self.keep(info.agent) if self.keep is not None else ()
            pruned = self.registry.prune(info.agent, keep_last=self.config.keep_last, keep=keep)
            if pruned:
                report.pruned[info.agent] = pruned
        ttl = self.config.trajectory_ttl_s
        if ttl is not None and self.trajectories is not None:
            cutoff = (time.time() if now is None else now) - ttl
            report.trajectories_deleted = self.trajectories.delete(before=cutoff)
        report.seconds = time.perf_counter() - started
        self.totals["passes"] += 1
        self.totals["pruned_versions"] += sum(map(len, report.pruned.values()))
        self.totals["trajectories_deleted"] += report.trajectories_deleted
        if report.pruned or report.trajectories_deleted:
            log.info("retention: pruned %s, deleted %d trajectories in %.3f s", report.pruned,
                     report.trajectories_deleted, report.seconds)  # fmt: skip
        return report
