"""The training pass's attention over a stream with a shared prefix, forward and backward by hand.

`forward._Stream` lays a pass's tokens out as one stream: R copies of a shared
prompt prefix (P tokens, one copy per agent run), then B rows of `width` own
tokens each. Each prefix copy attends causally to itself; each row attends to
its run's prefix copy and causally to its own tokens. Written as composites of
batched matmuls, autograd's backward of that is some hundred small ops a layer
(the transposes of every view, the splits and cats of the two score blocks);
`stream_attention` is one autograd function instead (3 autograd nodes a layer
where the composites make 60-100): the head-major copies of queries, keys and
values it needs are made once, the queries scaled as they are copied (exact
for a power-of-two scale such as head dim 64's; otherwise one rounding, as
`forward.prefixed_attention` has); each score block is one batched matmul with
its causal mask as an added bias; each softmax covers a whole block; and its
backward writes the query, key and value gradients straight into the stream's
layout.

Query heads that share a kv head (grouped-query attention, g = heads / kv) are
stacked as rows of one matmul: head-major tensors are [kv, g * positions, D].
Softmaxes compute in fp32 inside whatever the dtype (torch's CPU kernels do);
the matmuls run in the input dtype. Values and gradients match
`F.scaled_dot_product_attention` over each row's keys with the mask spelled
out (`tests/test_train_attention.py`).

Not here: which layout a pass uses and when (`forward._Stream.attend`), RoPE.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.autograd.function import FunctionCtx, once_differentiable

PLAIN_ATTENTION_MAX_LEN = 384
"""Longest prefix (or, without one, row) a reduced compute dtype on a CPU attends by plain
matmuls (`forward._Stream.attend`): from 400-600 positions on torch's flash attention in
fp32 is as fast or faster (`python -m benchmarks.attention`), and its memory stays linear
in the length where plain scores grow with its square. Causal biases up to this length are
kept between calls."""


def causal_bias(w: int, g: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[g*w, w] additive mask: 0 where query position (row % w) may see the key, else -inf.
    Kept for lengths up to `PLAIN_ATTENTION_MAX_LEN` (every layer of a pass reads the same one);
    built per call past it, where one would weigh tens of MB."""
    if w <= PLAIN_ATTENTION_MAX_LEN:
        return _kept_causal_bias(w, g, dtype, device)
    return _build_causal_bias(w, g, dtype, device)


def _build_causal_bias(w: int, g: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    future = torch.ones(w, w, dtype=torch.bool, device=device).triu(1)
    zeros = torch.zeros(w, w, dtype=dtype, device=device)
    return zeros.masked_fill(future, float("-inf")).repeat(g, 1)


_kept_causal_bias = functools.lru_cache(maxsize=16)(_build_causal_bias)


class _StreamAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: FunctionCtx,
        qk: torch.Tensor,
        v: torch.Tensor,
        heads: int,
        copies: int,
        prefix: int,
        run_rows: list[int],
    ) -> torch.Tensor:
        n, kv, d = qk.shape[0], qk.shape[1] - heads, qk.shape[2]
        g, rp, b = heads // kv, copies * prefix, sum(run_rows)
        w = (n - rp) // b
        p, scale, dtype, dev = prefix, d**-0.5, qk.dtype, qk.device
        v = v.reshape(n, kv, d)
        # head-major copies, queries scaled on the way: prefix [R, K, g, P, D], rows [K, B, g, w, D]
        qk_p, qk_r = qk[:rp].view(copies, p, heads + kv, d), qk[rp:].view(b, w, heads + kv, d)
        q_p = torch.empty(copies, kv, g, p, d, dtype=dtype, device=dev)
        torch.mul(
            qk_p[:, :, :heads].view(copies, p, kv, g, d).permute(0, 2, 3, 1, 4), scale, out=q_p
        )
        k_p = qk_p[:, :, heads:].permute(0, 2, 1, 3).contiguous()  # [R, K, P, D]
        v_p = v[:rp].view(copies, p, kv, d).permute(0, 2, 1, 3).contiguous()
        q_r = torch.empty(kv, b, g, w, d, dtype=dtype, device=dev)
        torch.mul(qk_r[:, :, :heads].view(b, w, kv, g, d).permute(2, 0, 3, 1, 4), scale, out=q_r)
        k_r = qk_r[:, :, heads:].permute(2, 0, 1, 3).contiguous()  # [K, B, w, D]
        v_r = v[rp:].view(b, w, kv, d).permute(2, 0, 1, 3).contiguous()
        out = torch.empty(n, heads * d, dtype=dtype, device=dev)

        # the prefix copies, causal: [R*K, g*P, P]
        scores = torch.baddbmm(
            causal_bias(p, g, dtype, dev),
            q_p.view(copies * kv, g * p, d),
            k_p.view(copies * kv, p, d).transpose(1, 2),
        )
        probs_p = torch.softmax(scores, dim=-1)
        o_p = torch.bmm(probs_p, v_p.view(copies * kv, p, d))
        out[:rp].view(copies, p, kv, g, d).copy_(
            o_p.view(copies, kv, g, p, d).permute(0, 3, 1, 2, 4)
        )

        # the rows: one softmax over [their run's prefix | their own tokens, causal]
        own = torch.baddbmm(
            causal_bias(w, g, dtype, dev),
            q_r.view(kv * b, g * w, d),
            k_r.view(kv * b, w, d).transpose(1, 2),
        ).view(kv, b, g * w, w)
        pre = [  # [K, n_run, g*w, P] per run: every row of the run in one matmul
            torch.bmm(q_run.reshape(kv, -1, d), k_p[i].transpose(1, 2)).view(kv, -1, g * w, p)
            for i, q_run in enumerate(q_r.split(run_rows, dim=1))
        ]
        probs_r = torch.softmax(torch.cat([_cat_runs(pre), own], dim=-1), dim=-1)
        probs_pre, probs_own = probs_r.split([p, w], dim=-1)
        o_r = torch.bmm(probs_own.reshape(kv * b, g * w, w), v_r.view(kv * b, w, d))
        o_r = o_r.view(kv, b, g * w, d)
        for i, (o_run, p_run) in enumerate(
            zip(o_r.split(run_rows, dim=1), probs_pre.split(run_rows, dim=1), strict=True)
        ):
            o_run.view(kv, -1, d).baddbmm_(p_run.reshape(kv, -1, p), v_p[i])
        out[rp:].view(b, w, kv, g, d).copy_(o_r.view(kv, b, g, w, d).permute(1, 3, 0, 2, 4))

        ctx.save_for_backward(q_p, k_p, v_p, probs_p, q_r, k_r, v_r, probs_r)
        ctx.shape = (heads, kv, d, copies, p, b, w, run_rows)  # type: ignore[attr-defined]
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q_p, k_p, v_p, probs_p, q_r, k_r, v_r, probs_r = ctx.saved_tensors
        heads, kv, d, copies, p, b, w, run_rows = ctx.shape
        g, rp, n = heads // kv, copies * p, grad.shape[0]
        dtype, dev = grad.dtype, grad.device
        d_qk = torch.empty(n, heads + kv, d, dtype=dtype, device=dev)
        d_v = torch.empty(n, kv, d, dtype=dtype, device=dev)
        grad_p = grad[:rp].reshape(copies, p, kv, g, d).permute(0, 2, 3, 1, 4)
        grad_p = grad_p.reshape(copies * kv, g * p, d)
        grad_r = grad[rp:].reshape(b, w, kv, g, d).permute(2, 0, 3, 1, 4).contiguous()

        # the prefix copies
        d_vp = torch.bmm(probs_p.transpose(1, 2), grad_p)  # [R*K, P, D]
        # softmax's backward as autograd runs it (a private op, stable since torch 1.11;
        # tests/test_train_attention.py fails if it changes)
        d_scores = torch._softmax_backward_data(
            torch.bmm(grad_p, v_p.view(copies * kv, p, d).transpose(1, 2)), probs_p, -1, dtype
        )
        d_qp = torch.bmm(d_scores, k_p.view(copies * kv, p, d))  # [R*K, g*P, D]
        d_kp = torch.bmm(d_scores.transpose(1, 2), q_p.view(copies * kv, g * p, d))

        # the rows
        probs_pre, probs_own = probs_r.split([p, w], dim=-1)
        grad_own = grad_r.view(kv * b, g * w, d)
        d_vr = torch.bmm(probs_own.reshape(kv * b, g * w, w).transpose(1, 2), grad_own)
        d_probs_own = torch.bmm(grad_own, v_r.view(kv * b, w, d).transpose(1, 2))
        d_probs_pre = []
        d_vp_runs = d_vp.view(copies, kv, p, d)
        for i, (g_run, p_run) in enumerate(
            zip(grad_r.split(run_rows, dim=1), probs_pre.split(run_rows, dim=1), strict=True)
        ):
            g_run, p_run = g_run.reshape(kv, -1, d), p_run.reshape(kv, -1, p)
            d_vp_runs[i].baddbmm_(p_run.transpose(1, 2), g_run)
            d_probs_pre.append(torch.bmm(g_run, v_p[i].transpose(1, 2)).view(kv, -1, g * w, p))
        d_probs = torch.cat([_cat_runs(d_probs_pre), d_probs_own.view(kv, b, g * w, w)], dim=-1)
        d_scores_r = torch._softmax_backward_data(d_probs, probs_r, -1, dtype)
        d_pre, d_own = d_scores_r.split([p, w], dim=-1)
        d_own = d_own.reshape(kv * b, g * w, w)
        d_qr = torch.bmm(d_own, k_r.view(kv * b, w, d)).view(kv, b, g * w, d)
        d_kr = torch.bmm(d_own.transpose(1, 2), q_r.view(kv * b, g * w, d))  # [K*B, w, D]
        d_kp_runs = d_kp.view(copies, kv, p, d)
        for i, (dq_run, ds_run, q_run) in enumerate(
            zip(
                d_qr.split(run_rows, dim=1),
                d_pre.split(run_rows, dim=1),
                q_r.split(run_rows, dim=1),
                strict=True,
            )
        ):
            ds_run = ds_run.reshape(kv, -1, p)
            dq_run.view(kv, -1, d).baddbmm_(ds_run, k_p[i])
            d_kp_runs[i].baddbmm_(ds_run.transpose(1, 2), q_run.reshape(kv, -1, d))

        # back to the stream's layout; the queries were scaled before the scores
        scale = d**-0.5
        dq_p = d_qk[:rp, :heads].view(copies, p, kv, g, d)
        torch.mul(d_qp.view(copies, kv, g, p, d).permute(0, 3, 1, 2, 4), scale, out=dq_p)
        dq_r = d_qk[rp:, :heads].view(b, w, kv, g, d)
        torch.mul(d_qr.view(kv, b, g, w, d).permute(1, 3, 0, 2, 4), scale, out=dq_r)
        d_qk[:rp, heads:].view(copies, p, kv, d).copy_(
            d_kp.view(copies, kv, p, d).permute(0, 2, 1, 3)
        )
        d_qk[rp:, heads:].view(b, w, kv, d).copy_(d_kr.view(kv, b, w, d).permute(1, 2, 0, 3))
        d_v[:rp].view(copies, p, kv, d).copy_(d_vp.view(copies, kv, p, d).permute(0, 2, 1, 3))
        d_v[rp:].view(b, w, kv, d).copy_(d_vr.view(kv, b, w, d).permute(1, 2, 0, 3))
        return d_qk, d_v.view(n, kv * d), None, None, None, None


def _cat_runs(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def stream_attention(
    qk: torch.Tensor, v: torch.Tensor, *, heads: int, copies: int, prefix: int, run_rows: list[int]
) -> torch.Tensor:
    """Attention over a stream of `copies` prefix copies then `sum(run_rows)` rows.

    Args:
        qk: [N, heads + kv, D] queries then keys of every stream token (RoPE applied).
        v: [N, kv * D] values.
        heads: query heads (a multiple of kv).
        copies: R prefix copies, one per run.
        prefix: P > 0 tokens in each copy.
        run_rows: rows per run, in order; the rows share one width (N - R*P) / B.

    Returns:
        [N, heads * D] in qk's dtype: prefix copy i's tokens attend causally within
        it; each row of run i to copy i and causally to its own tokens.
    """
    return _StreamAttention.apply(qk, v, heads, copies, prefix, run_rows)
