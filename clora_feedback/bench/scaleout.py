"""`clora bench scaleout`: the roles as separate processes, 1 vs 2 of each, on one machine.

Every role runs as a real `clora` subprocess (`roles.RoleProcess`) against a real
store (a fresh SQLite file, or a fresh database on the PostgreSQL server
`--pg-url` names) and a real local Tansu broker.

1. Ingest: a backlog of `--events` feedback events (the ingest benchmark's mix,
   every one joins a stored completion) is produced first; then 1, or 2,
   `clora ingest` processes in one consumer group apply it. Events/s is taken
   over the window from 10% to 100% of the backlog durable (the group join and
   the process start-up are outside it), on SQLite and on PostgreSQL. Baseline:
   one process, same backend, same run.
2. Training: `--train-agents` agents with `--train-samples` rewarded samples
   each are stored; then 1, or 2, `clora train` processes (trainer leases split
   the agents) train until every sample is in a published version. Steps/min
   over the window from the first to the last publish, and the trainers' CPU
   time (user + system, from /proc) per step over the same window.
3. Publish -> serving: 2 `clora serve` gateways (trainer off) on PostgreSQL; this
   process publishes a new version of one agent (`AdapterRegistry.publish`, what
   a trainer does at the end of its optimizer step) and, meanwhile, a thread per
   gateway streams one-token completions until one comes from the new version:
   the time from just before the publish to that first token, per gateway.
   Baseline in the same run: the same with `engine.adapter_notify: false`
   (polling every `engine.adapter_poll_interval_s`, 1 s); and the publish's own
   durable time.

The model is a small random-weight one (`models.tiny`, 4 layers x 256) unless
`--model` names a model directory.

Not here: the single-process benchmarks (`ingest`, `train`, `publish`), the roles (`cli`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from clora_feedback.bench.ingest import make_events, store_trajectories
from clora_feedback.bench.report import (
    Row,
    machine_facts,
    median,
    print_report,
    quick_defaults,
)
from clora_feedback.bench.roles import RoleProcess, free_port, wait_healthy, write_settings
from clora_feedback.config import FeedbackConfig, KafkaConfig
from clora_feedback.feedback.broker import LocalBroker
from clora_feedback.feedback.records import build_producer
from clora_feedback.feedback.rewards import DefaultRewardPolicy
from clora_feedback.feedback.store import FeedbackStore, Incoming
from clora_feedback.schemas.feedback import Reward
from clora_feedback.store.db import open_database, redact
from clora_feedback.store.trajectories import SampleRecord, TrajectoryRecord, TrajectoryStore

KAFKA = KafkaConfig()
DEFAULT_PG = "postgresql://clora:clora@127.0.0.1:5432/clora"


@dataclass
class ScaleoutFigures:
    """Raw measurements (written by `--json`); keys are `<backend>/<processes>`."""

    ingest_eps: dict[str, float] = field(default_factory=dict)
    train_steps_per_min: dict[str, float] = field(default_factory=dict)
    train_cpu_s_per_step: dict[str, float] = field(default_factory=dict)
    train_steps: dict[str, int] = field(default_factory=dict)
    publish_to_token_s: dict[str, list[float]] = field(default_factory=dict)
    publish_durable_s: list[float] = field(default_factory=list)


# -- stores ------------------------------------------------------------------------------


@contextlib.contextmanager
def fresh_store(backend: str, tmp: Path, pg_server: str) -> Iterator[str]:
    """A store URL: a new SQLite file under `tmp`, or a new database on `pg_server`
    (dropped afterwards)."""
    if backend == "sqlite":
        yield str(tmp / f"store-{uuid.uuid4().hex[:8]}.db")
        return
    from urllib.parse import urlsplit, urlunsplit

    import psycopg

    name = f"clora_bench_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_server, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    parts = urlsplit(pg_server)
    try:
        yield urlunsplit((parts.scheme, parts.netloc, f"/{name}", parts.query, parts.fragment))
    finally:
        with psycopg.connect(pg_server, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _count(url: str, sql: str) -> int:
    db = open_database(url)
    try:
        with db.read() as tx:
            return int(tx.execute(sql).fetchone()[0])
    finally:
        db.close()


def _wait_count(
    url: str, sql: str, target: int, timeout_s: float, procs: list[RoleProcess]
) -> dict[float, float]:
    """Poll `sql` (a count) until it reaches `target`; returns {fraction: time reached}."""
    marks: dict[float, float] = {}
    deadline = time.monotonic() + timeout_s
    db = open_database(url)
    try:
        while True:
            with db.read() as tx:
                n = int(tx.execute(sql).fetchone()[0])
            now = time.perf_counter()
            for frac in (0.0, 0.1, 1.0):
                if frac not in marks and n >= max(1, frac * target):
                    marks[frac] = now
            if n >= target:
                return marks
            if time.monotonic() > deadline or not all(p.alive for p in procs):
                tails = "\n".join(f"--- {p.name}\n{p.tail(1500)}" for p in procs)
                raise RuntimeError(f"{n} of {target} after {timeout_s} s\n{tails}")
            time.sleep(0.05)
    finally:
        db.close()


# -- 1: ingest -----------------------------------------------------------------------------


def ingest_once(args: argparse.Namespace, backend: str, processes: int, tmp: Path) -> float:
    """Events/s of `processes` ingest processes draining a backlog (10% -> 100% window)."""
    with fresh_store(backend, tmp, args.pg_url) as url:
        trajectories = TrajectoryStore(url)
        store_trajectories(trajectories, args.agents, args.completions, args.seed)
        FeedbackStore(
            url, trajectories=trajectories, policy=DefaultRewardPolicy(FeedbackConfig())
        ).close()
        trajectories.close()
        run_dir = tmp / f"ingest-{backend}-{processes}"
        with LocalBroker(
            run_dir / "tansu", topics=[*KAFKA.topics, KAFKA.dead_letter_topic], partitions=4
        ) as broker:
            events = make_events(f"{backend}{processes}", args.events, args.agents,
                                 args.completions, args.seed)  # fmt: skip
            asyncio.run(_produce(broker.bootstrap, events))
            cfg = write_settings(
                run_dir / "settings.json",
                {"store_url": url if backend == "postgresql" else None,
                 "feedback": {"kafka": {"bootstrap_servers": broker.bootstrap,
                                        "group_id": f"bench-{processes}"}}},
            )  # fmt: skip
            where = [] if backend == "postgresql" else ["--db", url]
            cmd = ["ingest", "--config", str(cfg), *where, "--session-timeout-ms", "2000",
                   "--heartbeat-interval-ms", "300"]  # fmt: skip
            procs = [RoleProcess(f"ingest{i}", cmd, run_dir) for i in range(processes)]
            try:
                for p in procs:
                    p.start()
                marks = _wait_count(
                    url, "SELECT count(*) FROM feedback_events", len(events), 600, procs
                )
            finally:
                for p in procs:
                    p.stop()
    window = marks[1.0] - marks[0.1]
    if window < 0.2:
        raise RuntimeError(
            f"the backlog drained in {window:.3f} s: too small to time; raise --events"
        )
    return 0.9 * len(events) / window


async def _produce(bootstrap: str, events: list[Any]) -> None:
    producer = build_producer(KAFKA, bootstrap)
    await producer.start()
    try:
        for k in range(0, len(events), 1000):
            await producer.send_many(events[k : k + 1000])
    finally:
        await producer.stop()


# -- 2: training ---------------------------------------------------------------------------


def _train_data(url: str, agents: int, samples: int, vocab: int, seed: int) -> None:
    """`samples` served completions per agent, each with one reward, all joined."""
    rng = random.Random(seed)
    trajectories = TrajectoryStore(url)
    feedback = FeedbackStore(
        url, trajectories=trajectories, policy=DefaultRewardPolicy(FeedbackConfig())
    )
    try:
        events = []
        for a in range(agents):
            for k in range(samples):
                cid, agent = f"t-{a}-{k}", f"agent-{a}"
                ids = [rng.randrange(3, vocab) for _ in range(32)]
                prompt = [rng.randrange(3, vocab) for _ in range(96)]
                sample = SampleRecord(0, "x", ids, [-1.5] * 32, [0] * 32, "stop")
                trajectories.record(
                    TrajectoryRecord(cid, agent, 0, "chat", {}, prompt, [sample], time.time())
                )
                value = rng.uniform(-1, 1)
                events.append(Reward(event_id=f"r{a}-{k}", agent=agent, completion_id=cid,
                                     source="bench", value=value))  # fmt: skip
        for k in range(0, len(events), 500):
            feedback.apply([Incoming(e, "bench") for e in events[k : k + 500]])
    finally:
        feedback.close()
        trajectories.close()


def _cpu_s(procs: list[RoleProcess]) -> float:
    """User + system CPU seconds of the processes so far (Linux /proc)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for p in procs:
        if p.proc is None:
            continue
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{p.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / ticks
    return total


def train_once(
    args: argparse.Namespace, processes: int, model: Path, tmp: Path
) -> tuple[float, float, int]:
    """(steps/min, CPU s/step, steps) of `processes` trainers on disjoint agents."""
    from clora_feedback.store.registry import AdapterRegistry

    per_step = args.batch
    steps = args.train_agents * (args.train_samples // per_step)
    with fresh_store("postgresql", tmp, args.pg_url) as url:
        _train_data(url, args.train_agents, args.train_samples, args.vocab, args.seed)
        run_dir = tmp / f"train-{processes}"
        AdapterRegistry(run_dir / "adapters", db=url).close()  # the tables exist before timing
        cfg = write_settings(
            run_dir / "settings.json",
            {"store_url": url, "adapters_dir": str(run_dir / "adapters"),
             "engine": {"model": str(model), "device": "cpu", "num_threads": 1},
             "trainer": {"nice": 0, "poll_interval_s": 0.1, "trigger_interval_s": 3600,
                         "lease_ttl_s": 6.0,
                         "admission": {"min_batch": per_step, "max_batch": per_step,
                                       "max_staleness": 100_000}},
             # Every sample trains (no held-out reserve) and each step serves at once.
             "release": {"enabled": False}},
        )  # fmt: skip
        procs = [
            RoleProcess(f"train{i}", ["train", "--config", str(cfg), "--owner", f"t{i}"], run_dir)
            for i in range(processes)
        ]
        cpu: dict[float, float] = {}
        try:
            for p in procs:
                p.start()
            sql = "SELECT count(*) FROM versions"
            first = _wait_count(url, sql, 1, 600, procs)[1.0]
            cpu[0.0] = _cpu_s(procs)
            last = _wait_count(url, sql, steps, 1200, procs)[1.0]
            cpu[1.0] = _cpu_s(procs)
        finally:
            for p in procs:
                p.stop()
    window = last - first
    return 60.0 * (steps - 1) / window, (cpu[1.0] - cpu[0.0]) / (steps - 1), steps


# -- 3: publish -> serving -----------------------------------------------------------------


def _first_new_token(base: str, agent: str, version: int, deadline: float) -> float:
    """Stream one-token completions until one comes from `version`; perf_counter() then."""
    with httpx.Client(base_url=base, timeout=30) as http:
        while time.monotonic() < deadline:
            body = {"model": agent, "max_tokens": 1, "stream": True,
                    "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip
            with http.stream("POST", "/v1/chat/completions", json=body,
                             headers={"authorization": f"Bearer k-{agent}"}) as r:  # fmt: skip
                for line in r.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    served = (chunk.get("clora") or {}).get("adapter_version")
                    if served == version and chunk.get("choices"):
                        return time.perf_counter()
                    break
    raise RuntimeError(f"{base} never served {agent} v{version}")


def publish_once(
    args: argparse.Namespace, model: Path, tmp: Path, notify: bool, figures: ScaleoutFigures
) -> list[float]:
    """Publish `--publishes` versions; per publish and gateway: publish start -> first token."""
    from clora_feedback.lora.weights import random_lora_weights
    from clora_feedback.store.registry import AdapterRegistry
    from clora_feedback.train.policy import DecoderPolicy

    limits = DecoderPolicy.from_dir(model, max_lora_rank=16, target_modules=("q_proj", "v_proj"),
                                    model_name="m", max_model_len=256).lora_limits  # fmt: skip
    agent = "pub"
    out: list[float] = []
    with fresh_store("postgresql", tmp, args.pg_url) as url:
        run_dir = tmp / f"publish-{notify}"
        cfg = write_settings(
            run_dir / "settings.json",
            {"store_url": url, "adapters_dir": str(run_dir / "adapters"),
             "admin_api_key": "k-admin", "agents": [{"name": agent, "api_keys": [f"k-{agent}"]}],
             "engine": {"model": str(model), "device": "cpu", "num_threads": 1,
                        "max_model_len": 256, "adapter_notify": notify, "prefix_cache_mb": 0},
             "feedback": {"kafka": {"embedded_broker": False}},
             "trainer": {"enabled": False}, "release": {"enabled": False}},
        )  # fmt: skip
        ports = [free_port(), free_port()]
        procs = [
            RoleProcess(f"gw{i}", ["serve", "--config", str(cfg), "--port", str(port)], run_dir)
            for i, port in enumerate(ports)
        ]
        registry = None
        try:
            procs[0].start()
            wait_healthy(f"http://127.0.0.1:{ports[0]}", procs[0])
            procs[1].start()
            wait_healthy(f"http://127.0.0.1:{ports[1]}", procs[1])
            registry = AdapterRegistry(run_dir / "adapters", db=url, collect_on_open=False)
            parent = None
            for rep in range(args.publishes):
                version = registry.next_version(agent)
                times: list[float] = [0.0, 0.0]
                deadline = time.monotonic() + 60
                threads = [
                    threading.Thread(target=_into, args=(times, i, _first_new_token,
                                     f"http://127.0.0.1:{port}", agent, version, deadline))
                    for i, port in enumerate(ports)
                ]  # fmt: skip
                weights = random_lora_weights(limits, rank=4, seed=rep)
                for t in threads:
                    t.start()
                start = time.perf_counter()
                registry.publish(agent, weights, optimizer_state=None, base_model="m",
                                 parent=parent, step=rep, metrics={}, feedback_window=None,
                                 version=version)  # fmt: skip
                if notify:
                    figures.publish_durable_s.append(time.perf_counter() - start)
                for t in threads:
                    t.join()
                out += [t - start for t in times]
                parent = version
                time.sleep(0.3)  # let the followers settle before the next publish
        finally:
            if registry is not None:
                registry.close()
            for p in procs:
                p.stop()
    return out


def _into(out: list[float], i: int, fn: Callable[..., float], *args: Any) -> None:
    out[i] = fn(*args)


# -- the table -------------------------------------------------------------------------------


def rows(args: argparse.Namespace, f: ScaleoutFigures) -> list[Row]:
    out: list[Row] = []
    for backend in ("sqlite", "postgresql"):
        one, two = f.ingest_eps.get(f"{backend}/1"), f.ingest_eps.get(f"{backend}/2")
        if one and two:
            out.append(Row(
                f"ingest-{backend}", f"Kafka -> {backend}: {args.events} events, 2 `clora ingest` "
                "processes in one group (10%->100% window)", f"{two:,.0f} events/s",
                f"1 process {one:,.0f} events/s", f"{two / one:.2f}x", "-",
            ))  # fmt: skip
    one, two = f.train_steps_per_min.get("1"), f.train_steps_per_min.get("2")
    if one and two:
        c1, c2 = f.train_cpu_s_per_step["1"], f.train_cpu_s_per_step["2"]
        out.append(Row(
            "train", f"steps/min, 2 `clora train` processes on {args.train_agents} agents "
            f"(leases split them), {f.train_steps['2']} steps of {args.batch} samples",
            f"{two:.1f} steps/min ({c2:.2f} CPU s/step)",
            f"1 process {one:.1f} steps/min ({c1:.2f} CPU s/step)", f"{two / one:.2f}x", "-",
        ))  # fmt: skip
    on, off = f.publish_to_token_s.get("notify"), f.publish_to_token_s.get("poll")
    if on and off:
        out.append(Row(
            "publish", f"publish -> first token of the new version, each of 2 gateways, "
            f"median of {len(on)} (publish durable in {median(f.publish_durable_s) * 1e3:.0f} ms)",
            f"NOTIFY {median(on) * 1e3:.0f} ms (max {max(on) * 1e3:.0f})",
            f"polling only {median(off) * 1e3:.0f} ms (max {max(off) * 1e3:.0f})",
            f"{median(on) / median(off):.2f}x", "-",
        ))  # fmt: skip
    return out


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="clora bench scaleout", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small counts")
    p.add_argument("--parts", default="ingest,train,publish", help="comma-separated parts")
    p.add_argument("--pg-url", help="PostgreSQL server URL whose role may CREATE DATABASE "
                   "(default: var/postgres.url, else the scripts/postgres.sh default)")  # fmt: skip
    p.add_argument("--model", type=Path, help="model directory (default: a tiny random one)")
    p.add_argument("--events", type=int, help="ingest backlog (default 6000; quick 1500)")
    p.add_argument("--agents", type=int, default=8)
    p.add_argument("--completions", type=int, default=50)
    p.add_argument("--train-agents", type=int, default=4)
    p.add_argument("--train-samples", type=int, help="per agent (default 96; quick 32)")
    p.add_argument("--batch", type=int, default=8, help="samples per training step")
    p.add_argument("--publishes", type=int, help="publishes per mode (default 10; quick 4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="also write the raw figures here")
    args = p.parse_args(argv)
    quick_defaults(args, events=(6000, 1500), train_samples=(96, 32), publishes=(10, 4))
    if args.pg_url is None:
        url_file = Path("var/postgres.url")
        args.pg_url = url_file.read_text().strip() if url_file.is_file() else DEFAULT_PG
    return args


def run(argv: list[str]) -> int:
    """`clora bench scaleout [options]`: measure, print the table and machine facts."""
    from clora_feedback.model.tiny import build_tiny_model_dir

    args = _parse(argv)
    parts = set(args.parts.split(","))
    started = time.perf_counter()
    load_before = machine_facts()["load average (1, 5, 15 min)"]
    figures = ScaleoutFigures()
    with tempfile.TemporaryDirectory(prefix="clora-scaleout-") as tmp_name:
        tmp = Path(tmp_name)
        model = args.model or build_tiny_model_dir(
            tmp / "model", hidden_size=256, intermediate_size=512, num_hidden_layers=4
        )
        args.vocab = 250  # the tiny model's byte vocabulary (ids below it are valid anywhere)
        failed = []
        for part, measure in (("ingest", _ingest), ("train", _train), ("publish", _publish)):
            if part in parts:
                try:  # a failed part is reported; the others still run
                    measure(args, model, tmp, figures)
                except Exception as exc:
                    failed.append(part)
                    print(f"part {part} failed: {exc!r}", file=sys.stderr)
    facts = machine_facts()
    facts["load average at start"] = load_before
    facts["postgresql"] = redact(args.pg_url)
    facts["wall time"] = f"{time.perf_counter() - started:.0f} s"
    options = {k: str(v) for k, v in vars(args).items()}
    print_report(rows(args, figures), facts, args.json, options, asdict(figures))
    return 1 if failed else 0


def _ingest(args: argparse.Namespace, model: Path, tmp: Path, figures: ScaleoutFigures) -> None:
    for backend in ("sqlite", "postgresql"):
        for n in (1, 2):
            figures.ingest_eps[f"{backend}/{n}"] = ingest_once(args, backend, n, tmp)


def _train(args: argparse.Namespace, model: Path, tmp: Path, figures: ScaleoutFigures) -> None:
    for n in (1, 2):
        rate, cpu, steps = train_once(args, n, model, tmp)
        figures.train_steps_per_min[str(n)] = rate
        figures.train_cpu_s_per_step[str(n)] = cpu
        figures.train_steps[str(n)] = steps


def _publish(args: argparse.Namespace, model: Path, tmp: Path, figures: ScaleoutFigures) -> None:
    for notify in (True, False):
        key = "notify" if notify else "poll"
        figures.publish_to_token_s[key] = publish_once(args, model, tmp, notify, figures)


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
