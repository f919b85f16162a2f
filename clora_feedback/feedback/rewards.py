"""Reward policies: turning a feedback event into a scalar (and maybe a supervised target).

- `Resolution`: the configured reward of its outcome; with a satisfaction
  score, `(1 - w) * outcome_reward + w * score` where `w = score_weight`.
- `Correction`: `floor + (1 - floor) * similarity(output, corrected)`, with
  similarity the `difflib` ratio in [0, 1] (1.0 when unchanged). The corrected
  content is kept as a supervised target unless the output was accepted as-is.
- `Reward`: its value, unchanged.

Pure functions over already-validated events: no I/O.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from clora_feedback.config import FeedbackConfig, RewardPolicyConfig
from clora_feedback.errors import InvalidRequestError
from clora_feedback.feedback.diff import apply_unified_diff
from clora_feedback.schemas.feedback import Correction, Resolution, Reward


@dataclass(frozen=True)
class RewardSignal:
    """What one event says about one sample.

    Attributes:
        value: the scalar reward.
        target: corrected content to train on with supervised loss, if any.
        similarity: for corrections, how close the output was to the corrected one.
    """

    value: float
    target: str | None = None
    similarity: float | None = None


def edit_similarity(a: str, b: str) -> float:
    """Normalised similarity in [0, 1]; 1.0 iff the texts are equal."""
    if a == b:
        return 1.0
    return difflib.SequenceMatcher(None, a, b, autojunk=False).ratio()


class RewardPolicy:
    """Per-agent reward mapping built from `FeedbackConfig`."""

    def __init__(self, config: FeedbackConfig):
        self._default = config.rewards
        self._per_agent = dict(config.agent_rewards)

    def for_agent(self, agent: str) -> RewardPolicyConfig:
        return self._per_agent.get(agent, self._default)

    def signal(self, event: Correction | Resolution | Reward, output_text: str) -> RewardSignal:
        """The reward `event` gives a sample whose generated text was `output_text`.

        Raises:
            InvalidRequestError: a correction's diff does not apply to the output, or
                a resolution outcome has no configured reward.
        """
        policy = self.for_agent(event.agent)
        if isinstance(event, Reward):
            return RewardSignal(event.value)
        if isinstance(event, Resolution):
            if event.outcome not in policy.outcome_rewards:
                raise InvalidRequestError(
                    f"no reward is configured for outcome {event.outcome!r}", param="outcome"
                )
            value = policy.outcome_rewards[event.outcome]
            if event.score is not None:
                value = (1 - policy.score_weight) * value + policy.score_weight * event.score
            return RewardSignal(value)
        if event.accepted_as_is:
            return RewardSignal(1.0, None, 1.0)
        corrected = (
            event.corrected_content
            if event.corrected_content is not None
            else apply_unified_diff(output_text, event.diff or "")
        )
        similarity = edit_similarity(output_text, corrected)
        value = policy.correction_floor + (1.0 - policy.correction_floor) * similarity
        return RewardSignal(value, corrected if corrected != output_text else None, similarity)
