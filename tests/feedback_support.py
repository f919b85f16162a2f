"""Test helpers for the feedback store: drain its parked events the way the ingest does.

The ingest's `FeedbackIngest.rejoin_parked` is the one production loop over
`FeedbackStore.rejoin`'s bounded passes; store-level tests drive the same passes
synchronously here.
"""

from __future__ import annotations

from clora_feedback.feedback.store import FeedbackStore, Rejected


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
