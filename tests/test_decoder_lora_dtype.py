"""A bf16 decoder on a CPU keeps its adapter slots and LoRA update in fp32.

torch's bf16 kernels cost 2-4x their fp32 twins on the LoRA update's shapes
(a few rows times rank-r factors), so a bf16 engine on a CPU multiplies the
base in bf16 and the adapters in fp32, adding the update once per projection.
Checked on the tiny model: the slots are fp32, and a mixed-adapter decode step
in bf16 gives, per row, the fp32 reference forward's logits with that row's
adapter (`model.decoder.forward_hidden`, which PEFT is checked against) within
a tenth of what the adapter moves them (bf16 rounding of the base stream).
"""

from __future__ import annotations

from pathlib import Path

import torch

from clora_feedback.engine.decoder import KVCache, SlottedDecoder
from clora_feedback.lora.ops import LoRABatch
from clora_feedback.lora.weights import module_key, random_lora_weights
from clora_feedback.model.base import GROUPS
from clora_feedback.model.decoder import forward_hidden

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class _Adapter:
    """One adapter as the reference forward's `LoRAUpdate` (fp32, dense per member)."""

    def __init__(self, weights: object, shapes: dict[str, tuple[int, int]]):
        self.weights = weights
        self.shapes = shapes

    def delta(self, layer: int, group: str, x: torch.Tensor) -> torch.Tensor | None:
        parts = []
        for name in dict(GROUPS)[group]:
            pair = self.weights.tensors.get(module_key(layer, name))  # type: ignore[attr-defined]
            if pair is None:
                parts.append(x.new_zeros(*x.shape[:-1], self.shapes[name][1]))
            else:
                a, b = pair
                parts.append(x @ a.t() @ b.t() * self.weights.scaling)  # type: ignore[attr-defined]
        return torch.cat(parts, dim=-1)


def test_bf16_decoder_keeps_fp32_adapters_and_matches_the_fp32_reference(
    tiny_model_dir: Path,
) -> None:
    bf16 = SlottedDecoder.from_dir(
        tiny_model_dir, max_loras=3, max_lora_rank=8, target_modules=ALL, dtype=torch.bfloat16
    )
    fp32 = SlottedDecoder.from_dir(
        tiny_model_dir, max_loras=3, max_lora_rank=8, target_modules=ALL, dtype=torch.float32
    )
    assert bf16.lora_dtype == torch.float32 and fp32.lora_dtype == torch.float32
    assert all(s.a.dtype == torch.float32 for layer in bf16.slots for s in layer.values())
    adapters = {}
    for slot in (1, 2, 3):
        weights = random_lora_weights(bf16.limits, rank=8, seed=slot)
        for key, (a, b) in weights.tensors.items():  # adapters that move the logits visibly
            weights.tensors[key] = (a, b * 20)
        bf16.write_slot(slot, weights)
        adapters[slot] = weights
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 250, (7,), generator=gen) for _ in range(3)]
    cache = KVCache(bf16.config, 3, 16, torch.bfloat16, torch.device("cpu"))
    slots = [2, 3, 1]
    for row, (ids, slot) in enumerate(zip(prompts, slots, strict=True)):
        bf16.prefill(ids[:-1], cache, row, slot)
    logits = bf16.decode(
        torch.stack([p[-1] for p in prompts]),
        [0, 1, 2],
        torch.tensor([6, 6, 6]),
        LoRABatch.from_slots(slots),
        cache,
    )
    shapes = fp32.config.projection_shapes()
    with torch.no_grad():
        for row, (ids, slot) in enumerate(zip(prompts, slots, strict=True)):
            lora = _Adapter(adapters[slot], shapes)
            hidden = forward_hidden(fp32.base, ids.unsqueeze(0), lora)[0, -1]
            want = hidden @ fp32.base.lm_head.t()
            base = forward_hidden(fp32.base, ids.unsqueeze(0))[0, -1] @ fp32.base.lm_head.t()
            effect = float((want - base).abs().max())
            error = float((logits[row] - want).abs().max())
            assert effect > 0.5 and error < 0.1 * effect, (effect, error)
