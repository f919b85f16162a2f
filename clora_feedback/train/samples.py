"""The trainer's sample seam: where rewarded samples come from, and nothing about how.

`SampleSource` is what the trainer reads: rewarded samples per agent after a
durable cursor (the highest `last_seq` already trained on, kept in each
version's manifest), the agents that have any, and the id of the reward policy
the rewards come from (recorded in each version's manifest). The feedback
store (`clora_feedback.feedback.store.FeedbackStore`) is the one implementation
today; a PostgreSQL store or a remote sample service is another, with no change
to the trainer.

Not here: the join of feedback to trajectories, the reward mapping (`feedback/`).
"""

from __future__ import annotations

from typing import Protocol

from clora_feedback.feedback.store import TrainingSample

__all__ = ["SampleSource", "TrainingSample"]


class SampleSource(Protocol):
    """Rewarded samples for training, read incrementally by a durable cursor."""

    @property
    def reward_policy_id(self) -> str:
        """Id of the reward policy every sample's `reward` comes from."""
        ...

    def training_samples(
        self, agent: str, *, after_seq: int = 0, limit: int = 1000
    ) -> list[TrainingSample]:
        """Samples of `agent` with a reward newer than `after_seq`, by `last_seq`.

        The largest `last_seq` returned is a safe next cursor: every sample with a
        reward in (after_seq, that value] has been returned.
        """
        ...

    def agents_with_rewards(self) -> list[str]:
        """Agents with at least one rewarded sample, sorted."""
        ...
