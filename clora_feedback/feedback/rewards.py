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

`DefaultRewardPolicy` (id `default-v2:<hash of its config>`):

- scope: a `Correction` judges sample 0 of each named completion (the output the
  developer saw); a `Resolution` or `Reward` judges every sample.
- `Correction`: the configured reward of its verdict (`verdict_rewards`:
  accepted 1.0, edited_and_kept 0.5, ignored 0.25, corrected 0.0, rejected 0.0
  by default). A corrected output earns `corrected` however close it came: the
  corrected content is its supervised target (and the two form a preference
  pair, see `train/loss.py`); an edit that was kept is a target too.
- `Resolution`: the configured reward of its outcome; with a satisfaction
  score, `(1 - w) * outcome_reward + w * score` where `w = score_weight`. With a
  `correct_answer`: an output equal to it (ignoring surrounding whitespace)
  keeps that reward and is confirmed; any other output is wrong, earns at most
  `verdict_rewards["corrected"]`, and the answer is its target.
- `Reward`: its value, unchanged.
- aggregation of several events on one sample: if any of them says the output
  was wrong (corrected, rejected, or a correct answer it does not match), the
  lowest value, so no other judgement can lift a wrong output; otherwise the
  mean. Targets are the distinct right answers given. Source: the kind of the
  most recent event.

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
        target: the right answer when the output was not it (a supervised target,
            and the preferred side of a preference pair with the output), or an
            edit that was kept.
        similarity: for corrections, how close the output was to the corrected one
            (reported, never rewarded).
        wrong: the event says the output was wrong (corrected, rejected, or not the
            correct answer): the sample's reward is then the lowest of its judgements.
        confirmed: the event says the output itself was right (accepted, or equal to
            the correct answer): a positive example for replay.
    """

    value: float
    target: str | None = None
    similarity: float | None = None
    wrong: bool = False
    confirmed: bool = False


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
        self._id = f"default-v2:{digest[:12]}"

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
            return self._resolution(policy, event, output_text)
        verdict = event.signal
        value = policy.verdict_rewards[verdict]
        if verdict not in ("corrected", "edited_and_kept"):
            return RewardSignal(value, wrong=verdict == "rejected", confirmed=verdict == "accepted")
        corrected = (
            event.corrected_content
            if event.corrected_content is not None
            else apply_unified_diff(output_text, event.diff or "")
        )
        if corrected == output_text:  # an "edit" that changed nothing accepts the output
            return RewardSignal(policy.verdict_rewards["accepted"], None, 1.0, confirmed=True)
        similarity = edit_similarity(output_text, corrected)
        return RewardSignal(value, corrected, similarity, wrong=verdict == "corrected")

    @staticmethod
    def _resolution(
        policy: RewardPolicyConfig, event: Resolution, output_text: str
    ) -> RewardSignal:
        if event.outcome not in policy.outcome_rewards:
            raise InvalidRequestError(
                f"no reward is configured for outcome {event.outcome!r}", param="outcome"
            )
        value = policy.outcome_rewards[event.outcome]
        if event.score is not None:
            value = (1 - policy.score_weight) * value + policy.score_weight * event.score
        answer = event.correct_answer
        if answer is None:
            return RewardSignal(value)
        if output_text.strip() == answer.strip():
            return RewardSignal(value, confirmed=True)
        value = min(value, policy.verdict_rewards["corrected"])
        similarity = edit_similarity(output_text, answer)
        return RewardSignal(value, answer, similarity, wrong=True)

    def reward(self, judged: Sequence[Judgement]) -> float:
        values = [j.signal.value for j in judged]
        if any(j.signal.wrong for j in judged):
            return min(values)
        return sum(values) / len(values)

    def source(self, judged: Sequence[Judgement]) -> str:
        return judged[-1].kind
