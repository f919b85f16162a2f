"""Every serving fast path against its plain reference.

- `add_lora_delta_` / `lora_delta` (grouped per-slot matmuls, in-order and
  gathered rows, slot runs with holes, gathered slots, several tokens per row)
  against `lora_delta_reference`, with B stored both ways.
- `add_lora_update_` (B in block form, as `LoRASlots` writes it, for every
  mix of targeted members) against the same reference on the dense form.
- `DenseKernels` (oneDNN-packed and blocked fp32, packed or upcast bf16)
  against `F.linear`, for every batch size the engine uses.
- `SlottedDecoder.decode` (rows in any order, equal or different positions, so with
  and without the attention mask) against Hugging Face on the full sequence.
- `SlottedDecoder.prefill` and `decode` with adapters in their slots against the
  shared differentiable forward (`clora_feedback.model.decoder`) on the same
  base tensors, so the engine and the trainer compute one model.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from clora_feedback.engine import dense
from clora_feedback.engine.decoder import KVCache, LoRASlots, PrefillChunk, SlottedDecoder
from clora_feedback.engine.dense import DenseKernels, packed_supported
from clora_feedback.lora.ops import (
    LoRABatch,
    add_lora_delta_,
    add_lora_update_,
    lora_delta,
    lora_delta_reference,
)
from clora_feedback.lora.weights import random_lora_weights
from clora_feedback.model.decoder import forward_hidden
from clora_feedback.model.tiny import build_tiny_model_dir

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _slot_buffers(
    num_slots: int, rank: int, fan_in: int, fan_out: int, transposed_b: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(num_slots * 100 + rank)
    a = torch.randn(num_slots, rank, fan_in, generator=gen)
    if transposed_b:  # the engine's layout: [S, R, out] storage viewed as [S, out, R]
        b = torch.randn(num_slots, rank, fan_out, generator=gen).transpose(1, 2)
    else:
        b = torch.randn(num_slots, fan_out, rank, generator=gen)
    a[0].zero_()
    b[0].zero_()
    return a, b


@pytest.mark.parametrize("transposed_b", [False, True])
@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize(
    "slots",
    [
        [0, 0, 0],  # base only
        [2, 2, 2, 2],  # one adapter
        [1, 2, 3, 4],  # rows already grouped by slot, one each
        [1, 1, 2, 2],  # grouped, two each
        [4, 1, 3, 2],  # out of order
        [1, 0, 3, 1, 1],  # base rows, a hole in the run, uneven groups (padding)
        [9, 1, 9],  # sparse slots: gathered instead of a run
        [2, 2, 2, 5],  # uneven groups, contiguous: one-adapter updates on runs of rows
        [0, 0, 3, 3, 3],  # base rows and one adapter in runs
        [4, 4, 0, 1, 6, 6, 6],  # three adapters and a base run
    ],
)
def test_fast_lora_update_matches_reference(
    slots: list[int], tokens: int, transposed_b: bool
) -> None:
    a, b = _slot_buffers(10, 6, 12, 7, transposed_b)
    x = torch.randn(len(slots), tokens, 12, generator=torch.Generator().manual_seed(1))
    batch = LoRABatch.from_slots(slots)
    ref = lora_delta_reference(x, a, b, batch.slot_ids)
    base = torch.randn(len(slots), tokens, 7)
    y = base.clone()
    add_lora_delta_(y, x, a, b, batch)
    torch.testing.assert_close(y, base + ref)
    fast = lora_delta(x, a, b, batch)
    if batch.is_base_only:
        assert fast is None and ref.abs().max() == 0
    else:
        assert fast is not None
        torch.testing.assert_close(fast, ref)


def test_fast_lora_update_on_2d_rows() -> None:
    a, b = _slot_buffers(5, 4, 9, 11, True)
    x = torch.randn(4, 9)
    batch = LoRABatch.from_slots([3, 1, 1, 4])
    y = torch.zeros(4, 11)
    add_lora_delta_(y, x, a, b, batch)
    torch.testing.assert_close(y, lora_delta_reference(x.unsqueeze(1), a, b, batch.slot_ids)[:, 0])


SLOT_PATTERNS = [
    [2, 2, 2], [1, 2, 3], [1, 1, 3, 3], [3, 1, 1, 2], [1, 0, 3, 1], [7, 1, 7],
    [5, 5, 5, 2], [0, 3, 3, 3], [2, 1, 1, 0, 6],
]  # fmt: skip


def test_few_adapters_in_uneven_groups_update_runs_of_rows() -> None:
    """Rows of at most `_MAX_RUNS` slots, contiguous per slot, take the one-adapter update
    per run (no padding, gather or scatter); the decoder sorts rows to make them so."""
    assert LoRABatch.from_slots([2, 2, 2, 5]).mix_plan().runs == ((2, 0, 3), (5, 3, 4))
    assert LoRABatch.from_slots([0, 3, 3]).mix_plan().runs == ((3, 1, 3),)
    assert LoRABatch.from_slots([1, 2, 1, 3]).mix_plan().runs is None  # slot 1 split
    assert LoRABatch.from_slots([1, 2, 3, 4]).mix_plan().runs is None  # in order: batched
    assert LoRABatch.from_slots([1, 1, 2, 3, 4, 4]).mix_plan().runs is None  # four slots
    order = LoRABatch.from_slots([2, 5, 2, 2]).slot_order()
    assert order is not None and order.tolist() == [0, 2, 3, 1]
    assert LoRABatch.from_slots([2, 2, 2, 5]).slot_order() is None  # already in runs


@pytest.mark.parametrize("tokens", [1, 2])
@pytest.mark.parametrize("slots", SLOT_PATTERNS)
@pytest.mark.parametrize(
    "chosen",
    [("q", "k", "v"), ("q", "v"), ("k", "v"), ("gate", "up"), ("up",)],
)
def test_block_form_update_matches_reference(
    chosen: tuple[str, ...], slots: list[int], tokens: int
) -> None:
    members = (
        [("gate", 8), ("up", 8)] if chosen[0] in ("gate", "up") else [("q", 8), ("k", 4), ("v", 4)]
    )
    lora = LoRASlots(members, chosen, 10, 8, 4, torch.float32, torch.device("cpu"))
    gen = torch.Generator().manual_seed(len(chosen) * 10 + len(slots))
    for slot in range(1, 8):
        rank = 1 + slot % 4  # ranks below max_rank are zero-padded
        pieces = {
            name: (torch.randn(rank, 10, generator=gen), torch.randn(out, rank, generator=gen))
            for name, out in members
            if name in chosen
        }
        lora.write(slot, pieces, scaling=0.5)
    dense = lora.dense_b()
    assert dense.shape == (8, sum(out for _, out in members), 4 * len(chosen))
    x = torch.randn(len(slots), tokens, 10, generator=gen)
    batch = LoRABatch.from_slots(slots)
    base = torch.randn(len(slots), tokens, dense.shape[1], generator=gen)
    y = base.clone()
    add_lora_update_(y, x, lora.a, lora.blocks, batch)
    ref = lora_delta_reference(x, lora.a, dense, batch.slot_ids)
    assert ref.abs().max() > 0
    torch.testing.assert_close(y, base + ref)
    # Reading only the ranks the batch's adapters use (the rest is zero padding).
    used = max(1 + s % 4 for s in slots if s) if any(slots) else 0
    ranked = base.clone()
    add_lora_update_(ranked, x, lora.a, lora.blocks, LoRABatch.from_slots(slots, rank=used))
    torch.testing.assert_close(ranked, base + ref)


CPU = torch.device("cpu")


def _kernels(dtype: torch.dtype) -> list[str]:
    names = ["linear", "blocked"] + (["upcast"] if dtype != torch.float32 else [])
    if packed_supported(dtype, CPU):  # a CPU-feature probe: the same answer on every run
        names.append("packed")
    return names


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_kernels_match_linear(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    layers = [
        {
            "qkv": torch.randn(192, 96, generator=gen).to(dtype),
            "o": torch.randn(96, 64, generator=gen).to(dtype),
            "gate_up": torch.randn(100, 96, generator=gen).to(dtype),  # not a multiple of 64
            "down": torch.randn(96, 50, generator=gen).to(dtype),
        }
    ]
    lm_head = torch.randn(320, 96, generator=gen).to(dtype)
    tol = {"rtol": 1e-5, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 0.3}
    for name in _kernels(dtype):
        kernels = DenseKernels.build(layers, lm_head, name)
        assert kernels.name == name
        for n in range(1, 18):
            x = torch.randn(n, 96, generator=gen).to(kernels.compute_dtype)
            with torch.inference_mode():
                torch.testing.assert_close(
                    kernels.lm_head(x).float(), F.linear(x.float(), lm_head.float()), **tol
                )
                for group, w in layers[0].items():
                    xin = torch.randn(n, w.shape[1], generator=gen).to(kernels.compute_dtype)
                    got = kernels.layers[0][group](xin).float()
                    torch.testing.assert_close(got, F.linear(xin.float(), w.float()), **tol)


def test_auto_kernel_per_dtype() -> None:
    w = [
        {
            "qkv": torch.randn(64, 8),
            "o": torch.randn(8, 8),
            "gate_up": torch.randn(16, 8),
            "down": torch.randn(8, 8),
        }
    ]
    fp32_packed = packed_supported(torch.float32, CPU)  # oneDNN's fp32 linear: any x86 CPU
    assert DenseKernels.build(w, torch.randn(64, 8)).name == (
        "packed" if fp32_packed else "blocked"
    )
    wb = [{k: v.bfloat16() for k, v in w[0].items()}]
    head = torch.randn(64, 8).bfloat16()
    supported = packed_supported(torch.bfloat16, CPU)
    # Without oneDNN's bf16 path, bf16 weights are multiplied as fp32 copies (`upcast`).
    assert DenseKernels.build(wb, head).name == ("packed" if supported else "upcast")
    # Forcing `packed` where this CPU has no oneDNN bf16 path falls back to `linear`,
    # deterministically; whatever is chosen computes F.linear.
    forced = DenseKernels.build(wb, head, "packed")
    assert forced.name == ("packed" if supported else "linear")
    upcast = DenseKernels.build(wb, head, "upcast")
    x = torch.randn(5, 8).bfloat16()
    with torch.inference_mode():
        for kernels in (forced, upcast):
            got = kernels.lm_head(x.to(kernels.compute_dtype))
            assert got.dtype == kernels.compute_dtype
            torch.testing.assert_close(
                got.float(), F.linear(x.float(), head.float()), rtol=2e-2, atol=0.3
            )


def test_failed_fp32_packing_falls_back_to_blocked(monkeypatch: pytest.MonkeyPatch) -> None:
    """A oneDNN that cannot pack fp32 weights leaves the no-copy `blocked` kernel, not `linear`."""

    def cannot_pack(w: torch.Tensor) -> object:
        raise RuntimeError("no oneDNN here")

    monkeypatch.setattr(dense, "_packed", cannot_pack)
    gen = torch.Generator().manual_seed(3)
    layers = [{"qkv": torch.randn(128, 16, generator=gen), "o": torch.randn(16, 16, generator=gen)}]
    head = torch.randn(64, 16, generator=gen)
    kernels = DenseKernels.build(layers, head, "packed")
    assert kernels.name == "blocked"
    x = torch.randn(6, 16, generator=gen)
    with torch.inference_mode():
        torch.testing.assert_close(kernels.layers[0]["qkv"](x), F.linear(x, layers[0]["qkv"]))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "m", seed=5)


@pytest.mark.parametrize("same_length", [True, False])
def test_decode_rows_in_any_order_match_hf(model_dir: Path, same_length: bool) -> None:
    model = SlottedDecoder.from_dir(model_dir, max_loras=2, max_lora_rank=8, target_modules=ALL)
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(2)
    rows = [0, 2, 3, 5, 6]  # not consecutive: read through a gather
    lengths = [9] * len(rows) if same_length else [4 + 3 * i for i in range(len(rows))]
    prompts = [torch.randint(3, 250, (n,), generator=gen) for n in lengths]
    cache = KVCache(model.config, 8, 64, torch.float32, torch.device("cpu"))
    for row, ids in zip(rows, prompts, strict=True):
        model.prefill(ids[:-1], cache, row, 0)
    last = torch.stack([p[-1] for p in prompts])
    positions = torch.tensor([n - 1 for n in lengths])
    logits = model.decode(last, rows, positions, LoRABatch.from_slots([0] * len(rows)), cache)
    with torch.no_grad():
        for i, ids in enumerate(prompts):
            expected = hf(ids.unsqueeze(0)).logits[0, -1]
            assert (logits[i] - expected).abs().max().item() < 1e-4


class _SlotLoRA:
    """The engine's slot buffers read through the plain reference (a decoder `LoRAUpdate`)."""

    def __init__(self, model: SlottedDecoder, slots: list[int]):
        self.model, self.slot_ids = model, torch.tensor(slots)

    def delta(self, layer: int, group: str, x: torch.Tensor) -> torch.Tensor | None:
        slots = self.model.slots[layer].get(group)
        if slots is None:
            return None
        return lora_delta_reference(x, slots.a, slots.dense_b(), self.slot_ids)


def test_fast_paths_with_adapters_match_the_shared_decoder(model_dir: Path) -> None:
    model = SlottedDecoder.from_dir(model_dir, max_loras=3, max_lora_rank=8, target_modules=ALL)
    for slot, (rank, targets) in enumerate([(4, ("q_proj", "v_proj")), (8, ALL)], start=1):
        model.write_slot(
            slot, random_lora_weights(model.limits, rank=rank, seed=slot, target_modules=targets)
        )
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 250, (n,), generator=gen) for n in (7, 11, 5)]
    row_slots = [1, 2, 0]
    cache = KVCache(model.config, 4, 32, torch.float32, torch.device("cpu"))
    prefilled = [
        model.prefill(ids[:-1], cache, row, slot)
        for row, (ids, slot) in enumerate(zip(prompts, row_slots, strict=True))
    ]
    last = torch.stack([p[-1] for p in prompts])
    positions = torch.tensor([len(p) - 1 for p in prompts])
    decoded = model.decode(last, [0, 1, 2], positions, LoRABatch.from_slots(row_slots), cache)
    with torch.no_grad():
        for i, (ids, slot) in enumerate(zip(prompts, row_slots, strict=True)):
            hidden = forward_hidden(model.base, ids.unsqueeze(0), _SlotLoRA(model, [slot]))[0]
            logits = hidden @ model.base.lm_head.t()  # [T, V]
            torch.testing.assert_close(prefilled[i], logits[-2], atol=1e-4, rtol=0)
            torch.testing.assert_close(decoded[i], logits[-1], atol=1e-4, rtol=0)
        base_only = (
            forward_hidden(model.base, prompts[0].unsqueeze(0))[0, -1] @ model.base.lm_head.t()
        )
    assert (decoded[0] - base_only).abs().max() > 1e-3  # the adapter really changes the output


@pytest.mark.parametrize(
    ("same_length", "dtype"),
    [(True, torch.float32), (False, torch.float32), (False, torch.bfloat16)],
)
@pytest.mark.parametrize("row_slots", [[3, 1, 4, 2], [3, 1, 3, 3]])  # batched; runs
def test_mixed_adapters_in_any_row_order_match_each_adapter_alone(
    model_dir: Path, same_length: bool, dtype: torch.dtype, row_slots: list[int]
) -> None:
    """A batch whose rows are not grouped by slot is decoded in slot order (rows permuted,
    the cache read in place), each adapter read only up to the batch's highest rank:
    every row's logits are those of its adapter decoding alone (bf16: on this CPU's
    bf16 kernel, `packed` or `upcast`)."""
    model = SlottedDecoder.from_dir(
        model_dir, max_loras=4, max_lora_rank=8, target_modules=ALL, dtype=dtype
    )
    for slot in range(1, 5):
        weights = random_lora_weights(model.limits, rank=4 + slot % 2 * 4, seed=10 + slot)
        model.write_slot(slot, weights)
    gen = torch.Generator().manual_seed(4)
    rows = [2, 0, 3, 1]  # a run of rows, neither in row nor slot order
    lengths = [8] * 4 if same_length else [6, 9, 5, 12]
    prompts = [torch.randint(3, 250, (n,), generator=gen) for n in lengths]
    cache = KVCache(model.config, 4, 32, dtype, torch.device("cpu"))
    for row, ids, slot in zip(rows, prompts, row_slots, strict=True):
        model.prefill(ids[:-1], cache, row, slot)
    last = torch.stack([p[-1] for p in prompts])
    positions = torch.tensor([n - 1 for n in lengths])
    batch = LoRABatch.from_slots(row_slots)
    assert batch.slot_order() is not None  # the reordering path is the one under test
    mixed = model.decode(last, rows, positions, batch, cache)
    for i, (row, slot) in enumerate(zip(rows, row_slots, strict=True)):
        alone = model.decode(
            last[i : i + 1], [row], positions[i : i + 1], LoRABatch.from_slots([slot]), cache
        )
        if dtype == torch.float32:
            torch.testing.assert_close(mixed[i], alone[0], atol=1e-4, rtol=0)
            assert mixed[i].argmax() == alone[0].argmax()
        else:  # bf16 rounds the residual stream: batched and single rows may differ by an ulp
            torch.testing.assert_close(mixed[i], alone[0], atol=0.1, rtol=0.02)
    if dtype != torch.float32:
        return
    with torch.no_grad():
        ids = prompts[1]
        hidden = forward_hidden(model.base, ids.unsqueeze(0), _SlotLoRA(model, [row_slots[1]]))[0]
        torch.testing.assert_close(mixed[1], hidden[-1] @ model.base.lm_head.t(), atol=1e-4, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_many_matches_each_sequence_prefilled_alone(
    model_dir: Path, dtype: torch.dtype
) -> None:
    """Chunks of several sequences in one forward (mixed adapters, the base model, one
    adapter twice, chunks after a cached prefix and from position 0) give each chunk's
    logits and write each row's keys/values as that sequence prefilled alone; no other
    row or position of the cache changes."""
    model = SlottedDecoder.from_dir(
        model_dir, max_loras=3, max_lora_rank=8, target_modules=ALL, dtype=dtype
    )
    for slot, rank in ((1, 4), (2, 8), (3, 8)):
        model.write_slot(slot, random_lora_weights(model.limits, rank=rank, seed=20 + slot))
    gen = torch.Generator().manual_seed(6)
    # (row, slot, cached prefix length, chunk length)
    plan = [(3, 2, 0, 9), (0, 1, 6, 5), (4, 0, 3, 7), (1, 2, 0, 1), (2, 3, 10, 4)]
    cpu = torch.device("cpu")
    batched = KVCache(model.config, 6, 32, dtype, cpu)
    alone = KVCache(model.config, 6, 32, dtype, cpu)
    chunks, want = [], []
    for row, slot, cached, length in plan:
        ids = torch.randint(3, 250, (cached + length,), generator=gen)
        if cached:  # the same prefix in both caches, as a prefix-cache load would leave it
            for cache in (batched, alone):
                model.prefill(ids[:cached], cache, row, slot)
        chunks.append(PrefillChunk(ids[cached:], row, slot, cached))
        want.append(model.prefill(ids[cached:], alone, row, slot, start=cached))
    untouched = batched.k[:, 5].clone()
    got = model.prefill_many(chunks, batched)
    assert got.shape == (len(plan), model.config.vocab_size) and got.dtype == torch.float32
    tol = {"atol": 1e-4, "rtol": 0} if dtype == torch.float32 else {"atol": 0.1, "rtol": 0.02}
    for i, (row, _, cached, length) in enumerate(plan):
        torch.testing.assert_close(got[i], want[i], **tol)
        if dtype == torch.float32:
            assert got[i].argmax() == want[i].argmax()
        span = slice(0, cached + length)
        for stored, ref in ((batched.k, alone.k), (batched.v, alone.v)):
            torch.testing.assert_close(
                stored[:, row, :, span].float(), ref[:, row, :, span].float(), **tol
            )
    assert torch.equal(batched.k[:, 5], untouched)
    assert (want[0] - want[3]).abs().max() > 1e-3  # different chunks really differ
