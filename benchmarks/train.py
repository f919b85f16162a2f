"""`python -m benchmarks.train`: the continual trainer's costs, each against a baseline in the same run.

1. Swap cost: `TrainingSlot` swap-in + swap-out time as a share of a swap-based
   step (C-LoRA style: one agent per step) at the given rank.
2. Publish latency: end of an optimizer step to the first token served by the
   new version, with a stream of that agent decoding (see `publish`).
   Baseline: that stream's median inter-token gap.
3. Interference: other agents' inter-token gaps in windows with publishes of
   one agent every `--publish-interval-ms` against interleaved windows
   without (see `publish`).
4. Batched multi-tenant training (all agents in one forward/backward) against
   serial swap steps over the same batches, alternated per repetition.
5. Staleness of admitted samples, early vs train-batch admission: a
   virtual-clock simulation around the real `Admission` (see `staleness`).
6. Shared prompt prefix: one swap step over samples that share a long
   prompt prefix (a system prompt, tool schemas), with the prefix computed
   once per agent (`train.forward.shared_prefix_len`) against once per row.
7. Roofline: FLOPs of row 1's swap step from the model shape and tokens
   (`bench.precision.training_flops`), achieved GFLOP/s against this machine's
   GEMM rate in the compute dtype, measured in the same run.

`--compute-dtype` sets the trainer's compute dtype for rows 1, 4, 6 and 7
(`trainer.compute_dtype`); `python -m benchmarks.precision` compares the two.

Timing runs on a possibly shared CPU: compared variants alternate and the
table reports medians. `--quick` runs everything on a tiny random model in
seconds (a smoke test, not a measurement).

Not here: serving throughput (`serve`), ingestion (`ingest`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from benchmarks.precision import gemm_gflops, training_flops
from benchmarks.publish import (
    PUBLISHER,
    Interference,
    PublishLatency,
    measure_interference,
    measure_publish_latency,
    pg_samples,
    token_ids,
)
from benchmarks.staleness import (
    POLICIES,
    FeedbackStream,
    TrainerModel,
    simulate,
    utilisation,
)
from clora_feedback.bench import OMP_WAIT_POLICIES
from clora_feedback.bench.report import (
    Row,
    machine_facts,
    median,
    percentile,
    print_report,
    quick_defaults,
    verdict,
)
from clora_feedback.config import DEFAULT_MODEL, EngineConfig, FeedbackConfig
from clora_feedback.engine.deployer import Deployer
from clora_feedback.engine.embedded import EmbeddedEngine
from clora_feedback.feedback.rewards import DefaultRewardPolicy
from clora_feedback.feedback.store import FeedbackStore
from clora_feedback.lora.weights import random_lora_weights
from clora_feedback.store.registry import AdapterRegistry
from clora_feedback.store.trajectories import TrajectoryStore
from clora_feedback.train.forward import PackedBatch
from clora_feedback.train.loss import LossConfig
from clora_feedback.train.policy import COMPUTE_DTYPES, DecoderPolicy
from clora_feedback.train.state import (
    AdamConfig,
    AgentTrainState,
    LoRALayout,
    TrainingSlot,
    init_lora,
)
from clora_feedback.train.step import AgentBatch, StepResult, train_step

# -- 1 + 4: swap share, batched vs serial --------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """Per agent and step: `samples` sequences of `prompt` + `completion` tokens."""

    samples: int
    prompt: int
    completion: int

    def __str__(self) -> str:
        return f"{self.samples} x ({self.prompt}+{self.completion}) tokens"


@dataclass
class Tenancy:
    """Alternated repetitions: one batched step over all agents vs serial swap steps (seconds)."""

    shape: str = ""
    batched_s: list[float] = field(default_factory=list)
    serial_s: list[float] = field(default_factory=list)
    swap_s: list[float] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    step_flops: float = 0.0  # one agent's swap step (`training_flops`)


def measure_tenancy(
    engine: EmbeddedEngine, shape: Shape, *, agents: int, rank: int, reps: int, seed: int,
    compute_dtype: str = "float32",
) -> Tenancy:  # fmt: skip
    """Alternate one batched step over all agents with serial swap steps over the same batches."""
    # The trainer's own seam, on the engine's tensors (a cast copy in another compute dtype).
    policy = DecoderPolicy.shared_with(engine, compute_dtype=COMPUTE_DTYPES[compute_dtype])
    limits = policy.lora_limits
    layout = LoRALayout.build(limits, rank, 2.0 * rank, tuple(limits.target_modules))
    rng = random.Random(seed)
    vocab = policy.base.config.vocab_size
    batches = [
        AgentBatch(
            AgentTrainState.create(f"agent-{i}", layout, init_lora(layout, seed=i)),
            pg_samples(rng, vocab, shape.samples, shape.prompt, shape.completion),
        )
        for i in range(agents)
    ]
    slots = [TrainingSlot(layout.numel, policy.device) for _ in batches]
    loss, adam = LossConfig(), AdamConfig()
    first = [(p.prompt_ids, p.completion_ids) for p in batches[0].pg]
    flops = training_flops(
        policy.base.config,
        PackedBatch.build(first),
        rank=rank,
        targets=sum(len(c) for _, c in first),
    )
    out = Tenancy(str(shape), step_flops=flops)

    def batched() -> float:
        t0 = time.perf_counter()
        train_step(policy, slots, batches, loss, adam)
        return time.perf_counter() - t0

    def serial() -> tuple[float, list[StepResult]]:
        t0 = time.perf_counter()
        results = [train_step(policy, slots[:1], [b], loss, adam)[0] for b in batches]
        return time.perf_counter() - t0, results

    batched(), serial()  # warm-up: first-call allocations
    for rep in range(reps):
        for variant in ("batched", "serial") if rep % 2 == 0 else ("serial", "batched"):
            if variant == "batched":
                out.batched_s.append(batched())
                continue
            seconds, results = serial()
            out.serial_s.append(seconds)
            out.swap_s += [r.swap_s for r in results]
            out.step_s += [r.step_s for r in results]
        _progress(f"tenancy {shape}: rep {rep + 1}/{reps}")
    return out


@dataclass
class PrefixSharing:
    """One agent's swap step over samples that share a long prompt prefix (seconds)."""

    shape: str = ""
    shared_s: list[float] = field(default_factory=list)
    per_row_s: list[float] = field(default_factory=list)


def measure_prefix_sharing(
    engine: EmbeddedEngine, *, samples: int, prefix: int, own: int, completion: int, rank: int,
    reps: int, seed: int, compute_dtype: str = "float32",
) -> PrefixSharing:  # fmt: skip
    """Alternate steps with the shared prefix computed once and (forced) once per row."""
    import clora_feedback.train.forward as forward

    policy = DecoderPolicy.shared_with(engine, compute_dtype=COMPUTE_DTYPES[compute_dtype])
    limits = policy.lora_limits
    layout = LoRALayout.build(limits, rank, 2.0 * rank, tuple(limits.target_modules))
    rng = random.Random(seed)
    vocab = policy.base.config.vocab_size
    system = token_ids(rng, vocab, prefix)
    batch = AgentBatch(
        AgentTrainState.create("agent", layout, init_lora(layout, seed=seed)),
        [replace(s, prompt_ids=system + s.prompt_ids) for s in pg_samples(rng, vocab, samples, own, completion)],
    )  # fmt: skip
    slot = TrainingSlot(layout.numel, policy.device)
    loss, adam = LossConfig(), AdamConfig()
    out = PrefixSharing(f"{samples} x ({prefix} shared + {own} own prompt + {completion}) tokens")
    minimum = forward.MIN_SHARED_PREFIX

    def step(shared: bool) -> float:
        forward.MIN_SHARED_PREFIX = minimum if shared else 1 << 30
        try:
            t0 = time.perf_counter()
            train_step(policy, [slot], [batch], loss, adam)
            return time.perf_counter() - t0
        finally:
            forward.MIN_SHARED_PREFIX = minimum

    step(True), step(False)  # warm-up
    for rep in range(reps):
        for shared in (True, False) if rep % 2 == 0 else (False, True):
            (out.shared_s if shared else out.per_row_s).append(step(shared))
        _progress(f"prefix sharing: rep {rep + 1}/{reps}")
    return out


@dataclass
class Figures:
    """Raw measurements in seconds (written by `--json`)."""

    tenancy: Tenancy
    small: Tenancy
    prefix: PrefixSharing
    gemm_gflops: float
    publish: PublishLatency
    interference: Interference
    staleness: list[dict[str, Any]]


def _progress(message: str) -> None:
    print(f"[bench train] {message}", file=sys.stderr, flush=True)


# -- 5: staleness (simulated) ----------------------------------------------------------------


def measure_staleness(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Both admission policies on the same stream, at several trainer loads."""
    trainer = TrainerModel()
    out = []
    for rate in args.staleness_rates:
        stream = FeedbackStream(rate_per_s=rate, duration_s=args.staleness_duration_s)
        baseline, early = (simulate(stream, p, trainer) for p in POLICIES)
        out.append(
            {
                "stream": asdict(stream),
                "trainer": asdict(trainer),
                "utilisation": utilisation(stream, trainer),
                "baseline": asdict(baseline),
                "early": asdict(early),
            }
        )
    return out


# -- the table -----------------------------------------------------------------------------


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds * 1e3:.0f} ms"


def _lower(new: float, old: float) -> tuple[str, bool]:
    cut = 1 - new / old if old > 0 else float("nan")
    return f"{cut:.0%} lower", cut >= 0.9


def _tenancy_row(key: str, t: Tenancy, agents: int) -> Row:
    pairs = [s / b for s, b in zip(t.serial_s, t.batched_s, strict=True)]
    ratio = median(pairs)
    return Row(
        key,
        f"{agents} agents: one batched step vs {agents} serial swap steps "
        f"({t.shape} each; median of {len(pairs)} alternated pairs)",
        f"batched {median(t.batched_s):.2f} s",
        f"serial {median(t.serial_s):.2f} s",
        f"{ratio:.2f}x",
        ">= 1.5x",
        verdict(ratio >= 1.5),
    )


def _prefix_row(p: PrefixSharing) -> Row:
    pairs = [r / s for r, s in zip(p.per_row_s, p.shared_s, strict=True)]
    return Row(
        "6",
        f"one swap step, shared prompt prefix computed once per agent vs once per row ({p.shape}; "
        f"median of {len(pairs)} alternated pairs)",
        f"shared {median(p.shared_s):.2f} s",
        f"per row {median(p.per_row_s):.2f} s",
        f"{median(pairs):.2f}x",
        "-",
        "-",
    )


def _publish_rows(args: argparse.Namespace, p: PublishLatency) -> list[Row]:
    latency, gap = median(p.latency_s), median(p.stream_gap_s)
    return [
        Row(
            "2",
            f"end of optimizer step -> first token of the new version (rank {args.rank}, "
            f"stream of that agent decoding; median of {len(p.latency_s)})",
            f"{_ms(latency)} (max {_ms(max(p.latency_s))})",
            f"inter-token gap {_ms(gap)}",
            f"{latency / gap:.1f} gaps",
            "< 100 ms",
            verdict(latency < 0.1),
        ),
        Row(
            "2b",
            "parts of that publish: trainer hand-off (check, copy, reserve, staged slot "
            "write); of which the slot write; durable version written (after the hand-off, "
            "concurrent with serving)",
            f"hand-off {_ms(median(p.handoff_s))}; slot write {_ms(median(p.engine_write_s))}",
            f"durable after {_ms(median(p.durable_s))}",
            "-",
        ),
    ]


def _interference_rows(args: argparse.Namespace, i: Interference) -> list[Row]:
    base, floor = median(i.gaps_s["off"]), percentile(i.gaps_s["off"], 99)
    out = []
    for key, mode, what in (
        (
            "3",
            "durable",
            f"reserve + hand-off + durable write every {args.publish_interval_ms:g} ms",
        ),
        ("3b", "hand-off", f"reserve + hand-off only every {args.publish_interval_ms:g} ms"),
        ("3c", "off", "none (noise floor of the same run)"),
    ):
        p99 = percentile(i.gaps_s[mode], 99)
        has_goal = mode != "off"
        out.append(
            Row(
                key,
                f"p99 inter-token gap of {args.agents} other agents' streams; publishes: {what} "
                f"({i.publishes.get(mode, 0)} publishes in {i.seconds.get(mode, 0):.0f} s, "
                f"{len(i.gaps_s[mode])} gaps)",
                f"p99 {_ms(p99)}",
                f"median {_ms(base)} without publishes",
                f"{p99 / base:.2f}x" + (f" ({p99 / floor:.2f}x p99 without)" if has_goal else ""),
                "<= 1.2x" if has_goal else "-",
                verdict(p99 / base <= 1.2) if has_goal else "-",
            )
        )
    return out


def _staleness_rows(staleness: list[dict[str, Any]]) -> list[Row]:
    out = []
    for i, s in enumerate(staleness):
        b, e = s["baseline"], s["early"]
        load = f"trainer load {s['utilisation']:.0%}, {s['stream']['rate_per_s']:g} samples/s"
        for suffix, metric, name in (
            ("arch", "mean_architectural", "architectural"),
            ("total", "mean_total", "total"),
        ):
            text, ok = _lower(e[metric], b[metric])
            out.append(
                Row(
                    f"5{chr(ord('a') + i)}-{suffix}",
                    f"{name} staleness, early vs train-batch admission (simulated, {load})",
                    f"{e[metric]:.3f} versions (lag {e['mean_lag_s']:.1f} s)",
                    f"{b[metric]:.3f} versions (lag {b['mean_lag_s']:.1f} s)",
                    text,
                    ">= 90% lower",
                    verdict(ok),
                )
            )
    return out


def rows(args: argparse.Namespace, f: Figures) -> list[Row]:
    """The table: one row per measurement (see the module docstring for what each means)."""
    t = f.tenancy
    share = median([s / total for s, total in zip(t.swap_s, t.step_s, strict=True)])
    swap_row = Row(
        "1",
        f"swap in+out / swap-based step, rank {args.rank}, {t.shape}",
        f"swap {_ms(median(t.swap_s))}",
        f"step {_ms(median(t.step_s))}",
        f"{share:.2%}",
        "<= 5%",
        verdict(share <= 0.05),
    )
    return [
        swap_row,
        *_publish_rows(args, f.publish),
        *_interference_rows(args, f.interference),
        _tenancy_row("4", f.tenancy, args.agents),
        _tenancy_row("4b", f.small, args.agents),
        _prefix_row(f.prefix),
        _roofline_row(args, f),
        *_staleness_rows(f.staleness),
    ]


def _roofline_row(args: argparse.Namespace, f: Figures) -> Row:
    t = f.tenancy
    gflop, seconds = t.step_flops / 1e9, median(t.step_s)
    achieved = gflop / seconds
    return Row(
        "7",
        f"roofline: row 1's swap step, {gflop:.1f} GFLOP (model shape and tokens), "
        f"{args.compute_dtype} compute; against the GEMM rate measured in this run "
        f"(x[512, hidden] @ W[intermediate, hidden]^T)",
        f"{achieved:.1f} GFLOP/s",
        f"GEMM {f.gemm_gflops:.1f} GFLOP/s",
        f"{achieved / f.gemm_gflops:.0%}",
    )


# -- entry -----------------------------------------------------------------------------------


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.train", description=__doc__.split("\n")[0]
    )
    p.add_argument("--model", default=DEFAULT_MODEL, help="base model spec (default: %(default)s)")
    p.add_argument("--model-cache", type=Path, default=Path("var/models"), help="model cache root")
    p.add_argument("--quick", action="store_true", help="tiny random model, one repetition")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank (default 16)")
    p.add_argument("--agents", type=int, default=4, help="agents batched / streaming (default 4)")
    p.add_argument("--samples", type=int, default=4, help="samples per agent per step")
    p.add_argument("--prompt-tokens", type=int, help="prompt length (default 64; quick 16)")
    p.add_argument("--completion-tokens", type=int, help="completion length (default 32; quick 8)")
    p.add_argument("--reps", type=int, help="publish rounds and windows (default 5; quick 1)")
    p.add_argument("--train-reps", type=int, help="batched/serial pairs (default 3; quick 1)")
    p.add_argument("--window-s", type=float, help="interference window (default 4; quick 0.3)")
    p.add_argument("--publish-interval-ms", type=float, help="default 1000; quick 50")
    p.add_argument("--threads", type=int, help="torch threads (default: all cores)")
    p.add_argument(
        "--compute-dtype",
        default="float32",
        choices=tuple(COMPUTE_DTYPES),
        help="the trainer's compute dtype (trainer.compute_dtype; default float32)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="also write the raw figures here")
    p.add_argument(
        "--omp-wait-policy",
        default="product",
        choices=OMP_WAIT_POLICIES,
        help="OpenMP idle threads (default product: a brief spin, then sleep); applied "
        "before torch loads",
    )
    args = p.parse_args(argv)
    quick = args.quick
    quick_defaults(
        args,
        prompt_tokens=(64, 16),
        completion_tokens=(32, 8),
        reps=(5, 1),
        train_reps=(3, 1),
        window_s=(4.0, 0.3),
        publish_interval_ms=(1000.0, 50.0),
    )
    args.small_shape = Shape(1, 8, 4) if quick else Shape(1, 32, 16)
    args.staleness_rates = (0.1, 0.5, 1.0)
    args.staleness_duration_s = 2_000.0 if quick else 20_000.0
    return args


def _model_dir(args: argparse.Namespace, scratch: Path) -> Path:
    if args.quick:
        from clora_feedback.model.tiny import build_tiny_model_dir

        return build_tiny_model_dir(scratch / "tiny", seed=args.seed)
    from clora_feedback.model.resolve import resolve_model_dir

    return resolve_model_dir(args.model, args.model_cache)


async def measure(args: argparse.Namespace) -> Figures:
    """Every measurement, on one engine and one scratch directory."""
    with tempfile.TemporaryDirectory(prefix="clora-bench-train-") as tmp:
        root = Path(tmp)
        model_dir = _model_dir(args, root)
        config = EngineConfig(
            model=str(model_dir),
            max_num_seqs=8,
            max_loras=args.agents + 2,
            max_lora_rank=args.rank,
            max_model_len=2048,
            num_threads=args.threads,
        )
        engine = EmbeddedEngine(model_dir, config)
        feedback = FeedbackStore(
            root / "trajectories.db",
            trajectories=TrajectoryStore(root / "trajectories.db"),
            policy=DefaultRewardPolicy(FeedbackConfig()),
        )
        registry = AdapterRegistry(root / "adapters", root / "registry.db")
        await engine.start()
        try:
            common = {"agents": args.agents, "rank": args.rank, "seed": args.seed}
            shape = Shape(args.samples, args.prompt_tokens, args.completion_tokens)
            dtype = args.compute_dtype
            tenancy = measure_tenancy(
                engine, shape, reps=args.train_reps, compute_dtype=dtype, **common
            )
            small = measure_tenancy(
                engine, args.small_shape, reps=args.train_reps, compute_dtype=dtype, **common
            )
            prefix = measure_prefix_sharing(
                engine,
                samples=8,
                prefix=32 if args.quick else 256,
                own=8 if args.quick else 24,
                completion=args.completion_tokens,
                rank=args.rank,
                reps=args.train_reps,
                seed=args.seed + 3,
                compute_dtype=args.compute_dtype,
            )
            cfg = engine.base_weights.config
            gemm = gemm_gflops(
                512, cfg.hidden_size, cfg.intermediate_size, COMPUTE_DTYPES[args.compute_dtype], 3
            )
            weights = random_lora_weights(
                engine.lora_limits, rank=args.rank, alpha=2.0 * args.rank, seed=1, std=0.01
            )
            info = registry.publish(
                PUBLISHER,
                weights,
                optimizer_state=None,
                base_model=engine.model_name,
                parent=None,
                step=0,
                metrics={},
                feedback_window=None,
            )
            await Deployer(engine, registry).sync(info.agent)  # the engine follows the pointer
            _progress("publish latency")
            publish = await measure_publish_latency(
                engine,
                feedback,
                registry,
                rank=args.rank,
                samples=args.samples,
                prompt=args.prompt_tokens,
                completion=args.completion_tokens,
                reps=args.reps,
                seed=args.seed + 1,
            )
            _progress("interference")
            interference = await measure_interference(
                engine,
                registry,
                agents=args.agents,
                rank=args.rank,
                reps=args.reps,
                window_s=args.window_s,
                interval_s=args.publish_interval_ms / 1e3,
                seed=args.seed + 2,
            )
        finally:
            await engine.stop()
            feedback.close()
            registry.close()
    _progress("staleness simulation")
    return Figures(tenancy, small, prefix, gemm, publish, interference, measure_staleness(args))


def run(argv: list[str]) -> int:
    """`python -m benchmarks.train [options]`: measure, print the table and machine facts; exit code."""
    args = _parse(argv)
    if os.environ.get("OMP_WAIT_POLICY", "").upper() == "ACTIVE":
        _progress(
            "OMP_WAIT_POLICY is ACTIVE: on a CPU shared with other work (or with the engine "
            "and trainer threads of this process) spinning OpenMP threads can slow steps "
            "down 10x at random; see docs/benchmarks.md"
        )
    started = time.perf_counter()
    load_before = machine_facts()["load average (1, 5, 15 min)"]
    figures = asyncio.run(measure(args))
    facts = machine_facts()
    facts["OMP_WAIT_POLICY"] = os.environ.get("OMP_WAIT_POLICY", "(unset)")
    facts["load average at start"] = load_before
    facts["wall time"] = f"{time.perf_counter() - started:.0f} s"
    options = {k: str(v) for k, v in vars(args).items()}
    print_report(rows(args, figures), facts, args.json, options, asdict(figures))
    return 0


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
