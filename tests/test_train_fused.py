"""The training pass's hand-written autograd pieces give the reference's values and gradients.

`clora_feedback.train.fused` replaces composites of the training pass by
functions with a hand-written backward: RMSNorm, SwiGLU and the head's
log-probabilities, whose forward values must be bit-identical to
`clora_feedback.model.decoder` (the reference checked against PEFT); the frozen
projections' `F.linear`, whose input gradient `train.gemm` computes the faster
of two ways; and a projection with its LoRA (`lora_linear`), which in bf16 rounds
its sum once where the composite rounds twice. Gradients must equal what
autograd computes through the composites: exactly in fp32 up to summation order,
within bf16 rounding in bf16. The head's backward multiplies by the head in the
compute dtype: in bf16 that product is a bf16 matmul (half the bytes of the
[V, hidden] head), its result within 1% of fp32.
"""

from __future__ import annotations

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
    weight = (torch.randn(96, 134, generator=g) * 0.1).to(dtype)  # odd halves: 67 + 67
    bias = torch.randn(96, generator=g).to(dtype)
    for rows in (45, 60, 33):  # one shape class (33..64 rows): timed once
        x = torch.randn(rows, 134, generator=g).to(dtype)
        grad = torch.randn(rows, 96, generator=g).to(dtype)
        y_ref, dx_ref = _value_and_grad(lambda t: F.linear(t, weight, bias), x, grad)
        y, dx = _value_and_grad(lambda t: frozen_linear(t, weight, bias), x, grad)
        assert torch.equal(y, y_ref)
        tol = 1e-6 if dtype == torch.float32 else 2**-7
        assert float((dx.float() - dx_ref.float()).abs().max()) <= tol * float(dx_ref.abs().max())
    assert timed == [((45, 96), (96, 134))]
    gemm.forget_choices()


def test_the_second_way_is_kept_only_when_clearly_faster(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [0.0]  # a clock that moves only when a way runs: each way takes what it says
    monkeypatch.setattr(gemm.time, "perf_counter", lambda: now[0])

    def takes(seconds: float) -> Callable[[], None]:
        def run() -> None:
            now[0] += seconds

        return run

    assert gemm.second_is_faster(takes(1.0), takes(0.5))
    assert gemm.second_is_faster(takes(1.0), takes(0.875))  # past the margin (0.9)
    assert not gemm.second_is_faster(takes(1.0), takes(0.9375))  # within it: the first stays
    assert not gemm.second_is_faster(takes(0.5), takes(1.0))


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


# Segments of a stream: (tokens, which factor pair or None), as `_StreamLoRA.pieces`
# gives them; a shared prefix puts one agent's pair in two segments that are not adjacent.
LAYOUTS = {
    "three agents, one without LoRA here": [(6, 0), (4, None), (7, 1)],
    "one agent": [(17, 0)],
    "prefix copies then rows": [(5, 0), (3, 1), (6, 0), (3, 1)],
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("x_grad", [True, False], ids=["x grad", "no x grad"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no bias"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_lora_linear_matches_the_composite_for_every_segment(
    dtype: torch.dtype, with_bias: bool, x_grad: bool, layout: str
) -> None:
    g = torch.Generator().manual_seed(6)

    def t(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    segments = LAYOUTS[layout]
    sizes = [n for n, _ in segments]
    n = sum(sizes)
    weight, x, grad = t(40, 24, scale=0.2), t(n, 24), t(n, 40)
    bias = t(40) if with_bias else None
    pairs = [(t(4, 24, scale=0.3), t(4, 40, scale=0.3)), (t(2, 24), t(2, 40))]  # ranks 4, 2

    def composite(x: torch.Tensor, *flat: torch.Tensor) -> torch.Tensor:
        parts = [
            (xs @ flat[2 * k].t()) @ flat[2 * k + 1] if k is not None else xs.new_zeros(len(xs), 40)
            for xs, (_, k) in zip(x.split(sizes), segments, strict=True)
        ]
        return F.linear(x, weight, bias) + torch.cat(parts)

    def fused(x: torch.Tensor, *flat: torch.Tensor) -> torch.Tensor:
        pieces: list[LoRAPiece] = [
            (m, flat[2 * k], flat[2 * k + 1]) if k is not None else (m, None, None)
            for m, k in segments
        ]
        return lora_linear(x, weight, bias, pieces)

    results = []
    for fn in (composite, fused):
        leaves = [x.clone().requires_grad_(x_grad)] + [
            p.clone().requires_grad_(True) for pair in pairs for p in pair
        ]
        y = fn(*leaves)
        y.backward(grad)
        results.append((y.detach(), [leaf.grad for leaf in leaves]))
    (y_ref, grads_ref), (y_got, grads_got) = results
    tol = 1e-5 if dtype == torch.float32 else 2**-6
    assert float((y_got.float() - y_ref.float()).abs().max()) <= tol * float(y_ref.abs().max())
    assert (grads_got[0] is None) == (not x_grad)
    for got, want in zip(grads_got, grads_ref, strict=True):
        if want is None:
            continue
        assert got is not None
        scale = float(want.abs().max())
        assert float((got.float() - want.float()).abs().max()) <= tol * max(scale, 1e-6)
