"""The stream's attention by hand (`train.attention.stream_attention`) is SDPA's, values and gradients.

A training pass lays its tokens out as prefix copies (one per agent run) then
rows; `stream_attention` computes, in one autograd function, each prefix copy's
causal attention and each row's attention to its run's prefix copy and causally
to its own tokens. The reference spells that out with torch's
`scaled_dot_product_attention`: per prefix copy with `is_causal`, per row over
the concatenated keys and values with the mask written down, grouped kv heads
expanded by SDPA itself. fp32 must agree to rounding, bf16 to bf16's rounding of
the fp32 reference.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from clora_feedback.train.attention import causal_bias, stream_attention


def _reference(
    qk: torch.Tensor, v: torch.Tensor, heads: int, copies: int, prefix: int, run_rows: list[int]
) -> torch.Tensor:
    n, kv, d = qk.shape[0], qk.shape[1] - heads, qk.shape[2]
    v = v.view(n, kv, d)
    rp, b = copies * prefix, sum(run_rows)
    w = (n - rp) // b
    q, k = qk[:, :heads], qk[:, heads:]

    def heads_first(x: torch.Tensor) -> torch.Tensor:  # [len, h, D] -> [1, h, len, D]
        return x.transpose(0, 1).unsqueeze(0)

    out = []
    for c in range(copies):
        span = slice(c * prefix, (c + 1) * prefix)
        o = F.scaled_dot_product_attention(
            heads_first(q[span]), heads_first(k[span]), heads_first(v[span]),
            is_causal=True, enable_gqa=True,
        )  # fmt: skip
        out.append(o[0].transpose(0, 1).reshape(prefix, heads * d))
    owner = [c for c, rows in enumerate(run_rows) for _ in range(rows)]
    allowed = torch.ones(w, prefix + w, dtype=torch.bool).tril(prefix)
    for row, c in enumerate(owner):
        own = slice(rp + row * w, rp + (row + 1) * w)
        pre = slice(c * prefix, (c + 1) * prefix)
        keys = torch.cat([k[pre], k[own]])
        values = torch.cat([v[pre], v[own]])
        o = F.scaled_dot_product_attention(
            heads_first(q[own]), heads_first(keys), heads_first(values),
            attn_mask=allowed, enable_gqa=True,
        )  # fmt: skip
        out.append(o[0].transpose(0, 1).reshape(w, heads * d))
    return torch.cat(out)


@pytest.mark.parametrize(
    "run_rows,heads,kv",
    [([3], 6, 2), ([2, 3], 6, 2), ([1, 1, 2], 6, 2), ([1, 4], 4, 4), ([2, 1], 4, 1)],
    ids=["one run", "two runs", "three runs", "a one-row run, no grouping", "one kv head"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stream_attention_matches_sdpa_values_and_gradients(
    dtype: torch.dtype, run_rows: list[int], heads: int, kv: int
) -> None:
    gen = torch.Generator().manual_seed(len(run_rows) + heads + kv)
    d, prefix, w = 8, 5, 4
    copies = len(run_rows)
    n = copies * prefix + sum(run_rows) * w
    qk = torch.randn(n, heads + kv, d, generator=gen)
    # the values as the pass has them: a column split of the fused projection's output
    v = torch.randn(n, kv * d + 3, generator=gen)[:, 3:]
    weights = torch.randn(n, heads * d, generator=gen)

    def run(fn, dt: torch.dtype):  # type: ignore[no-untyped-def]
        v_wide = torch.zeros(n, kv * d + 3, dtype=dt)
        v_wide[:, 3:] = v
        leaves = [qk.to(dt).requires_grad_(True), v_wide.requires_grad_(True)]
        v_in = leaves[1][:, 3:]  # not contiguous: rows kv * d + 3 apart
        out = fn(leaves[0], v_in, heads, copies, prefix, run_rows)
        d_qk, d_v = torch.autograd.grad((out * weights.to(dt)).sum(), leaves)
        assert torch.all(d_v[:, :3] == 0)  # nothing reaches the columns beside the values
        return out, d_qk, d_v[:, 3:]

    def fast(qk: torch.Tensor, v: torch.Tensor, *shape: object) -> torch.Tensor:
        h, c, p, rows = shape
        return stream_attention(qk, v, heads=h, copies=c, prefix=p, run_rows=rows)  # type: ignore[arg-type]

    got = run(fast, dtype)
    want = run(_reference, torch.float32)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 5e-2, "rtol": 3e-2}
    for g, r in zip(got, want, strict=True):
        assert g.dtype == dtype
        torch.testing.assert_close(g.float(), r, **tol)


def test_the_causal_bias_masks_each_query_heads_future() -> None:
    bias = causal_bias(3, 2, torch.float32, torch.device("cpu"))
    assert bias.shape == (6, 3)
    inf = float("-inf")
    want = torch.tensor([[0, inf, inf], [0, 0, inf], [0, 0, 0]]).repeat(2, 1)
    assert torch.equal(bias, want)
    assert causal_bias(3, 2, torch.float32, torch.device("cpu")) is bias  # kept
    assert causal_bias(400, 1, torch.bfloat16, torch.device("cpu")).shape == (400, 400)
