"""The per-row multi-LoRA engine against PEFT, the reference implementation of LoRA.

A decode batch mixing several adapters (different ranks, different target
modules, plus base-model rows) must give each row the logits that
`peft.PeftModel` gives for that adapter alone. Tolerance: 1e-4 absolute on
fp32 logits (observed ~1e-6; the slack covers summation-order differences).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from clora_feedback.engine.decoder import KVCache, SlottedDecoder
from clora_feedback.lora.ops import LoRABatch, lora_delta, lora_delta_reference
from clora_feedback.lora.peft_io import load_peft_adapter, save_peft_adapter
from clora_feedback.lora.weights import LoRAWeights, random_lora_weights
from clora_feedback.model.tiny import build_tiny_model_dir

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TOL = 1e-4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "m", seed=3)


def _adapters(model: SlottedDecoder) -> list[LoRAWeights]:
    specs = [
        (2, ALL),
        (4, ("q_proj", "v_proj")),
        (8, ("gate_proj", "down_proj", "o_proj")),
        (16, ALL),
    ]
    return [
        random_lora_weights(
            model.limits, rank=r, alpha=2.0 * r, seed=10 + i, std=0.2, target_modules=t
        )
        for i, (r, t) in enumerate(specs)
    ]


def _peft_logits(model_dir: Path, adapter_dir: Path | None, ids: torch.Tensor) -> torch.Tensor:
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    model = PeftModel.from_pretrained(base, str(adapter_dir)).eval() if adapter_dir else base
    with torch.no_grad():
        return model(ids.unsqueeze(0)).logits[0].float()


def test_mixed_batch_matches_each_adapter_alone_through_peft(
    model_dir: Path, tmp_path: Path
) -> None:
    model = SlottedDecoder.from_dir(model_dir, max_loras=4, max_lora_rank=16, target_modules=ALL)
    adapters = _adapters(model)
    dirs = []
    for i, w in enumerate(adapters):
        save_peft_adapter(w, tmp_path / f"a{i}", base_model=str(model_dir))
        model.write_slot(i + 1, load_peft_adapter(tmp_path / f"a{i}", limits=model.limits))
        dirs.append(tmp_path / f"a{i}")
    # Rows: base, adapters 1..4, adapter 2 again; each with its own prompt length.
    row_slots = [0, 1, 2, 3, 4, 2]
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 200, (5 + 3 * r,), generator=gen) for r in range(len(row_slots))]
    cache = KVCache(model.config, len(row_slots), 64, torch.float32, torch.device("cpu"))
    for row, (slot, ids) in enumerate(zip(row_slots, prompts, strict=True)):
        model.prefill(ids[:-1], cache, row, slot)
    last = torch.stack([p[-1] for p in prompts])
    positions = torch.tensor([len(p) - 1 for p in prompts])
    lora = LoRABatch.from_slots(row_slots)
    assert lora.uniform_slot is None
    mixed = model.decode(last, list(range(len(row_slots))), positions, lora, cache)
    for row, (slot, ids) in enumerate(zip(row_slots, prompts, strict=True)):
        expected = _peft_logits(model_dir, dirs[slot - 1] if slot else None, ids)[-1]
        err = (mixed[row] - expected).abs().max().item()
        assert err < TOL, f"row {row} (slot {slot}): max |diff| {err}"
    # The adapters really change the output, so the comparison above is not vacuous.
    assert (mixed[1] - mixed[0]).abs().max() > 1e-2


def test_prefill_with_adapter_matches_peft(model_dir: Path, tmp_path: Path) -> None:
    model = SlottedDecoder.from_dir(model_dir, max_loras=2, max_lora_rank=16, target_modules=ALL)
    weights = _adapters(model)[3]
    save_peft_adapter(weights, tmp_path / "a", base_model=str(model_dir))
    model.write_slot(2, weights)
    ids = torch.randint(3, 200, (40,), generator=torch.Generator().manual_seed(1))
    cache = KVCache(model.config, 1, 64, torch.float32, torch.device("cpu"))
    model.prefill(ids[:25], cache, 0, 2)
    logits = model.prefill(
        ids[25:], cache, 0, 2, start=25
    )  # a second chunk reads the cached prefix
    expected = _peft_logits(model_dir, tmp_path / "a", ids)[-1]
    assert (logits - expected).abs().max().item() < TOL


@pytest.mark.parametrize("slots", [[0, 0, 0], [2, 2, 2], [1, 0, 3], [3, 1, 3]])
def test_fast_lora_op_matches_reference(slots: list[int]) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 12, generator=gen)
    a = torch.randn(4, 6, 12, generator=gen)
    b = torch.randn(4, 7, 6, generator=gen)
    a[0].zero_()
    b[0].zero_()
    batch = LoRABatch.from_slots(slots)
    ref = lora_delta_reference(x, a, b, batch.slot_ids)
    fast = lora_delta(x, a, b, batch)
    if fast is None:
        assert batch.is_base_only and ref.abs().max() == 0
    else:
        torch.testing.assert_close(fast, ref)
