"""Per-row multi-LoRA math: every row of a batch may use a different adapter.

Adapters live in preallocated slot buffers (see `clora_feedback.engine.model`):
`a_slots` [S, R, in] and `b_slots` [S, out, R], slot 0 all zeros ("no
adapter"), lower ranks zero-padded to R, the alpha/r scaling folded into B.

`lora_delta_reference` is the plain-torch definition (gather each row's A and
B, batched matmul). `lora_delta` is the dispatching fast path used by the
engine; `tests/test_lora_ops.py` checks that the two agree.

Semantics (both functions):
    delta[b, t, :] = x[b, t, :] @ a_slots[slot_ids[b]].T @ b_slots[slot_ids[b]].T
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LoRABatch:
    """Which slot each batch row uses, with the facts the fast path dispatches on.

    Attributes:
        slot_ids: [B] int64 slot per row (0 = no adapter).
        uniform_slot: the slot shared by every row, or None when rows differ.
    """

    slot_ids: torch.Tensor
    uniform_slot: int | None

    @classmethod
    def from_slots(cls, slots: list[int], device: torch.device | str = "cpu") -> LoRABatch:
        uniform = slots[0] if slots and all(s == slots[0] for s in slots) else None
        return cls(torch.tensor(slots, dtype=torch.long, device=device), uniform)

    @property
    def is_base_only(self) -> bool:
        return self.uniform_slot == 0


def lora_delta_reference(
    x: torch.Tensor, a_slots: torch.Tensor, b_slots: torch.Tensor, slot_ids: torch.Tensor
) -> torch.Tensor:
    """Reference per-row LoRA update.

    Args:
        x: [B, T, in] activations.
        a_slots: [S, R, in] stacked A matrices.
        b_slots: [S, out, R] stacked (pre-scaled) B matrices.
        slot_ids: [B] slot index per row.

    Returns:
        [B, T, out] update to add to the base projection's output.
    """
    a = a_slots.index_select(0, slot_ids)  # [B, R, in]
    b = b_slots.index_select(0, slot_ids)  # [B, out, R]
    return torch.bmm(torch.bmm(x, a.transpose(1, 2)), b.transpose(1, 2))


def lora_delta(
    x: torch.Tensor, a_slots: torch.Tensor, b_slots: torch.Tensor, batch: LoRABatch
) -> torch.Tensor | None:
    """Fast per-row LoRA update with the semantics of `lora_delta_reference`.

    Returns None when every row uses slot 0 (the update is exactly zero), so the
    caller skips the add. When all rows share one adapter, the rows are flattened
    into one plain matmul pair instead of a gather + batched matmul.
    """
    if batch.uniform_slot == 0:
        return None
    if batch.uniform_slot is not None:
        a = a_slots[batch.uniform_slot]  # [R, in]
        b = b_slots[batch.uniform_slot]  # [out, R]
        return (x @ a.t()) @ b.t()
    return lora_delta_reference(x, a_slots, b_slots, batch.slot_ids)
