"""One agent's batch: which admitted samples become which rows of its step.

A rewarded sample can give three kinds of row (`step`):

- a **policy-gradient** row, when the engine recorded raw behaviour logprobs for
  its output (a trajectory that recorded another mode is never scored against the
  wrong quantity: it keeps its other rows and is counted as kept out);
- **supervised** rows: each right answer feedback gave for it, and its own output
  when that output is worth imitating (confirmed right, or rewarded above what the
  agent usually earns with no event calling it wrong), then a few labelled examples
  of earlier steps (`replay`);
- a **preference** pair per wrong output and each right answer given for it.

A batch with nothing to teach (only settled confirmed outputs, rewards at the
agent's running mean) gives no step at all (`teaches`).

Not here: which samples are admitted and when (`admission`), the losses (`loss`),
the step (`step`), what the trainer does with a batch that teaches nothing (`trainer`).
"""

from __future__ import annotations

import math

from clora_feedback.config import TrainerConfig
from clora_feedback.train.policy import PolicyModel
from clora_feedback.train.replay import ReplayBuffer
from clora_feedback.train.samples import TrainingSample
from clora_feedback.train.state import AgentTrainState
from clora_feedback.train.step import AgentBatch, PGSample, PreferencePair, SFTSample

Admitted = list[tuple[TrainingSample, int]]
"""An agent's admitted samples with each one's staleness, as `Admission.admit` releases them."""


def agent_batch(
    state: AgentTrainState,
    replay: ReplayBuffer,
    admitted: Admitted,
    policy: PolicyModel,
    config: TrainerConfig,
) -> tuple[AgentBatch, int]:
    """The step's rows for one agent, and how many outputs were kept out of the policy gradient.

    Policy gradient: every sample with raw behaviour logprobs (a trajectory that
    recorded another mode is never scored against the wrong quantity: it keeps
    its supervised rows and pairs, and is counted). Supervised: each right answer
    given for a sample, and each output worth imitating (`_imitated`) as it was
    generated; then up to `config.replay` labelled examples of earlier steps, drawn
    from `replay` before this batch's own are added to it. Pairs: each wrong output
    with each right answer given for it.
    """
    batch = AgentBatch(state)
    fresh: list[SFTSample] = []
    skipped_pg = 0
    reference = _reference_reward(state.baseline, admitted)
    for sample, staleness in admitted:
        output = sample.completion_token_ids
        if output and sample.logprobs_mode == "raw":
            batch.pg.append(
                PGSample(
                    group=sample.completion_id,
                    prompt_ids=sample.prompt_token_ids,
                    completion_ids=output,
                    behaviour_logprobs=sample.logprobs,
                    reward=sample.reward,
                    staleness=staleness,
                )
            )
        elif output:
            skipped_pg += 1
        for target in sample.targets:
            ids = _target_ids(policy, sample.prompt_token_ids, target)
            if not ids:
                continue
            fresh.append(SFTSample(sample.prompt_token_ids, ids))
            if sample.wrong and output:
                batch.pairs.append(PreferencePair(sample.prompt_token_ids, ids, output))
        if output and _imitated(sample, reference, config):
            fresh.append(SFTSample(sample.prompt_token_ids, output))
    batch.sft = fresh + replay.sample(config.replay)
    replay.add(fresh)
    return batch, skipped_pg


def teaches(admitted: Admitted, baseline: float | None, config: TrainerConfig) -> bool:
    """Whether a batch can teach the agent anything: some sample has a right answer
    other than its output, or is a confirmed output the agent was not yet sure of, or
    its reward is away from what the agent usually earns (`baseline`, its running mean;
    policy-gradient signal)."""
    for sample, _ in admitted:
        if sample.targets:
            return True
        if sample.confirmed:  # a settled confirmed output teaches nothing, whatever its reward
            if not _settled_output(sample, config.settled_prob):
                return True
        elif baseline is None or abs(sample.reward - baseline) > config.settled_margin:
            return True
    return False


def _settled_output(sample: TrainingSample, settled_prob: float) -> bool:
    """Whether the engine produced `sample` with per-token probability (geometric
    mean, raw logprobs) at least `settled_prob`: nothing left to learn from it."""
    lps = sample.logprobs
    if not lps or sample.logprobs_mode != "raw":
        return False
    return math.exp(sum(lps) / len(lps)) >= settled_prob


def _reference_reward(baseline: float | None, admitted: Admitted) -> float:
    """What the agent usually earns: its running mean, else this batch's mean."""
    if baseline is not None:
        return baseline
    return sum(s.reward for s, _ in admitted) / len(admitted)


def _imitated(sample: TrainingSample, reference: float, config: TrainerConfig) -> bool:
    """Whether the output itself is a labelled example of a batch that teaches:
    confirmed right, or rewarded above what the agent usually earns (by more than
    `settled_margin`) with no event calling it wrong.

    Why the rewarded ones, and the ones the agent is already sure of: when only wrong
    outputs carried supervised targets, a batch of an agent that answered one class
    everywhere supervised only the other classes, and the next version answered
    another class everywhere (a two-class task flipped between "confirm all" and
    "escalate all"). The right answers anchor their class against that push. Whether
    a batch teaches at all is `teaches`'s call."""
    if sample.wrong:
        return False
    if sample.confirmed:
        return True
    above = sample.reward > reference + config.settled_margin
    return config.imitate_above_mean and above


def _target_ids(policy: PolicyModel, prompt_ids: list[int], target: str) -> list[int]:
    """A right answer's token ids, cut to the context, EOS last (empty if no room)."""
    tokenizer = policy.tokenizer
    eos = tokenizer.eos_token_id
    budget = policy.max_model_len - len(prompt_ids) - 1
    if budget <= 0:
        return []
    ids = list(tokenizer.encode(target, add_special_tokens=False))[:budget]
    return ids + ([eos] if eos is not None else [])
