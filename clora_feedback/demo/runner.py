"""`clora demo`: a simulated population of agents that visibly learns from its users' feedback.

What runs (all in this process, except the broker):

- the full service of `clora serve` (`build_service`): gateway, engine,
  trajectory and feedback stores, Kafka consumer group, webhook, continual
  trainer, adapter registry and release path (gate, canary);
- a Kafka-protocol broker (Tansu, as the embedded default uses) standing in
  for the company's cluster, so feedback flows through the log (in its own
  session, see `brokerhost`, so Ctrl-C cannot kill it before we are done);
- simulated users: per agent, a few concurrent users who send tasks through
  the OpenAI API and judge the answers with the workload's ground truth:
  - `support`: tickets routed by the agent; a simulated operator resolves or
    escalates each one and publishes the `Resolution` to Kafka;
  - `coding`: one-line Python tasks; a simulated developer accepts or
    rewrites each answer and posts the `Correction` to the webhook.

The terminal shows a progress bar and one live line per agent (requests,
feedback, live version, the reward of the last 32 answers, staleness of the
samples the trainer admitted); without a terminal, one plain line per new
version. The reward is one quantity everywhere: the simulated judge's 1 or 0
is what the server's reward policy gives the event it sends (a resolved or
accepted answer 1.0, an escalated or corrected one 0.0), so the live line and
the versions table's per-step batch mean measure the same thing. At the end (or on Ctrl-C, which stops everything
cleanly) it writes a reward-curve PNG per agent and prints the table of
versions from the registry.

Not here: the workloads' ground truth (`support`, `coding`), the service.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import random
import shutil
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clora_feedback.config import (
    DEFAULT_MODEL,
    AgentConfig,
    EngineConfig,
    FeedbackConfig,
    KafkaConfig,
    Settings,
    TrainerConfig,
)
from clora_feedback.demo.brokerhost import HostedBroker
from clora_feedback.demo.server import LocalServer
from clora_feedback.demo.workloads import CodingWorkload, Sampling, SupportWorkload, Workload
from clora_feedback.heap import release_freed_memory
from clora_feedback.lifecycle import cancel_and_wait

log = logging.getLogger(__name__)

AGENTS: dict[str, tuple[type[SupportWorkload] | type[CodingWorkload], str]] = {
    "support": (SupportWorkload, "kafka"),
    "coding": (CodingWorkload, "webhook"),
}
"""Demo agents: workload and the path its feedback takes."""


@dataclass(frozen=True)
class DemoConfig:
    """What the demo runs.

    Attributes:
        model: base model (the default name or a model directory).
        data_dir: databases, adapters and the broker log (wiped first when `fresh`).
        out_dir: reward-curve PNGs, versions table, summary JSON.
        agents: which demo agents to run (`support`, `coding`).
        versions: stop once every agent has published this many versions (0: no limit).
        minutes: stop after this long at the latest.
        users: concurrent simulated users per agent.
        think_s: a user's mean pause between answers (exponential): people read, and a
            demo that saturates both cores leaves its lower-priority trainer only the
            leftovers (a step took 100 s instead of 10).
        temperature: the agents' sampling temperature (exploration).
        lr: the trainer's learning rate (None: `TrainerConfig`'s default, as `clora serve`).
        rank: LoRA rank of the trained adapters.
        batch: samples per optimizer step, admission min and max (None: the defaults).
        num_threads: torch threads (None: all cores).
        progress: draw tqdm bars (else print one plain line per new version); None:
            bars when standard output is a terminal.
        fresh: start from empty stores and adapters.
        seed: task order of the simulated users.
    """

    model: str = DEFAULT_MODEL
    data_dir: Path = Path("var/demo")
    out_dir: Path = Path("var/demo/out")
    agents: tuple[str, ...] = ("support", "coding")
    versions: int = 10
    minutes: float = 15.0
    users: int = 4
    think_s: float = 2.0
    temperature: float = 0.8
    lr: float | None = None
    rank: int = 8
    batch: int | None = None
    num_threads: int | None = None
    progress: bool | None = None
    fresh: bool = True
    seed: int = 0


@dataclass
class AgentLive:
    """What the display shows for one agent (updated by its users and the monitor)."""

    name: str
    requests: int = 0
    feedback: int = 0
    rewards: list[float] = field(default_factory=list)
    version_marks: list[tuple[int, int]] = field(default_factory=list)
    version: int = 0
    staleness: float = 0.0
    errors: int = 0

    def moving_average(self, window: int = 32) -> float:
        tail = self.rewards[-window:]
        return sum(tail) / len(tail) if tail else float("nan")

    def line(self) -> str:
        return (
            f"{self.name:<8} requests {self.requests:>5}  feedback {self.feedback:>5}  "
            f"version v{self.version:<3} reward (last 32) {self.moving_average():.2f}  "
            f"staleness {self.staleness:.2f}" + (f"  errors {self.errors}" if self.errors else "")
        )


def demo_settings(config: DemoConfig, model_dir: Path, bootstrap: str) -> Settings:
    """The service configuration of the demo: `clora serve`'s, trainer defaults included
    (only `lr` and `batch` when given, a faster trigger) and the release path as it ships:
    each trainer candidate is gated and canaried before it serves (docs/release.md)."""
    trainer: dict[str, Any] = {"rank": config.rank}
    if config.lr is not None:
        trainer["lr"] = config.lr
    if config.batch is not None:
        trainer["admission"] = {"min_batch": config.batch, "max_batch": config.batch}
    return Settings(
        data_dir=config.data_dir,
        adapters_dir=config.data_dir / "adapters",
        engine=EngineConfig(
            model=str(model_dir),
            max_num_seqs=max(8, 2 * config.users * len(config.agents)),
            max_model_len=1024,
            num_threads=config.num_threads,
        ),
        agents=[AgentConfig(name=a) for a in config.agents],
        feedback=FeedbackConfig(kafka=KafkaConfig(bootstrap_servers=bootstrap)),
        trainer=TrainerConfig(
            **trainer,
            trigger_interval_s=120.0,
            poll_interval_s=0.2,
        ),
    )


class Demo:
    """The running demo: service, broker, simulated users and the live display."""

    def __init__(self, config: DemoConfig, server: LocalServer, bootstrap: str):
        self.config = config
        self.server = server
        self.bootstrap = bootstrap
        self.live = {name: AgentLive(name) for name in config.agents}
        self.started = time.monotonic()
        self._stop = asyncio.Event()

    def done(self) -> bool:
        elapsed_min = (time.monotonic() - self.started) / 60
        if elapsed_min >= self.config.minutes:
            return True
        target = self.config.versions
        return target > 0 and all(a.version >= target for a in self.live.values())

    async def run(self) -> None:
        """Users and monitor until `done()` or cancellation (Ctrl-C)."""
        from openai import AsyncOpenAI

        from clora_feedback.client import AsyncFeedbackClient

        client = AsyncOpenAI(base_url=self.server.base_url, api_key="demo", max_retries=3)
        senders = {
            "kafka": AsyncFeedbackClient(
                kafka_bootstrap=self.bootstrap, source="simulated-operator"
            ),
            "webhook": AsyncFeedbackClient(self.server.url, source="simulated-developer"),
        }
        # One send at a time per client: the Kafka client starts its producer on the
        # first send, and concurrent first sends would each start one.
        locks = {path: asyncio.Lock() for path in senders}
        tasks = []
        for name in self.config.agents:
            workload_cls, path = AGENTS[name]
            workload = workload_cls()
            for user in range(self.config.users):
                tasks.append(
                    asyncio.create_task(
                        self._user(client, senders[path], locks[path], name, workload, user),
                        name=f"user-{name}-{user}",
                    )
                )
        progress = self.config.progress
        if progress is None:
            progress = sys.stdout.isatty()
        display = _Display(self) if progress else _LogDisplay(self)
        try:
            while not self.done():
                self._refresh()
                display.update()
                await asyncio.sleep(0.5)
        finally:
            self._stop.set()
            await cancel_and_wait(tasks)
            self._refresh()
            display.close()
            for sender in senders.values():
                # A broker gone with Ctrl-C must not hide the results.
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(sender.aclose(), 10)
            await client.close()

    async def _user(
        self,
        client: Any,
        sender: Any,
        lock: asyncio.Lock,
        agent: str,
        workload: Workload,
        user: int,
    ) -> None:
        live = self.live[agent]
        rng = random.Random(f"{self.config.seed}/{agent}/{user}")
        pool = workload.tasks(self.config.seed, "train", 512)
        while not self._stop.is_set():
            task = rng.choice(pool)
            sampling = Sampling(self.config.temperature, 1.0, rng.randrange(2**31))
            try:
                episode = await workload.run_episode(client, agent, task, sampling)
                live.requests += len(episode.completion_ids)
                events = workload.feedback(agent, task, episode, event_id=uuid.uuid4().hex)
                async with lock:
                    await sender.send(events)
            except asyncio.CancelledError:
                raise
            except Exception:  # a refused request (e.g. 429) or a broker hiccup: try again
                live.errors += 1
                log.debug("simulated user %s/%d failed", agent, user, exc_info=True)
                await asyncio.sleep(1.0)
                continue
            version = episode.versions[0] if episode.versions else 0
            if not live.version_marks or live.version_marks[-1][1] != version:
                live.version_marks.append((len(live.rewards) + 1, version))
            live.rewards.append(episode.reward)
            live.feedback += len(events)
            if self.config.think_s > 0:
                await asyncio.sleep(rng.expovariate(1.0 / self.config.think_s))

    def _refresh(self) -> None:
        service = self.server.service
        served = service.engine.stats().adapters
        metrics = service.trainer.metrics() if service.trainer is not None else {}
        for name, live in self.live.items():
            live.version = int(served.get(name, live.version))
            live.staleness = float(metrics.get(name, {}).get("staleness_mean", live.staleness))


class _Display:
    """tqdm: an overall bar (versions or time) and one status line per agent."""

    def __init__(self, demo: Demo):
        from tqdm import tqdm

        self.demo = demo
        cfg = demo.config
        self.by_versions = cfg.versions > 0
        total = cfg.versions * len(cfg.agents) if self.by_versions else int(cfg.minutes * 60)
        unit = "versions" if self.by_versions else "s"
        self.bar = tqdm(
            total=total,
            desc="learning",
            position=0,
            leave=True,
            bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} " + unit + " [{elapsed}]",
        )
        self.lines = [
            tqdm(total=0, bar_format="{desc}", position=i + 1, leave=True)
            for i in range(len(cfg.agents))
        ]

    def update(self) -> None:
        live = list(self.demo.live.values())
        if self.by_versions:
            done = sum(min(a.version, self.demo.config.versions) for a in live)
        else:
            done = int(time.monotonic() - self.demo.started)
        self.bar.n = min(done, self.bar.total)
        self.bar.refresh()
        for line, agent in zip(self.lines, live, strict=True):
            line.set_description_str(agent.line())

    def close(self) -> None:
        self.update()
        for bar in [self.bar, *self.lines]:
            bar.close()


class _LogDisplay:
    """One plain line per new version of an agent (no terminal: CI, a log file)."""

    def __init__(self, demo: Demo):
        self.demo = demo
        self.shown = {name: -1 for name in demo.live}

    def update(self) -> None:
        for name, agent in self.demo.live.items():
            if agent.version != self.shown[name]:
                self.shown[name] = agent.version
                elapsed = time.monotonic() - self.demo.started
                print(f"[{elapsed:6.0f} s] {agent.line()}", flush=True)

    def close(self) -> None:
        for agent in self.demo.live.values():
            print(agent.line(), flush=True)


# -- results ---------------------------------------------------------------------------------


def versions_table(registry: Any, agents: Sequence[str]) -> str:
    """Markdown table of every agent's versions (status, step, reward, loss, samples, staleness)."""
    rows = [
        "| agent | version | parent | status | step | reward (step batch) | loss | samples | staleness |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for agent in agents:
        try:
            versions = registry.versions(agent)
        except Exception:  # an agent that never published has no versions yet
            continue
        for v in sorted(versions, key=lambda v: v.version):
            m, window = v.metrics, v.feedback_window or {}
            rows.append(
                f"| {agent} | v{v.version} | {v.parent or '-'} | {v.status} | {v.step} | "
                f"{_num(m.get('reward_mean'))} | {_num(m.get('loss'), 4)} | "
                f"{window.get('samples', '-')} | {_num(m.get('staleness_mean'))} |"
            )
    return "\n".join(rows)


def _num(value: Any, digits: int = 2) -> str:
    return "-" if value is None else f"{float(value):.{digits}f}"


def write_results(demo: Demo, registry: Any, out_dir: Path, *, interrupted: bool) -> list[Path]:
    """Reward-curve PNGs, `versions.md` and `summary.json` under `out_dir`; returns the paths."""
    from clora_feedback.demo.plots import reward_curve

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, live in demo.live.items():
        if live.rewards:
            written.append(
                reward_curve(out_dir / f"reward_{name}.png", name, live.rewards, live.version_marks)
            )
    table = versions_table(registry, list(demo.live))
    (out_dir / "versions.md").write_text(table + "\n")
    written.append(out_dir / "versions.md")
    summary = {
        "interrupted": interrupted,
        "elapsed_s": time.monotonic() - demo.started,
        "agents": {
            n: {
                "requests": a.requests,
                "feedback": a.feedback,
                "version": a.version,
                "reward_first32": sum(a.rewards[:32]) / max(1, len(a.rewards[:32])),
                "reward_last32": a.moving_average(),
                "errors": a.errors,
            }
            for n, a in demo.live.items()
        },
    }
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    written.append(out_dir / "summary.json")
    print("\n" + table)
    return written


# -- entry point -----------------------------------------------------------------------------


def run_demo(config: DemoConfig) -> dict[str, Any]:
    """Run the demo until done or Ctrl-C; write the results; return the summary."""
    from clora_feedback.cores import main_thread_alone

    with main_thread_alone():  # the engine thread's pool is the process's only one
        return _run_demo(config)


def _run_demo(config: DemoConfig) -> dict[str, Any]:
    from clora_feedback.model.resolve import resolve_model_dir
    from clora_feedback.service import build_service

    if config.fresh and config.data_dir.exists():
        for name in ("trajectories.db", "registry.db", "adapters", "kafka"):
            path = config.data_dir / name
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
        for suffix in ("-wal", "-shm"):
            for db in ("trajectories.db", "registry.db"):
                (config.data_dir / (db + suffix)).unlink(missing_ok=True)
    model_dir = resolve_model_dir(config.model, Settings().model_cache_dir)
    release_freed_memory()
    print(f"clora demo: model {config.model}, agents {', '.join(config.agents)}; Ctrl-C stops.")
    broker = HostedBroker(config.data_dir / "kafka")
    bootstrap = broker.start()
    interrupted = False
    try:
        service = build_service(demo_settings(config, model_dir, bootstrap))
        with LocalServer(service) as server:
            print(f"console: {server.url}/console (open the page to watch the agents learn)")
            demo = Demo(config, server, bootstrap)
            try:
                asyncio.run(demo.run())
            except KeyboardInterrupt:
                interrupted = True
                print("\ninterrupted: stopping the users, the trainer and the gateway ...")
            registry = service.registry
        paths = write_results(demo, registry, config.out_dir, interrupted=interrupted)
    finally:
        broker.stop()
    print("wrote " + ", ".join(str(p) for p in paths))
    summary: dict[str, Any] = json.loads((config.out_dir / "summary.json").read_text())
    return summary


def build_parser() -> argparse.ArgumentParser:
    d = DemoConfig()
    p = argparse.ArgumentParser(
        prog="clora demo",
        description="Simulated users give feedback; watch their agents learn (Ctrl-C stops).",
    )
    p.add_argument("--model", default=d.model, help="Base model (default: the embedded default).")
    p.add_argument("--data-dir", type=Path, default=d.data_dir, help="Stores and adapters.")
    p.add_argument("--out", type=Path, default=d.out_dir, help="PNGs and the versions table.")
    p.add_argument("--agents", default=",".join(d.agents), help="Comma list: support,coding.")
    p.add_argument("--versions", type=int, default=d.versions, help="Stop at this many versions per agent (0: no limit).")  # fmt: skip
    p.add_argument("--minutes", type=float, default=d.minutes, help="Stop after this long at the latest.")  # fmt: skip
    p.add_argument("--users", type=int, default=d.users, help="Concurrent users per agent.")
    p.add_argument("--think", type=float, default=d.think_s, help="A user's mean pause between answers, seconds.")  # fmt: skip
    p.add_argument("--batch", type=int, default=d.batch, help="Samples per optimizer step (default: the trainer's admission).")  # fmt: skip
    p.add_argument("--lr", type=float, default=d.lr, help="Learning rate (default: the trainer's).")  # fmt: skip
    p.add_argument("--temperature", type=float, default=d.temperature, help="Sampling temperature.")  # fmt: skip
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores).")  # fmt: skip
    p.add_argument("--no-progress", action="store_true", help="Plain lines (one per new version) instead of bars; the default without a terminal.")  # fmt: skip
    p.add_argument("--keep", action="store_true", help="Keep earlier stores and adapters.")
    p.add_argument("--seed", type=int, default=d.seed)
    return p


def run(argv: Sequence[str] | None = None) -> int:
    """`clora demo [options]`; returns the exit status."""
    args = build_parser().parse_args(argv)
    # The simulated users' HTTP clients log every request at INFO; the live lines are the display.
    for name in ("httpx", "httpx2", "openai"):
        logging.getLogger(name).setLevel(max(logging.WARNING, logging.getLogger().level))
    agents = tuple(a.strip() for a in args.agents.split(",") if a.strip())
    unknown = [a for a in agents if a not in AGENTS]
    if unknown or not agents:
        print(f"unknown agents {unknown}; choose from {', '.join(AGENTS)}")
        return 2
    config = DemoConfig(
        model=args.model,
        data_dir=args.data_dir,
        out_dir=args.out,
        agents=agents,
        versions=args.versions,
        minutes=args.minutes,
        users=args.users,
        think_s=args.think,
        temperature=args.temperature,
        lr=args.lr,
        batch=args.batch,
        num_threads=args.threads,
        progress=False if args.no_progress else None,
        fresh=not args.keep,
        seed=args.seed,
    )
    run_demo(config)
    return 0
