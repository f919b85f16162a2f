"""The `upcast` dense kernel's choice by row count, against `F.linear`.

On a CPU without oneDNN's bf16 path, `upcast` multiplies a few rows by the
bf16 weight itself (`reduced_rows`) and more rows by its fp32 copy. Both
paths must compute `F.linear` (fp32 in, fp32 out); which one ran is seen in
the result: the bf16 product is rounded to bf16, the fp32 one is not.
Correctness only: nothing here times anything.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from clora_feedback.engine.dense import DenseKernels

# Shapes shaped like the model's groups (qkv, o, gate_up, down) and the lm_head, scaled down;
# one not a multiple of 64 (no blocked form).
SHAPES = {"qkv": (160, 96), "o": (96, 96), "gate_up": (100, 96), "down": (96, 256)}
HEAD = (320, 96)


def _weights(dtype: torch.dtype) -> tuple[list[dict[str, torch.Tensor]], torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    layer = {g: (torch.randn(*s, generator=gen) / s[1] ** 0.5).to(dtype) for g, s in SHAPES.items()}
    return [layer], (torch.randn(*HEAD, generator=gen) / HEAD[1] ** 0.5).to(dtype)


def _is_bf16_rounded(y: torch.Tensor) -> bool:
    return bool(torch.equal(y, y.bfloat16().float()))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_upcast_picks_the_weight_by_row_count(dtype: torch.dtype) -> None:
    layers, head = _weights(dtype)
    kernels = DenseKernels.build(layers, head, "upcast")
    assert kernels.name == "upcast" and kernels.compute_dtype == torch.float32
    pairs = [(kernels.layers[0][g], w) for g, w in layers[0].items()] + [(kernels.lm_head, head)]
    gen = torch.Generator().manual_seed(1)
    for kernel, w in pairs:
        reduced = kernel.reduced_rows
        # The measured rule: one bf16 row is multiplied by the bf16 weight; fp16 never is.
        assert (1 in reduced) == (dtype == torch.bfloat16)
        for n in range(1, 18):
            # The engine's input: values of its bf16/fp16 residual stream, in fp32.
            x = torch.randn(n, w.shape[1], generator=gen).to(dtype).float()
            with torch.inference_mode():
                got = kernel(x)
                want = F.linear(x, w.float())
            assert got.dtype == torch.float32 and got.shape == want.shape
            if n in reduced:
                assert torch.equal(got, F.linear(x.to(dtype), w).float())
                assert _is_bf16_rounded(got)
                torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
            else:
                assert not _is_bf16_rounded(got)
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_upcast_one_dimensional_input_is_one_row() -> None:
    """Prefill's logits project a single [hidden] vector: the one-row path."""
    layers, head = _weights(torch.bfloat16)
    kernels = DenseKernels.build(layers, head, "upcast")
    x = torch.randn(HEAD[1]).bfloat16().float()
    with torch.inference_mode():
        got = kernels.lm_head(x)
        assert torch.equal(got, kernels.lm_head(x.unsqueeze(0))[0])
    assert got.shape == (HEAD[0],)
    assert _is_bf16_rounded(got)
    torch.testing.assert_close(got, F.linear(x, head.float()), rtol=1e-2, atol=1e-2)


def test_auto_bf16_without_onednn_bf16_is_upcast_with_reduced_rows() -> None:
    layers, head = _weights(torch.bfloat16)
    kernels = DenseKernels.build(layers, head)
    if kernels.name != "upcast":
        pytest.skip(f"this CPU multiplies bf16 with `{kernels.name}`")
    assert 1 in kernels.lm_head.reduced_rows
