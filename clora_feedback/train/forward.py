"""Differentiable forward pass for training: base weights frozen, LoRA rows per agent.

The layers are `clora_feedback.model.decoder`'s, over a `BaseWeights` that the
composition root may share with the serving engine (no second copy of the
model) or load on its own (see `policy`). Several agents can share one forward/backward: row b uses agent
`row_agent[b]`'s parameters, and each agent's gradient lands in its own flat
buffer. The base projection runs once over all rows; each agent's LoRA update
runs over its own run of consecutive rows as two plain matmuls
(`x @ A^T`, then `@ B^T`), the per-row multi-LoRA computation grouped by
adapter, so no row gathers (or, backwards, scatters) a copy of its weights.

With `lora=None` the adapter is disabled and the pass computes the base
model: the reference policy for the KL term, with no second model in memory.

Precision: the pass computes in the base weights' dtype (the trainer's
compute dtype, see `policy`). In bf16 the activations and the base GEMMs are
bf16, each LoRA factor is cast from its fp32 master at each use (so its
gradient comes back through the cast and accumulates in fp32), and the final
norm, the vocabulary projection and the log-softmax run in fp32 on an fp32
copy of the head (`head`): a bf16 logit of magnitude 20 is only good to
0.06, which an importance ratio would see as noise.

Not here: losses, optimizer, batching policy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from clora_feedback.lora.weights import module_key
from clora_feedback.model.base import GROUPS, BaseWeights
from clora_feedback.model.decoder import (
    LoRAUpdate,
    attention_inputs,
    attention_output,
    gather_logprobs,
    mlp_block,
    rms_norm,
)
from clora_feedback.train.state import LoRALayout

_MEMBERS = dict(GROUPS)


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


@dataclass(frozen=True)
class _RunsLoRA:
    """`TrainLoRA` bound to the row runs of one stream (a `LoRAUpdate` for the decoder)."""

    lora: TrainLoRA
    runs: list[tuple[int, int, int]]
    shapes: dict[str, tuple[int, int]]

    def delta(self, layer: int, group: str, x: torch.Tensor) -> torch.Tensor | None:
        parts: list[torch.Tensor] = []
        any_delta = False
        for name in _MEMBERS[group]:
            delta = self.lora.delta(module_key(layer, name), x, self.runs)
            if delta is None:
                parts.append(x.new_zeros(*x.shape[:-1], self.shapes[name][1]))
            else:
                parts.append(delta)
                any_delta = True
        if not any_delta:
            return None
        return torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]


MIN_SHARED_PREFIX = 16
"""Shortest common prompt prefix (tokens) worth computing once per agent instead of per row."""


def shared_prefix_len(batch: PackedBatch) -> int:
    """Tokens every row starts with, never reaching a scored position (0 if under the minimum).

    Rows of one agent usually share a long system prompt (instructions, tool
    schemas, worked examples); no position before the first scored one of any
    row needs its own output, only its keys and values.
    """
    ids = batch.input_ids
    if ids.shape[0] < 2:
        return 0
    scored = batch.mask
    first_scored = int(scored.float().argmax(dim=1).min()) if bool(scored.any()) else 0
    limit = min(first_scored, min(batch.lengths))
    same = (ids[:, :limit] == ids[:1, :limit]).all(dim=0)
    differs = (~same).nonzero()
    length = int(differs[0, 0]) if differs.numel() else limit
    return length if length >= MIN_SHARED_PREFIX else 0


def token_logprobs(
    base: BaseWeights,
    batch: PackedBatch,
    lora: TrainLoRA | None,
    head: torch.Tensor | None = None,
) -> torch.Tensor:
    """Log-probabilities of the scored next tokens.

    When all rows share a prompt prefix (`shared_prefix_len`), it is computed
    once per agent run (its LoRA applies to it as to any token) and its keys
    and values are attended by every row of that run: the same values as
    computing it per row, and the same gradients (autograd sums the rows'
    contributions through the shared tensors), for a fraction of the compute.

    Args:
        base: the frozen base weights (read, never written); their dtype is the compute dtype.
        batch: packed sequences.
        lora: trainable adapters, or None for the base model (reference policy).
        head: the fp32 vocabulary projection [V, hidden] when `base` is not fp32
            (default: `base.lm_head` cast per call).

    Returns:
        [N] fp32 logprobs of `batch.targets[batch.mask]`, in row-major order.
    """
    scored, targets = scored_hidden(base, batch, lora)
    return gather_logprobs(scored, _fp32_head(base, head), targets)


def next_token_logprobs(
    base: BaseWeights,
    batch: PackedBatch,
    lora: TrainLoRA | None,
    head: torch.Tensor | None = None,
) -> torch.Tensor:
    """[N, V] fp32 log-softmax over the vocabulary at each scored position (a rollout's
    sampling distribution: score one dummy token after each prompt). Same arguments as
    `token_logprobs`."""
    scored, _ = scored_hidden(base, batch, lora)
    logits = scored @ _fp32_head(base, head).t()
    return torch.log_softmax(logits, dim=-1)


def _fp32_head(base: BaseWeights, head: torch.Tensor | None) -> torch.Tensor:
    if head is not None:
        return head
    return base.lm_head if base.lm_head.dtype == torch.float32 else base.lm_head.float()


def scored_hidden(
    base: BaseWeights, batch: PackedBatch, lora: TrainLoRA | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 final-norm hidden states [N, hidden] of the scored positions and their
    [N] targets (the pass of `token_logprobs` before the vocabulary projection)."""
    ids = batch.input_ids.to(base.device)
    b, t = ids.shape
    runs = lora.runs if lora is not None else [(0, 0, b)]
    prefix = shared_prefix_len(batch)
    # One prefix row per agent run; row r of the batch reads prefix row `owner[r]`.
    prefix_runs = [(agent, i, i + 1) for i, (agent, _, _) in enumerate(runs)]
    rows_lora, prefix_lora = _bind(base, lora, runs), _bind(base, lora, prefix_runs)
    owner = torch.tensor(
        [i for i, (_, start, end) in enumerate(runs) for _ in range(start, end)], device=ids.device
    )
    h_p = base.embed[ids[:1, :prefix]].expand(len(runs), prefix, -1)
    h = base.embed[ids[:, prefix:]]
    pos_p = torch.arange(prefix, device=ids.device).unsqueeze(0).expand(len(runs), prefix)
    pos = torch.arange(prefix, t, device=ids.device).unsqueeze(0).expand(b, t - prefix)
    allowed: torch.Tensor | None = None
    if prefix:
        # Rest position i sees every prefix position and rest positions <= i (right padding
        # is never seen by a real token).
        allowed = torch.ones(t - prefix, t, dtype=torch.bool, device=ids.device)
        allowed[:, prefix:] = torch.ones(t - prefix, t - prefix, dtype=torch.bool).tril()
    for i in range(base.config.num_layers):
        q, k, v = attention_inputs(base, i, h, pos, rows_lora)
        if allowed is not None:
            q_p, k_p, v_p = attention_inputs(base, i, h_p, pos_p, prefix_lora)
            attn_p = F.scaled_dot_product_attention(q_p, k_p, v_p, is_causal=True, enable_gqa=True)
            keys = torch.cat([k_p.index_select(0, owner), k], dim=2)
            values = torch.cat([v_p.index_select(0, owner), v], dim=2)
            attn = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=allowed, enable_gqa=True
            )
            h_p = mlp_block(
                base, i, attention_output(base, i, h_p, attn_p, prefix_lora), prefix_lora
            )
        else:
            # Right padding: real tokens never attend to later (padding) positions when causal.
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        h = mlp_block(base, i, attention_output(base, i, h, attn, rows_lora), rows_lora)
    mask = batch.mask[:, prefix:].to(base.device)
    # The last norm in fp32 (weights and output): the head and the log-softmax read it.
    scored = rms_norm(h[mask].float(), base.final_norm.float(), base.config.rms_norm_eps)
    targets = batch.targets[:, prefix:].to(base.device)[mask]
    return scored, targets


def _bind(
    base: BaseWeights, lora: TrainLoRA | None, runs: list[tuple[int, int, int]]
) -> LoRAUpdate | None:
    if lora is None:
        return None
    return _RunsLoRA(lora, runs, base.config.projection_shapes())
