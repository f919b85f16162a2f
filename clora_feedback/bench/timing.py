"""The one timing rule the profile scripts share: the best of a few wall-clock runs.

Not here: what is timed (the benchmarks and `scripts/`), how it is reported (`report`).
"""

from __future__ import annotations

import time
from collections.abc import Callable


def best_wall_s(fn: Callable[[], object], reps: int) -> float:
    """The minimum wall seconds of `reps` calls of `fn`, after one untimed warm-up call."""
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best
