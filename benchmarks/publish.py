"""What publishing a new adapter version costs serving: the timed parts of `python -m benchmarks.train`.

- `measure_publish_latency`: `ContinualTrainer` rounds (real feedback store,
  registry and publish path) while a stream of the same agent decodes; from
  the end of each optimizer step to the arrival of the first token the new
  version produced.
- `measure_interference`: inter-token gaps of other agents' streams in windows
  with publishes of one agent every `interval_s` against interleaved windows
  without. Publishes make the trainer's calls in its order, without its
  training compute: that competes for the same cores whether or not it
  publishes, and would hide what the publish itself costs.

Token arrival times are taken on the event loop that consumes the streams,
as a client in this process would see them.

Not here: the table and the other measurements (see `train`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from clora_feedback.config import AdmissionConfig, TrainerConfig
from clora_feedback.engine.deployer import Deployer
from clora_feedback.engine.embedded import EmbeddedEngine
from clora_feedback.engine.types import GenerationRequest, SamplingParams
from clora_feedback.feedback.store import FeedbackStore, Incoming
from clora_feedback.lora.weights import random_lora_weights
from clora_feedback.priority import lower_thread_priority
from clora_feedback.schemas.feedback import Reward
from clora_feedback.store.registry import AdapterRegistry
from clora_feedback.store.trajectories import SampleRecord, TrajectoryRecord
from clora_feedback.store.versions import AdapterRef
from clora_feedback.train.policy import DecoderPolicy
from clora_feedback.train.state import AgentTrainState, LoRALayout, init_lora
from clora_feedback.train.step import PGSample, StepResult
from clora_feedback.train.trainer import ContinualTrainer

PUBLISHER = "publisher"
"""The agent whose adapter is trained and published."""

CONDITIONS = ("off", "hand-off", "durable")
"""Interference windows: no publishes, reserve + engine hand-off, and hand-off + durable write."""


# -- inputs ------------------------------------------------------------------------------


def token_ids(rng: random.Random, vocab: int, n: int) -> list[int]:
    """`n` random token ids, clear of the first few (special) ids."""
    return [rng.randrange(3, vocab) for _ in range(n)]


def pg_samples(
    rng: random.Random, vocab: int, n: int, prompt: int, completion: int
) -> list[PGSample]:
    """`n` rewarded samples of fixed length (rewards alternate so advantages are non-zero)."""
    return [
        PGSample(
            f"g{i}",
            token_ids(rng, vocab, prompt),
            token_ids(rng, vocab, completion),
            [-3.0] * completion,
            float(i % 2),
        )
        for i in range(n)
    ]


# -- streams -------------------------------------------------------------------------------


class Streams:
    """One long greedy request per agent, restarted when it ends; every token's arrival recorded."""

    def __init__(self, engine: EmbeddedEngine, agents: list[str], prompt: list[int]):
        self.engine = engine
        self.prompt = prompt
        self.max_tokens = engine.max_model_len - len(prompt) - 1
        # agent -> (arrival time, adapter version, request number) per token
        self.arrivals: dict[str, list[tuple[float, int, int]]] = {a: [] for a in agents}
        self._tasks: list[asyncio.Task[None]] = []
        self._current: dict[str, str] = {}
        self._stopping = False

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._run(a)) for a in self.arrivals]

    async def stop(self) -> None:
        self._stopping = True
        for request_id in self._current.values():
            self.engine.abort(request_id)
        await asyncio.gather(*self._tasks)

    async def _run(self, agent: str) -> None:
        sampling = SamplingParams(max_tokens=self.max_tokens, temperature=0.0, ignore_eos=True)
        for k in itertools.count():
            if self._stopping:
                return
            request_id = self._current[agent] = f"bench-{agent}-{k}"
            stream = self.engine.add_request(
                GenerationRequest(request_id, agent, list(self.prompt), sampling)
            )
            async for chunk in stream:
                now = time.perf_counter()
                self.arrivals[agent] += [(now, t.adapter_version, k) for t in chunk.tokens]

    def gaps(self, agent: str, start: float = 0.0, end: float = float("inf")) -> list[float]:
        """Gaps between consecutive tokens of one request, for gaps ending inside [start, end]."""
        return [
            b[0] - a[0]
            for a, b in itertools.pairwise(self.arrivals[agent])
            if a[2] == b[2] and start <= b[0] <= end
        ]

    async def first(self, agent: str, version: int, after: float, timeout_s: float) -> float:
        """Arrival time of the first token of `version` (or later) that arrived after `after`."""
        deadline = time.perf_counter() + timeout_s
        while time.perf_counter() < deadline:
            for t, v, _ in self.arrivals[agent]:
                if t > after and v >= version:
                    return t
            await asyncio.sleep(0.002)
        raise TimeoutError(f"no token of {agent} v{version} within {timeout_s:g} s")


# -- publish latency -------------------------------------------------------------------------


@dataclass
class PublishLatency:
    """Per measured round (seconds).

    Attributes:
        latency_s: end of the optimizer step -> first token of the new version.
        handoff_s: the trainer's own count: start of its publish -> weights handed to the engine.
        durable_s: start of its publish -> version durable in the registry.
        engine_write_s: the engine's copy of the new weights into its spare slot (on the
            trainer's thread, while decoding goes on).
        stream_gap_s: inter-token gaps of the publisher's stream over the whole measurement.
    """

    latency_s: list[float] = field(default_factory=list)
    handoff_s: list[float] = field(default_factory=list)
    durable_s: list[float] = field(default_factory=list)
    engine_write_s: list[float] = field(default_factory=list)
    stream_gap_s: list[float] = field(default_factory=list)


@contextlib.contextmanager
def _step_end_marks(marks: list[float]) -> Iterator[None]:
    """Record when each `train_step` the trainer calls returns (after the optimizer step).

    The trainer times its publish from the start of the publish, not from the
    end of the step; wrapping the step function it calls is the least
    intrusive way to see the true start of the interval.
    """
    import clora_feedback.train.trainer as trainer_module

    original = trainer_module.train_step

    def marked(*a: Any, **kw: Any) -> list[StepResult]:
        results = original(*a, **kw)
        marks.append(time.perf_counter())
        return results

    setattr(trainer_module, "train_step", marked)  # noqa: B010 (mypy: a different callable type)
    try:
        yield
    finally:
        setattr(trainer_module, "train_step", original)  # noqa: B010


def _record_rewarded(
    feedback: FeedbackStore,
    engine: EmbeddedEngine,
    rng: random.Random,
    samples: int,
    prompt: int,
    completion: int,
) -> None:
    """Store `samples` served completions of the publisher, each with a reward."""
    version = engine.adapter_version(PUBLISHER) or 0
    for s in pg_samples(rng, engine.base_weights.config.vocab_size, samples, prompt, completion):
        cid = f"cmpl-{rng.getrandbits(64):016x}"
        n = len(s.completion_ids)
        sample = SampleRecord(
            0, "bench", s.completion_ids, s.behaviour_logprobs, [version] * n, "length"
        )
        feedback.trajectories.record(
            TrajectoryRecord(
                cid, PUBLISHER, version, "completion", {}, s.prompt_ids, [sample], time.time()
            )
        )
        event = Reward(
            event_id=f"e-{cid}", agent=PUBLISHER, completion_id=cid, source="bench", value=s.reward
        )
        feedback.apply([Incoming(event, "bench")])


async def measure_publish_latency(
    engine: EmbeddedEngine,
    feedback: FeedbackStore,
    registry: AdapterRegistry,
    *,
    rank: int,
    samples: int,
    prompt: int,
    completion: int,
    reps: int,
    seed: int,
) -> PublishLatency:
    """`reps` trainer rounds (after one warm-up round) while the publisher's stream decodes.

    The publisher must already have an active version in `registry` that the
    engine serves.
    """
    cfg = TrainerConfig(
        rank=rank,
        alpha=2.0 * rank,
        admission=AdmissionConfig(min_batch=samples, max_batch=samples),
        trigger_interval_s=1e9,
    )
    policy = DecoderPolicy.shared_with(engine)
    deployer = Deployer(engine, registry)  # not started: the hand-off alone, as in `serve`
    trainer = ContinualTrainer(
        policy, feedback, registry, cfg, deployer=deployer, agents=lambda: [PUBLISHER]
    )
    rng = random.Random(seed)
    streams = Streams(
        engine, [PUBLISHER], token_ids(rng, engine.base_weights.config.vocab_size, 16)
    )
    out = PublishLatency()
    streams.start()
    begin = time.perf_counter()
    try:
        for rep in range(reps + 1):
            _record_rewarded(feedback, engine, rng, samples, prompt, completion)
            marks: list[float] = []
            with _step_end_marks(marks):
                results = await trainer.run_round_async()
            if len(results) != 1 or len(marks) != 1:
                raise RuntimeError(f"expected one published step, got {results}")
            version = engine.adapter_version(PUBLISHER) or 0
            arrived = await streams.first(PUBLISHER, version, marks[0], timeout_s=60)
            if rep > 0:
                out.latency_s.append(arrived - marks[0])
                out.handoff_s.append(trainer.last_publish["handoff_s"])
                out.durable_s.append(trainer.last_publish["durable_s"])
                out.engine_write_s.append(engine.last_publish_s or float("nan"))
    finally:
        await streams.stop()
    out.stream_gap_s = streams.gaps(PUBLISHER, begin)
    return out


# -- interference ----------------------------------------------------------------------------


class Publisher:
    """Publishes the publisher's adapter every `interval_s` from a thread, as the trainer does.

    Each publish makes `ContinualTrainer`'s calls in its order, on a thread at
    the trainer's priority: flat parameters -> `LoRAWeights` copy, reserve a
    version, the deployer's hand-off (staged into the spare slot, served from
    the next decode step), then in `durable` mode, inside the hand-off,
    `registry.publish` of that version with its optimizer state. `mode` is
    read before every publish.
    """

    def __init__(
        self, engine: EmbeddedEngine, registry: AdapterRegistry, rank: int, interval_s: float
    ):
        self.engine, self.registry, self.interval_s = engine, registry, interval_s
        self.deployer = Deployer(engine, registry)
        self.nice = TrainerConfig().nice
        limits = engine.lora_limits
        layout = LoRALayout.build(limits, rank, 2.0 * rank, tuple(limits.target_modules))
        self.state = AgentTrainState.create(PUBLISHER, layout, init_lora(layout, seed=7))
        active = registry.active(PUBLISHER)
        self.parent = active.version if active else None
        self.mode = "off"
        self.count = 0
        self.busy = threading.Lock()  # held during a publish
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bench-publisher", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def wait_idle(self) -> None:
        """Block until a publish in progress has finished."""
        with self.busy:
            pass

    def _loop(self) -> None:
        lower_thread_priority(self.nice)  # as the trainer's own thread runs
        next_at = time.perf_counter()
        while not self._stop.is_set():
            if self.mode != "off":
                with self.busy:
                    self.publish(durable=self.mode == "durable")
            next_at = max(next_at + self.interval_s, time.perf_counter())
            self._stop.wait(max(0.0, next_at - time.perf_counter()))

    def publish(self, *, durable: bool) -> None:
        weights = self.state.layout.to_weights(self.state.params)
        version = self.registry.next_version(PUBLISHER)
        with self.deployer.handoff(AdapterRef(PUBLISHER, version, None, weights)):
            if durable:
                self.registry.publish(
                    PUBLISHER,
                    weights,
                    optimizer_state=self.state.optimizer_state(),
                    base_model=self.engine.model_name,
                    parent=self.parent,
                    step=self.count,
                    metrics={},
                    feedback_window={"bench": self.count},
                    version=version,
                )
                self.parent = version
        self.count += 1


@dataclass
class Interference:
    """Per condition: inter-token gaps of the other agents, publishes made, window time (s)."""

    gaps_s: dict[str, list[float]] = field(default_factory=dict)
    publishes: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)


async def measure_interference(
    engine: EmbeddedEngine,
    registry: AdapterRegistry,
    *,
    agents: int,
    rank: int,
    reps: int,
    window_s: float,
    interval_s: float,
    seed: int,
) -> Interference:
    """`reps` rounds of one window per `CONDITIONS` entry, order rotated each round.

    `agents` other agents stream alongside the publisher (whose own stream keeps
    its adapter resident, so every publish really writes an engine slot).
    """
    limits = engine.lora_limits
    others = [f"other-{i}" for i in range(agents)]
    for i, agent in enumerate(others):
        weights = random_lora_weights(limits, rank=rank, alpha=2.0 * rank, seed=10 + i)
        engine.set_adapter(agent, 1, weights)
    rng = random.Random(seed)
    streams = Streams(
        engine, [*others, PUBLISHER], token_ids(rng, engine.base_weights.config.vocab_size, 16)
    )
    publisher = Publisher(engine, registry, rank, interval_s)
    windows: list[tuple[str, float, float]] = []
    out = Interference()
    streams.start()
    publisher.start()
    try:
        await asyncio.sleep(window_s / 2)  # every stream past its prefill
        for rep in range(reps):
            for k in range(len(CONDITIONS)):
                mode = CONDITIONS[(rep + k) % len(CONDITIONS)]
                publisher.mode = mode
                await asyncio.to_thread(publisher.wait_idle)  # the last window's publish is done
                before = publisher.count
                start = time.perf_counter()
                await asyncio.sleep(window_s)
                end = time.perf_counter()
                windows.append((mode, start, end))
                out.publishes[mode] = out.publishes.get(mode, 0) + publisher.count - before
                out.seconds[mode] = out.seconds.get(mode, 0.0) + end - start
    finally:
        publisher.mode = "off"
        await asyncio.to_thread(publisher.stop)
        await streams.stop()
    for mode, start, end in windows:
        bucket = out.gaps_s.setdefault(mode, [])
        for agent in others:
            bucket += streams.gaps(agent, start, end)
    return out
