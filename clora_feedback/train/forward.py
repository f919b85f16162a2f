"""Differentiable forward pass for training: base weights frozen, LoRA rows per agent.

The layer math is `clora_feedback.model.decoder`'s (its `forward_hidden` is the
reference this pass is checked against, with PEFT as the oracle), over a
`BaseWeights` that the composition root may share with the serving engine (no
second copy of the model) or load on its own (see `policy`). Several agents can
share one forward/backward: row b uses agent `row_agent[b]`'s parameters, and
each agent's gradient lands in its own flat buffer.

Laid out for a CPU, where a step is a few hundred tokens and every op's fixed
cost counts: all tokens of the pass form one [N, hidden] stream (`_Stream`:
the shared prompt prefix once per agent, then every row's own tokens), so each
projection, norm and MLP is one op over all of them (one bigger GEMM per
weight); only attention sees rows. Each fused projection group's LoRA is two
matmuls per agent over all the group's members (`_GroupFactors`: A stacked,
B block-diagonal), added in place into the base output (`fused.lora_linear`,
whose backward also sums the input gradients in one buffer); an agent's tokens are
contiguous segments of the stream, so no row gathers (or, backwards, scatters)
a copy of its weights. Splits instead of slices, RoPE by one roll: no op's
backward allocates a zero-filled full-size gradient.

With `lora=None` the adapter is disabled and the pass computes the base
model: the reference policy for the KL term, with no second model in memory.

Precision: the pass computes in the base weights' dtype (the trainer's
compute dtype, see `policy`). In bf16 the activations, the base GEMMs and the
LoRA matmuls are bf16, and so is attention on a CPU (plain matmuls, see `_Stream.attend`;
fp32 flash attention for a prefix, or rows without one, past `PLAIN_ATTENTION_MAX_LEN`
tokens); each agent's fp32 master
is cast once per pass (its gradient comes back through that cast and accumulates
in fp32), and the final
norm, the vocabulary projection and the log-softmax run in fp32 on an fp32
copy of the head (`head`): a bf16 logit of magnitude 20 is only good to
0.06, which an importance ratio would see as noise. The head's backward
multiplies by the head in the compute dtype (`fused.head_logprobs`); the
norms, the SwiGLU and the projections are `fused`'s too (same values, fewer ops
backwards).

Not here: losses, optimizer, batching policy.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from clora_feedback.lora.weights import module_key
from clora_feedback.model.base import GROUPS, BaseWeights
from clora_feedback.model.decoder import rope_signed, signed_sin
from clora_feedback.train.attention import PLAIN_ATTENTION_MAX_LEN, causal_bias, stream_attention
from clora_feedback.train.fused import (
    LoRAPiece,
    frozen_linear,
    head_logprobs,
    lora_linear,
    rms_norm,
    swiglu,
)
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

    def group_factors(self, base: BaseWeights) -> list[dict[tuple[int, str], _GroupFactors]]:
        """Per agent, each fused projection group's factors in the compute dtype (see
        `_GroupFactors`), made once per pass from the fp32 masters with one cast each."""
        shapes = base.config.projection_shapes()
        out = []
        for layout, flat in zip(self.layouts, self.params, strict=True):
            # One cast of the whole flat master per pass (not one per factor and use): its
            # gradient comes back through this cast and accumulates in the fp32 leaf.
            views = layout.split_views(flat if flat.dtype == base.dtype else flat.to(base.dtype))
            factors = {}
            for layer in range(base.config.num_layers):
                for group, members in GROUPS:
                    made = _GroupFactors.build(
                        [(views.get(module_key(layer, m)), shapes[m][1]) for m in members],
                        layout.scaling,
                    )
                    if made is not None:
                        factors[(layer, group)] = made
            out.append(factors)
        return out


@dataclass(frozen=True)
class _GroupFactors:
    """One agent's LoRA on one fused projection group, as two matmuls over all its members.

    Attributes:
        a: [sum r_j, in] the members' A stacked (members without LoRA contribute no rows).
        bt: [sum r_j, out_group] the block-diagonal B^T, alpha/r folded in (member j's
            output columns read only member j's ranks; zero columns for members without LoRA).
    """

    a: torch.Tensor
    bt: torch.Tensor

    @classmethod
    def build(
        cls, members: list[tuple[tuple[torch.Tensor, torch.Tensor] | None, int]], scaling: float
    ) -> _GroupFactors | None:
        """From (A [r, in], B [out, r]) or None, and the output width, of each member."""
        present = [pair for pair, _ in members if pair is not None]
        if not present:
            return None
        a = torch.cat([pa for pa, _ in present]) if len(present) > 1 else present[0][0]
        like = present[0][1]
        blocks = [pair[1] if pair is not None else like.new_zeros(out, 0) for pair, out in members]
        b = torch.block_diag(*blocks) if len(blocks) > 1 else blocks[0]
        return cls(a, (b * scaling if scaling != 1.0 else b).t())


@dataclass(frozen=True)
class _StreamLoRA:
    """The LoRA of a token stream: which agent owns each segment of its tokens.

    Attributes:
        factors: per agent, from `TrainLoRA.group_factors`.
        segments: (agent, first token, end token), covering the stream in order.
    """

    factors: list[dict[tuple[int, str], _GroupFactors]]
    segments: list[tuple[int, int, int]]

    def pieces(self, layer: int, group: str) -> list[LoRAPiece]:
        """(tokens, A, B^T) of each segment on projection `group` of `layer`, in order
        (`fused.lora_linear`'s input)."""
        out: list[LoRAPiece] = []
        for agent, start, end in self.segments:
            f = self.factors[agent].get((layer, group))
            out.append((end - start, None, None) if f is None else (end - start, f.a, f.bt))
        return out


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
    return head_logprobs(scored, _fp32_head(base, head), base.lm_head, targets)


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
    runs = lora.runs if lora is not None else [(0, 0, ids.shape[0])]
    stream = _Stream.build(ids, shared_prefix_len(batch), runs)
    c = base.config
    rows_lora = (
        _StreamLoRA(lora.group_factors(base), stream.segments(runs)) if lora is not None else None
    )
    sin_signed = signed_sin(base.sin)
    cos = base.cos[stream.positions].unsqueeze(1)  # [N, 1, D], once for every layer
    sin = sin_signed[stream.positions].unsqueeze(1)
    qk_width, v_width = (c.num_heads + c.num_kv_heads) * c.head_dim, c.num_kv_heads * c.head_dim
    h = base.embed[stream.tokens]  # [N, hidden]
    for i, layer in enumerate(base.layers):
        x = rms_norm(h, layer["in_norm"], c.rms_norm_eps)
        qk, v = _project(base, x, i, "qkv", rows_lora).split([qk_width, v_width], dim=-1)
        qk = rope_signed(qk.view(-1, c.num_heads + c.num_kv_heads, c.head_dim), cos, sin)
        h = h + _project(base, stream.attend(qk, v, c.num_heads), i, "o", rows_lora)
        x = rms_norm(h, layer["post_norm"], c.rms_norm_eps)
        h = h + _project(
            base, swiglu(_project(base, x, i, "gate_up", rows_lora)), i, "down", rows_lora
        )
    # The last norm in fp32 (weights and output): the head and the log-softmax read it.
    scored = h.index_select(0, stream.scored(batch.mask.to(base.device)))
    scored = rms_norm(scored.float(), base.final_norm.float(), c.rms_norm_eps)
    targets = batch.targets[:, stream.prefix :].to(base.device)[batch.mask[:, stream.prefix :]]
    return scored, targets


def _project(
    base: BaseWeights, x: torch.Tensor, layer: int, group: str, lora: _StreamLoRA | None
) -> torch.Tensor:
    """x [N, in] -> [N, out]: fused base projection `group` of `layer` plus the tokens' LoRA."""
    weight, bias = base.layers[layer][group], base.bias(layer, group)
    if lora is None:
        return frozen_linear(x, weight, bias)
    return lora_linear(x, weight, bias, lora.pieces(layer, group))


@dataclass(frozen=True)
class _Stream:
    """The pass's tokens as one [N] stream: every projection, norm and MLP runs once over
    all of them (one bigger GEMM per weight); only attention sees rows.

    With a shared prefix of P tokens (`shared_prefix_len`), the stream holds one copy of
    the prefix per agent run (R runs), then each of the B rows' remaining T - P tokens:
    [R * P prefix tokens | B * (T - P) row tokens]; without one, the B rows' T tokens.

    Attributes:
        tokens, positions: [N] token ids and their positions.
        rows, width: B rows of `width` = T - P tokens each (the rows part of the stream).
        prefix: P (0: no shared prefix).
        copies: R prefix copies (one per agent run; 0 without a shared prefix).
        run_rows: how many rows each run has (prefix copy i is read by run i's rows).
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    rows: int
    width: int
    prefix: int
    copies: int
    run_rows: list[int]

    @classmethod
    def build(cls, ids: torch.Tensor, prefix: int, runs: list[tuple[int, int, int]]) -> _Stream:
        b, t = ids.shape
        copies = len(runs) if prefix else 0
        dev = ids.device
        tokens = torch.cat([ids[0, :prefix].repeat(copies), ids[:, prefix:].reshape(-1)])
        positions = torch.cat(
            [
                torch.arange(prefix, device=dev).repeat(copies),
                torch.arange(prefix, t, device=dev).repeat(b),
            ]
        )
        run_rows = [end - start for _, start, end in runs]
        return cls(tokens, positions, b, t - prefix, prefix, copies, run_rows)

    def segments(self, runs: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
        """(agent, first token, end token) of the stream's tokens, adjacent ones merged."""
        p, w, first_row = self.prefix, self.width, self.copies * self.prefix
        spans = [(agent, i * p, (i + 1) * p) for i, (agent, _, _) in enumerate(runs)] if p else []
        spans += [(agent, first_row + s * w, first_row + e * w) for agent, s, e in runs]
        merged: list[tuple[int, int, int]] = []
        for agent, start, end in spans:
            if merged and merged[-1][0] == agent and merged[-1][2] == start:
                merged[-1] = (agent, merged[-1][1], end)
            else:
                merged.append((agent, start, end))
        return merged

    def attend(
        self, qk: torch.Tensor, v: torch.Tensor, heads: int, *, one_function: bool = True
    ) -> torch.Tensor:
        """qk [N, H+K, D] (RoPE applied; `heads` = H), v [N, K*D] -> [N, H*D] attention output.

        Each prefix copy attends causally to itself; each row attends to its run's
        prefix copy and causally to its own tokens (right padding is never seen by a
        real token). Softmaxes compute in fp32 inside whatever the compute dtype.

        On a CPU with a shared prefix of at most `PLAIN_ATTENTION_MAX_LEN` tokens in a
        reduced dtype (`FP32_ONE_FUNCTION_MAX_PREFIX` in fp32), all of it is one
        autograd function of plain matmuls in the compute dtype
        (`attention.stream_attention`). Otherwise the composites: the prefix by
        `causal_attention` (plain matmuls) in a reduced dtype on a CPU up to
        `PLAIN_ATTENTION_MAX_LEN`, else by torch's flash attention (on a CPU in a
        reduced dtype through fp32); the rows by `prefixed_attention` (plain matmuls,
        any width); rows without a prefix as the prefix. `one_function=False` takes
        the composites whatever the length (`python -m benchmarks.attention` times
        both ways).
        """
        kv, d = qk.shape[1] - heads, qk.shape[2]
        on_cpu = qk.device.type == "cpu"
        limit = (
            PLAIN_ATTENTION_MAX_LEN if qk.dtype != torch.float32 else FP32_ONE_FUNCTION_MAX_PREFIX
        )
        if one_function and self.prefix and on_cpu and self.prefix <= limit:
            # one function for the whole stream, a few autograd nodes where the composites
            # below make some hundred: as fast or faster in either dtype up to these limits
            # (`python -m benchmarks.attention`, its stream rows)
            return stream_attention(
                qk, v, heads=heads, copies=self.copies, prefix=self.prefix, run_rows=self.run_rows
            )
        out_dtype = qk.dtype
        # torch's CPU flash attention runs its backward 3x slower in bf16 than in fp32, so
        # a reduced compute dtype on a CPU attends by plain matmuls in that dtype up to
        # PLAIN_ATTENTION_MAX_LEN positions (`causal_attention`: 1.3-2.4x fp32 flash at
        # 26-300 positions, `python -m benchmarks.attention`) and by fp32 flash beyond
        # (whose memory stays linear in the length).
        reduced = on_cpu and out_dtype != torch.float32
        q, k = qk.split([heads, kv], dim=1)
        v = v.view(-1, kv, d)

        # [n * len, heads, D] -> [n, heads, len, D]
        def rows_of(x: torch.Tensor, n: int, length: int) -> torch.Tensor:
            return x.view(n, length, x.shape[1], d).transpose(1, 2)

        def back(x: torch.Tensor) -> torch.Tensor:  # [n, H, len, D] -> [n*len, H*D]
            return x.transpose(1, 2).reshape(-1, heads * d)

        def causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if reduced and q.shape[2] <= PLAIN_ATTENTION_MAX_LEN:
                return back(causal_attention(q, k, v))
            if reduced:
                q, k, v = q.float(), k.float(), v.float()
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            return back(out).to(out_dtype)

        if not self.prefix:
            return causal(*(rows_of(x, self.rows, self.width) for x in (q, k, v)))
        n, p, w = self.copies, self.prefix, self.width
        (q_p, q_r), (k_p, k_r), (v_p, v_r) = (x.split([n * p, self.rows * w]) for x in (q, k, v))
        q_p, k_p, v_p = (rows_of(x, n, p) for x in (q_p, k_p, v_p))
        q_r, k_r, v_r = (rows_of(x, self.rows, w) for x in (q_r, k_r, v_r))
        attn = prefixed_attention(q_r, k_p, v_p, k_r, v_r, self.run_rows)
        return torch.cat([causal(q_p, k_p, v_p), back(attn)])

    def scored(self, mask: torch.Tensor) -> torch.Tensor:
        """Stream index of each scored position of `mask` [B, T] (row-major)."""
        flat = mask[:, self.prefix :].reshape(-1).nonzero().squeeze(1)
        return flat + self.copies * self.prefix


FP32_ONE_FUNCTION_MAX_PREFIX = 256
"""Longest prefix an fp32 pass on a CPU attends by `attention.stream_attention` (plain
fp32 matmuls for the prefix, where the composites take torch's flash kernel):
composites / one function 1.2x at 141 prefix tokens, 1.1x at 200, even at 256 and 300
(`python -m benchmarks.attention`, its fp32 stream rows). Past it the composites keep
flash's memory, linear in the length, where the one function saves the prefix's
[P, P] probabilities per head (2.4 MB a layer at 256 tokens and SmolLM2's 9 heads)."""


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """`F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)` by
    plain matmuls in the input dtype: the query heads that share a kv head are stacked as
    rows of one batched matmul whose causal mask is an added bias (`torch.baddbmm`, the
    scale folded in), then a softmax (fp32 inside, whatever the dtype) and one more.

    Args:
        q: [B, H, w, D]; k, v: [B, K, w, D] with K dividing H.

    Returns:
        [B, H, w, D].
    """
    b, heads, w, d = q.shape
    kv = k.shape[1]
    g = heads // kv  # query head h reads kv head h // g
    bias = causal_bias(w, g, q.dtype, q.device)
    scores = torch.baddbmm(
        bias, q.reshape(b * kv, g * w, d), k.reshape(b * kv, w, d).transpose(1, 2), alpha=d**-0.5
    )
    probs = torch.softmax(scores, dim=-1)
    return torch.bmm(probs, v.reshape(b * kv, w, d)).view(b, heads, w, d)


def prefixed_attention(
    q: torch.Tensor,
    k_prefix: torch.Tensor,
    v_prefix: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    run_rows: list[int],
) -> torch.Tensor:
    """Rows that each attend to their run's prefix and causally to their own tokens.

    The same as `F.scaled_dot_product_attention(q, cat([k_prefix[owner], k], 2), ...,
    attn_mask=ones(w, P + w).tril(P), enable_gqa=True)` with `owner` repeating copy i
    `run_rows[i]` times, without copying the prefix keys and values per row (nor
    scattering their gradients back): one softmax over both score blocks, the query
    heads that share a kv head stacked as rows of one matmul.

    Args:
        q: [B, H, w, D] the rows' queries (B = sum(run_rows)).
        k_prefix, v_prefix: [R, K, P, D] one prefix copy per run.
        k, v: [B, K, w, D] the rows' own keys and values.
        run_rows: rows per run, in order.

    Returns:
        [B, H, w, D].
    """
    b, heads, w, d = q.shape
    kv, p = k.shape[1], k_prefix.shape[2]
    g = heads // kv  # query head h reads kv head h // g
    q = q.reshape(b, kv, g * w, d) * d**-0.5  # row i*w + t: head j*g + i, position t
    own = torch.baddbmm(  # [B, K, g*w, w], the future masked by an added -inf
        causal_bias(w, g, q.dtype, q.device),
        q.reshape(b * kv, g * w, d),
        k.reshape(b * kv, w, d).transpose(1, 2),
    ).view(b, kv, g * w, w)
    outs = []
    if len(run_rows) == 1:  # one run: no split, whose backward would copy each gradient
        parts: Iterable[tuple[torch.Tensor, ...]] = [
            (q, own, v, k_prefix.squeeze(0), v_prefix.squeeze(0))
        ]
    else:  # split and unbind, not slices: their backward is one cat or stack, no zero fills
        parts = zip(
            q.split(run_rows),
            own.split(run_rows),
            v.split(run_rows),
            k_prefix.unbind(0),
            v_prefix.unbind(0),
            strict=True,
        )
    for q_i, own_i, v_i, kp_i, vp_i in parts:
        n = q_i.shape[0]
        stacked = q_i.transpose(0, 1).reshape(kv, n * g * w, d)  # every row of the run at once
        pre = torch.bmm(stacked, kp_i.transpose(1, 2))  # [K, n*g*w, P]
        pre = pre.view(kv, n, g * w, p).transpose(0, 1)
        # torch's softmax computes in fp32 whatever the input dtype: the probabilities of
        # an fp32 softmax and a cast, without the cast's passes; backwards it works from
        # the rounded probabilities and a gradient in the input dtype (in bf16, within a
        # unit in the last place of an fp32 backward and a cast)
        scores = torch.cat([pre, own_i], dim=-1)
        probs = torch.softmax(scores, dim=-1)
        probs_pre, probs_own = probs.split([p, w], dim=-1)
        from_pre = torch.bmm(probs_pre.transpose(0, 1).reshape(kv, n * g * w, p), vp_i)
        outs.append(from_pre.view(kv, n, g * w, d).transpose(0, 1) + probs_own @ v_i)
    out = torch.cat(outs) if len(outs) > 1 else outs[0]
    return out.reshape(b, heads, w, d)
