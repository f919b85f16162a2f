"""The training pass's op budget: what a bf16 step pays outside the big GEMMs.

On a CPU a swap step is a few hundred tokens, so every op's fixed cost and
every extra pass over an activation shows up next to the GEMMs (a bf16
elementwise op also costs about twice its fp32 twin). Counted on the tiny
model with a dispatch mode, forward and backward of one pass: each agent's
fp32 master is cast to bf16 once per pass (not once per factor and use), no
backward allocates a zero-filled full-size gradient (`slice_backward`), and
the matmuls stay at one base GEMM plus one fused LoRA pair per projection
group (forward and backward), whatever the number of members a group fuses.
The values themselves are checked elsewhere (against PEFT and the fp32 pass).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from clora_feedback.train import forward
from clora_feedback.train.forward import (
    PackedBatch,
    TrainLoRA,
    causal_attention,
    prefixed_attention,
)
from clora_feedback.train.policy import DecoderPolicy
from clora_feedback.train.state import LoRALayout, init_lora

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class _Ops(TorchDispatchMode):
    """Counts aten ops by name, and the shapes of the tensors cast fp32 -> bf16."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.downcasts: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        self.ops[name] += 1
        cast = name == "_to_copy" and kwargs.get("dtype") == torch.bfloat16
        if cast and args[0].dtype == torch.float32:
            self.downcasts.append(tuple(args[0].shape))
        return func(*args, **kwargs)


def _count(model_dir: Path, dtype: torch.dtype) -> tuple[_Ops, LoRALayout, int]:
    policy = DecoderPolicy.from_dir(model_dir, max_lora_rank=8, target_modules=ALL, dtype=dtype)
    layout = LoRALayout.build(policy.lora_limits, 8, 16.0, ALL)
    leaf = init_lora(layout, seed=0).requires_grad_(True)
    system = list(range(3, 23))  # a shared prefix: both streams of the pass run
    # 9 scored tokens: no activation or gradient shares a LoRA factor's shape
    packed = PackedBatch.build([([*system, 30 + i], [40 + i, 41, 42]) for i in range(3)])
    lora = TrainLoRA([layout], [leaf], torch.zeros(3, dtype=torch.long))
    with _Ops() as ops:
        policy.token_logprobs(packed, lora).sum().backward()
    assert leaf.grad is not None and float(leaf.grad.abs().max()) > 0
    return ops, layout, policy.base.config.num_layers


def test_bf16_pass_casts_each_master_once(tiny_model_dir: Path) -> None:
    ops, layout, _ = _count(tiny_model_dir, torch.bfloat16)
    factor_shapes = {shape for _, _, sa, _, sb in layout.entries for shape in (sa, sb)}
    assert ops.downcasts.count((layout.numel,)) == 1
    assert not factor_shapes & set(ops.downcasts), "a LoRA factor was cast on its own"


def test_pass_has_no_zero_filled_gradients_and_one_matmul_pair_per_group(
    tiny_model_dir: Path,
) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        counted, _, layers = _count(tiny_model_dir, dtype)
        ops = counted.ops
        assert ops["slice_backward"] == 0
        # Per layer and group: base GEMM + LoRA shrink + expand forward; input gradient of
        # the base, and for each LoRA matmul its two gradients, backward: 3 + 1 + 4 = 8.
        matmuls = (
            ops["mm"] + ops["addmm"] + ops["addmm_"]
        )  # the projections' (attention's are batched)
        assert matmuls <= 8 * 4 * layers + 4, dict(ops)


def test_prefixed_attention_matches_attention_over_copied_prefix_keys() -> None:
    """The fast path against its plain reference: SDPA over each row's copy of its run's
    prefix keys and values, then its own, masked causally after the prefix."""
    gen = torch.Generator().manual_seed(0)
    run_rows, heads, kv, p, w, d = [2, 3], 6, 2, 5, 4, 8
    rows = sum(run_rows)

    def leaf(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).requires_grad_(True)

    q, k, v = leaf(rows, heads, w, d), leaf(rows, kv, w, d), leaf(rows, kv, w, d)
    k_p, v_p = leaf(len(run_rows), kv, p, d), leaf(len(run_rows), kv, p, d)
    weights = torch.randn(rows, heads, w, d, generator=gen)
    fast = prefixed_attention(q, k_p, v_p, k, v, run_rows)
    grads_fast = torch.autograd.grad((fast * weights).sum(), [q, k, v, k_p, v_p])
    owner = torch.repeat_interleave(torch.arange(len(run_rows)), torch.tensor(run_rows))
    keys = torch.cat([k_p.index_select(0, owner), k], dim=2)
    values = torch.cat([v_p.index_select(0, owner), v], dim=2)
    allowed = torch.ones(w, p + w, dtype=torch.bool).tril(p)
    ref = F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed, enable_gqa=True)
    grads_ref = torch.autograd.grad((ref * weights).sum(), [q, k, v, k_p, v_p])
    torch.testing.assert_close(fast, ref, atol=1e-5, rtol=1e-5)
    for got, want in zip(grads_fast, grads_ref, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_attention_matches_sdpa_values_and_gradients(dtype: torch.dtype) -> None:
    """Plain causal attention (the bf16 path on a CPU) against torch's SDPA with grouped
    kv heads, in fp32 (to rounding) and in bf16 (to bf16's own rounding of SDPA in fp32)."""
    gen = torch.Generator().manual_seed(1)
    b, heads, kv, w, d = 2, 6, 2, 7, 8

    def leaf(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype).requires_grad_(True)

    q, k, v = leaf(b, heads, w, d), leaf(b, kv, w, d), leaf(b, kv, w, d)
    weights = torch.randn(b, heads, w, d, generator=gen).to(dtype)
    fast = causal_attention(q, k, v)
    grads_fast = torch.autograd.grad((fast * weights).sum(), [q, k, v])
    q32, k32, v32 = (x.detach().float().requires_grad_(True) for x in (q, k, v))
    ref = F.scaled_dot_product_attention(q32, k32, v32, is_causal=True, enable_gqa=True)
    grads_ref = torch.autograd.grad((ref * weights.float()).sum(), [q32, k32, v32])
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 4e-2, "rtol": 4e-2}
    torch.testing.assert_close(fast.float(), ref, **tol)
    for got, want in zip(grads_fast, grads_ref, strict=True):
        torch.testing.assert_close(got.float(), want, **tol)


def test_a_pass_on_a_cpu_attends_by_plain_matmuls_only_up_to_the_length_limit(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a CPU a pass with a shared prefix that fits the limit attends by one function
    (`stream_attention`) in either dtype; past the limit, by flash attention for the
    prefix. Rows without a prefix attend by `causal_attention` in bf16 while they fit,
    else by SDPA (fp32 always). Each way gives the other's log-probabilities (fp32: to
    rounding; bf16: to bf16's)."""
    counted: Counter[str] = Counter()
    sdpa, plain, stream = (
        F.scaled_dot_product_attention,
        forward.causal_attention,
        forward.stream_attention,
    )

    def counting(name: str, fn: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> torch.Tensor:
            counted[name] += 1
            return fn(*args, **kwargs)

        return run

    monkeypatch.setattr(forward.F, "scaled_dot_product_attention", counting("sdpa", sdpa))
    monkeypatch.setattr(forward, "causal_attention", counting("plain", plain))
    monkeypatch.setattr(forward, "stream_attention", counting("stream", stream))
    system = list(range(3, 23))
    with_prefix = PackedBatch.build([([*system, 30 + i], [40 + i, 41, 42]) for i in range(3)])
    without = PackedBatch.build([([3 + i, 4, 5], [40 + i, 41]) for i in range(3)])
    results: dict[tuple[torch.dtype, int, str], torch.Tensor] = {}
    for dtype in (torch.float32, torch.bfloat16):
        policy = DecoderPolicy.from_dir(
            tiny_model_dir, max_lora_rank=8, target_modules=ALL, dtype=dtype
        )
        layers = policy.base.config.num_layers
        for limit in (384, 2):
            monkeypatch.setattr(forward, "PLAIN_ATTENTION_MAX_LEN", limit)
            monkeypatch.setattr(forward, "FP32_ONE_FUNCTION_MAX_PREFIX", limit)
            for name, packed in (("prefix", with_prefix), ("no prefix", without)):
                counted.clear()
                with torch.no_grad():
                    results[(dtype, limit, name)] = policy.token_logprobs(packed, None)
                if name == "prefix" and limit == 384:
                    expected = "stream"
                elif name == "no prefix" and dtype == torch.bfloat16 and limit == 384:
                    expected = "plain"
                else:
                    expected = "sdpa"
                assert counted == Counter({expected: layers}), (dtype, limit, name)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        for name in ("prefix", "no prefix"):
            torch.testing.assert_close(
                results[(dtype, 384, name)], results[(dtype, 2, name)], atol=tol, rtol=0
            )
