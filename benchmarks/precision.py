"""`python -m benchmarks.precision`: training in bf16 compute (fp32 masters) against fp32, in one run.

1. GEMM throughput of this machine, fp32 vs bf16, at the training pass's
   shape (M = the step's tokens, the MLP's up projection): the peak of the
   roofline line.
2. Step time: one swap step (the trainer's `train_step`) on the same batch of
   support-triage rows, fp32 and bf16 alternated; FLOPs per step from the model
   shape and the tokens (`training_flops`), achieved GFLOP/s against (1).
   2b: `--tickets` training tickets as supervised targets of `--target-tokens` tokens each
   (the shape of corrections and replayed examples: many scored tokens a row,
   where the vocabulary projection and its backward weigh more); the targets
   are the last tokens of each ticket's prompt, since only the shape sets the time.
3. Importance ratios: on fresh samples (behaviour logprobs from the fp32
   rollout policy, as an fp32 engine records them), exp(bf16 logprob - fp32
   logprob) per token: what the clipped objective sees at ratio 1.
4. Learning curve: support triage (`demo/support.py`: the six worked examples,
   operator rewards) as a one-token bandit, since a reply's first token decides
   its routing: per step, `--tickets` training tickets are rolled out at
   temperature 0.8 (sampled first token, its temperature-1 logprob recorded as
   the engine records it), rewarded 1.0 when `route_of` that token is the
   ticket's team, and one `train_step` runs in the compute dtype under test.
   The held-out metric after each step is the mean probability (temperature 1)
   of a right first token on `--eval` held-out tickets, plus greedy accuracy.
   Both dtypes see the same tickets and the same sampling random numbers per
   seed; `--seeds` seeds; mean ± std per step, with the share of samples the
   clipped objective dropped. The optimizer is the trainer's default
   (`trainer.lr`, `trainer.warmup_steps`). `--serving` says what serves each arm
   (rolls out and answers the held-out tickets): `same` (default), the arm's own
   pass in its own dtype, so behaviour logprobs and the trainer's agree (ratio 1, as a
   step's first scoring of fresh samples: nothing is clipped by construction), the
   pairing `auto` aims at by setting `engine.dtype` and `trainer.compute_dtype` alike
   (the embedded engine's own bf16 pass rounds the same way in its projections, but
   computes its logits in bf16); `float32`, an fp32 engine for both arms, which a bf16
   trainer does not match (see `service.parts.dtype_mismatch`).

No HTTP, no engine: the rollouts use the trainer's own forward
(`train.forward.next_token_logprobs`) with the arm's current fp32 masters.
`--quick` runs everything on the tiny random model (a smoke test).

Not here: the trainer's other costs (`bench train`), serving (`bench serve`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from clora_feedback.bench.report import (
    Row,
    format_facts,
    format_table,
    machine_facts,
    median,
    quick_defaults,
)
from clora_feedback.config import DEFAULT_MODEL, DEFAULT_TARGET_MODULES, TrainerConfig
from clora_feedback.demo import support
from clora_feedback.model.config import ModelConfig
from clora_feedback.train.forward import (
    PackedBatch,
    TrainLoRA,
    next_token_logprobs,
    shared_prefix_len,
)
from clora_feedback.train.loss import LossConfig
from clora_feedback.train.policy import COMPUTE_DTYPES, DecoderPolicy
from clora_feedback.train.state import (
    AdamConfig,
    AgentTrainState,
    LoRALayout,
    TrainingSlot,
    init_lora,
)
from clora_feedback.train.step import AgentBatch, PGSample, SFTSample, train_step

TEMPERATURE = 0.8

# -- FLOPs of a training step ------------------------------------------------------------------


def training_flops(
    config: ModelConfig, batch: PackedBatch, *, rank: int, targets: int, kl: bool = False
) -> float:
    """FLOPs one `train_step` executes on `batch` (padded shape, as the pass runs it).

    Counted from the model shape: per token processed, each base projection is
    2 * in * out forward and the same backward (input gradient only: the base
    is frozen); attention 4 * context * heads * head_dim forward (Q K^T and
    A V, causal context) and twice that backward; each LoRA projection
    2 * r * (in + out) forward and twice that backward (input and weight
    gradients); the head 2 * hidden * vocab per scored token, forward and
    backward. The shared prompt prefix (`shared_prefix_len`) is processed once
    per agent. `kl` adds the reference pass (forward only). Norms, RoPE,
    activations and the optimizer are left out (a few percent).
    """
    rows, width = batch.input_ids.shape
    prefix = shared_prefix_len(batch)
    shapes = config.projection_shapes()
    base = sum(2 * i * o for i, o in shapes.values()) * config.num_layers
    lora = sum(2 * rank * (i + o) for i, o in shapes.values()) * config.num_layers
    tokens = prefix + rows * (width - prefix)
    attn_unit = 4 * config.num_heads * config.head_dim * config.num_layers
    # Causal context summed over processed positions: the prefix stream, then each row's rest
    # (every rest position sees the whole prefix plus itself and earlier rest positions).
    rest = width - prefix
    context = prefix * (prefix + 1) / 2 + rows * (rest * prefix + rest * (rest + 1) / 2)
    scored = targets * 2 * config.hidden_size * config.vocab_size
    forward = tokens * (base + lora) + context * attn_unit + scored
    backward = tokens * (base + 2 * lora) + 2 * context * attn_unit + scored
    reference = tokens * base + context * attn_unit + scored if kl else 0.0
    return float(forward + backward + reference)


def gemm_gflops(m: int, k: int, n: int, dtype: torch.dtype, reps: int) -> float:
    """Median GFLOP/s of x [m, k] @ W[n, k]^T (`F.linear`, the pass's GEMM) in `dtype`."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = torch.randn(n, k, generator=gen).to(dtype)
    torch.nn.functional.linear(x, w)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.nn.functional.linear(x, w)
        times.append(time.perf_counter() - t0)
    return 2 * m * k * n / median(times) / 1e9


# -- the support-triage bandit -----------------------------------------------------------------


@dataclass(frozen=True)
class Task:
    """Tokenized support tickets and which first tokens route each team right."""

    train: list[tuple[list[int], str]]
    held_out: list[tuple[list[int], str]]
    team_tokens: dict[str, torch.Tensor]

    @classmethod
    def build(cls, policy: DecoderPolicy, *, seed: int, train: int, held_out: int) -> Task:
        tok = policy.tokenizer

        def encode(t: support.Ticket) -> tuple[list[int], str]:
            out: Any = tok.apply_chat_template(
                t.messages(), add_generation_prompt=True, tokenize=True
            )
            ids = out if isinstance(out, list) else out["input_ids"]  # or a BatchEncoding
            return [int(i) for i in ids], t.team

        vocab = policy.base.config.vocab_size
        words = [support.route_of(str(tok.decode([i]))) for i in range(min(vocab, len(tok)))]
        teams = {
            team: torch.tensor([i for i, w in enumerate(words) if w == team], dtype=torch.long)
            for team in support.TEAMS
        }
        return cls(
            [encode(t) for t in support.tickets(seed, "train", train)],
            [encode(t) for t in support.tickets(seed, "eval", held_out)],
            teams,
        )

    def right(self, team: str, token: int) -> bool:
        return bool((self.team_tokens[team] == token).any())


def _lora(state: AgentTrainState, rows: int) -> TrainLoRA:
    return TrainLoRA([state.layout], [state.params], torch.zeros(rows, dtype=torch.long))


def _prompt_batch(prompts: list[list[int]]) -> PackedBatch:
    return PackedBatch.build([(p, [0]) for p in prompts])  # score one dummy token after each


@torch.no_grad()
def rollout(
    policy: DecoderPolicy,
    state: AgentTrainState,
    tickets: list[tuple[list[int], str]],
    task: Task,
    gen: torch.Generator,
) -> list[PGSample]:
    """Sample each ticket's first reply token at `TEMPERATURE`; reward by the operator."""
    table = next_token_logprobs(
        policy.base, _prompt_batch([p for p, _ in tickets]), _lora(state, len(tickets)), policy.head
    )
    probs = torch.softmax(table / TEMPERATURE, dim=-1)
    tokens = torch.multinomial(probs, 1, generator=gen).squeeze(1).tolist()
    return [
        PGSample(
            f"t{i}", prompt, [tok], [float(table[i, tok])], 1.0 if task.right(team, tok) else 0.0
        )
        for i, ((prompt, team), tok) in enumerate(zip(tickets, tokens, strict=True))
    ]


@torch.no_grad()
def evaluate(policy: DecoderPolicy, state: AgentTrainState, task: Task) -> tuple[float, float]:
    """(mean probability of a right first token, greedy accuracy) on the held-out tickets."""
    p_right, correct = [], 0
    for start in range(0, len(task.held_out), 16):
        part = task.held_out[start : start + 16]
        table = next_token_logprobs(
            policy.base, _prompt_batch([p for p, _ in part]), _lora(state, len(part)), policy.head
        ).exp()
        for row, (_, team) in zip(table, part, strict=True):
            p_right.append(float(row[task.team_tokens[team]].sum()))
            correct += task.right(team, int(row.argmax()))
    return statistics.fmean(p_right), correct / len(task.held_out)


@dataclass
class Curve:
    """One seed, one dtype: per step the training reward, held-out metrics and the step's stats."""

    dtype: str
    seed: int
    reward: list[float] = field(default_factory=list)
    held_out_p: list[float] = field(default_factory=list)  # index 0: before step 1
    held_out_acc: list[float] = field(default_factory=list)
    ratio_mean: list[float] = field(default_factory=list)
    clip_frac: list[float] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)


def run_curves(
    rollout_policy: DecoderPolicy,
    trainers: dict[str, DecoderPolicy],
    task: Task,
    args: argparse.Namespace,
    seed: int,
) -> dict[str, Curve]:
    """`args.steps` bandit steps of one seed for every compute dtype, in lockstep.

    Each arm has its own adapter, rollouts and random numbers (seeded alike, so
    with `--serving float32` step 1 trains both on the very same batch; with `same`
    the sampled tokens may differ where the dtypes' probabilities do); per step the arms take turns in
    alternating order, so their step times form alternated pairs on batches of
    one shape (the same tickets, one sampled token each).
    """
    limits = rollout_policy.lora_limits
    layout = LoRALayout.build(limits, args.rank, 2.0 * args.rank, tuple(limits.target_modules))
    loss, adam = LossConfig(), AdamConfig(lr=args.lr, warmup_steps=args.warmup_steps)
    arms = {}
    for name, policy in trainers.items():
        state = AgentTrainState.create("support", layout, init_lora(layout, seed=seed))
        arms[name] = (
            state,
            TrainingSlot(layout.numel, policy.device),
            torch.Generator().manual_seed(seed),
        )
    curves = {name: Curve(name, seed) for name in trainers}
    serving = {
        name: policy if args.serving == "same" else rollout_policy
        for name, policy in trainers.items()
    }
    for name, c in curves.items():  # both start from one adapter
        p, acc = evaluate(serving[name], arms[name][0], task)
        c.held_out_p.append(p)
        c.held_out_acc.append(acc)
    order = random.Random(seed)
    names = list(trainers)
    for step in range(args.steps):
        tickets = order.sample(task.train, args.tickets)
        for name in names if step % 2 == 0 else names[::-1]:
            state, slot, gen = arms[name]
            samples = rollout(serving[name], state, tickets, task, gen)
            t0 = time.perf_counter()
            batch = AgentBatch(state, samples)
            result = train_step(trainers[name], [slot], [batch], loss, adam)[0]
            out = curves[name]
            out.step_s.append(time.perf_counter() - t0)
            out.reward.append(result.reward_mean)
            out.ratio_mean.append(result.ratio_mean)
            out.clip_frac.append(result.clip_frac)
            p, acc = evaluate(serving[name], state, task)
            out.held_out_p.append(p)
            out.held_out_acc.append(acc)
            _progress(
                f"{name} seed {seed} step {step + 1}/{args.steps}: reward "
                f"{result.reward_mean:.2f}, held-out p {p:.3f}, ratio {result.ratio_mean:.4f}, "
                f"{out.step_s[-1]:.1f} s"
            )
    return curves


# -- step time and ratios on one batch ---------------------------------------------------------


@torch.no_grad()
def ratio_stats(
    policies: dict[str, DecoderPolicy], samples: list[PGSample], rank: int, seed: int
) -> dict[str, float]:
    """exp(bf16 logprob - fp32 behaviour logprob) of fresh samples: mean, min, max, |log r| p99."""
    p32 = policies["float32"]
    limits = p32.lora_limits
    layout = LoRALayout.build(limits, rank, 2.0 * rank, tuple(limits.target_modules))
    flat = init_lora(layout, seed=seed)
    flat += 1e-3 * torch.randn(flat.shape, generator=torch.Generator().manual_seed(seed))
    state = AgentTrainState.create("agent", layout, flat)  # an adapter that is not the identity
    packed = PackedBatch.build([(s.prompt_ids, s.completion_ids) for s in samples])
    lora = _lora(state, len(samples))
    log_r = policies["bfloat16"].token_logprobs(packed, lora) - p32.token_logprobs(packed, lora)
    ratio = log_r.exp()
    return {
        "tokens": float(log_r.numel()),
        "mean": float(ratio.mean()),
        "min": float(ratio.min()),
        "max": float(ratio.max()),
        "abs_log_p99": float(log_r.abs().quantile(0.99)),
    }


def sft_step_times(
    policies: dict[str, DecoderPolicy], task: Task, args: argparse.Namespace
) -> dict[str, list[float]]:
    """Row 2b: seconds of one swap step on `args.tickets` supervised targets of
    `args.target_tokens` tokens, per dtype, `args.sft_reps` alternated rounds after one
    warm-up round."""
    samples = [
        SFTSample(prompt, prompt[-args.target_tokens :]) for prompt, _ in task.train[: args.tickets]
    ]
    times: dict[str, list[float]] = {name: [] for name in policies}
    names = list(policies)
    for rep in range(args.sft_reps + 1):
        for name in names if rep % 2 == 0 else names[::-1]:
            seconds = fresh_step_seconds(policies[name], args.rank, sft=samples)
            if rep:
                times[name].append(seconds)
    return times


# -- report ------------------------------------------------------------------------------------


def _mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def curve_table(curves: list[Curve]) -> tuple[str, int, int]:
    """Per-step mean ± std over seeds for both dtypes; (Markdown, trained steps within 1 std,
    trained steps). Step 0 is the untrained adapter (the base model) served in each arm's
    dtype: a row, not a verdict."""
    by = {d: [c for c in curves if c.dtype == d] for d in COMPUTE_DTYPES}
    steps = len(by["float32"][0].held_out_p)
    lines = [
        "| step | reward fp32 | reward bf16 | held-out p(right) fp32 | held-out p(right) bf16 "
        "| held-out acc fp32 | held-out acc bf16 | clipped fp32 | clipped bf16 | within 1 std |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    within = 0
    for s in range(steps):
        cells = [str(s)]
        for metric in ("reward", "held_out_p", "held_out_acc", "clip_frac"):
            for d in COMPUTE_DTYPES:
                values = getattr_list(by[d], metric, s)
                cells.append(
                    f"{_mean_std(values)[0]:.3f} ± {_mean_std(values)[1]:.3f}" if values else "-"
                )
        m32, sd32 = _mean_std(getattr_list(by["float32"], "held_out_p", s))
        m16, _ = _mean_std(getattr_list(by["bfloat16"], "held_out_p", s))
        ok = abs(m16 - m32) <= sd32
        within += ok and s > 0
        cells.append("-" if s == 0 else "yes" if ok else "no")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines), within, steps - 1


def getattr_list(curves: list[Curve], metric: str, step: int) -> list[float]:
    """Metric `metric` at `step` across seeds (training metrics start at step 1)."""
    offset = 0 if metric.startswith("held_out") else 1
    values: list[float] = []
    for c in curves:
        series = getattr(c, metric)
        if 0 <= step - offset < len(series):
            values.append(series[step - offset])
    return values


def rows(args: argparse.Namespace, figures: dict[str, Any], within: int, total: int) -> list[Row]:
    """The summary table (see the module docstring for what each row means)."""
    gemm, ratios, curves = figures["gemm"], figures["ratios"], figures["curves"]
    times = {d: [t for c in curves if c.dtype == d for t in c.step_s] for d in COMPUTE_DTYPES}
    t32, t16 = median(times["float32"]), median(times["bfloat16"])
    pairs = [a / b for a, b in zip(times["float32"], times["bfloat16"], strict=True)]
    speedup = median(pairs)
    gf = figures["flops"] / 1e9
    sft = figures["sft_times"]
    sft_pairs = [a / b for a, b in zip(sft["float32"], sft["bfloat16"], strict=True)]
    sft_speedup = median(sft_pairs)
    final = {
        d: _mean_std([c.held_out_p[-1] for c in curves if c.dtype == d]) for d in COMPUTE_DTYPES
    }
    gap = abs(final["bfloat16"][0] - final["float32"][0])
    return [
        Row(
            "P1",
            f"GEMM x[{args.gemm_m}, 576] @ W[1536, 576]^T (`F.linear`), median of {args.gemm_reps}",
            f"bf16 {gemm['bfloat16']:.1f} GFLOP/s",
            f"fp32 {gemm['float32']:.1f} GFLOP/s",
            f"{gemm['bfloat16'] / gemm['float32']:.2f}x",
        ),
        Row(
            "P2",
            f"one swap step, bf16 compute vs fp32 (the curve's steps: {figures['shape']}, rank "
            f"{args.rank}; median of {len(pairs)} alternated pairs on batches of one shape)",
            f"bf16 {t16:.2f} s",
            f"fp32 {t32:.2f} s",
            f"{speedup:.2f}x faster",
            ">= 1.8x",
            "yes" if speedup >= 1.8 else "no",
        ),
        Row(
            "P2b",
            f"one swap step on supervised targets ({args.tickets} rows of {args.target_tokens} "
            f"scored tokens: the corrections' shape), bf16 vs fp32, median of {len(sft_pairs)} "
            "alternated pairs",
            f"bf16 {median(sft['bfloat16']):.2f} s",
            f"fp32 {median(sft['float32']):.2f} s",
            f"{sft_speedup:.2f}x faster",
            ">= 1.8x",
            "yes" if sft_speedup >= 1.8 else "no",
        ),
        Row(
            "P3",
            f"roofline: {gf:.1f} GFLOP per step (`training_flops`: model shape and tokens), "
            "achieved vs the GEMM rate of P1 (the issue quotes ~180 fp32 / ~390 bf16 GFLOP/s)",
            f"bf16 {gf / t16:.1f} GFLOP/s ({gf / t16 / gemm['bfloat16']:.0%} of P1)",
            f"fp32 {gf / t32:.1f} GFLOP/s ({gf / t32 / gemm['float32']:.0%} of P1)",
            "-",
        ),
        Row(
            "P4",
            f"importance ratio exp(bf16 - fp32 behaviour logprob), fresh samples "
            f"({ratios['tokens']:.0f} tokens)",
            f"mean {ratios['mean']:.4f}, range {ratios['min']:.3f}-{ratios['max']:.3f}",
            "1 (exact)",
            f"|log r| p99 {ratios['abs_log_p99']:.4f}",
            "well inside 1 ± clip 0.2",
            "yes" if ratios["max"] < 1.2 and ratios["min"] > 0.8 else "no",
        ),
        Row(
            "P5",
            f"support triage, held-out p(right first token) after {args.steps} steps "
            f"({args.tickets} tickets/step, {len(curves) // 2} seeds, each arm served in "
            f"{'its own dtype' if args.serving == 'same' else 'fp32'}); trained steps within "
            f"1 std: {within}/{total}",
            f"bf16 {final['bfloat16'][0]:.3f} ± {final['bfloat16'][1]:.3f}",
            f"fp32 {final['float32'][0]:.3f} ± {final['float32'][1]:.3f}",
            f"|diff| {gap:.3f}",
            "within 1 std (every step)",
            "yes" if within == total else "no",
        ),
    ]


# -- entry -------------------------------------------------------------------------------------


def _progress(message: str) -> None:
    print(f"[bench precision] {message}", file=sys.stderr, flush=True)


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.precision", description=__doc__.split("\n")[0]
    )
    p.add_argument("--model", default=DEFAULT_MODEL, help="base model spec (default: %(default)s)")
    p.add_argument("--model-cache", type=Path, default=Path("var/models"), help="model cache root")
    p.add_argument("--quick", action="store_true", help="tiny random model, a few steps")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank (default 8, the trainer's)")
    trainer = TrainerConfig()
    p.add_argument(
        "--lr", type=float, default=trainer.lr, help="AdamW learning rate (trainer.lr: %(default)s)"
    )
    p.add_argument(
        "--warmup-steps",
        type=int,
        default=trainer.warmup_steps,
        help="learning-rate warm-up steps (trainer.warmup_steps: %(default)s)",
    )
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, help="optimizer steps per curve (default 5; quick 2)")
    p.add_argument("--tickets", type=int, help="training tickets per step (default 8; quick 4)")
    p.add_argument("--eval", type=int, help="held-out tickets (default 32; quick 8)")
    p.add_argument("--target-tokens", type=int, help="row 2b's tokens per target (default 32)")
    p.add_argument("--sft-reps", type=int, help="row 2b's alternated rounds (default 5; quick 1)")
    p.add_argument("--gemm-reps", type=int, default=3)
    p.add_argument("--threads", type=int, help="torch threads (default: all cores)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--serving",
        choices=("same", "float32"),
        default="same",
        help="what rolls out and answers for each arm: its own dtype (default) or fp32",
    )
    p.add_argument("--json", type=Path, help="also write the raw figures here")
    args = p.parse_args(argv)
    quick_defaults(
        args, steps=(5, 2), tickets=(8, 4), eval=(32, 8), target_tokens=(32, 8), sft_reps=(5, 1)
    )
    return args


def _model_dir(args: argparse.Namespace, scratch: Path) -> Path:
    if args.quick:
        from clora_feedback.model.tiny import build_tiny_model_dir

        # Byte-level vocabulary: the few-shot prompts are ~600 tokens.
        return build_tiny_model_dir(scratch / "tiny", seed=args.seed, max_position_embeddings=2048)
    from clora_feedback.model.resolve import resolve_model_dir

    return resolve_model_dir(args.model, args.model_cache)


def policies_by_dtype(model_dir: Path, rank: int) -> dict[str, DecoderPolicy]:
    """The model as a trainer computes it in each compute dtype (fp32 first)."""
    return {
        name: DecoderPolicy.from_dir(
            model_dir, max_lora_rank=rank, target_modules=DEFAULT_TARGET_MODULES, dtype=dtype
        )
        for name, dtype in COMPUTE_DTYPES.items()
    }


def measure(args: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    policies = policies_by_dtype(model_dir, args.rank)
    p32 = policies["float32"]
    task = Task.build(p32, seed=args.seed, train=200, held_out=args.eval)
    _progress(f"team first tokens: { {t: v.tolist() for t, v in task.team_tokens.items()} }")
    args.gemm_m = 512
    hidden, inter = p32.base.config.hidden_size, p32.base.config.intermediate_size
    gemm = {
        name: gemm_gflops(args.gemm_m, hidden, inter, dtype, args.gemm_reps)
        for name, dtype in COMPUTE_DTYPES.items()
    }
    _progress(f"GEMM GFLOP/s: {gemm}")
    fresh = rollout(
        p32,
        AgentTrainState.create("x", *_identity(p32, args.rank)),
        task.train[: args.tickets],
        task,
        torch.Generator().manual_seed(args.seed),
    )
    packed = PackedBatch.build([(s.prompt_ids, s.completion_ids) for s in fresh])
    prefix = shared_prefix_len(packed)
    flops = training_flops(p32.base.config, packed, rank=args.rank, targets=len(fresh))
    shape = (
        f"{len(fresh)} rows, {prefix} shared + up to {packed.input_ids.shape[1] - prefix} own "
        "tokens, 1 scored each"
    )
    ratios = ratio_stats(policies, fresh, args.rank, args.seed)
    _progress(f"ratios: {ratios}")
    sft_times = sft_step_times(policies, task, args)
    _progress(f"supervised step seconds: {sft_times}")
    curves: list[Curve] = []
    for seed in range(args.seeds):
        curves += run_curves(p32, policies, task, args, seed).values()
    return {
        "gemm": gemm,
        "flops": flops,
        "shape": shape,
        "ratios": ratios,
        "sft_times": sft_times,
        "curves": curves,
    }


def _identity(policy: DecoderPolicy, rank: int) -> tuple[LoRALayout, torch.Tensor]:
    limits = policy.lora_limits
    layout = LoRALayout.build(limits, rank, 2.0 * rank, tuple(limits.target_modules))
    return layout, init_lora(layout, seed=0)


def fresh_step_seconds(
    policy: DecoderPolicy,
    rank: int,
    *,
    pg: Sequence[PGSample] = (),
    sft: Sequence[SFTSample] = (),
    prof: Any = None,
) -> float:
    """Wall seconds of one swap step on `pg` and `sft` samples from a fresh rank-`rank`
    adapter (under the profiler `prof`, when given, only the step): the unit every step
    timing here and in the profiling scripts measures."""
    state = AgentTrainState.create("x", *_identity(policy, rank))
    slot = TrainingSlot(state.layout.numel, policy.device)
    batch = AgentBatch(state, list(pg), sft=list(sft))
    with prof if prof is not None else contextlib.nullcontext():
        t0 = time.perf_counter()
        train_step(policy, [slot], [batch], LossConfig(), AdamConfig(lr=1e-3))
        return time.perf_counter() - t0


def run(argv: list[str]) -> int:
    """`python -m benchmarks.precision [options]`: measure, print the tables and machine facts."""
    args = _parse(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    load_before = machine_facts()["load average (1, 5, 15 min)"]
    with tempfile.TemporaryDirectory(prefix="clora-bench-precision-") as tmp:
        figures = measure(args, _model_dir(args, Path(tmp)))
    curve_md, within, total = curve_table(figures["curves"])
    print(format_table(rows(args, figures, within, total)))
    print()
    print(curve_md)
    print()
    facts = machine_facts()
    facts["cpu capability (torch)"] = torch.backends.cpu.get_cpu_capability()
    facts["load average at start"] = load_before
    facts["wall time"] = f"{time.perf_counter() - started:.0f} s"
    print(format_facts(facts))
    if args.json is not None:
        raw = {
            "args": {k: str(v) for k, v in vars(args).items()},
            "facts": facts,
            "gemm": figures["gemm"],
            "flops": figures["flops"],
            "shape": figures["shape"],
            "ratios": figures["ratios"],
            "sft_times": figures["sft_times"],
            "curves": [asdict(c) for c in figures["curves"]],
        }
        args.json.write_text(json.dumps(raw, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
