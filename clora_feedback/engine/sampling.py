"""Token selection for a decode batch: temperature, top-p, seeds, logprobs, constraints.

Every row carries its own `SamplingParams` and its own `torch.Generator`, so a
seeded request gives the same tokens whatever else shares its batch.

Behaviour logprobs are "raw" (`EngineCapabilities.logprobs`): the log-softmax
of the raw logits, independent of temperature, top-p and any constraint. Why
not "processed" (of the distribution actually sampled from)? The trainer's
policy is the temperature-1 model: `train/loss.py` takes the PPO ratio
`exp(logp_now - logp_behaviour)` with `logp_now` at temperature 1, so raw
behaviour logprobs give a fresh sample a ratio of exactly 1 and the ratio then
measures only how far the adapter moved (staleness), which is what the clip is
for. Processed logprobs would fold the sampler into the ratio (at temperature
0.7 a fresh sample's ratio is already far from 1 and gets clipped; greedy or
top-p would give 0 or -inf), and would change what the OpenAI `logprobs`
field reports today. The sampler's own distribution is still fully known from
the recorded sampling parameters. The OpenAI `logprobs` response field carries
these same raw values.

Not here: stop strings and detokenisation (see `detok`), compiling constraints
(see `guided`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from clora_feedback.engine.types import SamplingParams, TokenConstraint

_CONSTRAINT_CANDIDATES = 32


@dataclass
class RowSampler:
    """Per-sequence sampling state."""

    params: SamplingParams
    generator: torch.Generator | None
    constraint: TokenConstraint | None = None

    @classmethod
    def create(
        cls, params: SamplingParams, constraint: TokenConstraint | None = None
    ) -> RowSampler:
        gen = None
        if params.temperature > 0:
            gen = torch.Generator()
            gen.manual_seed(
                params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item())
            )
        return cls(params, gen, constraint)


@dataclass(frozen=True)
class Sampled:
    """The choice for one row: token, its logprob, and top alternatives when asked."""

    token_id: int | None  # None: the constraint allows nothing (finish the row)
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...]


def _filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[V] logits -> [V] sampling distribution after temperature and top-p."""
    probs = torch.softmax(logits / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        cumulative = sorted_probs.cumsum(-1)
        drop = cumulative - sorted_probs > params.top_p  # keep the smallest prefix reaching top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        probs = probs / probs.sum()
    return probs


def _pick(logits: torch.Tensor, row: RowSampler) -> int | None:
    params = row.params
    if row.constraint is None:
        if params.temperature == 0:
            return int(logits.argmax().item())
        return int(
            torch.multinomial(_filtered_probs(logits, params), 1, generator=row.generator).item()
        )
    # Constrained: try candidates in order of preference, then fall back to a full scan.
    if params.temperature == 0:
        candidates = logits.topk(min(_CONSTRAINT_CANDIDATES, logits.numel())).indices.tolist()
    else:
        probs = _filtered_probs(logits, params)
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
    """Pick one token per row.

    Args:
        logits: [B, V] fp32 logits.
        rows: B per-row samplers.

    Returns:
        B `Sampled` choices.
    """
    logprobs = torch.log_softmax(logits, dim=-1)
    k = max((r.params.top_logprobs for r in rows), default=0)
    top = logprobs.topk(k, dim=-1) if k else None
    out = []
    for b, row in enumerate(rows):
        token = _pick(logits[b], row)
        alternatives: tuple[tuple[int, float], ...] = ()
        if top is not None and row.params.top_logprobs:
            n = row.params.top_logprobs
            alternatives = tuple(
                zip(top.indices[b, :n].tolist(), top.values[b, :n].tolist(), strict=True)
            )
        lp = float(logprobs[b, token].item()) if token is not None else 0.0
        out.append(Sampled(token, lp, alternatives))
    return out
