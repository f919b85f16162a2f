"""Soak: serve and train agents for a while and record where the gateway's memory goes.

    python -m benchmarks.soak --agents 2 --minutes 30 --out var/soak/2-agents.jsonl
    python -m benchmarks.soak --agents 100 --minutes 30 --out var/soak/100-agents.jsonl

Builds `clora serve`'s service in this process (the default model unless
`--model`), serves it on a loopback port, and runs simulated users against it
through HTTP, as `clora demo` does: the support and coding workloads
alternate over the agents, each user picks an agent (uniformly with 2 agents,
Zipf(1.1) with more), asks, and sends the simulated reviewer's feedback to the
webhook, so the trainer steps and publishes while serving goes on.

Every `--interval` seconds one JSON line records the resident set and what
can hold it: glibc's heap (`mallinfo2`: in use, free but kept, mmapped), the
bytes of distinct CPU tensor storages reachable from Python (every
`--tensor-every`-th sample; walking the heap takes a moment), the prefix
cache's bytes, the trainer's resident agents, versions published, requests
served. With `--tracemalloc`, the last line also lists the Python
allocation sites that grew most since the end of warm-up.

The summary at the end is the soak's verdict: RSS growth over the last 20
minutes of 30 (over the last two thirds of a shorter run), against the
5% goal of issue 27, as the rise of the least-squares line through the
window's samples (`trend_pct`: the resident set swings by a gigabyte with each
training step's activations, so two point samples say little), and also as
first-to-last sample, as the floor (lowest sample of the window's first and
last quarters), between training rounds only (a sample taken while a step runs
carries that step's activations) and without the prefix cache (which fills to
its bound, `engine.prefix_cache_mb`, by design). `--summarise JSONL` prints
the summary of an earlier run's record.

Not here: the benchmark of many agents' serving (`clora bench agents`).
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import ctypes.util
import gc
import json
import random
import statistics
import sys
import tempfile
import threading
import time
import tracemalloc
import uuid
from pathlib import Path
from typing import Any

import torch

from clora_feedback.config import (
    AgentConfig,
    EngineConfig,
    FeedbackConfig,
    KafkaConfig,
    Settings,
    TrainerConfig,
)


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
            "fsmblks", "uordblks", "fordblks", "keepcost",
        )
    ]  # fmt: skip


def _libc() -> Any:
    name = ctypes.util.find_library("c")
    return None if name is None else ctypes.CDLL(name)


_LIBC = _libc()


def rss_mb() -> float:
    """This process's resident set (MiB), from /proc."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def heap_mb() -> dict[str, float]:
    """glibc's view: bytes in use, freed but kept in the heap, and mmapped chunks (MiB)."""
    if _LIBC is None or not hasattr(_LIBC, "mallinfo2"):
        return {}
    _LIBC.mallinfo2.restype = _MallInfo2
    info = _LIBC.mallinfo2()
    mb = 1 << 20
    return {
        "heap_in_use_mb": info.uordblks / mb,
        "heap_free_kept_mb": info.fordblks / mb,
        "mmapped_mb": info.hblkhd / mb,
    }


def tensor_mb(top: int = 6) -> dict[str, Any]:
    """Distinct CPU tensor storages reachable from Python (MiB), how many tensors, and the
    storage sizes that hold most (by shape and dtype of a tensor viewing them)."""
    seen: dict[int, tuple[int, str]] = {}
    count = 0
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
                count += 1
                storage = obj.untyped_storage()
                seen[storage.data_ptr()] = (storage.nbytes(), f"{tuple(obj.shape)}:{obj.dtype}")
        except Exception:  # a half-built object met during the walk
            continue
    groups: dict[str, list[int]] = {}
    for nbytes, key in seen.values():
        groups.setdefault(key, []).append(nbytes)
    biggest = sorted(groups.items(), key=lambda kv: -sum(kv[1]))[:top]
    return {
        "tensor_mb": sum(n for n, _ in seen.values()) / (1 << 20),
        "tensors": count,
        "tensor_top": [[k, len(v), round(sum(v) / (1 << 20), 1)] for k, v in biggest],
    }


class Sampler:
    """Samples the memory figures on its own thread, one JSON line per sample."""

    def __init__(self, service: Any, out: Path, interval_s: float, tensor_every: int) -> None:
        self.service = service
        self.out = out
        self.interval_s = interval_s
        self.tensor_every = tensor_every
        self.requests = 0
        self.errors = 0
        self.samples: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-sampler", daemon=True)
        self.t0 = time.monotonic()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def sample(self, index: int) -> dict[str, Any]:
        row: dict[str, Any] = {"t_s": round(time.monotonic() - self.t0, 1), "rss_mb": rss_mb()}
        row |= heap_mb()
        if self.tensor_every and index % self.tensor_every == 0:
            row |= tensor_mb()
        engine = self.service.engine
        cache = getattr(engine, "prefix_cache", None)
        if cache is not None:
            row["prefix_cache_mb"] = cache.stats().bytes / (1 << 20)
        trainer = self.service.trainer
        if trainer is not None:
            row["trainer_runs"] = len(getattr(trainer, "_runs", {}))
            residency = getattr(trainer, "residency", None)
            if residency is not None:
                row["trainer_resident"] = residency.resident
            row["versions_published"] = len(trainer.history)
            # Between rounds (the round lock is free): no step's activations are alive, so
            # this RSS is the floor a creep would raise; a sample during a step is not.
            lock = getattr(trainer, "_lock", None)
            if lock is not None and lock.acquire(blocking=False):
                try:
                    row["rss_between_rounds_mb"] = rss_mb()
                finally:
                    lock.release()
        row["requests"] = self.requests
        row["errors"] = self.errors
        row["load_1m"] = round(_loadavg(), 2)
        return row

    def _run(self) -> None:
        index = 0
        with self.out.open("w") as f:
            while not self._stop.wait(0 if index == 0 else self.interval_s):
                row = self.sample(index)
                self.samples.append(row)
                f.write(json.dumps(row) + "\n")
                f.flush()
                print(json.dumps(row), flush=True)
                index += 1


def _loadavg() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def _zipf_weights(n: int, s: float = 1.1) -> list[float]:
    return [1.0 / (k**s) for k in range(1, n + 1)]


async def drive(url: str, agents: list[str], users: int, until: float, sampler: Sampler) -> None:
    """Simulated users until `until` (monotonic): ask, then send the reviewer's feedback."""
    from openai import AsyncOpenAI

    from clora_feedback.client import AsyncFeedbackClient
    from clora_feedback.demo.workloads import CodingWorkload, Sampling, SupportWorkload

    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="soak", max_retries=3)
    sender = AsyncFeedbackClient(url, source="soak")
    workloads = {a: (SupportWorkload() if i % 2 == 0 else CodingWorkload()) for i, a in
                 enumerate(agents)}  # fmt: skip
    pools = {a: w.tasks(0, "train", 256) for a, w in workloads.items()}
    weights = _zipf_weights(len(agents)) if len(agents) > 2 else [1.0] * len(agents)

    async def user(index: int) -> None:
        rng = random.Random(index)
        while time.monotonic() < until:
            agent = rng.choices(agents, weights)[0]
            workload: Any = workloads[agent]  # a support or a coding workload, each with its tasks
            task = rng.choice(pools[agent])
            try:
                episode = await workload.run_episode(
                    client, agent, task, Sampling(1.0, 1.0, rng.randrange(2**31))
                )
                sampler.requests += len(episode.completion_ids)
                await sender.send(workload.feedback(agent, task, episode,
                                                    event_id=uuid.uuid4().hex))  # fmt: skip
            except Exception:  # a 429 or a timeout: count it and go on
                sampler.errors += 1
                await asyncio.sleep(1.0)

    try:
        await asyncio.gather(*(user(i) for i in range(users)))
    finally:
        await sender.aclose()
        await client.close()


_WARM: list[tracemalloc.Snapshot] = []


def _take_warm_snapshot() -> None:
    _WARM.append(tracemalloc.take_snapshot())


def settings_for(args: argparse.Namespace, data_dir: Path) -> Settings:
    agents = ["support", "coding"] if args.agents == 2 else [f"agent-{i:03d}" for i in
                                                               range(args.agents)]  # fmt: skip
    engine: dict[str, Any] = {"max_model_len": 1024, "max_num_seqs": max(8, 2 * args.users)}
    if args.model:
        engine["model"] = args.model
    return Settings(
        data_dir=data_dir,
        adapters_dir=data_dir / "adapters",
        engine=EngineConfig(**engine),
        agents=[AgentConfig(name=a) for a in agents],
        feedback=FeedbackConfig(kafka=KafkaConfig(embedded_broker=False)),
        trainer=TrainerConfig(trigger_interval_s=120.0, poll_interval_s=0.2),
    )


def growth(samples: list[dict[str, Any]], minutes: float) -> dict[str, float]:
    """RSS growth over the last 20 minutes of 30 (the last two thirds of a shorter run)."""
    end = samples[-1]["t_s"]
    start_at = end - (20 * 60 if minutes >= 30 else end * 2 / 3)
    window = [s for s in samples if s["t_s"] >= start_at]
    first, last = window[0]["rss_mb"], window[-1]["rss_mb"]
    out = {
        "window_start_s": window[0]["t_s"],
        "window_end_s": window[-1]["t_s"],
        "rss_start_mb": first,
        "rss_end_mb": last,
        "rss_max_mb": max(s["rss_mb"] for s in samples),
        "growth_pct": 100.0 * (last - first) / first,
    }
    out |= trend([(s["t_s"], s["rss_mb"]) for s in window])
    quarter = max(1, len(window) // 4)  # the floor: what stays between training steps
    low_first = min(s["rss_mb"] for s in window[:quarter])
    low_last = min(s["rss_mb"] for s in window[-quarter:])
    out["floor_mb"] = [round(low_first, 1), round(low_last, 1)]
    out["floor_growth_pct"] = 100.0 * (low_last / low_first - 1)
    floor = [s for s in window if "rss_between_rounds_mb" in s]
    if len(floor) >= 2:  # the same, between training rounds, and without the prefix cache
        a, b = floor[0], floor[-1]
        out["between_rounds_growth_pct"] = 100.0 * (
            b["rss_between_rounds_mb"] / a["rss_between_rounds_mb"] - 1
        )
        net = [s["rss_between_rounds_mb"] - s.get("prefix_cache_mb", 0.0) for s in (a, b)]
        out["between_rounds_without_prefix_cache_mb"] = [round(x, 1) for x in net]
        out["between_rounds_without_prefix_cache_growth_pct"] = 100.0 * (net[1] / net[0] - 1)
    return out


def trend(points: list[tuple[float, float]]) -> dict[str, float]:
    """The least-squares line through (t, RSS) over the window: its rise from the
    window's start to its end, in MB and against its start (`trend_pct`). Two point
    samples of a resident set that swings with each training step's activations say
    little; the fitted line is the creep."""
    if len(points) < 2:
        return {"trend_mb": 0.0, "trend_pct": 0.0}
    times, rss = zip(*points, strict=True)
    slope, intercept = statistics.linear_regression(times, rss)
    start = intercept + slope * times[0]
    rise = slope * (times[-1] - times[0])
    return {"trend_mb": round(rise, 1), "trend_pct": 100.0 * rise / start}


def summarise(path: Path, minutes: float) -> dict[str, Any]:
    """The summary of a soak's JSON lines (`--summarise`), without running it again."""
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    samples = [line for line in lines if "t_s" in line]
    return growth(samples, minutes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--agents", type=int, default=2)
    parser.add_argument("--users", type=int, default=4, help="concurrent simulated users")
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--interval", type=float, default=30.0, help="seconds between samples")
    parser.add_argument("--tensor-every", type=int, default=4, help="tensor walk every N samples")
    parser.add_argument("--tracemalloc", action="store_true", help="Python allocation sites")
    parser.add_argument("--model", default=None, help="default: the embedded default model")
    parser.add_argument("--out", type=Path, default=Path("var/soak/soak.jsonl"))
    parser.add_argument("--summarise", type=Path, default=None, metavar="JSONL",
                        help="print the summary of an earlier soak's record; run nothing")  # fmt: skip
    args = parser.parse_args(argv)
    if args.summarise is not None:
        print(json.dumps({"summary": summarise(args.summarise, args.minutes)}, indent=1))
        return 0

    from clora_feedback.demo.server import LocalServer
    from clora_feedback.service import build_service

    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.model is None:  # converted once into var/models, not into the soak's temp dir
        from clora_feedback.config import DEFAULT_MODEL
        from clora_feedback.model.resolve import resolve_model_dir

        args.model = str(resolve_model_dir(DEFAULT_MODEL, Path("var/models")))
    if args.tracemalloc:
        tracemalloc.start(8)
    with tempfile.TemporaryDirectory(prefix="clora-soak-") as tmp:
        service = build_service(settings_for(args, Path(tmp)))
        with LocalServer(service) as server:
            sampler = Sampler(service, args.out, args.interval, args.tensor_every)
            sampler.start()
            until = time.monotonic() + args.minutes * 60
            names = service.agents.names()
            try:
                if args.tracemalloc:  # the baseline: the end of the first third (warm-up)
                    timer = threading.Timer(args.minutes * 20, _take_warm_snapshot)
                    timer.daemon = True
                    timer.start()
                asyncio.run(drive(server.url, sorted(names), args.users, until, sampler))
            finally:
                sampler.stop()
    warm = _WARM[0] if _WARM else None
    summary: dict[str, Any] = {"agents": args.agents, "minutes": args.minutes}
    summary |= growth(sampler.samples, args.minutes)
    summary["requests"] = sampler.requests
    summary["errors"] = sampler.errors
    if warm is not None:
        top = tracemalloc.take_snapshot().compare_to(warm, "lineno")[:15]
        summary["python_growth_top"] = [str(stat) for stat in top]
    print(json.dumps({"summary": summary}, indent=1))
    with args.out.open("a") as f:
        f.write(json.dumps({"summary": summary}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
