"""The input gradient of a frozen projection, computed the faster of two ways on this CPU.

Backwards, a frozen projection y = x @ W.T (W [out, in], no weight gradient)
needs one product, dx = dy @ W. The CPU library picks its blocking and its
split across threads from the shape alone, and for some shapes that split
leaves threads idle: on a 2-core Xeon with AMX, oneDNN's bf16 matmul
computes gate_up's input gradient, [rows, 3072] @ [3072, 576], about as fast
on two threads as on one past a few hundred rows, while the column halves of
the same product use both (`python -m benchmarks.fused_pass` reports the step
with and without this choice). Which way is faster depends on the library, the CPU,
the dtype and the thread count, so `input_gradient` times both ways on the
first product of each shape class (rows rounded up to `ROWS_CLASS`) and keeps
the faster for the process: one product, or the two column halves of dx as
two products over strided views of W (no copy of the weight), joined by one cat.

Not here: which projections are frozen (see `fused.frozen_linear`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

ROWS_CLASS = 32
"""Row counts are timed in classes of this many rows (rounded up)."""

MIN_HALF_COLUMNS = 64
"""Narrowest half (of the input width) worth a product of its own."""

MIN_MACS = 1 << 28
"""Multiply-adds below which one product is used untimed (the split cannot pay off)."""

TIMED_REPS = 2
"""Timed runs of each way (alternated, after one untimed run each); the best of them counts."""

MARGIN = 0.9
"""Halves are kept only when at most this fraction of one product's time."""

Key = tuple[torch.dtype, int, int, int, int]
"""(dtype, torch threads, rows class, out, in): what the library's choice depends on."""

_halves_faster: dict[Key, bool] = {}


def input_gradient(grad: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """dx = grad @ weight for a frozen projection: grad [rows, out], weight [out, in] -> [rows, in].

    The same values as `grad @ weight` up to the order of the library's
    accumulation (each output column's reduction is over all of `out` either way),
    so in bf16 two processes that chose differently may differ in the last bit. The
    first product of a shape class also times both ways (a few products more); the
    choice stands for the process (`forget_choices` to time again), so a timing
    skewed by a burst of other work keeps a slower way until then.
    """
    rows, (out, inp) = grad.shape[0], weight.shape
    if grad.device.type != "cpu" or inp < 2 * MIN_HALF_COLUMNS or rows * out * inp < MIN_MACS:
        return grad @ weight
    key = (grad.dtype, torch.get_num_threads(), -(-rows // ROWS_CLASS) * ROWS_CLASS, out, inp)
    halves = _halves_faster.get(key)
    if halves is None:
        halves = _halves_faster[key] = halves_are_faster(grad, weight)
    return _by_halves(grad, weight) if halves else grad @ weight


def _by_halves(grad: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    half = weight.shape[1] // 2
    return torch.cat([grad @ weight[:, :half], grad @ weight[:, half:]], dim=1)


def halves_are_faster(grad: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether two column-half products beat one for grad @ weight, timed now."""
    return second_is_faster(lambda: grad @ weight, lambda: _by_halves(grad, weight))


def second_is_faster(first: Callable[[], object], second: Callable[[], object]) -> bool:
    """Whether `second` takes at most `MARGIN` of `first`'s time: each run once untimed
    (a library builds its kernel for a new shape on the first call), then `TIMED_REPS`
    times alternated, the best run of each compared."""
    ways = (first, second)
    best = [float("inf")] * len(ways)
    for way in ways:
        way()
    for _ in range(TIMED_REPS):
        for i, way in enumerate(ways):
            t0 = time.perf_counter()
            way()
            best[i] = min(best[i], time.perf_counter() - t0)
    return best[1] <= MARGIN * best[0]


def forget_choices() -> None:
    """Time every shape class again on its next product (after the thread count or the
    machine's load changed for good, and in tests)."""
    _halves_faster.clear()
