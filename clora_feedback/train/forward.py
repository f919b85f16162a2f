"""Differentiable forward pass for training: base weights frozen, LoRA rows per agent.

The trainer reuses the serving engine's base weights in place (no second copy
of the model). Several agents can share one forward/backward: row b uses agent
`row_agent[b]`'s parameters, and each agent's gradient lands in its own flat
buffer. The base projection runs once over all rows; each agent's LoRA update
runs over its own run of consecutive rows as two plain matmuls
(`x @ A^T`, then `@ B^T`), the per-row multi-LoRA computation grouped by
adapter, so no row gathers (or, backwards, scatters) a copy of its weights.

With `lora=None` the adapter is disabled and the pass computes the base
model: the reference policy for the KL term, with no second model in memory.

Not here: losses, optimizer, batching policy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from clora_feedback.engine.model import GROUPS, LoRAModel, _rms_norm
from clora_feedback.lora.ops import LoRABatch
from clora_feedback.train.state import LoRALayout


@dataclass(frozen=True)
class PackedBatch:
    """Right-padded token sequences with the positions whose next token is scored.

    Attributes:
        input_ids: [B, T] token ids (prompt then completion, then padding).
        targets: [B, T] the token each position should predict (next token), -1 if unscored.
        lengths: B real lengths.
    """

    input_ids: torch.Tensor
    targets: torch.Tensor
    lengths: list[int]

    @classmethod
    def build(
        cls, sequences: Sequence[tuple[list[int], list[int]]], pad_id: int = 0
    ) -> PackedBatch:
        """From (prompt ids, completion ids) pairs: score exactly the completion tokens."""
        t = max(len(p) + len(c) for p, c in sequences)
        ids = torch.full((len(sequences), t), pad_id, dtype=torch.long)
        targets = torch.full((len(sequences), t), -1, dtype=torch.long)
        for b, (prompt, completion) in enumerate(sequences):
            seq = prompt + completion
            ids[b, : len(seq)] = torch.tensor(seq)
            # position j predicts token j+1; completion token k sits at len(prompt)+k
            targets[b, len(prompt) - 1 : len(seq) - 1] = torch.tensor(completion)
        return cls(ids, targets, [len(p) + len(c) for p, c in sequences])

    @property
    def mask(self) -> torch.Tensor:
        """[B, T] bool: positions that are scored."""
        return self.targets >= 0


@dataclass
class TrainLoRA:
    """The trainable adapters of one forward pass.

    Attributes:
        layouts: one layout per agent in the pass (all the same rank/targets shape family).
        params: one flat [P_i] leaf per agent (requires grad).
        row_agent: [B] index into `params` for each batch row.
    """

    layouts: list[LoRALayout]
    params: list[torch.Tensor]
    row_agent: torch.Tensor
    _views: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        # One split per agent per pass: cheap views, and one gradient concatenation on the way back.
        self._views = [
            layout.split_views(flat) for layout, flat in zip(self.layouts, self.params, strict=True)
        ]

    @property
    def runs(self) -> list[tuple[int, int, int]]:
        """(agent index, first row, end row) of each run of consecutive rows of one agent."""
        ids = self.row_agent.tolist()
        out: list[tuple[int, int, int]] = []
        for row, agent in enumerate(ids):
            if out and out[-1][0] == agent:
                out[-1] = (agent, out[-1][1], row + 1)
            else:
                out.append((agent, row, row + 1))
        return out

    def delta(
        self, key: str, x: torch.Tensor, runs: list[tuple[int, int, int]]
    ) -> torch.Tensor | None:
        """The LoRA update of projection `key` for x [B, T, in] -> [B, T, out]; None if no agent has it."""
        parts: list[torch.Tensor | None] = []
        for agent, start, end in runs:
            pair = self._views[agent].get(key)
            if pair is None:
                parts.append(None)
                continue
            a, b = pair  # [r, in], [out, r]
            shrunk = x[start:end] @ a.to(x.dtype).t() * self.layouts[agent].scaling  # [n, T, r]
            parts.append(shrunk @ b.to(x.dtype).t())
        present = [p for p in parts if p is not None]
        if not present:
            return None
        out_features = present[0].shape[-1]
        filled = [
            p if p is not None else x.new_zeros(end - start, x.shape[1], out_features)
            for p, (_, start, end) in zip(parts, runs, strict=True)
        ]
        return torch.cat(filled) if len(filled) > 1 else filled[0]


def _proj(
    model: LoRAModel,
    x: torch.Tensor,
    layer: int,
    group: str,
    lora: TrainLoRA | None,
    runs: list[tuple[int, int, int]],
) -> torch.Tensor:
    base = LoRABatch.from_slots([0] * x.shape[0], x.device)  # slot 0: base weights only
    y = model._proj(x, layer, group, base)
    if lora is None:
        return y
    shapes = model.config.projection_shapes()
    parts = []
    any_delta = False
    for name in dict(GROUPS)[group]:
        key = f"layers.{layer}.{'self_attn' if group in ('qkv', 'o') else 'mlp'}.{name}"
        delta = lora.delta(key, x, runs)
        if delta is None:
            parts.append(x.new_zeros(*x.shape[:-1], shapes[name][1]))
        else:
            parts.append(delta)
            any_delta = True
    if not any_delta:
        return y
    return y + (torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0])


def token_logprobs(model: LoRAModel, batch: PackedBatch, lora: TrainLoRA | None) -> torch.Tensor:
    """Log-probabilities of the scored next tokens.

    Args:
        model: the engine's model (base weights are read, never written).
        batch: packed sequences.
        lora: trainable adapters, or None for the base model (reference policy).

    Returns:
        [N] fp32 logprobs of `batch.targets[batch.mask]`, in row-major order.
    """
    c = model.config
    ids = batch.input_ids.to(model.device)
    b, t = ids.shape
    positions = torch.arange(t, device=model.device).unsqueeze(0).expand(b, t)
    h = model.embed[ids]
    runs = lora.runs if lora is not None else []
    for i, layer in enumerate(model.layers):
        x = _rms_norm(h, layer["in_norm"], c.rms_norm_eps)
        q, k, v = model._split_qkv(_proj(model, x, i, "qkv", lora, runs), positions)
        # Right padding: real tokens never attend to later (padding) positions under a causal mask.
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        h = h + _proj(model, attn.transpose(1, 2).reshape(b, t, -1), i, "o", lora, runs)
        x = _rms_norm(h, layer["post_norm"], c.rms_norm_eps)
        gate, up = _proj(model, x, i, "gate_up", lora, runs).chunk(2, dim=-1)
        h = h + _proj(model, F.silu(gate) * up, i, "down", lora, runs)
    mask = batch.mask.to(model.device)
    scored = _rms_norm(h[mask], model.final_norm, c.rms_norm_eps)  # [N, hidden]
    targets = batch.targets.to(model.device)[mask]
    return _gather_logprobs(scored, model.lm_head, targets)


def _gather_logprobs(
    hidden: torch.Tensor, lm_head: torch.Tensor, targets: torch.Tensor, chunk: int = 512
) -> torch.Tensor:
    """log_softmax(hidden @ lm_head.T)[targets], in chunks to bound the [N, V] logits memory."""
    out = []
    for start in range(0, hidden.shape[0], chunk):
        logits = (hidden[start : start + chunk] @ lm_head.t()).float()
        lp = torch.log_softmax(logits, dim=-1)
        out.append(lp.gather(1, targets[start : start + chunk].unsqueeze(1)).squeeze(1))
    return torch.cat(out) if out else hidden.new_zeros(0)
