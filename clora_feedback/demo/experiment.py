"""Learning experiments: K synchronous RL steps per agent through the real gateway, measured.

One experiment = one agent learning one workload for `steps` optimizer steps.
Each step, as in C-LoRA's synchronous loop:

1. rollout: `tasks_per_step` training tasks, each attempted `samples_per_task`
   times (separate requests at `temperature`), all concurrently through the
   gateway with the official `openai` client;
2. feedback: the simulator's events for every episode, in one webhook call
   (one durable transaction, so the trainer sees the whole batch at once);
3. train: the service's own continual trainer admits the batch, steps and
   publishes a version; the experiment waits until that version is live.

Held-out tasks are evaluated greedily before the first step and after the
last (and every `eval_every` steps when set). Nothing is simulated on the
serving or training side: the numbers come from the same code `clora serve`
runs, configured by `service_settings`.

Two ways to run several experiments (`seeds`):
- `run_serial`: one after another, each in a fresh service (its own cold
  start: model load, engine warm-up), single-tenant;
- `run_concurrent`: all at once, one agent per seed, on one warm service
  whose trainer takes turns between the agents (or batches them, with
  `batched_agents`). `schedule` says when an agent starts its next step:
  `independent`, as soon as its own version is live; `lockstep`, once every
  agent's previous step is live (a barrier), so every step's rollouts of all
  N agents share the engine's decode batches and the trainer then has all N
  batches back to back, with no rollout competing for the cores.

`calibrate_rollouts` measures the batch efficiency of multiplexed rollouts
on a warm service: one step's rollouts of N agents together against one
agent's alone (the bound of `clora_feedback.bench.experiments` uses it).

Not here: the workloads (`workloads`), tables and plots (`report`).
"""

from __future__ import annotations

import asyncio
import logging
import random
import statistics
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from clora_feedback.config import (
    AgentConfig,
    EngineConfig,
    FeedbackConfig,
    KafkaConfig,
    ReleaseConfig,
    Settings,
    TrainerConfig,
)
from clora_feedback.demo.server import LocalServer
from clora_feedback.demo.workloads import WORKLOADS, Episode, Sampling, Workload, episode_seed
from clora_feedback.heap import release_freed_memory

log = logging.getLogger(__name__)

SCHEDULES = ("independent", "lockstep")


@dataclass(frozen=True)
class ExperimentConfig:
    """What one experiment does (every agent of a run uses the same).

    Attributes:
        workload: `support`, `tool-use` or `coding`.
        steps: optimizer steps (K).
        tasks_per_step: distinct training tasks per step.
        samples_per_task: attempts per task (separate requests).
        eval_tasks: held-out tasks evaluated greedily.
        eval_every: also evaluate every this many steps (0: before and after only).
        temperature: sampling temperature of training rollouts.
        top_p: nucleus mass of training rollouts.
        lr: AdamW learning rate of the adapters (None: `TrainerConfig`'s default).
        rank: LoRA rank.
        alpha: LoRA alpha.
        batched_agents: agents per forward/backward when several train at once.
        corrections: tool-use only: a developer also corrects failed episodes.
        train_pool: size of the training task pool each step samples from.
        max_num_seqs: engine decode batch.
        max_model_len: engine context (the KV cache is preallocated for it).
        num_threads: torch threads (None: all cores).
        vllm_urls: serve on these vLLM servers (`engine.kind: vllm`) instead of the embedded
            engine; the trainer then trains on its own copy of the base model.
        schedule: concurrent runs only: `independent` (each agent steps on as soon as its
            version is live) or `lockstep` (every step starts once all agents' previous
            steps are live).
        trainer_nice: how much lower the trainer thread's CPU priority is than serving's
            (`TrainerConfig.nice`; None: the service's default).
    """

    workload: str = "support"
    steps: int = 20
    tasks_per_step: int = 8
    samples_per_task: int = 2
    eval_tasks: int = 48
    eval_every: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    lr: float | None = None
    rank: int = 8
    alpha: float = 16.0
    batched_agents: int = 1
    corrections: bool = False
    train_pool: int = 512
    max_num_seqs: int = 32
    max_model_len: int = 768
    num_threads: int | None = None
    vllm_urls: tuple[str, ...] = ()
    schedule: str = "independent"
    trainer_nice: int | None = None

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, not {self.schedule!r}")

    def workload_instance(self) -> Workload:
        cls = WORKLOADS[self.workload]
        if self.workload == "tool-use":
            return cls(corrections=self.corrections)  # type: ignore[call-arg]
        return cls()


@dataclass
class StepRecord:
    """One optimizer step of one agent, as the experiment saw it (seconds are wall time;
    `started_at`/`ended_at` are `time.time()` stamps of the rollout's start and the
    version going live)."""

    step: int
    reward: float
    version: int
    episodes: int
    samples: int
    rollout_s: float
    train_s: float
    step_s: float
    trainer_step_s: float | None = None
    started_at: float = 0.0
    ended_at: float = 0.0


@dataclass
class AgentRun:
    """The result of one experiment."""

    agent: str
    seed: int
    mode: str
    eval_before: float
    eval_after: float
    evals: list[tuple[int, float]] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list)
    started_at: float = 0.0
    finished_at: float = 0.0
    cold_start_s: float = 0.0

    @property
    def duration_s(self) -> float:
        return self.finished_at - self.started_at

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["duration_s"] = self.duration_s
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AgentRun:
        """Inverse of `as_dict` (JSON records written by the proofs and the benchmark)."""
        item = {k: v for k, v in data.items() if k != "duration_s"}
        item["steps"] = [StepRecord(**s) for s in item.get("steps", [])]
        item["evals"] = [(int(a), float(b)) for a, b in item.get("evals", [])]
        return cls(**item)


def _vllm_engine(cfg: ExperimentConfig) -> dict[str, Any]:
    """Engine settings for vLLM (none for the embedded engine); the deployer's watcher
    polls often, as each synchronous step waits for the version it published."""
    if not cfg.vllm_urls:
        return {}
    return {"kind": "vllm", "vllm": {"urls": list(cfg.vllm_urls)}, "adapter_poll_interval_s": 0.1}


def service_settings(
    model_dir: Path, data_dir: Path, cfg: ExperimentConfig, agents: list[str]
) -> Settings:
    """Settings of the service an experiment runs against.

    Admission takes whatever one step's feedback brought (it arrives in one
    transaction), staleness may not exceed one version (the loop is
    synchronous, so it is always 0), the time trigger is off, and the
    release path is off: every step's version serves at once (an experiment
    measures learning per step; `clora bench learning` turns the release path
    back on). Feedback goes straight to the store (no broker).
    """
    return Settings(
        data_dir=data_dir,
        adapters_dir=data_dir / "adapters",
        engine=EngineConfig(
            model=str(model_dir),
            max_num_seqs=cfg.max_num_seqs,
            max_waiting=4096,
            max_model_len=cfg.max_model_len,
            max_lora_rank=max(16, cfg.rank),
            num_threads=cfg.num_threads,
            **_vllm_engine(cfg),
        ),
        agents=[AgentConfig(name=a) for a in agents],
        feedback=FeedbackConfig(kafka=KafkaConfig(embedded_broker=False)),
        trainer=TrainerConfig(
            rank=cfg.rank,
            alpha=cfg.alpha,
            **({} if cfg.lr is None else {"lr": cfg.lr}),
            admission={"min_batch": 1, "max_batch": 4096, "max_staleness": 1},
            trigger_interval_s=1e9,
            poll_interval_s=0.05,
            batched_agents=cfg.batched_agents,
            **({} if cfg.trainer_nice is None else {"nice": cfg.trainer_nice}),
            seed=0,
        ),
        release=ReleaseConfig(enabled=False),
    )


# -- one agent's experiment ----------------------------------------------------------------


async def evaluate(
    client: Any, agent: str, workload: Workload, tasks: list[Any], *, concurrency: int = 16
) -> float:
    """Greedy accuracy (mean reward) of `agent` on `tasks`; nothing is sent as feedback."""
    gate = asyncio.Semaphore(concurrency)

    async def one(task: Any) -> float:
        async with gate:
            episode = await workload.run_episode(client, agent, task, Sampling(temperature=0.0))
            return episode.reward

    rewards = await asyncio.gather(*(one(t) for t in tasks))
    return sum(rewards) / len(rewards) if rewards else float("nan")


async def _wait_for_version(registry: Any, agent: str, version: int, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while True:
        active = await asyncio.to_thread(_active_version, registry, agent)
        if active >= version:
            return active
        if time.monotonic() > deadline:
            raise TimeoutError(f"agent {agent}: version {version} not published in {timeout_s} s")
        await asyncio.sleep(0.05)


def _active_version(registry: Any, agent: str) -> int:
    for info in registry.agents():
        if info.agent == agent:
            return int(info.active_version or 0)
    return 0


async def run_agent(
    server: LocalServer,
    agent: str,
    cfg: ExperimentConfig,
    seed: int,
    *,
    mode: str,
    on_step: Callable[[str, StepRecord], None] | None = None,
    barrier: asyncio.Barrier | None = None,
) -> AgentRun:
    """Run one experiment for `agent` against a started service.

    With a `barrier` (lockstep), each step starts only when every party has
    finished its previous step; a failure breaks the barrier, so the other
    parties fail too instead of waiting forever.
    """
    from openai import AsyncOpenAI

    from clora_feedback.client import AsyncFeedbackClient

    workload = cfg.workload_instance()
    registry = server.service.registry
    trainer = server.service.trainer
    pool = workload.tasks(seed, "train", cfg.train_pool)
    held_out = workload.tasks(seed, "eval", cfg.eval_tasks)
    rng = random.Random(f"experiment/{seed}")
    client = AsyncOpenAI(base_url=server.base_url, api_key="demo", max_retries=2, timeout=3600)
    feedback = AsyncFeedbackClient(server.url, source=f"experiment-{workload.name}")
    run = AgentRun(agent, seed, mode, eval_before=float("nan"), eval_after=float("nan"))
    run.started_at = time.time()
    try:
        run.eval_before = await evaluate(client, agent, workload, held_out)
        run.evals.append((0, run.eval_before))
        for step in range(cfg.steps):
            if barrier is not None:
                await barrier.wait()
            record = await _one_step(
                client, feedback, registry, agent, workload, cfg, rng, pool, seed, step
            )
            run.steps.append(record)
            if on_step is not None:
                on_step(agent, record)
            done = step + 1
            if cfg.eval_every and done % cfg.eval_every == 0 and done < cfg.steps:
                run.evals.append((done, await evaluate(client, agent, workload, held_out)))
        run.eval_after = await evaluate(client, agent, workload, held_out)
        run.evals.append((cfg.steps, run.eval_after))
        for record in run.steps:
            record.trainer_step_s = await _trainer_step_s(trainer, agent, record.step)
    except BaseException:
        if barrier is not None:
            await barrier.abort()
        raise
    finally:
        await feedback.aclose()
        await client.close()
    run.finished_at = time.time()
    return run


async def _one_step(
    client: Any,
    feedback: Any,
    registry: Any,
    agent: str,
    workload: Workload,
    cfg: ExperimentConfig,
    rng: random.Random,
    pool: list[Any],
    seed: int,
    step: int,
) -> StepRecord:
    started_at = time.time()
    t0 = time.perf_counter()
    jobs = step_jobs(cfg, rng, pool, seed, step)
    episodes: list[Episode] = await asyncio.gather(
        *(workload.run_episode(client, agent, task, sampling) for task, sampling in jobs)
    )
    t_rollout = time.perf_counter()
    events = []
    for (task, _), episode in zip(jobs, episodes, strict=True):
        events += workload.feedback(agent, task, episode, event_id=f"{agent}-{uuid.uuid4().hex}")
    await feedback.send(events)
    version = await _wait_for_version(registry, agent, step + 1, timeout_s=3600)
    t_done = time.perf_counter()
    ended_at = time.time()
    return StepRecord(
        step=step + 1,
        reward=sum(e.reward for e in episodes) / len(episodes),
        version=version,
        episodes=len(episodes),
        samples=sum(len(e.completion_ids) for e in episodes),
        rollout_s=t_rollout - t0,
        train_s=t_done - t_rollout,
        step_s=t_done - t0,
        started_at=started_at,
        ended_at=ended_at,
    )


def step_jobs(
    cfg: ExperimentConfig, rng: random.Random, pool: list[Any], seed: int, step: int
) -> list[tuple[Any, Sampling]]:
    """One step's episodes of one experiment: (task, sampling), `rng` advanced by one step."""
    tasks = rng.sample(pool, cfg.tasks_per_step)
    return [
        (task, Sampling(cfg.temperature, cfg.top_p, episode_seed(seed, step, i)))
        for i, (task, _) in enumerate((t, k) for t in tasks for k in range(cfg.samples_per_task))
    ]


async def _trainer_step_s(
    trainer: Any, agent: str, step: int, *, wait_s: float = 2.0
) -> float | None:
    """The trainer's own time (swap + forward/backward + optimizer) for the agent's `step`-th
    optimizer step (a fresh agent's step k is the experiment's step k).

    The trainer files a step's result only after the publishes of its pass, just after
    the version went live, so the last step's may need a moment; None if it never comes.
    """
    deadline = time.monotonic() + wait_s
    while True:
        for result in reversed(trainer.history):
            if result.agent == agent and result.step == step:
                return float(result.step_s)
        if time.monotonic() > deadline:
            return None
        await asyncio.sleep(0.05)


# -- several experiments -------------------------------------------------------------------


@dataclass(frozen=True)
class RolloutCalibration:
    """One step's rollouts on a warm service: the first agent alone, then all N together.

    Attributes:
        n: agents together.
        one_s: wall time of the first agent's rollouts alone.
        together_s: wall time of all N agents' rollouts at once (`one_s` when N = 1).
        wall_s: the whole calibration (to leave out of a makespan).
    """

    n: int
    one_s: float
    together_s: float
    wall_s: float

    @property
    def multiplier(self) -> float:
        """Rollout time of N agents together over one agent's (1 = free, N = no batching)."""
        return self.together_s / self.one_s

    def as_dict(self) -> dict[str, float]:
        return asdict(self) | {"multiplier": self.multiplier}


async def calibrate_rollouts(
    server: LocalServer, agents: list[str], seeds: list[int], cfg: ExperimentConfig
) -> RolloutCalibration:
    """Replay each experiment's first-step rollouts (same tasks, same sampling seeds) with
    the agents' current adapters, first agent alone then all at once; no feedback is sent,
    so nothing is trained."""
    from openai import AsyncOpenAI

    workload = cfg.workload_instance()
    client = AsyncOpenAI(base_url=server.base_url, api_key="demo", max_retries=2, timeout=3600)

    async def rollouts(agent: str, seed: int) -> None:
        rng = random.Random(f"experiment/{seed}")  # as `run_agent` draws step 1
        jobs = step_jobs(cfg, rng, workload.tasks(seed, "train", cfg.train_pool), seed, 0)
        await asyncio.gather(*(workload.run_episode(client, agent, t, sp) for t, sp in jobs))

    t0 = time.perf_counter()
    try:
        await rollouts(agents[0], seeds[0])
        t1 = time.perf_counter()
        if len(agents) > 1:
            await asyncio.gather(*(rollouts(a, s) for a, s in zip(agents, seeds, strict=True)))
        t2 = time.perf_counter()
    finally:
        await client.close()
    together = t2 - t1 if len(agents) > 1 else t1 - t0
    return RolloutCalibration(len(agents), t1 - t0, together, time.perf_counter() - t0)


def run_concurrent(
    model_dir: Path,
    work_dir: Path,
    cfg: ExperimentConfig,
    seeds: list[int],
    *,
    on_step: Callable[[str, StepRecord], None] | None = None,
) -> list[AgentRun]:
    """All seeds at once on one warm service, one agent per seed."""
    return _concurrent(model_dir, work_dir, cfg, seeds, on_step, calibrate=False)[0]


def run_concurrent_calibrated(
    model_dir: Path,
    work_dir: Path,
    cfg: ExperimentConfig,
    seeds: list[int],
    *,
    on_step: Callable[[str, StepRecord], None] | None = None,
) -> tuple[list[AgentRun], RolloutCalibration]:
    """`run_concurrent`, then `calibrate_rollouts` on the same warm service."""
    runs, calibration = _concurrent(model_dir, work_dir, cfg, seeds, on_step, calibrate=True)
    assert calibration is not None
    return runs, calibration


def _concurrent(
    model_dir: Path,
    work_dir: Path,
    cfg: ExperimentConfig,
    seeds: list[int],
    on_step: Callable[[str, StepRecord], None] | None,
    *,
    calibrate: bool,
) -> tuple[list[AgentRun], RolloutCalibration | None]:
    from clora_feedback.service import build_service

    release_freed_memory()
    agents = [f"agent-{seed}" for seed in seeds]
    t0 = time.time()
    service = build_service(service_settings(model_dir, work_dir, cfg, agents))
    with LocalServer(service) as server:
        cold = time.time() - t0

        async def all_agents() -> tuple[list[AgentRun], RolloutCalibration | None]:
            barrier = asyncio.Barrier(len(agents)) if cfg.schedule == "lockstep" else None
            runs = await asyncio.gather(
                *(
                    run_agent(
                        server, a, cfg, s, mode="concurrent", on_step=on_step, barrier=barrier
                    )
                    for a, s in zip(agents, seeds, strict=True)
                )
            )
            calibration = (
                await calibrate_rollouts(server, agents, seeds, cfg) if calibrate else None
            )
            return list(runs), calibration

        runs, calibration = asyncio.run(all_agents())
    for run in runs:
        run.cold_start_s = cold
    return runs, calibration


def run_single(
    model_dir: Path,
    work_dir: Path,
    cfg: ExperimentConfig,
    seed: int,
    *,
    on_step: Callable[[str, StepRecord], None] | None = None,
) -> AgentRun:
    """One single-tenant experiment in a fresh service (cold start included in its timing)."""
    from clora_feedback.service import build_service

    release_freed_memory()
    t0 = time.time()
    service = build_service(service_settings(model_dir, work_dir, cfg, ["agent"]))
    with LocalServer(service) as server:
        cold = time.time() - t0
        run = asyncio.run(run_agent(server, "agent", cfg, seed, mode="serial", on_step=on_step))
    run.cold_start_s = cold
    run.started_at = t0
    return run


def run_serial(
    model_dir: Path,
    work_dir: Path,
    cfg: ExperimentConfig,
    seeds: list[int],
    *,
    on_step: Callable[[str, StepRecord], None] | None = None,
) -> list[AgentRun]:
    """The seeds one after another, each single-tenant with its own cold start."""
    return [
        run_single(model_dir, work_dir / f"seed-{seed}", cfg, seed, on_step=on_step)
        for seed in seeds
    ]


def summarize(runs: list[AgentRun]) -> dict[str, float]:
    """Mean and standard deviation over runs of the numbers the results tables report."""

    def ms(values: list[float]) -> tuple[float, float]:
        if not values:
            return float("nan"), float("nan")
        return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0

    out: dict[str, float] = {}
    tail = [statistics.fmean(s.reward for s in r.steps[-3:]) for r in runs if r.steps]
    for name, values in (
        ("eval_before", [r.eval_before for r in runs]),
        ("eval_after", [r.eval_after for r in runs]),
        ("train_reward_first", [r.steps[0].reward for r in runs if r.steps]),
        ("train_reward_last3", tail),
        ("duration_s", [r.duration_s for r in runs]),
        ("step_s", [statistics.fmean(s.step_s for s in r.steps) for r in runs if r.steps]),
        ("rollout_s", [statistics.fmean(s.rollout_s for s in r.steps) for r in runs if r.steps]),
    ):
        out[f"{name}_mean"], out[f"{name}_std"] = ms(values)
    return out
