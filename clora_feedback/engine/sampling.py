"""Token selection for a decode batch: penalties, logit bias, min_tokens, temperature,
top-k, top-p, seeds, logprobs, constraints.

Every row carries its own `SamplingParams`, and the rows of one batch may all
differ: each control is applied to the rows that set it, as one batched tensor
operation; a batch of default rows takes none of them (one log-softmax, one
argmax or one inverse-CDF draw for the whole batch).

Seeds: a row's randomness is a pure function of (its seed, how many tokens it
has generated): the uniform draw of step t is the t-th output of SplitMix64
started at the seed (`uniform`), mapped through the row's cumulative
distribution. So a seeded request gives the same tokens whatever else shares
its batch, on any device and any torch version. Constrained rows, which need
several candidates in order of sampled preference, draw them from a
`torch.Generator` seeded with the same seed.

Behaviour logprobs are "raw" (`EngineCapabilities.logprobs`): the log-softmax
of the raw logits, before penalties, logit_bias, min_tokens, temperature,
top-k, top-p and any constraint. Why not "processed" (of the distribution
actually sampled from)? The trainer's policy is the temperature-1 model:
`train/loss.py` takes the PPO ratio `exp(logp_now - logp_behaviour)` with
`logp_now` of that model, so raw behaviour logprobs give a fresh sample a ratio
of exactly 1 and the ratio then measures only how far the adapter moved
(staleness), which is what the clip is for. Processed logprobs would fold the
sampler into the ratio (at temperature 0.7 a fresh sample's ratio is already
far from 1 and gets clipped; greedy, top-k, top-p or a -100 bias would give 0
or -inf), and would change what the OpenAI `logprobs` field reports (vLLM's
default, `raw_logprobs`, is the same choice, and the vLLM engine requires it, so
both engines record one quantity). The sampler's own distribution
is still fully known from the sampling parameters and the tokens so far. The
OpenAI `logprobs` response field carries these same raw values.

Not here: stop strings and detokenisation (see `detok`), compiling constraints
(see `guided`), range checks of the parameters (`SamplingParams.check`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from clora_feedback.engine.types import SamplingParams, TokenConstraint

_CONSTRAINT_CANDIDATES = 32
_BLOCK = 1024  # tokens per block of the two-level CDF (`draw`)
_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # SplitMix64's increment (2**64 / phi)


def splitmix64(seed: int, step: int) -> int:
    """The `step`-th (0-based) 64-bit output of SplitMix64 whose state starts at `seed`."""
    z = (seed + (step + 1) * _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def uniform(seed: int, step: int) -> float:
    """The row's uniform draw in [0, 1) for generation step `step` (53 random bits)."""
    return (splitmix64(seed, step) >> 11) * 2.0**-53


@dataclass(eq=False)
class RowSampler:
    """Per-sequence sampling state.

    Attributes:
        params: the sequence's sampling parameters.
        seed: the 64-bit seed ([0, 2**64)): `params.seed`, or a random one.
        constraint: the compiled constraint, if any.
        stop_ids: token ids that would end the sequence (EOS unless ignored, stop
            token ids); `min_tokens` keeps them out until it is reached.
        generated: tokens this row has sampled so far (its RNG step).
    """

    params: SamplingParams
    seed: int
    constraint: TokenConstraint | None = None
    stop_ids: tuple[int, ...] = ()
    generated: int = 0
    _generator: torch.Generator | None = field(default=None, repr=False)
    _counts: torch.Tensor | None = field(default=None, repr=False)  # [V] penalized rows only
    _bias: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    @classmethod
    def create(
        cls,
        params: SamplingParams,
        constraint: TokenConstraint | None = None,
        stop_ids: frozenset[int] | tuple[int, ...] = (),
    ) -> RowSampler:
        seed = params.seed
        if seed is None:
            seed = int(torch.randint(0, 2**62, ()).item())
        return cls(params, seed, constraint, tuple(sorted(stop_ids)))

    @property
    def generator(self) -> torch.Generator:
        """A CPU generator seeded with `seed` (constrained rows draw candidates from it)."""
        if self._generator is None:
            self._generator = torch.Generator().manual_seed(self.seed)
        return self._generator

    @property
    def blocks_stops(self) -> bool:
        """`min_tokens` is not reached yet, so the stop tokens are masked this step."""
        return self.generated < self.params.min_tokens and bool(self.stop_ids)

    def counts(self, vocab: int, device: torch.device) -> torch.Tensor:
        """[V] fp32 times each token was generated by this row (penalized rows only)."""
        if self._counts is None:
            self._counts = torch.zeros(vocab, device=device)
        return self._counts

    def bias(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids [K] int64, values [K] fp32) of `params.logit_bias`, built once per row."""
        if self._bias is None:
            pairs = self.params.logit_bias
            ids = torch.tensor([t for t, _ in pairs], dtype=torch.long, device=device)
            values = torch.tensor([b for _, b in pairs], dtype=torch.float32, device=device)
            self._bias = (ids, values)
        return self._bias

    def record(self, token_id: int) -> None:
        """Account for the token just sampled (the RNG step, the penalty counts)."""
        self.generated += 1
        if self._counts is not None:
            self._counts[token_id] += 1


@dataclass(frozen=True)
class Sampled:
    """The choice for one row: token, its logprob, and top alternatives when asked."""

    token_id: int | None  # None: the constraint allows nothing (finish the row)
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...]


def _take(t: torch.Tensor, index: list[int]) -> torch.Tensor:
    """Rows `index` of t; t itself (no copy) when that is every row in order."""
    if len(index) == t.shape[0]:
        return t
    return t[index]


def apply_controls(logits: torch.Tensor, rows: list[RowSampler]) -> torch.Tensor:
    """[B, V] raw logits -> [B, V] logits after penalties, logit_bias and min_tokens.

    Returns `logits` itself when no row sets any of them (the default fast path);
    otherwise a processed copy, each control applied to its rows in one batched op.
    """
    penalized = [b for b, r in enumerate(rows) if r.params.penalized]
    biased = [b for b, r in enumerate(rows) if r.params.logit_bias]
    blocking = [b for b, r in enumerate(rows) if r.blocks_stops]
    if not (penalized or biased or blocking):
        return logits
    out = logits.clone()
    vocab, device = logits.shape[-1], logits.device
    if penalized:
        counts = torch.stack([rows[b].counts(vocab, device) for b in penalized])
        frequency = logits.new_tensor([rows[b].params.frequency_penalty for b in penalized])
        presence = logits.new_tensor([rows[b].params.presence_penalty for b in penalized])
        penalty = frequency[:, None] * counts + presence[:, None] * (counts > 0)
        out[penalized] -= penalty
    if biased:
        parts = [rows[b].bias(device) for b in biased]
        sizes = torch.tensor([ids.numel() for ids, _ in parts], device=device)
        row_index = torch.tensor(biased, device=device).repeat_interleave(sizes)
        ids = torch.cat([ids for ids, _ in parts])
        values = torch.cat([v for _, v in parts])
        out.index_put_((row_index, ids), values, accumulate=True)
    if blocking:
        pairs = [(b, t) for b in blocking for t in rows[b].stop_ids]
        row_index = torch.tensor([b for b, _ in pairs], device=device)
        ids = torch.tensor([t for _, t in pairs], device=device)
        out.index_put_((row_index, ids), torch.tensor(float("-inf"), device=device))
    return out


def distribution(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """[b, V] logits of b sampled rows -> [b, V] probabilities after temperature, top-k, top-p.

    Semantics (per row): divide by the temperature; with top_k = k > 0 keep the
    logits >= the k-th highest (ties kept); softmax; with top_p < 1 keep the
    smallest prefix of the descending probabilities whose mass reaches top_p.
    The result is normalised.
    """
    vocab = logits.shape[-1]
    temperatures = logits.new_tensor([p.temperature for p in params])
    if bool((temperatures != 1.0).any()):
        logits = logits / temperatures[:, None]
    ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(ks):
        k = torch.tensor(ks, device=logits.device)
        kth = logits.topk(max(ks), dim=-1).values.gather(1, (k - 1).clamp(min=0)[:, None])
        kth = kth.masked_fill((k == 0)[:, None], float("-inf"))  # rows without top_k keep all
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    top_p = [b for b, p in enumerate(params) if p.top_p < 1.0]
    if top_p:
        mass = probs.new_tensor([params[b].top_p for b in top_p])
        sorted_probs, order = probs[top_p].sort(dim=-1, descending=True)
        drop = (
            sorted_probs.cumsum(-1) - sorted_probs > mass[:, None]
        )  # keep the prefix reaching top_p
        kept = torch.zeros_like(sorted_probs).scatter_(
            1, order, sorted_probs.masked_fill(drop, 0.0)
        )
        probs[top_p] = kept / kept.sum(-1, keepdim=True)
    return probs


def draw(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: [b, V] probabilities and [b] uniforms in [0, 1) -> [b] token ids.

    Two levels, so the CDF keeps fp64 precision at fp32 cost (an fp64 cumsum over
    the vocabulary costs several times the rest of the step): the mass of blocks of
    `_BLOCK` tokens is summed in fp64, the uniform picks a block, then the rest of it
    picks a token inside that block's fp32 CDF. A token of probability 0 is never drawn.
    """
    b, vocab = probs.shape
    blocks = -(-vocab // _BLOCK)
    inner = F.pad(probs, (0, blocks * _BLOCK - vocab)).view(b, blocks, _BLOCK).cumsum(-1)
    outer = inner[..., -1].double().cumsum(-1)  # [b, blocks] mass up to each block's end
    total = outer[:, -1:]
    target = torch.minimum(uniforms.double()[:, None] * total, torch.nextafter(total, total * 0))
    block = torch.searchsorted(outer, target, right=True).clamp(max=blocks - 1)  # [b, 1]
    start = torch.where(block > 0, outer.gather(1, (block - 1).clamp(min=0)), 0.0)
    cdf = inner[torch.arange(b, device=probs.device), block[:, 0]]  # [b, _BLOCK]
    end = cdf[:, -1:]
    rest = torch.minimum((target - start).float(), torch.nextafter(end, end * 0))
    within = torch.searchsorted(cdf, rest, right=True)
    return (block * _BLOCK + within).squeeze(1)


def _pick_free(
    processed: torch.Tensor,
    raw_logprobs: torch.Tensor | None,
    rows: list[RowSampler],
    free: list[int],
) -> dict[int, int]:
    """Tokens of the unconstrained rows `free`: argmax for greedy rows, one draw for the rest.

    `raw_logprobs` is given when `processed` is the raw logits (no control applied):
    then rows at temperature 1 without top-k/top-p sample from its exponent directly.
    """
    picked: dict[int, int] = {}
    greedy = [b for b in free if rows[b].params.temperature == 0]
    if greedy:
        picked.update(zip(greedy, _take(processed, greedy).argmax(-1).tolist(), strict=True))
    sampled = [b for b in free if rows[b].params.temperature > 0]
    if sampled:
        params = [rows[b].params for b in sampled]
        if raw_logprobs is not None and all(
            p.temperature == 1.0 and p.top_p == 1.0 and p.top_k == 0 for p in params
        ):
            probs = _take(raw_logprobs, sampled).exp()
        else:
            probs = distribution(_take(processed, sampled), params)
        uniforms = torch.tensor([uniform(rows[b].seed, rows[b].generated) for b in sampled])
        tokens = draw(probs, uniforms.to(probs.device))
        picked.update(zip(sampled, tokens.tolist(), strict=True))
    return picked


def _pick_constrained(logits: torch.Tensor, row: RowSampler) -> int | None:
    """[V] processed logits -> the first candidate, in order of sampled preference, that
    the row's constraint allows; a full scan in logit order when none of them is."""
    assert row.constraint is not None
    if row.params.temperature == 0:
        candidates = logits.topk(min(_CONSTRAINT_CANDIDATES, logits.numel())).indices.tolist()
    else:
        probs = distribution(logits[None], [row.params])[0].cpu()
        k = min(_CONSTRAINT_CANDIDATES, int((probs > 0).sum().item()))
        candidates = torch.multinomial(
            probs, k, replacement=False, generator=row.generator
        ).tolist()
    for token in candidates:
        if row.constraint.allows(token):
            return token
    for token in logits.argsort(descending=True).tolist():
        if row.constraint.allows(token):
            return token
    return None


def sample_batch(logits: torch.Tensor, rows: list[RowSampler]) -> list[Sampled]:
    """Pick one token per row and record it in the row's state.

    Args:
        logits: [B, V] fp32 raw logits.
        rows: B per-row samplers.

    Returns:
        B `Sampled` choices; logprobs are raw (see the module docstring).
    """
    logprobs = torch.log_softmax(logits, dim=-1)
    k = max((r.params.top_logprobs for r in rows), default=0)
    top = logprobs.topk(k, dim=-1) if k else None
    processed = apply_controls(logits, rows)
    free = [b for b, r in enumerate(rows) if r.constraint is None]
    raw = logprobs if processed is logits else None
    picked: dict[int, int | None] = dict(_pick_free(processed, raw, rows, free))
    for b, row in enumerate(rows):
        if row.constraint is not None:
            picked[b] = _pick_constrained(processed[b], row)
    chosen = [picked[b] for b in range(len(rows))]
    index = torch.tensor([t if t is not None else 0 for t in chosen], device=logits.device)
    chosen_logprobs = logprobs.gather(1, index[:, None]).squeeze(1).tolist()
    out = []
    for b, (row, token) in enumerate(zip(rows, chosen, strict=True)):
        alternatives: tuple[tuple[int, float], ...] = ()
        if top is not None and row.params.top_logprobs:
            n = row.params.top_logprobs
            alternatives = tuple(
                zip(top.indices[b, :n].tolist(), top.values[b, :n].tolist(), strict=True)
            )
        if token is None:
            out.append(Sampled(None, 0.0, alternatives))
            continue
        row.record(token)
        out.append(Sampled(token, float(chosen_logprobs[b]), alternatives))
    return out
