"""Autograd functions of the training pass that do one layer piece in fewer ops.

On a CPU a training step's time outside the big GEMMs is a few hundred
elementwise ops per layer, each a pass over memory; autograd's generic
backward of a composite (RMSNorm is eight ops forwards, more backwards)
makes several more. Each function here computes its piece's forward with the
same values as `clora_feedback.model.decoder` (the reference, checked against
PEFT; `lora_linear` in bf16 rounds its sum once where the composite rounds twice)
and writes its backward by hand, in fewer passes:

- `rms_norm`: HF Llama's RMSNorm (normalise in fp32, round to the compute
  dtype, scale by the frozen weight), input gradient only.
- `swiglu`: silu(gate) * up over the fused gate_up projection's output,
  whose gradient is written straight into one [N, 2I] buffer (no cat).
- `frozen_linear`: a frozen base projection, whose input gradient is
  `gemm.input_gradient` (the faster of one product or two column halves on
  this CPU) instead of autograd's one product.
- `lora_linear`: that projection plus each token segment's LoRA update, added
  in place into the base output; backwards the LoRA's input gradient is added
  into the base one's buffer, where autograd would sum two [N, in] gradients
  in a pass of their own, and a dozen small nodes become one.
- `head_logprobs`: log_softmax(hidden @ head.T)[targets] with fp32 logits,
  whose backward multiplies by the head in the compute dtype: the gradient
  is rounded to bf16 as every other activation gradient is, and the
  [N, V] x [V, hidden] product reads half the bytes at bf16's GEMM rate.

The frozen weights get no gradient (the trainer trains LoRA factors only).
Not here: the layer composition (see `forward`), losses.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import FunctionCtx, once_differentiable

from clora_feedback.model.decoder import gather_logprobs
from clora_feedback.train.gemm import input_gradient


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: FunctionCtx, x: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        x32 = x.float()
        r = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)  # the reference's ops, its values
        normed = torch.mul(x32, r, out=torch.empty_like(x))  # rounded once, as .to(x.dtype)
        ctx.save_for_backward(x, r, weight)
        return weight * normed

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        x, r, weight = ctx.saved_tensors
        # y = w * x * r with r = (mean(x^2) + eps)^-1/2, so with g = grad * w:
        # dx = r * g - x * r^3 * mean(g * x)
        g = (grad * weight).float()
        x32 = x.float()
        dot = torch.linalg.vecdot(g, x32, dim=-1).unsqueeze(-1)
        coef = dot.mul_(r.pow(3)).div_(-x.shape[-1])
        dx = torch.addcmul(g.mul_(r), x32, coef)
        return dx.to(x.dtype), None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`model.decoder.rms_norm`'s values; the gradient reaches `x` only (weight frozen)."""
    return _RMSNorm.apply(x, weight, eps)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        act = F.silu(gate)
        ctx.save_for_backward(gate_up, act)
        return act * up

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        gate_up, act = ctx.saved_tensors
        gate, up = gate_up.chunk(2, dim=-1)
        out = torch.empty_like(gate_up)
        d_gate, d_up = out.chunk(2, dim=-1)
        torch.mul(grad, act, out=d_up)
        torch.ops.aten.silu_backward.grad_input(grad * up, gate, grad_input=d_gate)
        return out


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [N, 2I] (gate then up) -> silu(gate) * up [N, I]."""
    return _SwiGLU.apply(gate_up)


class _FrozenLinear(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: FunctionCtx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        ctx.save_for_backward(weight)
        return F.linear(x, weight, bias)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (weight,) = ctx.saved_tensors
        return input_gradient(grad, weight), None, None


def frozen_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` with a frozen weight and bias: the gradient reaches `x`
    only (x [N, in], weight [out, in])."""
    if not (torch.is_grad_enabled() and x.requires_grad):
        return F.linear(x, weight, bias)
    return _FrozenLinear.apply(x, weight, bias)


LoRAPiece = tuple[int, torch.Tensor, torch.Tensor] | tuple[int, None, None]
"""(tokens, A [r, in], B^T [r, out]) of one segment of the token stream, in order; None
factors for a segment whose agent has no LoRA on this projection."""


class _LoRALinear(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: FunctionCtx,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        sizes: list[int],
        *factors: torch.Tensor | None,
    ) -> torch.Tensor:
        y = F.linear(x, weight, bias)
        downs: list[torch.Tensor | None] = []  # each segment's x A^T [n, r] (None: no LoRA)
        for xs, ys, a, bt in zip(
            x.split(sizes), y.split(sizes), factors[0::2], factors[1::2], strict=True
        ):
            if a is None or bt is None:
                downs.append(None)
                continue
            xa = xs @ a.t()
            ys.addmm_(xa, bt)
            downs.append(xa)
        ctx.save_for_backward(x, weight, *factors, *downs)  # type: ignore[arg-type]  # None is kept
        ctx.sizes = sizes  # type: ignore[attr-defined]
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, *rest = ctx.saved_tensors
        k = len(ctx.sizes)
        factors, downs = rest[: 2 * k], rest[2 * k :]
        want_x = ctx.needs_input_grad[0]
        dx = input_gradient(grad, weight) if want_x else None
        d_factors: list[torch.Tensor | None] = []
        parts = zip(
            grad.split(ctx.sizes),
            x.split(ctx.sizes),
            dx.split(ctx.sizes) if dx is not None else [None] * k,
            factors[0::2],
            factors[1::2],
            downs,
            strict=True,
        )
        wanted = ctx.needs_input_grad[4:]  # (A, B^T) of each segment
        for j, (gs, xs, dxs, a, bt, xa) in enumerate(parts):
            want_a, want_bt = wanted[2 * j], wanted[2 * j + 1]
            if a is None or bt is None or xa is None:
                d_factors += [None, None]
                continue
            d_xa = gs @ bt.t() if dxs is not None or want_a else None  # [n, r]
            if dxs is not None and d_xa is not None:
                dxs.addmm_(d_xa, a)  # the LoRA's share of dx, into the base share's buffer
            d_factors += [
                d_xa.t() @ xs if want_a and d_xa is not None else None,
                xa.t() @ gs if want_bt else None,
            ]
        return (dx, None, None, None, *d_factors)


def lora_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, pieces: list[LoRAPiece]
) -> torch.Tensor:
    """x [N, in] -> x @ weight.T + bias plus each segment's (x_s A^T) B^T, [N, out].

    The frozen weight and bias get no gradient; x, each A and each B^T do. The input
    gradient of the frozen part is `gemm.input_gradient`'s, as in `frozen_linear`.
    """
    sizes = [n for n, _, _ in pieces]
    factors = [t for _, a, bt in pieces for t in (a, bt)]
    return _LoRALinear.apply(x, weight, bias, sizes, *factors)


class _HeadLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: FunctionCtx,
        hidden: torch.Tensor,
        head: torch.Tensor,
        head_compute: torch.Tensor,
        targets: torch.Tensor,
        chunk: int,
    ) -> torch.Tensor:
        outs, saved = [], []
        for part, wanted in zip(hidden.split(chunk), targets.split(chunk), strict=True):
            lp = torch.log_softmax(part @ head.t(), dim=-1)
            outs.append(lp.gather(1, wanted.unsqueeze(1)).squeeze(1))
            saved.append(lp)
        ctx.save_for_backward(head_compute, targets, *saved)
        ctx.chunk = chunk  # type: ignore[attr-defined]
        return torch.cat(outs)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        head_compute, targets, *saved = ctx.saved_tensors
        parts = []
        for lp, wanted, g in zip(
            saved, targets.split(ctx.chunk), grad.split(ctx.chunk), strict=True
        ):
            # d lp[t] / d logits = onehot(t) - softmax
            d_logits = lp.exp().mul_(-g.unsqueeze(1))
            d_logits.scatter_add_(1, wanted.unsqueeze(1), g.unsqueeze(1))
            parts.append((d_logits.to(head_compute.dtype) @ head_compute).to(grad.dtype))
        return torch.cat(parts), None, None, None, None


def head_logprobs(
    hidden: torch.Tensor,
    head: torch.Tensor,
    head_compute: torch.Tensor,
    targets: torch.Tensor,
    chunk: int = 512,
) -> torch.Tensor:
    """log_softmax(hidden @ head.T)[targets] -> [N] fp32, in chunks of `chunk` rows.

    Args:
        hidden: [N, hidden] fp32 final-norm states.
        head: [V, hidden] the fp32 vocabulary projection (the forward's logits).
        head_compute: the same weights in the compute dtype (the backward's product).
        targets: [N] token ids.

    Without a gradient to compute (the reference pass, evaluation) it is the reference
    `gather_logprobs`, which keeps one chunk's logits at a time instead of every chunk's
    log-softmax for a backward.
    """
    if not (torch.is_grad_enabled() and hidden.requires_grad):
        return gather_logprobs(hidden, head, targets, chunk)
    return _HeadLogprobs.apply(hidden, head, head_compute, targets, chunk)
