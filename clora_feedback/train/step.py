"""One optimizer step for one agent (swap-based) or several at once (batched multi-tenant).

`train_step` is the readable core of learning:

1. swap each agent's state (params, Adam moments) from host memory into a slot;
2. one forward/backward over every agent's rows together (policy-gradient
   rows on engine token ids, supervised rows on right answers; a preference
   pair reuses the two rows of its sides), each agent's loss normalised over its own rows
   only, so its gradient is exactly what training it alone would give; the
   base model (adapter disabled) scores the pairs, and every row for the KL
   term, in one extra pass without gradients;
3. each agent's own AdamW step on its own flat buffers;
4. swap back out.

Not here: choosing samples (see `admission`), publishing (see `trainer`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import torch

from clora_feedback.train.forward import PackedBatch, TrainLoRA
from clora_feedback.train.loss import (
    LossConfig,
    advantages,
    clipped_pg_loss,
    kl_to_reference,
    preference_loss,
    sft_loss,
)
from clora_feedback.train.policy import PolicyModel
from clora_feedback.train.state import AdamConfig, AgentTrainState, TrainingSlot, adam_step


@dataclass(frozen=True)
class PGSample:
    """A rewarded trajectory sample, in engine token ids.

    Attributes:
        group: prompt group (completion id); samples of one request share it.
        prompt_ids: [P] prompt tokens.
        completion_ids: [C] generated tokens.
        behaviour_logprobs: [C] logprobs recorded at serving time.
        reward: scalar reward.
        staleness: versions between the one that produced it and the one being trained.
    """

    group: str
    prompt_ids: list[int]
    completion_ids: list[int]
    behaviour_logprobs: list[float]
    reward: float
    staleness: int = 0


@dataclass(frozen=True)
class SFTSample:
    """A supervised target: prompt ids plus the corrected output's ids (EOS included)."""

    prompt_ids: list[int]
    target_ids: list[int]


@dataclass(frozen=True)
class PreferencePair:
    """A wrong output and the right answer given for the same prompt.

    Attributes:
        prompt_ids: [P] prompt tokens.
        chosen_ids: [W] the right answer's tokens (EOS included).
        rejected_ids: [L] the wrong output's engine tokens.
    """

    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]


@dataclass
class AgentBatch:
    """One agent's admitted mini-batch.

    Attributes:
        state: the agent's training state.
        pg: rewarded samples with raw behaviour logprobs (policy gradient).
        sft: supervised targets (right answers, replayed labelled examples).
        pairs: preference pairs.
    """

    state: AgentTrainState
    pg: list[PGSample] = field(default_factory=list)
    sft: list[SFTSample] = field(default_factory=list)
    pairs: list[PreferencePair] = field(default_factory=list)


@dataclass(frozen=True)
class StepResult:
    """What one agent's step did (logged, stored in the version manifest)."""

    agent: str
    step: int
    loss: float
    pg_loss: float
    sft_loss: float
    kl: float
    reward_mean: float
    num_pg: int
    num_sft: int
    num_pairs: int
    pref_loss: float
    pref_ordered: float
    lr: float
    tokens: int
    grad_norm: float
    ratio_mean: float
    clip_frac: float
    staleness_mean: float
    staleness_max: int
    swap_s: float
    step_s: float

    def metrics(self) -> dict[str, float]:
        return {k: float(v) for k, v in self.__dict__.items() if k != "agent"}


@dataclass(frozen=True)
class _AgentRows:
    """Where one agent's samples sit among the pass's rows (indices into them).

    A row is one distinct (prompt, scored ids) pair of the agent: a wrong output's
    policy-gradient row is also the rejected side of its pairs, and a right
    answer's supervised row their chosen side, so a pair adds no row of its own."""

    pg: list[int]
    sft: list[int]
    pairs: list[tuple[int, int]]  # (chosen, rejected)
    first: int
    end: int


class _RowTable:
    """The pass's distinct rows (prompt, scored ids) and the agent of each; an agent's
    rows are consecutive, and a row repeated within one agent is stored once."""

    def __init__(self) -> None:
        self.seqs: list[tuple[list[int], list[int]]] = []
        self.owner: list[int] = []
        self._index: dict[tuple[tuple[int, ...], tuple[int, ...]], int] = {}

    def begin(self, agent: int) -> int:
        self._index, self._agent = {}, agent
        return len(self.seqs)

    def row(self, prompt: list[int], ids: list[int]) -> int:
        key = (tuple(prompt), tuple(ids))
        if key not in self._index:
            self._index[key] = len(self.seqs)
            self.seqs.append((prompt, ids))
            self.owner.append(self._agent)
        return self._index[key]


def _rows(
    batches: list[AgentBatch], scored: list[list[tuple[PGSample, float]]]
) -> tuple[list[tuple[list[int], list[int]]], list[int], list[_AgentRows]]:
    """The pass's distinct rows, the agent index of each row, and where each agent's
    samples sit among them (of its policy-gradient samples, the `scored` ones)."""
    table = _RowTable()
    layouts: list[_AgentRows] = []
    for i, batch in enumerate(batches):
        first = table.begin(i)
        pg = [table.row(s.prompt_ids, s.completion_ids) for s, _ in scored[i]]
        sft = [table.row(t.prompt_ids, t.target_ids) for t in batch.sft]
        pairs = [
            (table.row(p.prompt_ids, p.chosen_ids), table.row(p.prompt_ids, p.rejected_ids))
            for p in batch.pairs
        ]
        layouts.append(_AgentRows(pg, sft, pairs, first, len(table.seqs)))
    return table.seqs, table.owner, layouts


def _reference_rows(
    model: PolicyModel,
    seqs: list[tuple[list[int], list[int]]],
    counts: list[int],
    wanted: list[bool],
) -> dict[int, torch.Tensor]:
    """The base model's (adapter disabled) token logprobs of the rows marked `wanted`,
    by row index, in one pass without gradients."""
    picked = [i for i, w in enumerate(wanted) if w]
    if not picked:
        return {}
    with torch.no_grad():
        logp = model.token_logprobs(PackedBatch.build([seqs[i] for i in picked]), None)
    rows = torch.split(logp, [counts[i] for i in picked])
    return dict(zip(picked, rows, strict=True))


def train_step(
    model: PolicyModel,
    slots: list[TrainingSlot],
    batches: list[AgentBatch],
    loss_cfg: LossConfig,
    adam_cfg: AdamConfig,
) -> list[StepResult]:
    """Run one optimizer step for every agent in `batches` (len(batches) <= len(slots))."""
    if len(batches) > len(slots):
        raise ValueError(f"{len(batches)} agents but only {len(slots)} training slots")
    t0 = time.perf_counter()
    leaves = [slot.swap_in(b.state) for slot, b in zip(slots, batches, strict=False)]
    # Advantages first: a sample with none (every reward at the baseline, e.g. all 0 before
    # the first right answer) adds nothing to the policy gradient, so it gets no row.
    scored = [_scored(b, loss_cfg) for b in batches]
    seqs, owner, layouts = _rows(batches, scored)
    if seqs:
        packed = PackedBatch.build(seqs)
        lora = TrainLoRA(
            [b.state.layout for b in batches], leaves, torch.tensor(owner, device=model.device)
        )
        logp = model.token_logprobs(packed, lora)
        counts: list[int] = packed.mask.sum(dim=1).tolist()
    else:  # nothing carries a gradient: no pass (each agent's update sees a zero gradient)
        logp, counts = torch.zeros(0, device=model.device), []
    per_row = list(torch.split(logp, counts))
    wanted = [False] * len(seqs)  # the reference scores the pairs, and the PG rows for KL
    for rows in layouts:
        for i in [r for pair in rows.pairs for r in pair] + (rows.pg if loss_cfg.kl_coef else []):
            wanted[i] = True
    ref = _reference_rows(model, seqs, counts, wanted)

    total = logp.new_zeros(())
    stats: list[dict[str, float]] = []
    for batch, pg, rows in zip(batches, scored, layouts, strict=True):
        loss_i, s = _agent_loss(batch, pg, rows, per_row, ref, loss_cfg, logp.new_zeros(()))
        s["loss"] = float(loss_i.item())
        s["tokens"] = float(sum(counts[rows.first : rows.end]))
        total = total + loss_i
        stats.append(s)
    if total.requires_grad:
        total.backward()

    results = []
    elapsed = time.perf_counter() - t0
    for slot, leaf, batch, s in zip(slots, leaves, batches, stats, strict=False):
        state = batch.state
        n = state.layout.numel
        grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
        state.step += 1
        cfg = (
            adam_cfg
            if state.lr_scale == 1.0
            else replace(adam_cfg, lr=adam_cfg.lr * state.lr_scale)
        )
        norm = adam_step(leaf.data, grad, slot.exp_avg[:n], slot.exp_avg_sq[:n], state.step, cfg)
        slot.swap_out(leaf)
        stale = [p.staleness for p in batch.pg] or [0]
        rewards = [p.reward for p in batch.pg]
        results.append(
            StepResult(
                agent=state.agent,
                step=state.step,
                loss=s["loss"],
                pg_loss=s["pg_loss"],
                sft_loss=s["sft_loss"],
                kl=s["kl"],
                reward_mean=sum(rewards) / len(rewards) if rewards else float("nan"),
                num_pg=len(batch.pg),
                num_sft=len(batch.sft),
                num_pairs=len(batch.pairs),
                pref_loss=s["pref_loss"],
                pref_ordered=s["pref_ordered"],
                lr=cfg.lr_at(state.step),
                tokens=int(s["tokens"]),
                grad_norm=norm,
                ratio_mean=s["ratio_mean"],
                clip_frac=s["clip_frac"],
                staleness_mean=sum(stale) / len(stale),
                staleness_max=max(stale),
                swap_s=slot.last_swap_s,
                step_s=elapsed + slot.last_swap_s,
            )
        )
    return results


def _scored(batch: AgentBatch, cfg: LossConfig) -> list[tuple[PGSample, float]]:
    """(sample, advantage) of the policy-gradient samples that carry a gradient (all of
    them when the KL term scores them); updates the agent's running baseline."""
    if not batch.pg:
        return []
    adv, batch.state.baseline = advantages(
        [p.reward for p in batch.pg],
        [p.group for p in batch.pg],
        batch.state.baseline,
        cfg.baseline_momentum,
    )
    pairs = list(zip(batch.pg, adv, strict=True))
    return pairs if cfg.kl_coef > 0 else [(p, a) for p, a in pairs if abs(a) > 1e-9]


def _agent_loss(
    batch: AgentBatch,
    pg_scored: list[tuple[PGSample, float]],
    rows: _AgentRows,
    per_row: list[torch.Tensor],
    ref: dict[int, torch.Tensor],
    cfg: LossConfig,
    zero: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, float]]:
    """One agent's loss over its rows (`rows` says which of the pass's rows are whose;
    `pg_scored` are its policy-gradient samples with a gradient, with their advantages)."""
    s: dict[str, float] = {
        "pg_loss": 0.0,
        "sft_loss": 0.0,
        "kl": 0.0,
        "ratio_mean": 1.0,
        "clip_frac": 0.0,
        "pref_loss": 0.0,
        "pref_ordered": float("nan"),
    }
    loss = zero
    if pg_scored:
        lp = torch.cat([per_row[i] for i in rows.pg])
        behaviour = torch.tensor(
            [x for p, _ in pg_scored for x in p.behaviour_logprobs], device=lp.device
        )
        adv_tok = torch.tensor(
            [a for p, a in pg_scored for _ in p.completion_ids], device=lp.device
        )
        pg, extra = clipped_pg_loss(lp, behaviour, adv_tok, cfg.clip_eps)
        loss = loss + pg
        s.update(extra, pg_loss=float(pg.item()))
        if cfg.kl_coef > 0:
            kl = kl_to_reference(lp, torch.cat([ref[i] for i in rows.pg]))
            loss = loss + cfg.kl_coef * kl
            s["kl"] = float(kl.item())
    if batch.sft:
        sl = sft_loss([per_row[i] for i in rows.sft])
        loss = loss + cfg.sft_weight * sl
        s["sft_loss"] = float(sl.item())
    if rows.pairs and cfg.preference_weight > 0:
        chosen, rejected = zip(*rows.pairs, strict=True)

        def sums(
            source: dict[int, torch.Tensor] | list[torch.Tensor], idx: tuple[int, ...]
        ) -> torch.Tensor:
            return torch.stack([source[i].sum() for i in idx])

        pl, extra = preference_loss(
            sums(per_row, chosen),
            sums(per_row, rejected),
            sums(ref, chosen),
            sums(ref, rejected),
            cfg.preference_beta,
        )
        loss = loss + cfg.preference_weight * pl
        s.update(extra, pref_loss=float(pl.item()))
    return loss, s
