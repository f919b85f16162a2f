"""Reward policies: the one place where feedback events become rewards, applied at read time.

A `RewardPolicy` answers four questions, and nothing else in the project does:

1. scope (`judges`): which samples of a named completion an event judges;
2. value (`signal`): the scalar (and maybe a supervised target) an event gives
   one sample's output;
3. aggregation (`reward`): one sample's reward from every event judging it;
4. source (`source`): the reward kind that admission balances batches by.

The feedback store keeps facts only (the raw event and the completions it
names) and asks the policy whenever samples are read, so a new mapping applies
to every stored event at once. `id` names the mapping; it goes into each
version's manifest (`feedback_window["reward_policy"]`).

`DefaultRewardPolicy` (id `default-v1:<hash of its config>`):

- scope: a `Correction` judges sample 0 of each named completion (the output the
  developer edited); a `Resolution` or `Reward` judges every sample.
- `Resolution`: the configured reward of its outcome; with a satisfaction
  score, `(1 - w) * outcome_reward + w * score` where `w = score_weight`.
- `Correction`: `floor + (1 - floor) * similarity(output, corrected)`, with
  similarity the `difflib` ratio in [0, 1] (1.0 when unchanged). The corrected
  content is kept as a supervised target unless the output was accepted as-is.
- `Reward`: its value, unchanged.
- aggregation: the mean; source: the kind of the most recent event.

Pure functions over already-validated events: no I/O.

Not here: storing events or joining them to completions (`store`), batches (`train`).
"""

from __future__ import annotations

import difflib
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from clora_feedback.config import FeedbackConfig, RewardPolicyConfig
from clora_feedback.errors import InvalidRequestError
from clora_feedback.feedback.diff import apply_unified_diff
from clora_feedback.schemas.feedback import Correction, Event, Resolution, Reward


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


@dataclass(frozen=True)
class Judgement:
    """One event's signal for one sample, as a policy aggregates it.

    Attributes:
        event_id: the event.
        kind: its kind (`correction`, `resolution`, `reward`).
        signal: what it says about the sample.
    """

    event_id: str
    kind: str
    signal: RewardSignal


class RewardPolicy(Protocol):
    """Events -> per-sample rewards. Implementations are pure and deterministic."""

    @property
    def id(self) -> str:
        """Stable name of this mapping: equal ids give equal rewards for equal facts."""
        ...

    def judges(self, event: Event, sample_index: int) -> bool:
        """Whether `event` judges choice `sample_index` of a completion it names."""
        ...

    def signal(self, event: Event, output_text: str) -> RewardSignal:
        """The reward `event` gives a sample whose generated text was `output_text`.

        Raises:
            CloraError: the event cannot be scored under this policy (the store
                refuses it at ingest, and skips it at read time).
        """
        ...

    def reward(self, judged: Sequence[Judgement]) -> float:
        """One sample's reward from its judgements (oldest first, never empty)."""
        ...

    def source(self, judged: Sequence[Judgement]) -> str:
        """The reward source admission balances by (oldest first, never empty)."""
        ...


def edit_similarity(a: str, b: str) -> float:
    """Normalised similarity in [0, 1]; 1.0 iff the texts are equal."""
    if a == b:
        return 1.0
    return difflib.SequenceMatcher(None, a, b, autojunk=False).ratio()


class DefaultRewardPolicy:
    """Per-agent reward mapping built from `FeedbackConfig` (see the module docstring)."""

    def __init__(self, config: FeedbackConfig):
        self._default = config.rewards
        self._per_agent = dict(config.agent_rewards)
        mapping = {
            "rewards": self._default.model_dump(mode="json"),
            "agent_rewards": {a: c.model_dump(mode="json") for a, c in self._per_agent.items()},
        }
        digest = hashlib.sha256(json.dumps(mapping, sort_keys=True).encode()).hexdigest()
        self._id = f"default-v1:{digest[:12]}"

    @property
    def id(self) -> str:
        return self._id

    def for_agent(self, agent: str) -> RewardPolicyConfig:
        return self._per_agent.get(agent, self._default)

    def judges(self, event: Event, sample_index: int) -> bool:
        return sample_index == 0 if isinstance(event, Correction) else True

    def signal(self, event: Event, output_text: str) -> RewardSignal:
        """See `RewardPolicy.signal`.

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

    def reward(self, judged: Sequence[Judgement]) -> float:
        return sum(j.signal.value for j in judged) / len(judged)

    def source(self, judged: Sequence[Judgement]) -> str:
        return judged[-1].kind
