"""Admission: which rewarded samples enter an agent's next mini-batch, and when.

Early admission (after KnitTrans): a mini-batch is released as soon as its
constraints can be met (at least `min_batch` samples within the staleness
limit, sources balanced) instead of waiting for a fixed full batch, so
samples are trained on while the version that produced them is still
current. `full_batch=True` gives the conventional policy (wait for exactly
`max_batch`), kept as the baseline the benchmark compares against.

Staleness of a sample = active version at admission - the oldest version
that produced any of its tokens. Samples beyond `max_staleness` are dropped
(not down-weighted): the clipped ratio already bounds their influence, and
a sample many versions old mostly carries information the policy has since
absorbed. Drops are counted and exported.

Source balance: when several reward sources are waiting, no source takes
more than `max_source_fraction` of a batch (round-robin across sources), so a
burst of one signal (e.g. accepted-as-is corrections) cannot crowd out the
others. A sample's source is the reward policy's (`TrainingSample.source`).

Not here: where samples come from (`samples`), rewards (`feedback.rewards`).
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field

from clora_feedback.config import AdmissionConfig
from clora_feedback.train.samples import TrainingSample


@dataclass
class AdmissionStats:
    """Counters for /metrics."""

    offered: int = 0
    admitted: int = 0
    dropped_stale: int = 0
    staleness: list[int] = field(default_factory=list)  # of admitted samples, most recent batches


def sample_staleness(sample: TrainingSample, active_version: int) -> int:
    oldest = min(sample.token_versions) if sample.token_versions else sample.adapter_version
    return max(0, active_version - oldest)


class Admission:
    """Per-agent queues of rewarded samples waiting for a step."""

    def __init__(self, config: AdmissionConfig):
        self.config = config
        self._queues: dict[str, deque[TrainingSample]] = defaultdict(deque)
        self.stats: dict[str, AdmissionStats] = defaultdict(AdmissionStats)

    def offer(self, agent: str, samples: list[TrainingSample]) -> None:
        self._queues[agent].extend(samples)
        self.stats[agent].offered += len(samples)

    def pending(self, agent: str) -> int:
        return len(self._queues[agent])

    def discard(self, agent: str) -> int:
        """Forget `agent`'s waiting samples (its trainer state was dropped: another trainer
        took it, or it reloads from the registry); returns how many were dropped."""
        queue = self._queues.pop(agent, None)
        return 0 if queue is None else len(queue)

    def admit(
        self, agent: str, active_version: int, *, force: bool = False
    ) -> list[tuple[TrainingSample, int]]:
        """Release a mini-batch of (sample, staleness) if the constraints allow, else [].

        Args:
            agent: whose queue.
            active_version: the version the step will train from.
            force: release whatever fresh samples there are (time-based trigger).
        """
        cfg = self.config
        queue = self._queues[agent]
        stats = self.stats[agent]
        fresh: list[tuple[TrainingSample, int]] = []
        for sample in queue:
            staleness = sample_staleness(sample, active_version)
            if staleness > cfg.max_staleness:
                stats.dropped_stale += 1
            else:
                fresh.append((sample, staleness))
        queue.clear()
        need = cfg.max_batch if cfg.full_batch else (1 if force else cfg.min_batch)
        if len(fresh) < need:
            queue.extend(s for s, _ in fresh)
            return []
        batch = self._balanced(fresh, cfg.max_batch)
        chosen = {id(s) for s, _ in batch}
        queue.extend(s for s, _ in fresh if id(s) not in chosen)
        stats.admitted += len(batch)
        stats.staleness = (stats.staleness + [st for _, st in batch])[-1000:]
        return batch

    def _balanced(
        self, fresh: list[tuple[TrainingSample, int]], size: int
    ) -> list[tuple[TrainingSample, int]]:
        by_kind: dict[str, deque[tuple[TrainingSample, int]]] = defaultdict(deque)
        for item in fresh:
            by_kind[item[0].source].append(item)
        if len(by_kind) == 1:
            return fresh[:size]
        cap = max(1, int(self.config.max_source_fraction * size))
        taken: dict[str, int] = defaultdict(int)
        out: list[tuple[TrainingSample, int]] = []
        while len(out) < size and any(by_kind.values()):
            progressed = False
            for kind, items in by_kind.items():
                if items and taken[kind] < cap and len(out) < size:
                    out.append(items.popleft())
                    taken[kind] += 1
                    progressed = True
            if not progressed:  # every waiting kind hit its cap: fill from what is left
                cap = size
        return out
