"""Test helpers for the feedback store: drain its parked events the way the ingest does, and
open the stores a trainer reads and publishes to.

The ingest's `FeedbackIngest.rejoin_parked` is the one production loop over
`FeedbackStore.rejoin`'s bounded passes; store-level tests drive the same passes
synchronously here.
"""

from __future__ import annotations

from pathlib import Path

from clora_feedback.config import FeedbackConfig
from clora_feedback.feedback.rewards import DefaultRewardPolicy
from clora_feedback.feedback.store import FeedbackStore, Rejected
from clora_feedback.store.registry import AdapterRegistry
from clora_feedback.store.trajectories import TrajectoryStore


def trainer_stores(root: Path) -> tuple[TrajectoryStore, FeedbackStore, AdapterRegistry]:
    """The trajectories and feedback (one SQLite file) and the adapter registry under `root`,
    the feedback scored by the default reward policy."""
    trajectories = TrajectoryStore(root / "t.db")
    feedback = FeedbackStore(
        root / "t.db", trajectories=trajectories, policy=DefaultRewardPolicy(FeedbackConfig())
    )
    return trajectories, feedback, AdapterRegistry(root / "adapters", root / "registry.db")


def rejoin_all(
    store: FeedbackStore, *, ttl_s: float, now: float | None = None
) -> tuple[list[str], list[Rejected]]:
    """Bounded `rejoin` passes until none has more work: (event ids joined, dead events)."""
    joined: list[str] = []
    dead: list[Rejected] = []
    while True:
        report = store.rejoin(ttl_s=ttl_s, now=now)
        joined += report.joined
        dead += report.dead
        if not report.more:
            return joined, dead
