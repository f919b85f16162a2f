"""`python -m benchmarks.attention`: the training pass's attention, one layer, by the ways
the pass can take.

`clora_feedback.train.forward._Stream.attend` attends rows without a shared prefix
(and, past the one function's limit, a prefix), in a reduced compute dtype on a
CPU, by `forward.causal_attention` (plain bf16 matmuls) up to
`PLAIN_ATTENTION_MAX_LEN` positions and by torch's flash attention in fp32 beyond
(torch's CPU flash backward is slower in bf16 than in fp32). This
times one layer's attention, forward and backward, at SmolLM2-135M's heads (9
query heads over 3 kv heads of 64) for each `--shapes` entry (rows x positions),
alternated per repetition: `plain bf16` (`causal_attention`), `flash via fp32`
(bf16 inputs cast to fp32, flash, cast back: what the pass did before) and
`flash bf16` (torch's kernel on the bf16 inputs). Reported: the median
milliseconds per shape and way, and flash via fp32 / plain bf16 per shape (above
1: plain is faster).

Then the whole stream of a pass with a shared prefix (`--streams`: R prefix copies
of P tokens, then B rows of W own tokens, one run of rows per copy), in fp32 and
bf16: `one function` (`attention.stream_attention`, what a pass on a CPU uses up to
its limits) against `composites` (the prefix by `causal_attention` in bf16 or flash
in fp32, the rows by `forward.prefixed_attention`: what a pass did before, and does
past the limit), alternated per repetition; reported as composites / one function
per stream and dtype. Prints the CPU model and flags. Not a test: nothing asserts.

Not here: a whole step (`python -m benchmarks.precision`, `benchmarks.fused_pass`).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.shapes import finish, print_medians
from clora_feedback.train.forward import _Stream, causal_attention

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _flash_via_fp32(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    out = F.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), is_causal=True, enable_gqa=True
    )
    return out.to(q.dtype)


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


WAYS: dict[str, Attention] = {
    "plain bf16": causal_attention,
    "flash via fp32": _flash_via_fp32,
    "flash bf16": _flash,
}


def _shape(text: str) -> tuple[int, int]:
    rows, _, length = text.partition("x")
    return int(rows), int(length)


STREAM_WAYS = ("one function", "composites")


def _stream(text: str) -> tuple[int, int, int, int]:
    prefix, _, rows = text.partition("+")
    copies, _, length = prefix.partition("x")
    b, _, w = rows.partition("x")
    return int(copies), int(length), int(b), int(w)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--shapes",
        type=lambda text: [_shape(s) for s in text.split(",")],
        default=[(1, 141), (8, 26), (8, 170), (2, 300), (1, 400), (1, 600)],
        help="rows x positions, comma-separated (default: 1x141,8x26,8x170,2x300,1x400,1x600).",
    )
    p.add_argument(
        "--streams",
        type=lambda text: [_stream(s) for s in text.split(",")],
        default=[
            (1, 141, 8, 26),
            (2, 141, 8, 26),
            (1, 200, 8, 26),
            (1, 256, 8, 26),
            (1, 300, 4, 64),
        ],
        help="prefix copies x prefix tokens + rows x row tokens, comma-separated (default: "
        "1x141+8x26,2x141+8x26,1x200+8x26,1x256+8x26,1x300+4x64; the rows split evenly "
        "over the copies).",
    )
    p.add_argument("--reps", type=int, default=20, help="Timed repetitions per shape and way.")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all).")
    p.add_argument("--json", type=Path, default=None, help="Also write the figures here.")
    return p


def _seconds(way: Attention, rows: int, length: int, gen: torch.Generator) -> float:
    """One forward and backward of `way` on fresh bf16 inputs of the shape."""

    def leaf(heads: int) -> torch.Tensor:
        x = torch.randn(rows, heads, length, HEAD_DIM, generator=gen).bfloat16()
        return x.requires_grad_(True)

    q, k, v = leaf(HEADS), leaf(KV_HEADS), leaf(KV_HEADS)
    grad = torch.randn(rows, HEADS, length, HEAD_DIM, generator=gen).bfloat16()
    t0 = time.perf_counter()
    way(q, k, v).backward(grad)
    return time.perf_counter() - t0


def _alternate(
    ways: Sequence[str],
    reps: int,
    seconds_of: Callable[[str], float],
    label: str,
    into: dict[str, list[float]],
) -> None:
    """Time each way once untimed (kernels built, buffers touched), then `reps` times,
    the order reversed every other repetition; seconds land under "label, way"."""
    for way in ways:
        seconds_of(way)
    for rep in range(reps):
        for way in ways if rep % 2 == 0 else ways[::-1]:
            into.setdefault(f"{label}, {way}", []).append(seconds_of(way))


def measure(args: argparse.Namespace) -> dict[str, list[float]]:
    """Seconds per (shape, way), the ways alternated per repetition after one warm-up each."""
    gen = torch.Generator().manual_seed(0)
    seconds: dict[str, list[float]] = {}
    for rows, length in args.shapes:
        _alternate(
            list(WAYS),
            args.reps,
            lambda way: _seconds(WAYS[way], rows, length, gen),  # noqa: B023  (called at once)
            f"{rows}x{length}",
            seconds,
        )
    return seconds


def _stream_seconds(
    way: str, shape: tuple[int, int, int, int], dtype: torch.dtype, gen: torch.Generator
) -> float:
    """One forward and backward of a stream's attention on fresh inputs."""
    copies, prefix, rows, width = shape
    per_run = rows // copies
    runs = [(i, i * per_run, rows if i == copies - 1 else (i + 1) * per_run) for i in range(copies)]
    stream = _Stream.build(torch.zeros(rows, prefix + width, dtype=torch.long), prefix, runs)
    n = stream.tokens.shape[0]
    qk = torch.randn(n, HEADS + KV_HEADS, HEAD_DIM, generator=gen).to(dtype).requires_grad_(True)
    v = torch.randn(n, KV_HEADS * HEAD_DIM, generator=gen).to(dtype).requires_grad_(True)
    grad = torch.randn(n, HEADS * HEAD_DIM, generator=gen).to(dtype)
    t0 = time.perf_counter()
    stream.attend(qk, v, HEADS, one_function=way == "one function").backward(grad)
    return time.perf_counter() - t0


def _stream_key(shape: tuple[int, int, int, int], dtype: torch.dtype) -> str:
    copies, prefix, rows, width = shape
    return f"{copies}x{prefix}+{rows}x{width} {str(dtype).removeprefix('torch.')}"


def measure_streams(args: argparse.Namespace) -> dict[str, list[float]]:
    """Seconds per (stream, dtype, way), alternated per repetition after one warm-up each."""
    gen = torch.Generator().manual_seed(1)
    seconds: dict[str, list[float]] = {}
    for shape in args.streams:
        for dtype in (torch.float32, torch.bfloat16):
            _alternate(
                STREAM_WAYS,
                args.reps,
                lambda way: _stream_seconds(way, shape, dtype, gen),  # noqa: B023  (called at once)
                _stream_key(shape, dtype),
                seconds,
            )
    return seconds


def run(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    seconds = measure(args)
    median = print_medians(seconds, "shape, way (forward + backward)", unit="ms")
    ratios = {
        f"{rows}x{length}: flash via fp32 / plain bf16": median[f"{rows}x{length}, flash via fp32"]
        / median[f"{rows}x{length}, plain bf16"]
        for rows, length in args.shapes
    }
    streams = measure_streams(args)
    median = print_medians(streams, "stream, dtype, way (forward + backward)", unit="ms")
    for shape in args.streams:
        for dtype in (torch.float32, torch.bfloat16):
            key = _stream_key(shape, dtype)
            ratios[f"{key}: composites / one function"] = (
                median[f"{key}, composites"] / median[f"{key}, one function"]
            )
    return finish(args, ratios, {"seconds": seconds, "streams": streams})


if __name__ == "__main__":
    sys.exit(run())
