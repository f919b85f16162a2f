"""Per-agent replay of labelled examples: what keeps a small, lopsided batch from steering.

Feedback arrives a few samples at a time, and one step's batch may hold one
class only (four tickets that all belonged to `billing`, say); a step on it
alone pulls every answer toward that class, and the next batch pulls toward
another, so versions oscillate. Each step therefore also trains on a few
labelled examples of earlier steps (right answers from corrections and
resolutions, and outputs confirmed as right), drawn uniformly from the last
`capacity` ones, so every step sees the agent's recent mix of cases.

Memory only: after a restart the buffer fills again from new feedback.

Not here: which samples are labelled (`batch`), the loss (`loss`).
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Iterable

from clora_feedback.train.step import SFTSample


class ReplayBuffer:
    """The last `capacity` labelled examples of one agent, sampled without replacement."""

    def __init__(self, capacity: int, *, seed: int = 0):
        self._items: deque[SFTSample] = deque(maxlen=max(capacity, 0))
        self._rng = random.Random(seed)

    def __len__(self) -> int:
        return len(self._items)

    def add(self, examples: Iterable[SFTSample]) -> None:
        """Keep `examples` (the oldest fall out past the capacity)."""
        if self._items.maxlen:
            self._items.extend(examples)

    def sample(self, k: int) -> list[SFTSample]:
        """Up to `k` distinct examples, uniformly at random."""
        k = min(k, len(self._items))
        return self._rng.sample(list(self._items), k) if k > 0 else []
