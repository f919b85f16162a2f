"""One optimizer step for one agent (swap-based) or several at once (batched multi-tenant).

`train_step` is the readable core of learning:

1. swap each agent's state (params, Adam moments) from host memory into a slot;
2. one forward/backward over every agent's rows together (policy-gradient
   rows on engine token ids, supervised rows on right answers, and both sides
   of each preference pair), each agent's loss normalised over its own rows
   only, so its gradient is exactly what training it alone would give; the
   base model (adapter disabled) scores the pairs, and every row for the KL
   term, in one extra pass without gradients;
3. each agent's own AdamW step on its own flat buffers;
4. swap back out.

Not here: choosing samples (see `admission`), publishing (see `trainer`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

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

    @property
    def rows(self) -> int:
        return len(self.pg) + len(self.sft) + 2 * len(self.pairs)


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


def _rows(batches: list[AgentBatch]) -> tuple[list[tuple[list[int], list[int]]], list[int]]:
    """All rows of the pass, (prompt, scored ids), and the agent index of each row.

    Per agent: its policy-gradient rows, its supervised rows, then each pair's
    chosen and rejected rows."""
    seqs: list[tuple[list[int], list[int]]] = []
    owner: list[int] = []
    for i, batch in enumerate(batches):
        seqs += [(s.prompt_ids, s.completion_ids) for s in batch.pg]
        seqs += [(t.prompt_ids, t.target_ids) for t in batch.sft]
        for p in batch.pairs:
            seqs += [(p.prompt_ids, p.chosen_ids), (p.prompt_ids, p.rejected_ids)]
        owner += [i] * batch.rows
    return seqs, owner


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
    seqs, owner = _rows(batches)
    packed = PackedBatch.build(seqs)
    lora = TrainLoRA(
        [b.state.layout for b in batches], leaves, torch.tensor(owner, device=model.device)
    )
    logp = model.token_logprobs(packed, lora)
    counts = packed.mask.sum(dim=1).tolist()
    per_row = list(torch.split(logp, counts))
    wanted: list[bool] = []
    for batch in batches:  # the reference scores every row for KL, else only the pairs
        kl = loss_cfg.kl_coef > 0
        wanted += [kl] * len(batch.pg) + [False] * len(batch.sft) + [True] * 2 * len(batch.pairs)
    ref = _reference_rows(model, seqs, counts, wanted)

    total = logp.new_zeros(())
    stats: list[dict[str, float]] = []
    row = 0
    for batch in batches:
        loss_i, s = _agent_loss(batch, per_row, ref, row, loss_cfg, logp.new_zeros(()))
        s["loss"] = float(loss_i.item())
        s["tokens"] = float(sum(counts[row : row + batch.rows]))
        total = total + loss_i
        stats.append(s)
        row += batch.rows
    if total.requires_grad:
        total.backward()

    results = []
    elapsed = time.perf_counter() - t0
    for slot, leaf, batch, s in zip(slots, leaves, batches, stats, strict=False):
        state = batch.state
        n = state.layout.numel
        grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
        state.step += 1
        norm = adam_step(
            leaf.data, grad, slot.exp_avg[:n], slot.exp_avg_sq[:n], state.step, adam_cfg
        )
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
                lr=adam_cfg.lr_at(state.step),
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


def _agent_loss(
    batch: AgentBatch,
    per_row: list[torch.Tensor],
    ref: dict[int, torch.Tensor],
    row: int,
    cfg: LossConfig,
    zero: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, float]]:
    """One agent's loss over its rows, which start at `row` (see `_rows` for their order)."""
    n_pg, n_sft, n_pairs = len(batch.pg), len(batch.sft), len(batch.pairs)
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
    if n_pg:
        adv, batch.state.baseline = advantages(
            [p.reward for p in batch.pg],
            [p.group for p in batch.pg],
            batch.state.baseline,
            cfg.baseline_momentum,
        )
        lp = torch.cat(per_row[row : row + n_pg])
        behaviour = torch.tensor(
            [x for p in batch.pg for x in p.behaviour_logprobs], device=lp.device
        )
        adv_tok = torch.tensor(
            [a for p, a in zip(batch.pg, adv, strict=True) for _ in p.completion_ids],
            device=lp.device,
        )
        pg, extra = clipped_pg_loss(lp, behaviour, adv_tok, cfg.clip_eps)
        loss = loss + pg
        s.update(extra, pg_loss=float(pg.item()))
        if cfg.kl_coef > 0:
            kl = kl_to_reference(lp, torch.cat([ref[i] for i in range(row, row + n_pg)]))
            loss = loss + cfg.kl_coef * kl
            s["kl"] = float(kl.item())
    if n_sft:
        sl = sft_loss(per_row[row + n_pg : row + n_pg + n_sft])
        loss = loss + cfg.sft_weight * sl
        s["sft_loss"] = float(sl.item())
    if n_pairs and cfg.preference_weight > 0:
        first = row + n_pg + n_sft
        sums = [per_row[i].sum() for i in range(first, first + 2 * n_pairs)]
        ref_sums = [ref[i].sum() for i in range(first, first + 2 * n_pairs)]
        pl, extra = preference_loss(
            torch.stack(sums[0::2]),
            torch.stack(sums[1::2]),
            torch.stack(ref_sums[0::2]),
            torch.stack(ref_sums[1::2]),
            cfg.preference_beta,
        )
        loss = loss + cfg.preference_weight * pl
        s.update(extra, pref_loss=float(pl.item()))
    return loss, s
