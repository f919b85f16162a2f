"""The serving fast path of the base decoder: per-row multi-LoRA slots and a slotted KV cache.

The base tensors, config and RoPE tables come from `clora_feedback.model`
(shared, read-only); this module adds what only serving needs: every target
projection owns preallocated adapter slot buffers (see
`clora_feedback.lora.ops`), dense kernels tuned for a few rows (see `dense`),
and a KV cache that is a fixed array of rows so sequences join and leave the
batch without reallocation. Its outputs match the differentiable reference
forward in `clora_feedback.model.decoder` (tests/test_engine_fast_paths.py).

Entry points: `prefill` (one sequence, many tokens, fills its cache row),
`prefill_many` (prompt chunks of several sequences in one forward, each with
its own adapter, row and start) and `decode` (many sequences, one token each,
every row with its own adapter).

Not here: the base weights and the differentiable forward (`clora_feedback.model`),
scheduling, sampling, tokenisation (see `embedded`, `sampling`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from clora_feedback.engine.dense import DenseKernels
from clora_feedback.errors import AdapterError
from clora_feedback.lora.ops import (
    LoRABatch,
    LoRAOutputBlock,
    add_lora_update_,
    blocks_to_dense,
)
from clora_feedback.lora.weights import LoRAWeights, module_key
from clora_feedback.model.base import GROUPS, BaseWeights
from clora_feedback.model.config import ModelConfig


class LoRASlots:
    """Adapter slot buffers for one fused projection group of one layer.

    `a` is [S, R * T, in] for T targeted member projections, rank-major (row
    r * T + t is rank r of member t), so the "shrink" of a fused q/k/v (or
    gate/up) update is one matmul, and a batch whose adapters have rank r <= R
    reads only the first r * T rows of each slot (no zero padding). B is kept in block form (`blocks`, see
    `clora_feedback.lora.ops.LoRAOutputBlock`): consecutive targeted members
    of equal output width share one [S, members, R, width] buffer of B^T, so a
    step reads no zeros and each slot's B^T streams contiguously. Members that
    are not targeted have no block (their outputs get no update).
    """

    def __init__(
        self,
        members: list[tuple[str, int]],
        chosen: tuple[str, ...],
        fan_in: int,
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.members = [(name, out) for name, out in members if name in chosen]
        self.max_rank = max_rank
        self.out_features = sum(out for _, out in members)
        specs: list[list[int]] = []  # [column, first member, width, count] per block
        self._place: dict[str, tuple[int, int]] = {}  # member -> (block, index in block)
        column, targeted, extend = 0, 0, False
        for name, out in members:
            if name in chosen:
                if extend and specs[-1][2] == out:
                    specs[-1][3] += 1
                else:
                    specs.append([column, targeted, out, 1])
                self._place[name] = (len(specs) - 1, specs[-1][3] - 1)
                targeted += 1
            extend = name in chosen
            column += out
        self.a = torch.zeros(num_slots, max_rank * targeted, fan_in, dtype=dtype, device=device)
        self.blocks = [
            LoRAOutputBlock(
                col,
                first,
                torch.zeros(num_slots, count, max_rank, width, dtype=dtype, device=device),
            )
            for col, first, width, count in specs
        ]

    def write(
        self, slot: int, pieces: dict[str, tuple[torch.Tensor, torch.Tensor]], scaling: float
    ) -> None:
        """Copy one adapter's matrices into `slot` (missing members stay zero)."""
        self.clear(slot)
        rank_major = self.a[slot].view(self.max_rank, len(self.members), -1)
        for m, (name, _) in enumerate(self.members):
            if name in pieces:
                a, b = pieces[name]
                r = a.shape[0]
                rank_major[:r, m].copy_(a)
                block, j = self._place[name]
                self.blocks[block].bt[slot, j, :r].copy_((b * scaling).t())

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        for block in self.blocks:
            block.bt[slot].zero_()

    def dense_b(self) -> torch.Tensor:
        """B as one block-diagonal [S, out_g, R_g] tensor (the reference layout)."""
        return blocks_to_dense(self.blocks, self.out_features, self.a.shape[1])


class KVCache:
    """Keys and values for `rows` sequences of up to `max_len` tokens: [L, rows, kv_heads, max_len, head_dim]."""

    def __init__(
        self, config: ModelConfig, rows: int, max_len: int, dtype: torch.dtype, device: torch.device
    ):
        shape = (config.num_layers, rows, config.num_kv_heads, max_len, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len


@dataclass
class _DecodeStep:
    """Per-step values shared by every layer of one decode step.

    Attributes:
        cos, sin: [B, H+K, D] RoPE tables for each row's position (`sin` pre-signed,
            the query heads pre-scaled by 1/sqrt(D) so attention needs no scaling).
        offsets: [B*K] flat index of each (row, kv head) slot at its position in a
            layer's cache viewed as [rows*K*max_len, D].
        rows: the cache rows; `run` is its first row when they are consecutive.
        span: cache positions any row attends to.
        mask: [B, 1, 1, span] True where a row attends (up to its own position; rows in
            cache order when `to_run` is set), or None when every row is at the same position.
        to_run, from_run: when the rows are a consecutive run in another order (the
            batch sorted by adapter slot, see `SlottedDecoder.decode`): batch entry of each
            run row, and run row of each batch entry; None when the batch is in run order.
    """

    cos: torch.Tensor
    sin: torch.Tensor
    offsets: torch.Tensor
    rows: torch.Tensor
    run: int | None
    span: int
    mask: torch.Tensor | None
    to_run: torch.Tensor | None = None
    from_run: torch.Tensor | None = None

    @classmethod
    def build(
        cls, model: SlottedDecoder, rows: list[int], positions: torch.Tensor, cache: KVCache
    ) -> _DecodeStep:
        c, device = model.config, model.device
        b, kv = len(rows), c.num_kv_heads
        pos = positions.tolist()
        span = max(pos) + 1
        row_index = torch.tensor(rows, device=device)
        heads = torch.arange(kv, device=device)
        offsets = ((row_index * kv).unsqueeze(1) + heads) * cache.max_len + positions.unsqueeze(1)
        scale = torch.ones(c.num_heads + kv, 1, dtype=model.dtype, device=device)
        scale[: c.num_heads] = c.head_dim**-0.5
        cos = model.base.cos[positions].unsqueeze(1) * scale  # [B, H+K, D]
        sin = model._sin_signed[positions].unsqueeze(1) * scale
        first = min(rows)
        run = first if sorted(rows) == list(range(first, first + b)) else None
        to_run = from_run = None
        if run is not None and rows != list(range(run, run + b)):
            from_run = row_index - run
            to_run = torch.argsort(from_run)
        mask = None
        if min(pos) != span - 1:
            attending = positions if to_run is None else positions[to_run]
            mask = torch.arange(span, device=device).unsqueeze(0) <= attending.unsqueeze(1)
            mask = mask.view(b, 1, 1, span)
        return cls(cos, sin, offsets.view(-1), row_index, run, span, mask, to_run, from_run)

    def store(self, cache: KVCache, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k [B, K, D] and v [B, K*D] at each row's position."""
        d = cache.k.shape[-1]
        cache.k[layer].view(-1, d).index_copy_(0, self.offsets, k.reshape(-1, d))
        cache.v[layer].view(-1, d).index_copy_(0, self.offsets, v.reshape(-1, d))

    def attend(self, cache: KVCache, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q [B, H, D] (pre-scaled) -> [B, H*D] attention output over each row's cache."""
        b = q.shape[0]
        if self.run is not None:  # consecutive rows: a view, no copy
            keys = cache.k[layer, self.run : self.run + b, :, : self.span]
            values = cache.v[layer, self.run : self.run + b, :, : self.span]
            if self.to_run is not None and self.from_run is not None:  # permute q, not the cache
                out = self._attend(q.index_select(0, self.to_run), keys, values)
                return out.index_select(0, self.from_run)
        else:
            keys = cache.k[layer, :, :, : self.span].index_select(0, self.rows)
            values = cache.v[layer, :, :, : self.span].index_select(0, self.rows)
        return self._attend(q, keys, values)

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """q [B, H, D], keys/values [B, K, span, D] of the same rows -> [B, H*D].

        torch's fused attention reads the cache views in place (a `bmm` would first copy
        each layer's keys and values out of the wider cache) and keeps the probabilities
        in fp32: an 8-row bf16 decode step 46-48 -> 44-45 CPU ms at one thread
        (`python -m benchmarks.serve --decode-profile`, docs/benchmarks-history.md).
        """
        b, heads, d = q.shape
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2), keys, values, attn_mask=self.mask, scale=1.0, enable_gqa=True
        )
        return out.reshape(b, heads * d)


@dataclass(frozen=True)
class PrefillChunk:
    """One sequence's share of a `SlottedDecoder.prefill_many` forward.

    Attributes:
        token_ids: [T] prompt tokens at positions start..start+T-1 (T >= 1).
        row: the sequence's cache row (earlier positions already cached there).
        slot: adapter slot (0 = base model).
        start: position of the first token.
    """

    token_ids: torch.Tensor
    row: int
    slot: int
    start: int = 0


class SlottedDecoder:
    """The decoder for serving: shared base weights plus per-layer adapter slots.

    The base tensors are a `BaseWeights` (read, never written), so the same
    instance may also back a trainer's policy (see `clora_feedback.train.policy`).
    """

    def __init__(
        self,
        base: BaseWeights,
        *,
        max_loras: int,
        max_lora_rank: int,
        target_modules: tuple[str, ...],
    ):
        self.base = base
        self.config = base.config
        self.device = base.device
        self.dtype = base.dtype
        self.num_slots = max_loras + 1
        self.slot_ranks = [0] * self.num_slots  # rank of the adapter in each slot (0: none)
        self.max_lora_rank = max_lora_rank
        self.target_modules = tuple(target_modules)
        self.limits = base.lora_limits(max_lora_rank, self.target_modules)
        self._dense = DenseKernels.build(
            [{g: layer[g] for g, _ in GROUPS} for layer in base.layers], base.lm_head
        )
        # The dtype projections compute in (fp32 for `upcast`).
        self.compute_dtype = self._dense.compute_dtype
        # Adapter slots and the LoRA update: fp32 on a CPU even when the base is bf16. The
        # update is a few rows times rank-r factors, where torch's bf16 kernels cost 2-4x
        # their fp32 twins (oneDNN's fixed cost per call); in bf16 a mixed batch's update
        # took 23 ms of a 62 ms decode step, in fp32 11 ms (docs/benchmarks.md).
        cpu_bf16 = self.device.type == "cpu" and self.compute_dtype == torch.bfloat16
        self.lora_dtype = torch.float32 if cpu_bf16 else self.compute_dtype
        shapes = self.config.projection_shapes()
        self.slots: list[dict[str, LoRASlots]] = []
        for _ in range(self.config.num_layers):
            group_slots = {}
            for group, members in GROUPS:
                if any(m in self.target_modules for m in members):
                    group_slots[group] = LoRASlots(
                        [(m, shapes[m][1]) for m in members],
                        self.target_modules,
                        shapes[members[0]][0],
                        self.num_slots,
                        max_lora_rank,
                        self.lora_dtype,
                        self.device,
                    )
            self.slots.append(group_slots)
        # rotate_half(x) * sin == roll(x, D/2) * sin_signed: one roll instead of slice/neg/cat.
        half = self.config.head_dim // 2
        self._sin_signed = torch.cat((-base.sin[:, :half], base.sin[:, half:]), dim=-1)

    @property
    def kernel_name(self) -> str:
        """The dense kernel the base weights are multiplied by (`DenseKernels.build`)."""
        return self._dense.name

    @classmethod
    def from_dir(
        cls,
        model_dir: Path,
        *,
        max_loras: int,
        max_lora_rank: int,
        target_modules: tuple[str, ...],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> SlottedDecoder:
        return cls(
            BaseWeights.from_dir(model_dir, dtype=dtype, device=device),
            max_loras=max_loras,
            max_lora_rank=max_lora_rank,
            target_modules=target_modules,
        )

    # -- adapters -----------------------------------------------------------------

    def write_slot(self, slot: int, weights: LoRAWeights) -> None:
        """Copy an adapter into `slot` (1..max_loras). Caller validated it."""
        if not 1 <= slot < self.num_slots:
            raise AdapterError(f"slot {slot} out of range")
        if weights.rank > self.max_lora_rank:
            raise AdapterError(f"rank {weights.rank} > max_lora_rank {self.max_lora_rank}")
        with torch.no_grad():
            for i, group_slots in enumerate(self.slots):
                for slots in group_slots.values():
                    pieces = {}
                    for name, _ in slots.members:
                        pair = weights.tensors.get(module_key(i, name))
                        if pair is not None:
                            pieces[name] = (
                                pair[0].to(self.device, self.lora_dtype),
                                pair[1].to(self.device, self.lora_dtype),
                            )
                    slots.write(slot, pieces, weights.scaling)
            self.slot_ranks[slot] = max(
                (a.shape[0] for a, _ in weights.tensors.values()), default=0
            )

    def clear_slot(self, slot: int) -> None:
        with torch.no_grad():
            for group_slots in self.slots:
                for slots in group_slots.values():
                    slots.clear(slot)
            self.slot_ranks[slot] = 0

    # -- forward: serving fast path (inference only) ---------------------------------

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [..., hidden] -> [..., V] fp32 logits."""
        x = F.rms_norm(h, (h.shape[-1],), self.base.final_norm, self.config.rms_norm_eps)
        return self._dense.lm_head(x.to(self.compute_dtype)).float()

    def _fast_proj(self, x: torch.Tensor, layer: int, group: str, lora: LoRABatch) -> torch.Tensor:
        """x [N, in] -> [N, out] for N tokens of `lora`'s rows; the same values as `clora_feedback.model.decoder.project`."""
        xc = x.to(self.compute_dtype)  # a no-op unless the kernel is `upcast`
        y = self._dense.layers[layer][group](xc)
        bias = self.base.bias(layer, group)
        if bias is not None:
            y += bias
        slots = self.slots[layer].get(group)
        if slots is not None and not lora.is_base_only:
            if self.lora_dtype == y.dtype:
                add_lora_update_(y, xc, slots.a, slots.blocks, lora)
            else:  # fp32 update of a bf16 projection (see `lora_dtype`), added once
                update = torch.zeros(y.shape, dtype=self.lora_dtype, device=y.device)
                add_lora_update_(update, xc.to(self.lora_dtype), slots.a, slots.blocks, lora)
                y += update
        return y.to(self.dtype)

    def _fast_rope(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE on [..., heads, D] with `sin` pre-signed (see `_sin_signed`)."""
        return torch.addcmul(qk * cos, torch.roll(qk, qk.shape[-1] // 2, -1), sin)

    @torch.inference_mode()
    def prefill(
        self, token_ids: torch.Tensor, cache: KVCache, row: int, slot: int, start: int = 0
    ) -> torch.Tensor:
        """Run a prompt chunk for one sequence and store its keys/values.

        Args:
            token_ids: [T] prompt tokens occupying positions start..start+T-1.
            cache: the KV cache; row `row` is written at those positions.
            row: cache row owned by the sequence.
            slot: adapter slot (0 = base model).
            start: position of the first token (earlier positions already cached).

        Returns:
            [V] fp32 logits for the token after the chunk.
        """
        return self.prefill_many([PrefillChunk(token_ids, row, slot, start)], cache)[0]

    @torch.inference_mode()
    def prefill_many(self, chunks: Sequence[PrefillChunk], cache: KVCache) -> torch.Tensor:
        """Prompt chunks of several sequences in one forward; [len(chunks), V] fp32 logits.

        The chunks' tokens are stacked into one [sum T, hidden] batch, so every
        projection reads its weight once for all of them (a bigger, faster
        GEMM) and the LoRA update mixes the chunks' adapters per token; only
        attention runs per chunk, over that sequence's own cache row. Row i of
        the result is the logits after chunk i's last token. The rows must differ.
        """
        c = self.config
        heads, kv, d = c.num_heads, c.num_kv_heads, c.head_dim
        lengths = [int(ch.token_ids.shape[0]) for ch in chunks]
        n = sum(lengths)
        dev = self.device
        pos_list: list[int] = []
        row_list: list[int] = []
        slots: list[int] = []
        for ch, t in zip(chunks, lengths, strict=True):
            pos_list += range(ch.start, ch.start + t)
            row_list += [ch.row] * t
            slots += [ch.slot] * t
        positions = torch.tensor(pos_list, device=dev)
        token_rows = torch.tensor(row_list, device=dev)
        lora = LoRABatch.from_slots(slots, dev, max(self.slot_ranks[s] for s in set(slots)))
        cos = self.base.cos[positions].unsqueeze(1)  # [N, 1, D]
        sin = self._sin_signed[positions].unsqueeze(1)
        # Flat index of each (token, kv head) in a layer's cache viewed as [rows*K*max_len, D].
        heads_kv = torch.arange(kv, device=dev)
        offsets = (
            (((token_rows * kv).unsqueeze(1) + heads_kv) * cache.max_len)
            .add_(positions.unsqueeze(1))
            .view(-1)
        )
        spans, first = [], 0
        for ch, t in zip(chunks, lengths, strict=True):
            mask = None
            if ch.start:
                mask = torch.ones(t, ch.start + t, dtype=torch.bool, device=dev).tril(ch.start)
            spans.append((first, t, ch, mask))
            first += t
        h = self.base.embed[torch.cat([ch.token_ids for ch in chunks])]  # [N, hidden]
        for i, layer in enumerate(self.base.layers):
            x = F.rms_norm(h, (c.hidden_size,), layer["in_norm"], c.rms_norm_eps)
            qkv = self._fast_proj(x, i, "qkv", lora)  # [N, (H+2K)*D]
            qk = self._fast_rope(qkv[:, : (heads + kv) * d].view(n, heads + kv, d), cos, sin)
            cache.k[i].view(-1, d).index_copy_(0, offsets, qk[:, heads:].reshape(-1, d))
            cache.v[i].view(-1, d).index_copy_(
                0, offsets, qkv[:, (heads + kv) * d :].reshape(-1, d)
            )
            outs = []
            for lo, t, ch, mask in spans:
                q = qk[lo : lo + t, :heads].transpose(0, 1).unsqueeze(0)  # [1, H, T, D]
                keys = cache.k[i, ch.row : ch.row + 1, :, : ch.start + t]
                values = cache.v[i, ch.row : ch.row + 1, :, : ch.start + t]
                attn = F.scaled_dot_product_attention(
                    q, keys, values, attn_mask=mask, is_causal=mask is None, enable_gqa=True
                )
                outs.append(attn[0].transpose(0, 1).reshape(t, -1))
            h = h + self._fast_proj(torch.cat(outs), i, "o", lora)
            x = F.rms_norm(h, (c.hidden_size,), layer["post_norm"], c.rms_norm_eps)
            h = h + self._fast_mlp(x, i, lora)
        last = torch.tensor([lo + t - 1 for lo, t, _, _ in spans], device=dev)
        return self._logits(h.index_select(0, last))

    def _fast_mlp(self, x: torch.Tensor, i: int, lora: LoRABatch) -> torch.Tensor:
        gate_up = self._fast_proj(x, i, "gate_up", lora)
        inter = self.config.intermediate_size
        return self._fast_proj(F.silu(gate_up[:, :inter]) * gate_up[:, inter:], i, "down", lora)

    @torch.inference_mode()
    def decode(
        self,
        token_ids: torch.Tensor,
        rows: list[int],
        positions: torch.Tensor,
        lora: LoRABatch,
        cache: KVCache,
    ) -> torch.Tensor:
        """One decode step for a batch of sequences.

        Args:
            token_ids: [B] the last sampled token of each sequence.
            rows: B cache rows; a run of consecutive rows (in any order) is read as a view.
                Rows not grouped by adapter slot are decoded in slot order (the LoRA
                update then reads each slot in place, with no gather of the rows) and
                the logits returned in the caller's order.
            positions: [B] position of each new token.
            lora: the adapter slot of each row.
            cache: KV cache.

        Returns:
            [B, V] fp32 logits.
        """
        if lora.rank is None:
            used = set(lora.slot_ids.tolist()) if lora.uniform_slot is None else {lora.uniform_slot}
            lora = LoRABatch(
                lora.slot_ids, lora.uniform_slot, max(self.slot_ranks[s] for s in used)
            )
        order = lora.slot_order()
        if order is not None:  # rows grouped by slot: the LoRA update needs no gather
            inverse = torch.argsort(order)
            logits = self._decode(
                token_ids[order], [rows[i] for i in order.tolist()], positions[order],
                lora.reordered(order), cache,
            )  # fmt: skip
            return logits.index_select(0, inverse)
        return self._decode(token_ids, rows, positions, lora, cache)

    def _decode(
        self,
        token_ids: torch.Tensor,
        rows: list[int],
        positions: torch.Tensor,
        lora: LoRABatch,
        cache: KVCache,
    ) -> torch.Tensor:
        c = self.config
        b = token_ids.shape[0]
        heads, kv, d = c.num_heads, c.num_kv_heads, c.head_dim
        step = _DecodeStep.build(self, rows, positions, cache)
        h = self.base.embed[token_ids]  # [B, hidden]
        for i, layer in enumerate(self.base.layers):
            x = F.rms_norm(h, (c.hidden_size,), layer["in_norm"], c.rms_norm_eps)
            qkv = self._fast_proj(x, i, "qkv", lora)  # [B, (H+2K)*D]
            qk = self._fast_rope(
                qkv[:, : (heads + kv) * d].view(b, heads + kv, d), step.cos, step.sin
            )
            step.store(cache, i, qk[:, heads:], qkv[:, (heads + kv) * d :])
            attn = step.attend(cache, i, qk[:, :heads])  # [B, H*D]
            h = h + self._fast_proj(attn, i, "o", lora)
            x = F.rms_norm(h, (c.hidden_size,), layer["post_norm"], c.rms_norm_eps)
            h = h + self._fast_mlp(x, i, lora)
        return self._logits(h)
