"""The training pass's hand-written autograd pieces give the reference's values and gradients.

`clora_feedback.train.fused` replaces three composites of the training pass
(RMSNorm, SwiGLU, the head's log-probabilities) by functions with a
hand-written backward, and the frozen projections' `F.linear` by one whose
input gradient `train.gemm` computes the faster of two ways. Forward values must be bit-identical to
`clora_feedback.model.decoder` (the reference checked against PEFT), and input
gradients equal to what autograd computes through the reference: exactly in
fp32 up to summation order, within bf16 rounding in bf16. The head's backward
multiplies by the head in the compute dtype: in bf16 that product is a bf16
matmul (half the bytes of the [V, hidden] head), its result within 1% of fp32.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from clora_feedback.model.decoder import gather_logprobs
from clora_feedback.model.decoder import rms_norm as reference_rms_norm
from clora_feedback.train import gemm
from clora_feedback.train.fused import (
    LoRAPiece,
    frozen_linear,
    head_logprobs,
    lora_linear,
    rms_norm,
    swiglu,
)

DTYPES = [torch.float32, torch.bfloat16]


def _value_and_grad(
    fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, grad: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    leaf = x.detach().clone().requires_grad_(True)
    y = fn(leaf)
    y.backward(grad)
    assert leaf.grad is not None
    return y.detach(), leaf.grad


def _reference_swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_the_reference(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(37, 64, generator=g) * 3).to(dtype)
    weight = (torch.rand(64, generator=g) + 0.5).to(dtype)
    grad = torch.randn(37, 64, generator=g).to(dtype)
    before = x.clone()
    y_ref, dx_ref = _value_and_grad(lambda t: reference_rms_norm(t, weight, 1e-5), x, grad)
    y, dx = _value_and_grad(lambda t: rms_norm(t, weight, 1e-5), x, grad)
    assert torch.equal(x, before)  # the input is not normalised in place
    assert torch.equal(y, y_ref)
    scale = float(dx_ref.float().abs().max())
    tol = 1e-6 if dtype == torch.float32 else 2**-7
    assert float((dx.float() - dx_ref.float()).abs().max()) <= tol * scale


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_matches_the_reference(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    gate_up = (torch.randn(29, 2 * 48, generator=g) * 2).to(dtype)
    grad = torch.randn(29, 48, generator=g).to(dtype)
    y_ref, d_ref = _value_and_grad(_reference_swiglu, gate_up, grad)
    y, d = _value_and_grad(swiglu, gate_up, grad)
    assert torch.equal(y, y_ref)
    assert torch.allclose(d.float(), d_ref.float(), rtol=1e-6, atol=1e-6)


class _MatmulDtypes(TorchDispatchMode):
    """The dtypes of every mm's inputs, with their shapes."""

    def __init__(self) -> None:
        super().__init__()
        self.mms: list[tuple[torch.dtype, tuple[int, ...], tuple[int, ...]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.overloadpacket.__name__ == "mm":
            self.mms.append((args[0].dtype, tuple(args[0].shape), tuple(args[1].shape)))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", DTYPES)
def test_head_logprobs_match_the_reference_and_multiply_back_in_the_compute_dtype(
    dtype: torch.dtype,
) -> None:
    g = torch.Generator().manual_seed(2)
    vocab, width, n = 300, 32, 11
    head = torch.randn(vocab, width, generator=g).to(dtype).float()  # the fp32 copy of a head
    hidden = torch.randn(n, width, generator=g)
    targets = torch.randint(0, vocab, (n,), generator=g)
    grad = torch.randn(n, generator=g)
    lp_ref, dh_ref = _value_and_grad(lambda h: gather_logprobs(h, head, targets, 4), hidden, grad)
    with _MatmulDtypes() as seen:
        lp, dh = _value_and_grad(
            lambda h: head_logprobs(h, head, head.to(dtype), targets, chunk=4), hidden, grad
        )
    assert torch.equal(lp, lp_ref)
    assert lp.dtype == dh.dtype == torch.float32
    backward = [mm for mm in seen.mms if mm[1][1] == vocab]  # [rows, V] x [V, hidden]
    assert [mm[0] for mm in backward] == [dtype] * 3  # three chunks of at most 4 rows
    err = float((dh - dh_ref).abs().max()) / float(dh_ref.abs().max())
    assert err <= (1e-6 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("halves", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_frozen_linear_matches_linear_whichever_way_its_input_gradient_is_computed(
    dtype: torch.dtype, halves: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    timed: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

    def chosen(grad: torch.Tensor, weight: torch.Tensor) -> bool:
        timed.append((tuple(grad.shape), tuple(weight.shape)))
        return halves

    monkeypatch.setattr(gemm, "halves_are_faster", chosen)
    monkeypatch.setattr(gemm, "MIN_MACS", 0)
    gemm.forget_choices()
    g = torch.Generator().manual_seed(3)
    weight = (torch.randn(96, 70, generator=g) * 0.1).to(dtype)  # odd halves: 35 + 35
    bias = torch.randn(96, generator=g).to(dtype)
    for rows in (45, 60, 33):  # one shape class (33..64 rows): timed once
        x = torch.randn(rows, 70, generator=g).to(dtype)
        grad = torch.randn(rows, 96, generator=g).to(dtype)
        y_ref, dx_ref = _value_and_grad(lambda t: F.linear(t, weight, bias), x, grad)
        y, dx = _value_and_grad(lambda t: frozen_linear(t, weight, bias), x, grad)
        assert torch.equal(y, y_ref)
        tol = 1e-6 if dtype == torch.float32 else 2**-7
        assert float((dx.float() - dx_ref.float()).abs().max()) <= tol * float(dx_ref.abs().max())
    assert timed == [((45, 96), (96, 70))]
    gemm.forget_choices()


def test_the_second_way_is_kept_only_when_clearly_faster() -> None:
    def sleeps(seconds: float) -> Callable[[], None]:
        return lambda: time.sleep(seconds)

    assert gemm.second_is_faster(sleeps(0.004), sleeps(0.001))
    assert not gemm.second_is_faster(sleeps(0.001), sleeps(0.004))
    assert not gemm.second_is_faster(sleeps(0.01), sleeps(0.01))  # a tie keeps the first


def test_small_products_and_narrow_weights_are_one_product_untimed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def never(grad: torch.Tensor, weight: torch.Tensor) -> bool:
        raise AssertionError(f"timed {tuple(grad.shape)} @ {tuple(weight.shape)}")

    monkeypatch.setattr(gemm, "halves_are_faster", never)
    gemm.forget_choices()
    g = torch.Generator().manual_seed(4)
    grad, weight = torch.randn(8, 64, generator=g), torch.randn(64, 512, generator=g)
    assert torch.equal(gemm.input_gradient(grad, weight), grad @ weight)  # few multiply-adds
    monkeypatch.setattr(gemm, "MIN_MACS", 0)
    narrow = torch.randn(64, 32, generator=g)  # halves of 16 columns: never worth timing
    assert torch.equal(gemm.input_gradient(grad, narrow), grad @ narrow)


@pytest.mark.parametrize("dtype", DTYPES)
def test_lora_linear_matches_the_composite_for_every_segment(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(6)

    def t(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    weight, bias, x, grad = t(40, 24, scale=0.2), t(40), t(17, 24), t(17, 40)
    # three agents' segments: rank 4, no LoRA on this projection, rank 2
    factors = [(t(4, 24, scale=0.3), t(4, 40, scale=0.3)), None, (t(2, 24), t(2, 40))]
    sizes = [6, 4, 7]

    def composite(x: torch.Tensor, *flat: torch.Tensor) -> torch.Tensor:
        parts, it = [], iter(flat)
        for xs, f in zip(x.split(sizes), factors, strict=True):
            parts.append((xs @ next(it).t()) @ next(it) if f else xs.new_zeros(len(xs), 40))
        return F.linear(x, weight, bias) + torch.cat(parts)

    def fused(x: torch.Tensor, *flat: torch.Tensor) -> torch.Tensor:
        it = iter(flat)
        pieces: list[LoRAPiece] = [
            (n, next(it), next(it)) if f else (n, None, None)
            for n, f in zip(sizes, factors, strict=True)
        ]
        return lora_linear(x, weight, bias, pieces)

    results = []
    for fn in (composite, fused):
        leaves = [x.clone().requires_grad_(True)] + [
            p.clone().requires_grad_(True) for f in factors if f for p in f
        ]
        y = fn(*leaves)
        y.backward(grad)
        results.append((y.detach(), [leaf.grad for leaf in leaves]))
    (y_ref, grads_ref), (y_got, grads_got) = results
    tol = 1e-5 if dtype == torch.float32 else 2**-6
    assert float((y_got.float() - y_ref.float()).abs().max()) <= tol * float(y_ref.abs().max())
    for got, want in zip(grads_got, grads_ref, strict=True):
        assert got is not None and want is not None
        assert float((got.float() - want.float()).abs().max()) <= tol * float(want.abs().max())
