"""Staleness of admitted samples under two admission policies: a virtual-clock simulation.

The real `Admission` class decides; only time is simulated. One agent's traffic
is a Poisson stream of completions, each generated over `generation_s` by
whatever adapter version is live while its tokens are produced (a publish in
the middle of a completion gives it mixed token versions, as in the engine).
Its reward arrives an exponentially distributed delay after it finishes. The
trainer is idle or stepping: when idle it asks admission for a batch every
time a reward arrives or a step ends; each optimizer step takes
`step_overhead_s + step_per_sample_s * samples` of simulated time and
publishes a new version when it ends. Every policy sees the same stream
(same seed), so the comparison is paired.

Two policies are compared (see `POLICIES`):

- train-batch admission (the conventional baseline, `AdmissionConfig(full_batch=True)`):
  wait for a full batch of 16, then train it as 4 optimizer steps of 4, each
  publishing a version: the last mini-batch trains 3 versions after the
  batch was admitted;
- early admission (KnitTrans-style, `min_batch=4`): a mini-batch of 4 is
  admitted and trained as soon as it is ready.

Both take optimizer steps of 4 samples, so they publish the same number of
versions per sample and differ only in when samples are admitted.

Two staleness figures per trained sample, in versions:

- total: version the step trains from - oldest version that produced any of
  the sample's tokens (`sample_staleness`, the figure the trainer exports);
- architectural (KnitTrans' term): versions published between the sample's
  reward arriving (the moment it could be trained) and the step that trains
  it. Generation time and reward delay add staleness no admission policy
  can remove; this part is what admission adds.

Not here: any model, any wall-clock time (see `train` for the measured benchmarks).
"""

from __future__ import annotations

import bisect
import random
import statistics
from collections import deque
from dataclasses import dataclass

from clora_feedback.config import AdmissionConfig
from clora_feedback.feedback.store import TrainingSample
from clora_feedback.train.admission import Admission, sample_staleness

_AGENT = "sim"
_NO_DROP = 1_000_000  # admission never drops: every sample counts in both policies


@dataclass(frozen=True)
class FeedbackStream:
    """The simulated traffic of one agent (identical for every policy compared).

    Attributes:
        rate_per_s: completions per second (Poisson arrivals of completion starts).
        generation_s: time to generate one completion; its tokens are spread evenly over it.
        tokens: tokens per completion (each records the version live when it was produced).
        reward_delay_s: mean of the exponential delay from a completion's end to its reward.
        duration_s: simulated time during which completions start.
        seed: random seed of the stream.
    """

    rate_per_s: float = 0.25
    generation_s: float = 2.0
    tokens: int = 32
    reward_delay_s: float = 2.0
    duration_s: float = 20_000.0
    seed: int = 0


@dataclass(frozen=True)
class TrainerModel:
    """Simulated step time: `overhead_s + per_sample_s * samples` per optimizer step."""

    overhead_s: float = 0.2
    per_sample_s: float = 0.6


@dataclass(frozen=True)
class Policy:
    """An admission policy and how an admitted batch becomes optimizer steps.

    Attributes:
        name: shown in the table.
        admission: the real admission configuration.
        minibatch: split each admitted batch into optimizer steps of this many samples
            (the conventional train-batch loop); None trains it in one step.
    """

    name: str
    admission: AdmissionConfig
    minibatch: int | None = None


TRAIN_BATCH = Policy(
    "train-batch admission (16, as 4 steps of 4)",
    AdmissionConfig(full_batch=True, max_batch=16, max_staleness=_NO_DROP),
    minibatch=4,
)
EARLY = Policy(
    "early admission (min 4, max 4)",
    AdmissionConfig(min_batch=4, max_batch=4, max_staleness=_NO_DROP),
)
POLICIES = (TRAIN_BATCH, EARLY)
"""(baseline, early): the paired comparison the benchmark reports."""


@dataclass(frozen=True)
class StalenessResult:
    """What one policy did with the stream.

    Attributes:
        policy: the policy's name.
        mean_total: mean total staleness of trained samples (versions).
        mean_architectural: mean architectural staleness (versions).
        mean_lag_s: mean time from a completion's end to the start of its step.
        trained: samples trained before the stream ended.
        steps: optimizer steps (= versions published).
    """

    policy: str
    mean_total: float
    mean_architectural: float
    mean_lag_s: float
    trained: int
    steps: int


@dataclass(frozen=True)
class _Completion:
    start: float
    end: float
    reward_at: float


def _stream(s: FeedbackStream) -> list[_Completion]:
    rng = random.Random(s.seed)
    out: list[_Completion] = []
    t = 0.0
    while True:
        t += rng.expovariate(s.rate_per_s)
        if t > s.duration_s:
            return sorted(out, key=lambda c: c.reward_at)
        end = t + s.generation_s
        out.append(_Completion(t, end, end + rng.expovariate(1.0 / s.reward_delay_s)))


class _Run:
    """The event loop of one simulation (virtual clock)."""

    def __init__(self, stream: FeedbackStream, policy: Policy, trainer: TrainerModel):
        self.stream, self.policy, self.trainer = stream, policy, trainer
        self.admission = Admission(policy.admission)
        self.publishes: list[float] = []  # times at which versions 1, 2, ... went live
        self.pending: deque[list[TrainingSample]] = deque()  # admitted, not yet stepped
        self.busy_until: float | None = None
        self.reward_at: dict[str, float] = {}
        self.total: list[int] = []
        self.architectural: list[int] = []
        self.lag: list[float] = []

    def version_at(self, t: float) -> int:
        return bisect.bisect_right(self.publishes, t)

    def sample(self, i: int, c: _Completion) -> TrainingSample:
        n = self.stream.tokens
        token_times = [c.start + (c.end - c.start) * (k + 0.5) / n for k in range(n)]
        versions = [self.version_at(t) for t in token_times]
        cid = f"c{i}"
        self.reward_at[cid] = c.reward_at
        return TrainingSample(
            completion_id=cid,
            sample_index=0,
            agent=_AGENT,
            adapter_version=versions[0],
            prompt_token_ids=[1],
            completion_token_ids=[2] * n,
            logprobs=[-1.0] * n,
            token_versions=versions,
            rewards=[(f"e{i}", "reward", 1.0)],
            targets=[],
            last_seq=i + 1,
            created_at=c.end,
            reward=1.0,
            source="reward",
        )

    def start_step(self, now: float) -> None:
        batch = self.pending.popleft()
        version = len(self.publishes)
        for s in batch:
            self.total.append(sample_staleness(s, version))
            self.architectural.append(version - self.version_at(self.reward_at[s.completion_id]))
            self.lag.append(now - s.created_at)
        self.busy_until = now + self.trainer.overhead_s + self.trainer.per_sample_s * len(batch)

    def try_admit(self, now: float) -> None:
        admitted = [s for s, _ in self.admission.admit(_AGENT, len(self.publishes))]
        if not admitted:
            return
        size = self.policy.minibatch or len(admitted)
        for k in range(0, len(admitted), size):
            self.pending.append(admitted[k : k + size])
        self.start_step(now)

    def run(self) -> StalenessResult:
        completions = _stream(self.stream)
        i = 0
        while i < len(completions) or self.busy_until is not None:
            next_reward = completions[i].reward_at if i < len(completions) else float("inf")
            if self.busy_until is not None and self.busy_until <= next_reward:
                now, self.busy_until = self.busy_until, None
                self.publishes.append(now)
                if self.pending:
                    self.start_step(now)
                else:
                    self.try_admit(now)
                continue
            now = next_reward
            self.admission.offer(_AGENT, [self.sample(i, completions[i])])
            i += 1
            if self.busy_until is None:
                self.try_admit(now)
        return StalenessResult(
            policy=self.policy.name,
            mean_total=statistics.fmean(self.total) if self.total else float("nan"),
            mean_architectural=(
                statistics.fmean(self.architectural) if self.architectural else float("nan")
            ),
            mean_lag_s=statistics.fmean(self.lag) if self.lag else float("nan"),
            trained=len(self.total),
            steps=len(self.publishes),
        )


def simulate(
    stream: FeedbackStream, policy: Policy, trainer: TrainerModel | None = None
) -> StalenessResult:
    """Run `policy` on `stream` until every admitted sample is trained.

    Samples left waiting for a full batch when the stream ends are not counted.
    """
    return _Run(stream, policy, trainer or TrainerModel()).run()


def utilisation(stream: FeedbackStream, trainer: TrainerModel, minibatch: int = 4) -> float:
    """Share of time a trainer taking steps of `minibatch` samples is busy on this stream."""
    step = trainer.overhead_s + trainer.per_sample_s * minibatch
    return stream.rate_per_s * step / minibatch
