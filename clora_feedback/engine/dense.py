"""Dense matmul kernels for serving: how each base weight multiplies a few rows fast.

`DenseKernels.build` picks, per dtype and device, a callable per weight that
computes `x @ W.T` with the semantics of `F.linear` but a faster CPU path
where one exists (measurements in docs/benchmarks.md): MKL's own GEMM repacks
the whole weight on every small-batch call, so on a CPU with oneDNN each
weight is packed once into oneDNN's blocked layout (fp32, and bf16 where
oneDNN has a bf16 path); without oneDNN, 4..15 fp32 rows are multiplied by
64-row blocks of W as one batched matmul; bf16 weights on a CPU without a
oneDNN bf16 path are multiplied as (packed) fp32 copies except for 1..2 rows
(bf16 GEMV reads half the bytes). Inference only (no autograd).

Not here: the model (see `model`), LoRA (see `clora_feedback.lora.ops`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F


class DenseKernels:
    """How the serving fast path multiplies by each base weight (inference only).

    `layers[i][group](x)` computes x [N, in] @ W.T for the layer's weight
    W [out, in], `lm_head(x)` the vocabulary projection, both taking and
    returning `compute_dtype` (the weights' dtype, except for `upcast`: fp32). The caller keeps the
    plain weights (for the differentiable path); a kernel may hold another
    copy in a layout the CPU multiplies faster (see `build`).
    """

    def __init__(
        self,
        layers: list[dict[str, Linear]],
        lm_head: Linear,
        name: str,
        compute_dtype: torch.dtype,
    ):
        self.layers = layers
        self.lm_head = lm_head
        self.name = name
        self.compute_dtype = compute_dtype

    @classmethod
    def build(
        cls, layers: list[dict[str, torch.Tensor]], lm_head: torch.Tensor, kernel: str = "auto"
    ) -> DenseKernels:
        """Pick the kernel for these weights' dtype and device.

        - `packed` (fp32 on a CPU with oneDNN; bf16 where oneDNN has a bf16
          path): each weight pre-packed once into oneDNN's blocked layout (a
          second copy in memory). fp32 on this AVX2 CPU: 1.1-2.6x the `blocked`
          kernel from 1 to 48 rows (decode and prefill); bf16: ~1.5x `F.linear`.
        - `blocked` (fp32 on CPU without oneDNN): no copy; for 4..15 rows the
          product runs as one batched matmul over 64-row blocks of W, which MKL
          streams ~1.5x (lm_head ~2.4x) faster than its small-M GEMM; other
          sizes use `F.linear`.
        - `upcast` (bf16/fp16 on a CPU where `packed` bf16 cannot run, e.g. AVX2
          only): there a bf16 GEMM of 4+ rows converts on every call and runs at
          about half the fp32 speed, so each weight keeps an fp32 copy of its
          (exactly representable) values, multiplied as `packed` fp32 (or
          `blocked` without oneDNN): fp32 in and out (the caller casts around
          the projection). A second copy in memory.
          1..2 bf16 rows (`_REDUCED_ROWS`) are multiplied by the bf16 weight
          itself: torch's bf16 GEMV accumulates in fp32 and reads half the bytes
          (1.6-1.9x the packed fp32 copy at 1 row on the model's shapes,
          1.1-1.7x at 2, about even at 3; docs/benchmarks.md). The product is
          rounded to bf16, as `packed`'s is.
        - `linear`: `F.linear` on the plain weights (CUDA, other dtypes).

        A non-plain kernel is checked against `F.linear` on the first weight and
        replaced if it disagrees or fails: fp32 `packed` by `blocked`, anything
        else by `linear` (so a forced bf16 `packed` where `packed_supported` is
        false reports `linear`).
        """
        dtype, cpu = lm_head.dtype, lm_head.device.type == "cpu"
        if kernel == "auto":
            kernel = "linear"
            if packed_supported(dtype, lm_head.device):
                kernel = "packed"
            elif cpu and dtype == torch.float32:
                kernel = "blocked"
            elif cpu and dtype in (torch.bfloat16, torch.float16):
                kernel = "upcast"
        make = {"packed": _packed, "blocked": _blocked, "upcast": _upcast, "linear": _plain}[kernel]
        try:
            built = cls(
                [{g: make(w) for g, w in layer.items()} for layer in layers],
                make(lm_head),
                kernel,
                torch.float32 if kernel == "upcast" else lm_head.dtype,
            )
            first = next(iter(layers[0]))
            if kernel == "linear" or _agrees(
                built.layers[0][first], layers[0][first], built.compute_dtype
            ):
                return built
        except RuntimeError:
            pass
        fallback = "blocked" if kernel == "packed" and cpu and dtype == torch.float32 else "linear"
        return cls.build(layers, lm_head, fallback)


Linear = Callable[[torch.Tensor], torch.Tensor]


def _plain(w: torch.Tensor) -> Linear:
    return functools.partial(F.linear, weight=w)


_BLOCK_ROWS = 64
_BLOCKED_BATCH = range(4, 16)  # where MKL's own small-M GEMM is slowest (measured)


def _blocked(w: torch.Tensor) -> Linear:
    out, fan_in = w.shape
    if out % _BLOCK_ROWS:
        return _plain(w)
    blocks = w.view(out // _BLOCK_ROWS, _BLOCK_ROWS, fan_in).transpose(1, 2)  # [C, in, 64]

    def linear(x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        if x.dim() != 2 or n not in _BLOCKED_BATCH:
            return F.linear(x, w)
        # [C, n, in] (a stride-0 view) @ [C, in, 64] -> [C, n, 64] -> [n, out]
        y = torch.bmm(x.expand(blocks.shape[0], n, fan_in), blocks)
        return y.transpose(0, 1).reshape(n, out)

    return linear


# Rows for which `upcast` multiplies by the bf16 weight itself (see `DenseKernels.build`).
# Measured on the model's shapes with cold caches (AVX2, 2 threads): bf16 F.linear beats
# the oneDNN-packed fp32 copy at 1..2 rows for every shape, ties at 3 and loses from 4 on.
# (Against the older `blocked` fp32 path it won up to 3 rows.)
_REDUCED_ROWS = range(1, 3)


class _Upcast:
    """`upcast` for one weight: x [N, in] or [in] fp32 -> fp32, by the bf16 weight or its fp32 copy.

    `reduced_rows` (the row counts multiplied by the bf16 weight) is fixed at
    build from the dtype, a rule and not a per-call timing: `_REDUCED_ROWS`
    for bf16, none for fp16 (not measured). A 1-D x is one row.
    """

    def __init__(self, w: torch.Tensor):
        self.weight = w
        self.reduced_rows = _REDUCED_ROWS if w.dtype == torch.bfloat16 else range(0)
        self.fp32 = fp32_kernel(w.float())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() <= 2 and (x.shape[0] if x.dim() == 2 else 1) in self.reduced_rows:
            # x came from the bf16 residual stream, so the cast back is exact.
            return F.linear(x.to(self.weight.dtype), self.weight).float()
        return self.fp32(x)


def _upcast(w: torch.Tensor) -> Linear:
    return _Upcast(w)


def packed_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the `packed` kernel can run here: fp32 or bf16 on a CPU with oneDNN.

    A CPU-feature probe, not a timing one, so the choice is the same on every
    run of one machine. fp32 needs only oneDNN's linear ops (any x86 CPU);
    oneDNN's bf16 weight reorder needs AVX512-BW/VL/DQ or AVX-NE-CONVERT, and
    on a plain AVX2 CPU bf16 is not supported (`upcast` is used).
    """
    if dtype not in _PACK_BATCH or device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    ops = torch.ops.mkldnn
    if not (hasattr(ops, "_linear_pointwise") and hasattr(ops, "_reorder_linear_weight")):
        return False
    if dtype == torch.float32:
        return True
    probe = getattr(ops, "_is_mkldnn_bf16_supported", None)
    return bool(probe()) if probe is not None else True


# The batch size oneDNN picks its packed layout for. fp32: 8 rows, the best single
# choice measured here from 1 to 48 rows (docs/benchmarks.md); bf16: 1 (not measured
# on this AVX2 CPU, which has no oneDNN bf16 path).
_PACK_BATCH = {torch.float32: 8, torch.bfloat16: 1}


def fp32_kernel(w: torch.Tensor) -> Linear:
    """The fastest fp32 kernel for `w` here: `packed` with oneDNN, else `blocked`."""
    return _packed(w) if packed_supported(torch.float32, w.device) else _blocked(w)


def _packed(w: torch.Tensor, batch: int | None = None) -> Linear:
    """`w` reordered once for oneDNN, laid out for `batch` rows (default: `_PACK_BATCH`)."""
    hint = _PACK_BATCH.get(w.dtype, 1) if batch is None else batch
    blocked = torch.ops.mkldnn._reorder_linear_weight(w, hint)
    pointwise = torch.ops.mkldnn._linear_pointwise

    def linear(x: torch.Tensor) -> torch.Tensor:
        return pointwise(x, blocked, None, "none", [], "")

    return linear


def _agrees(kernel: Linear, w: torch.Tensor, compute_dtype: torch.dtype) -> bool:
    """Whether `kernel` computes F.linear by `w` for 1 and 5 rows (both `upcast` paths)."""
    x = torch.randn(5, w.shape[1], generator=torch.Generator().manual_seed(0)).to(w.dtype)
    with torch.inference_mode():
        for rows in (x[:1], x):
            want = F.linear(rows.float(), w.float())
            got = kernel(rows.to(compute_dtype)).float()
            tol = 2e-2 * float(want.abs().max())
            if not torch.allclose(got, want, rtol=2e-2, atol=tol):
                return False
    return True
