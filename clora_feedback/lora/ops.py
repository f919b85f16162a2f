"""Per-row multi-LoRA math: every row of a batch may use a different adapter.

Adapters live in preallocated slot buffers (see `clora_feedback.engine.decoder`):
`a_slots` [S, R, in] and `b_slots` [S, out, R], slot 0 all zeros ("no
adapter"), lower ranks zero-padded to R, the alpha/r scaling folded into B.

`lora_delta_reference` is the plain-torch definition (gather each row's A and
B, batched matmul). `lora_delta` and `add_lora_delta_` are the fast paths for
that layout; `tests/test_engine_fast_paths.py` checks that they agree.

Semantics (all three functions):
    delta[b, t, :] = x[b, t, :] @ a_slots[slot_ids[b]].T @ b_slots[slot_ids[b]].T

The engine stores B of a fused projection (q/k/v, gate/up) in block form
instead (`LoRAOutputBlock`, `add_lora_update_`): B of a fused group is
block-diagonal (member j's output only reads member j's ranks), so storing it
densely would make every step read 2-3x zeros. A block holds the B^T of
consecutive members of equal output width, [S, members, R, out]; the
semantics are those of the dense form, `blocks_to_dense`.

How the fast paths mix adapters without a per-row gather of A and B: rows
are grouped by slot (once per batch, see `LoRABatch.mix_plan`), and the
update is batched matmuls over the slots in use, [n, m, in] @ A^T ->
[n, m, R] @ B^T -> [n, m, out] (n slots, m rows per slot), added in place
when the rows are already grouped, else scattered back with `index_add_`.
Each slot's A and B are read once, streamed in their stored layout, never
copied; when the slots in use form a run lo..hi the operands are views. On
CPU this streams adapter bytes ~3x faster than one dense [B, n*R] matmul
(which repacks the whole [n*R, out] operand per call) and ~5x faster than
gathering per-row copies.

A batch of few adapters in uneven groups (a release gate's or a canary's row
beside an agent's rows: 4 + 1) would pad every group to the largest and gather
and scatter every projection. When the token rows form at most `_MAX_RUNS`
contiguous runs of one slot each (the decoder sorts rows by slot to make them
so, `LoRABatch.slot_order`), each run gets the one-adapter update on views of
its rows instead: no padding, no gather, no scatter.

Not here: slot bookkeeping, file formats.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

_MAX_RUNS = 3  # slots in use up to which contiguous runs beat the batched, padded update


@dataclass(frozen=True)
class _MixPlan:
    """Rows of a mixed batch grouped by slot: n slots x m rows (padded).

    Attributes:
        lo, hi: slot run lo..hi (inclusive), read as views; unused when `index` is set.
        index: [n] slots to gather instead (when the run would read many unused slots).
        rows: [n*m] token row feeding each (slot, j) entry; padding points at row 0.
        padded: [n*m] bool, true for padding entries (None when there are none).
        m: rows per slot.
        in_order: `rows` is 0..n*m-1 with no padding (token rows already grouped by slot).
        runs: (slot, first, end) of each run of token rows of one adapter slot (slot 0
            left out), when the rows of each slot are contiguous, the groups uneven and
            the slots at most `_MAX_RUNS`; else None.
    """

    lo: int
    hi: int
    index: torch.Tensor | None
    rows: torch.Tensor
    padded: torch.Tensor | None
    m: int
    in_order: bool
    runs: tuple[tuple[int, int, int], ...] | None = None

    @property
    def n(self) -> int:
        return self.rows.numel() // self.m


@dataclass(frozen=True)
class LoRABatch:
    """Which slot each batch row uses, with the facts the fast path dispatches on.

    Attributes:
        slot_ids: [B] int64 slot per row (0 = no adapter).
        uniform_slot: the slot shared by every row, or None when rows differ.
        rank: the highest adapter rank among the rows' slots (their higher ranks
            are zero padding, so the fast path reads only the first `rank`); None:
            the slots' full rank.
    """

    slot_ids: torch.Tensor
    uniform_slot: int | None
    rank: int | None = None
    # Per-batch derived values (mixing plan, masks per dtype), computed once and
    # shared by every projection of every layer in the step.
    _memo: dict[object, object] = field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def from_slots(
        cls, slots: list[int], device: torch.device | str = "cpu", rank: int | None = None
    ) -> LoRABatch:
        uniform = slots[0] if slots and all(s == slots[0] for s in slots) else None
        return cls(torch.tensor(slots, dtype=torch.long, device=device), uniform, rank)

    @property
    def is_base_only(self) -> bool:
        return self.uniform_slot == 0

    def mix_plan(self, tokens_per_row: int = 1) -> _MixPlan:
        """Group the token rows ([B * tokens_per_row], row-major) by slot."""
        key = ("plan", tokens_per_row)
        plan = self._memo.get(key)
        if plan is None:
            plan = _build_plan(self.slot_ids, tokens_per_row)
            self._memo[key] = plan
        assert isinstance(plan, _MixPlan)
        return plan

    def slot_order(self) -> torch.Tensor | None:
        """[B] order of the rows that groups them by slot, when that makes the plan in order.

        None when the rows share one slot, are already grouped (`mix_plan().in_order`),
        or sorting would not help (uneven groups of more than `_MAX_RUNS` slots, gaps in
        the slot run: the fast path gathers then anyway). A caller that reorders its rows
        so (`reordered`) gets the in-place update, with no gather or scatter per projection.
        """
        if self.uniform_slot is not None:
            return None
        key = "order"
        if key not in self._memo:
            order = None
            plan = self.mix_plan()
            if not plan.in_order and plan.runs is None:
                ranked = torch.argsort(self.slot_ids, stable=True)
                sorted_plan = _build_plan(self.slot_ids[ranked], 1)
                if sorted_plan.in_order or sorted_plan.runs is not None:
                    order = ranked
            self._memo[key] = order
        cached = self._memo[key]
        assert cached is None or isinstance(cached, torch.Tensor)
        return cached

    def reordered(self, order: torch.Tensor) -> LoRABatch:
        """The same batch with its rows taken in `order`."""
        return LoRABatch(self.slot_ids[order], self.uniform_slot, self.rank)

    def mix_padding(self, plan: _MixPlan, dtype: torch.dtype) -> torch.Tensor:
        """[n, m, 1] multiplier zeroing the padding entries of `plan`."""
        key = ("keep", id(plan), dtype)
        keep = self._memo.get(key)
        if keep is None:
            assert plan.padded is not None
            keep = (~plan.padded).to(dtype).view(plan.n, plan.m, 1)
            self._memo[key] = keep
        assert isinstance(keep, torch.Tensor)
        return keep


def _build_plan(slot_ids: torch.Tensor, tokens_per_row: int) -> _MixPlan:
    slots = [int(s) for s in slot_ids.tolist()]
    groups: dict[int, list[int]] = {}
    for b, s in enumerate(slots):
        if s != 0:
            groups.setdefault(s, []).extend(range(b * tokens_per_row, (b + 1) * tokens_per_row))
    used = sorted(groups)
    lo, hi = used[0], used[-1]
    # A run reads the unused slots in between; gathering copies each used slot
    # and reads it again (~3x its bytes). Take the run unless it is 2x wider.
    index = None
    order = list(range(lo, hi + 1))
    if len(order) > 2 * len(used):
        order = used
        index = torch.tensor(used, dtype=torch.long, device=slot_ids.device)
    m = max(len(g) for g in groups.values())
    rows: list[int] = []
    padded: list[bool] = []
    for s in order:
        group = groups.get(s, [])
        rows += group + [0] * (m - len(group))
        padded += [False] * len(group) + [True] * (m - len(group))
    in_order = rows == list(range(len(slots) * tokens_per_row))
    runs = None
    if not in_order and len(used) <= _MAX_RUNS:
        spans = [(s, g[0], g[-1] + 1) for s, g in groups.items()]
        if all(end - first == len(groups[s]) for s, first, end in spans):
            runs = tuple(sorted(spans, key=lambda span: span[1]))
    return _MixPlan(
        lo,
        hi,
        index,
        torch.tensor(rows, dtype=torch.long, device=slot_ids.device),
        torch.tensor(padded, device=slot_ids.device) if any(padded) else None,
        m,
        in_order=in_order,
        runs=runs,
    )


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


def add_lora_delta_(
    y: torch.Tensor,
    x: torch.Tensor,
    a_slots: torch.Tensor,
    b_slots: torch.Tensor,
    batch: LoRABatch,
) -> None:
    """In place: `y += delta` with the semantics of `lora_delta_reference`.

    Args:
        y: [B, T, out] or [B, out] contiguous base projection output (modified).
        x: [B, T, in] or [B, in] activations (T = 1 when 2-D).
        a_slots: [S, R, in] stacked A matrices.
        b_slots: [S, out, R] stacked (pre-scaled) B matrices.
        batch: the slot of each of the B rows.
    """
    if batch.uniform_slot == 0:
        return
    fan_in, fan_out = x.shape[-1], y.shape[-1]
    x2 = x.reshape(-1, fan_in)
    y2 = y.view(-1, fan_out)
    if batch.uniform_slot is not None:
        # One adapter for every row: a plain matmul pair over all tokens.
        shrunk = x2 @ a_slots[batch.uniform_slot].t()  # [N, R]
        y2.addmm_(shrunk, b_slots[batch.uniform_slot].t())
        return
    plan = batch.mix_plan(x2.shape[0] // batch.slot_ids.shape[0])
    if plan.runs is not None:  # few adapters, rows contiguous per slot: views per run
        for slot, first, end in plan.runs:
            shrunk = x2[first:end] @ a_slots[slot].t()
            y2[first:end].addmm_(shrunk, b_slots[slot].t())
        return
    a, b = _plan_slots(a_slots, plan), _plan_slots(b_slots, plan)  # [n, R, in], [n, out, R]
    if plan.in_order:  # rows already grouped by slot: no gather, accumulate in place
        shrunk = torch.bmm(x2.view(plan.n, plan.m, fan_in), a.transpose(1, 2))  # [n, m, R]
        y2.view(plan.n, plan.m, fan_out).baddbmm_(shrunk, b.transpose(1, 2))
        return
    grouped = x2.index_select(0, plan.rows).view(plan.n, plan.m, fan_in)
    if plan.padded is not None:
        grouped = grouped * batch.mix_padding(plan, x.dtype)
    shrunk = torch.bmm(grouped, a.transpose(1, 2))  # [n, m, R]
    update = torch.bmm(shrunk, b.transpose(1, 2))  # [n, m, out]
    y2.index_add_(0, plan.rows, update.view(-1, fan_out))


def lora_delta(
    x: torch.Tensor, a_slots: torch.Tensor, b_slots: torch.Tensor, batch: LoRABatch
) -> torch.Tensor | None:
    """Fast per-row LoRA update with the semantics of `lora_delta_reference`.

    Returns None when every row uses slot 0 (the update is exactly zero), so the
    caller skips the add. Otherwise returns the [B, T, out] update (see
    `add_lora_delta_` for how rows with different adapters are combined).
    """
    if batch.uniform_slot == 0:
        return None
    out = x.new_zeros(*x.shape[:-1], b_slots.shape[1])
    add_lora_delta_(out, x, a_slots, b_slots, batch)
    return out


@dataclass(frozen=True)
class LoRAOutputBlock:
    """B of consecutive members of a fused projection that share an output width.

    The matching A is rank-major: `a_slots` [S, R * T, in] for T targeted members,
    row r * T + t holding rank r of member t, so an update of rank r <= R reads the
    first r * T rows of each slot and the first r rows of each member's B^T.

    Attributes:
        column: first output column of the block in the fused projection.
        member: index (among the T targeted members) of the block's first member.
        bt: [S, members, R, width] B^T per slot and member, alpha/r folded in,
            ranks zero-padded to R; member j owns output columns
            column + j*width ... and shrink columns r * T + member + j.
    """

    column: int
    member: int
    bt: torch.Tensor

    @property
    def members(self) -> int:
        return self.bt.shape[1]

    @property
    def max_rank(self) -> int:
        return self.bt.shape[2]

    @property
    def width(self) -> int:
        return self.bt.shape[3]


def blocks_to_dense(
    blocks: Sequence[LoRAOutputBlock], out_features: int, rank: int
) -> torch.Tensor:
    """The dense [S, out_features, rank] form of `blocks` (the reference), `rank` = R * T."""
    first = blocks[0].bt
    dense = first.new_zeros(first.shape[0], out_features, rank)
    targeted = rank // first.shape[2]
    for blk in blocks:
        for j in range(blk.members):
            c = blk.column + j * blk.width
            dense[:, c : c + blk.width, blk.member + j :: targeted] = blk.bt[:, j].transpose(1, 2)
    return dense


def _plan_slots(buffer: torch.Tensor, plan: _MixPlan) -> torch.Tensor:
    """The plan's slots of a per-slot buffer: a view of the run, or a gather."""
    if plan.index is None:
        return buffer[plan.lo : plan.hi + 1]
    return buffer.index_select(0, plan.index)


def _add_one_slot_(
    y2: torch.Tensor,
    x2: torch.Tensor,
    a_slots: torch.Tensor,
    blocks: Sequence[LoRAOutputBlock],
    slot: int,
    r: int,
    targeted: int,
) -> None:
    """In place: `y2 += delta` of one slot's adapter for every row of `x2` [N, in]."""
    shrunk = (x2 @ a_slots[slot, : r * targeted].t()).view(-1, r, targeted)  # [N, r, T]
    for blk in blocks:
        k, w = blk.members, blk.width
        cols = y2[:, blk.column : blk.column + k * w]
        if k == 1:
            cols.addmm_(shrunk[:, :, blk.member], blk.bt[slot, 0, :r])
        else:  # [k, N, r] @ [k, r, w] -> [k, N, w]
            part = shrunk[:, :, blk.member : blk.member + k].permute(2, 0, 1)
            update = torch.bmm(part, blk.bt[slot, :, :r])
            cols.view(-1, k, w).add_(update.transpose(0, 1))


def add_lora_update_(
    y: torch.Tensor,
    x: torch.Tensor,
    a_slots: torch.Tensor,
    blocks: Sequence[LoRAOutputBlock],
    batch: LoRABatch,
) -> None:
    """In place: `y += delta` for B in block form.

    Same result as `add_lora_delta_(y, x, a_slots, blocks_to_dense(...), batch)`.

    Args:
        y: [B, T, out] or [B, out] contiguous base projection output (modified).
        x: [B, T, in] or [B, in] activations.
        a_slots: [S, R * T_g, in] rank-major A of every targeted member (see
            `LoRAOutputBlock`).
        blocks: the output blocks of the members that carry LoRA weights.
        batch: the slot of each of the B rows, and the highest rank they use
            (`LoRABatch.rank`: only the first `rank` ranks of each slot are read).
    """
    rank = batch.rank
    if batch.uniform_slot == 0 or not blocks or rank == 0:
        return
    fan_in, fan_out = x.shape[-1], y.shape[-1]
    full = blocks[0].max_rank
    targeted = a_slots.shape[1] // full
    r = full if rank is None else min(rank, full)
    x2 = x.reshape(-1, fan_in)
    y2 = y.view(-1, fan_out)
    if batch.uniform_slot is not None:
        _add_one_slot_(y2, x2, a_slots, blocks, batch.uniform_slot, r, targeted)
        return
    plan = batch.mix_plan(x2.shape[0] // batch.slot_ids.shape[0])
    if plan.runs is not None:  # few adapters, rows contiguous per slot: views per run
        for slot, first, end in plan.runs:
            _add_one_slot_(y2[first:end], x2[first:end], a_slots, blocks, slot, r, targeted)
        return
    n, m = plan.n, plan.m
    a = _plan_slots(a_slots, plan)[:, : r * targeted]  # [n, r*T, in]
    if plan.in_order:  # rows already grouped by slot: no gather, accumulate in place
        grouped = x2.view(n, m, fan_in)
        target = y2
    else:
        grouped = x2.index_select(0, plan.rows).view(n, m, fan_in)
        if plan.padded is not None:
            grouped = grouped * batch.mix_padding(plan, x.dtype)
        target = y2.new_zeros(n * m, fan_out)
    shrunk = torch.bmm(grouped, a.transpose(1, 2)).view(n, m, r, targeted)
    for blk in blocks:
        k, w = blk.members, blk.width
        bt = _plan_slots(blk.bt, plan)[:, :, :r]  # [n, k, r, w]
        cols = target[:, blk.column : blk.column + k * w].view(n, m, k, w)
        if k == 1:
            cols[:, :, 0].add_(torch.bmm(shrunk[:, :, :, blk.member], bt[:, 0]))
        else:  # members as extra batch entries: [n*k, m, r] @ [n*k, r, w]
            part = shrunk[:, :, :, blk.member : blk.member + k].permute(0, 3, 1, 2)
            update = torch.bmm(part.reshape(n * k, m, r), bt.reshape(n * k, r, w))
            cols.add_(update.view(n, k, m, w).transpose(1, 2))
    if not plan.in_order:
        y2.index_add_(0, plan.rows, target)
