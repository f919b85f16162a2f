"""What OpenMP's waits cost the compute threads: the figures behind `clora_feedback.cores`.

For each wait setting (sleeping workers, `OMP_WAIT_POLICY=PASSIVE`; the brief spin
`cores.configure_waits` sets; spin counts given with `--spins`), in a fresh process
(OpenMP reads its variables once), on the default model in bf16 where the CPU has it:

- `main`: a one-row decode step on the main thread, the only thread that computes;
- `second`: the same step on a second thread after the main thread computed with
  every core (its pool stays: libgomp then throttles every spin to 100 pauses);
- `second, main alone`: the same after `cores.main_thread_alone` (no pool
  on the main thread), as `clora serve` runs the engine;
- `swap step`: one training step of the precision benchmark's batch on the main thread.

Median milliseconds over `--reps`. Not a test, and not a benchmark of the product
(`clora bench serve` is): it shows why the product waits and sizes teams as it does.

    python3 -m scripts.openmp_waits [--reps 20] [--spins 1000,3000]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

SETTINGS = {"sleep (PASSIVE)": {"OMP_WAIT_POLICY": "PASSIVE"}, "product spin": {}}


def _median_ms(fn: Callable[[], object], reps: int) -> float:
    for _ in range(3):
        fn()
    walls = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        walls.append(time.perf_counter() - t0)
    return statistics.median(walls) * 1e3


def _on_thread(fn: Callable[[], float]) -> float:
    out: list[float] = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    thread.join()
    return out[0]


def _decoder(model_cache: Path) -> tuple[Callable[[], object], Path]:
    """A one-row decode step of the default model (bf16 where the CPU has it), and the
    model's directory."""
    import torch

    from clora_feedback.config import DEFAULT_MODEL, EngineConfig
    from clora_feedback.engine.decoder import KVCache, SlottedDecoder
    from clora_feedback.hardware import resolve_dtype
    from clora_feedback.lora.ops import LoRABatch
    from clora_feedback.model.resolve import resolve_model_dir

    model_dir = resolve_model_dir(DEFAULT_MODEL, model_cache)
    dtype = resolve_dtype("auto", torch.device("cpu"))
    targets = tuple(EngineConfig().lora_target_modules)
    model = SlottedDecoder.from_dir(
        model_dir, max_loras=2, max_lora_rank=16, target_modules=targets, dtype=dtype
    )
    cache = KVCache(model.config, 2, 256, dtype, model.device)
    tokens, positions = torch.tensor([42]), torch.tensor([60])
    return (
        lambda: model.decode(tokens, [0], positions, LoRABatch.from_slots([0]), cache)
    ), model_dir


def measure(reps: int, model_cache: Path) -> dict[str, float]:
    """In this process (its waits already set): the figures but the last, milliseconds."""
    import torch

    from benchmarks.precision import Task, _identity, rollout
    from clora_feedback.config import DEFAULT_TARGET_MODULES
    from clora_feedback.hardware import resolve_dtype
    from clora_feedback.train.loss import LossConfig
    from clora_feedback.train.policy import DecoderPolicy
    from clora_feedback.train.state import AdamConfig, AgentTrainState, TrainingSlot
    from clora_feedback.train.step import AgentBatch, train_step

    decode, model_dir = _decoder(model_cache)
    policy = DecoderPolicy.from_dir(
        model_dir,
        max_lora_rank=8,
        target_modules=DEFAULT_TARGET_MODULES,
        dtype=resolve_dtype("auto", torch.device("cpu")),
    )
    task = Task.build(policy, seed=0, train=8, held_out=1)
    fresh = AgentTrainState.create("x", *_identity(policy, 8))
    samples = rollout(policy, fresh, task.train, task, torch.Generator().manual_seed(0))

    def step() -> None:
        state = AgentTrainState.create("x", *_identity(policy, 8))
        slot = TrainingSlot(state.layout.numel, policy.device)
        batch = [AgentBatch(state, samples)]
        train_step(policy, [slot], batch, LossConfig(), AdamConfig(lr=1e-3))

    return {  # the main thread's pool stays: "second, main alone" needs a new process
        "main": _median_ms(decode, reps),
        "swap step": _median_ms(step, max(3, reps // 5)),
        "second": _on_thread(lambda: _median_ms(decode, reps)),
    }


def _second_main_alone(reps: int, model_cache: Path) -> float:
    """The decode step on a second thread in a process whose main thread computed alone."""
    import torch

    from clora_feedback.cores import main_thread_alone, set_thread_teams

    cores = torch.get_num_threads()
    with main_thread_alone():
        decode, _ = _decoder(model_cache)

        def run() -> float:
            set_thread_teams(cores)
            return _median_ms(decode, reps)

        return _on_thread(run)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--spins", default="", help="more GOMP_SPINCOUNT values, comma-separated")
    p.add_argument("--model-cache", type=Path, default=Path("var/models"))
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child == "all":
        print(json.dumps(measure(args.reps, args.model_cache)))
        return
    if args.child == "alone":
        print(json.dumps({"second, main alone": _second_main_alone(args.reps, args.model_cache)}))
        return
    settings = dict(SETTINGS)
    settings |= {f"spin {n}": {"GOMP_SPINCOUNT": n} for n in args.spins.split(",") if n}
    rows = {}
    for name, env in settings.items():
        base = {
            k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
        }
        if not env:  # the product's: what `configure_waits` sets
            from clora_feedback.cores import configure_waits

            configure_waits(env)
        figures: dict[str, float] = {}
        for child in ("all", "alone"):
            cmd = [sys.executable, "-m", "scripts.openmp_waits", "--child", child,
                   "--reps", str(args.reps), "--model-cache", str(args.model_cache)]  # fmt: skip
            out = subprocess.run(
                cmd, env={**base, **env}, capture_output=True, text=True, check=True
            )
            got = json.loads(out.stdout.strip().splitlines()[-1])
            figures |= got
        rows[f"{name} ({' '.join(f'{k}={v}' for k, v in env.items())})"] = figures
    cols = ["main", "second", "second, main alone", "swap step"]
    print("| waits | " + " | ".join(f"{c} (ms)" for c in cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for name, figures in rows.items():
        print(f"| {name} | " + " | ".join(f"{figures[c]:.1f}" for c in cols) + " |")
    from clora_feedback.bench.report import format_facts, machine_facts

    print(format_facts(machine_facts()))


if __name__ == "__main__":
    main()
