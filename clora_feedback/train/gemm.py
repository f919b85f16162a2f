"""The input gradient of a frozen projection, computed the faster of two ways on this CPU.

Backwards, a frozen projection y = x @ W.T (W [out, in], no weight gradient)
needs one product, dx = dy @ W. The CPU library picks its blocking and its
split across threads from the shape alone, and for some shapes that split
leaves threads idle: oneDNN's bf16 matmul (AMX) computes gate_up's input
gradient, [rows, 3072] @ [3072, 576], on one thread from about 342 rows on,
while the same product at 336 rows, and its column halves at any row count,
use every thread (`python -m benchmarks.fused_pass` reports the step with and
without this choice). Which way is faster depends on the library, the CPU,
the dtype and the thread count, so `input_gradient` times both ways once per
shape class (rows rounded up to `ROWS_CLASS`) on tensors of that shape and
keeps the faster: one product, or the two column halves of dx as two products
over strided views of W (no copy of the weight), joined by one cat.

Not here: which projections are frozen (see `fused.frozen_linear`).
"""

from __future__ import annotations

import time
from functools import cache

import torch

ROWS_CLASS = 32
"""Row counts are timed in classes of this many rows (rounded up)."""

MIN_MACS = 1 << 26
"""Multiply-adds below which one product is used untimed (the split cannot pay off)."""

TIMED_REPS = 3
"""Timed runs of each way (alternated, after one untimed run each); the best of them counts."""

MARGIN = 0.9
"""Halves are kept only when at most this fraction of one product's time."""


def input_gradient(grad: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """dx = grad @ weight for a frozen projection: grad [rows, out], weight [out, in] -> [rows, in].

    The same values as `grad @ weight` up to the order of the library's
    accumulation (each output column's reduction is over all of `out` either way).
    """
    rows, (out, inp) = grad.shape[0], weight.shape
    if grad.device.type != "cpu" or inp < 2 * ROWS_CLASS or rows * out * inp < MIN_MACS:
        return grad @ weight
    rows_class = -(-rows // ROWS_CLASS) * ROWS_CLASS
    if halves_are_faster(grad.dtype, torch.get_num_threads(), rows_class, out, inp):
        return _by_halves(grad, weight)
    return grad @ weight


def _by_halves(grad: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    half = weight.shape[1] // 2
    return torch.cat([grad @ weight[:, :half], grad @ weight[:, half:]], dim=1)


@cache
def halves_are_faster(dtype: torch.dtype, threads: int, rows: int, out: int, inp: int) -> bool:
    """Whether two column-half products beat one for [rows, out] @ [out, inp] in `dtype`,
    timed now on random tensors (`threads` is torch's current thread count: part of the
    key, since the library splits work by it)."""
    gen = torch.Generator().manual_seed(0)
    grad = torch.randn(rows, out, generator=gen).to(dtype)
    weight = torch.randn(out, inp, generator=gen).to(dtype)
    ways = (lambda: grad @ weight, lambda: _by_halves(grad, weight))
    best = [float("inf")] * len(ways)
    for way in ways:
        way()
    for _ in range(TIMED_REPS):
        for i, way in enumerate(ways):
            t0 = time.perf_counter()
            way()
            best[i] = min(best[i], time.perf_counter() - t0)
    return best[1] <= MARGIN * best[0]
