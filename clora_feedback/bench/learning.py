"""`clora bench learning`: held-out accuracy against wall time on tasks the repo was not tuned for.

Per task family (`learning_tasks`), one fresh service with the **default
trainer settings** (`TrainerConfig()`: learning rate, admission, trigger, and
the release path: gate and canary, all as `clora serve` ships them; nothing
tuned per task)
runs a streaming loop like a real deployment, for `--minutes`:

- `--users` simulated users send training prompts through the real gateway
  with the official `openai` client (sampling at `--temperature`), judge each
  reply against the ground truth and post their feedback events to the
  webhook as they go (one request each, as a user's tool would), then pause
  (`--think` seconds on average, exponential): a deployment's serving is not
  saturated all the time, and on a small CPU a saturated engine starves the
  trainer, whose thread runs at a lower priority by default;
- the service's own continual trainer admits samples and publishes versions
  whenever its default admission says so;
- whenever a new version serves (at most every `--eval-every` seconds), the
  fixed held-out prompts (`--held-out`, combinations never seen in training)
  are answered greedily through the gateway (no feedback is sent for them),
  and the accuracy is recorded against the wall time since the users started
  and the version that answered. The users keep going meanwhile.

For each task it prints a table (time, version, held-out accuracy, the share
of the most common answer class, the users' live accuracy since the previous
evaluation, requests and events so far), then a summary over tasks and the
machine (CPU model and flags). `--out PREFIX` writes PREFIX.json, PREFIX.md
and PREFIX.png (held-out accuracy against time, one panel per task).

Routing feedback: a right desk gets `Resolution(outcome="resolved")`; a wrong
one `Resolution(outcome="escalated")` that names the right desk in its
`correct_answer` when the schema has that field, else the escalation plus a
`Correction` carrying the desk (the record says which).

Run: `clora bench learning [--tasks api-call,routing,extract,escalation] [--minutes 10] [--seed 0]`.

`--replot RECORD.json --out PREFIX` redraws the tables and the plot from a record.

Not here: the task generators (`learning_tasks`), tables and plot (`learning_report`),
the service (`clora_feedback.service`).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import logging
import random
import re
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel, ValidationError

from clora_feedback.bench.learning_report import (
    EvalPoint,
    TaskRun,
    code_version,
    cpu_facts,
    replot,
    write,
)
from clora_feedback.bench.learning_tasks import (
    ESCALATION,
    FAMILIES,
    Family,
    Prompt,
    Split,
    desk_of,
    fields_of,
    fields_right,
    first_line,
)
from clora_feedback.bench.report import machine_facts
from clora_feedback.config import ReleaseConfig, Settings, TrainerConfig
from clora_feedback.demo.experiment import ExperimentConfig, service_settings
from clora_feedback.demo.server import LocalServer
from clora_feedback.demo.workloads import Episode, Sampling
from clora_feedback.heap import release_freed_memory
from clora_feedback.lifecycle import cancel_and_wait
from clora_feedback.schemas.feedback import Correction, Event, Resolution, Reward

if TYPE_CHECKING:
    from openai import AsyncOpenAI

log = logging.getLogger(__name__)

AGENT = "learner"
"""The agent name of every task (each task runs on its own fresh service)."""


def resolutions_carry_answer() -> bool:
    """Whether `Resolution` has the `correct_answer` field (else routing adds a `Correction`)."""
    return "correct_answer" in Resolution.model_fields


# -- one family as a workload ----------------------------------------------------------------


class FamilyWorkload:
    """A `learning_tasks.Family` behind the demo's `Workload` protocol, with its simulated user."""

    def __init__(self, family: Family):
        self.family = family
        self.name = family.name
        self.feedback_kind = "resolution" if family.name == "routing" else "correction"

    def tasks(self, seed: int, split: Split, count: int) -> list[Prompt]:
        return self.family.prompts(seed, split, count)

    async def run_episode(
        self, client: AsyncOpenAI, agent: str, task: Prompt, sampling: Sampling
    ) -> Episode:
        """One chat completion (stopped at the end of its first line), judged."""
        reply = await client.chat.completions.create(
            model=agent,
            messages=task.messages(),  # type: ignore[arg-type]
            max_tokens=self.family.max_tokens,
            stop=["\n"],
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            seed=sampling.seed,
        )
        extra = reply.model_extra or {}
        text = reply.choices[0].message.content or ""
        return Episode(
            task.id,
            completion_ids=[reply.id],
            reward=1.0 if self.family.correct(task, text) else 0.0,
            answer=text,
            versions=[int(extra.get("clora", {}).get("adapter_version", 0))],
        )

    def feedback(self, agent: str, task: Prompt, episode: Episode, *, event_id: str) -> list[Event]:
        """The simulated user's events about one episode (see the module docstring)."""
        target = {"agent": agent, "completion_id": episode.completion_ids[-1]}
        right = episode.reward > 0
        fix = Correction(
            event_id=f"{event_id}-fix", source="simulated-developer",
            corrected_content=task.answer, **target,
        )  # fmt: skip
        name = self.family.name
        if name == "api-call":
            if right:
                return [Correction(event_id=event_id, source="simulated-developer", **target)]
            return [fix.model_copy(update={"event_id": event_id})]
        if name == "routing":
            return _routing_events(task, right, event_id, target, fix)
        value = fields_right(task.answer, episode.answer) if name == "extract" else float(right)
        reward = Reward(
            event_id=event_id, source=f"simulated-{name}-checker", value=value,
            name="fields_right" if name == "extract" else "policy_followed",
            completion_ids=[target["completion_id"]], agent=agent,
        )  # fmt: skip
        return [reward] if right else [reward, fix]


def _routing_events(
    task: Prompt, right: bool, event_id: str, target: dict[str, Any], fix: Correction
) -> list[Event]:
    common = {"event_id": event_id, "source": "simulated-operator", **target}
    if right:
        note = f"handled by {task.answer}"
        return [Resolution(outcome="resolved", resolution_text=note, **common)]
    if resolutions_carry_answer():  # the field the learning issue adds
        carried = {**common, "outcome": "escalated", "correct_answer": task.answer}
        return [Resolution.model_validate(carried)]
    note = f"rerouted to {task.answer}"
    return [Resolution(outcome="escalated", resolution_text=note, **common), fix]


def answer_class(family: Family, reply: str | None) -> str:
    """What a reply chose, to see a collapse onto one answer: the desk (`routing`), escalate or
    answer (`escalation`), the service called (`api-call`), the city written (`extract`)."""
    line = first_line(reply)
    if family.name == "routing":
        return desk_of(reply) or "other"
    if family.name == "escalation":
        return (
            "escalate"
            if line == ESCALATION
            else ("answer" if line.startswith("Added") else "other")
        )
    if family.name == "api-call":
        match = re.match(r'client\.call\("([^"]*)"', line)
        return match.group(1) if match else "other"
    return fields_of(line).get("city") or "other"


@dataclass
class _Live:
    """What the users have done so far (shared by the users and the monitor)."""

    requests: int = 0
    events: int = 0
    rejected: int = 0
    errors: int = 0
    outcomes: list[bool] = field(default_factory=list)


# -- the loop --------------------------------------------------------------------------------


@dataclass(frozen=True)
class LearningConfig:
    """Attributes: see `build_parser` (one option each)."""

    tasks: tuple[str, ...] = tuple(FAMILIES)
    minutes: float = 10.0
    seed: int = 0
    users: int = 4
    think_s: float = 2.0
    temperature: float = 0.8
    held_out: int = 32
    eval_every_s: float = 30.0
    train_pool: int = 512
    max_model_len: int = 1024
    num_threads: int | None = None
    trainer: tuple[str, ...] = ()  # KEY=VALUE overrides of `TrainerConfig` (ablations)
    release: tuple[str, ...] = ()  # KEY=VALUE overrides of `ReleaseConfig` (ablations)


M = TypeVar("M", bound=BaseModel)


def overridden(model: type[M], overrides: Sequence[str], flag: str) -> M:
    """`model()` with `KEY=VALUE` overrides (dotted keys for nested settings, JSON values,
    else strings): the defaults unless an ablation says otherwise.

    Raises:
        ValueError: a malformed override, an unknown key or a value the model refuses.
    """
    data = model().model_dump()
    for item in overrides:
        key, sep, raw = item.partition("=")
        *path, leaf = key.strip().split(".")
        node: dict[str, Any] = data
        for part in path:
            child = node.get(part)
            if not isinstance(child, dict):
                raise ValueError(f"{flag} {item!r}: no setting group {part!r}")
            node = child
        if not sep or leaf not in node or isinstance(node[leaf], dict):
            raise ValueError(f"{flag} {item!r}: expected KEY=VALUE with a setting of that group")
        try:
            node[leaf] = json.loads(raw)
        except json.JSONDecodeError:
            node[leaf] = raw
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ValueError(f"{flag}: {exc.errors()[0]['loc']}: {exc.errors()[0]['msg']}") from exc


def trainer_config(overrides: Sequence[str]) -> TrainerConfig:
    """`TrainerConfig()` with `--trainer KEY=VALUE` overrides (see `overridden`)."""
    return overridden(TrainerConfig, overrides, "--trainer")


def release_config(overrides: Sequence[str]) -> ReleaseConfig:
    """`ReleaseConfig()` with `--release KEY=VALUE` overrides (see `overridden`)."""
    return overridden(ReleaseConfig, overrides, "--release")


def learning_settings(model_dir: Path, data_dir: Path, cfg: LearningConfig) -> Settings:
    """The experiments' service (embedded engine, webhook feedback, no broker) with every
    trainer setting at its default: what a new user gets from `clora serve`."""
    engine = ExperimentConfig(
        max_num_seqs=max(8, 2 * cfg.users), max_model_len=cfg.max_model_len,
        num_threads=cfg.num_threads,
    )  # fmt: skip
    settings = service_settings(model_dir, data_dir, engine, [AGENT])
    settings.trainer = trainer_config(cfg.trainer)
    settings.release = release_config(cfg.release)  # experiments turn it off; users have it on
    return settings


async def evaluate_held_out(
    client: AsyncOpenAI, workload: FamilyWorkload, prompts: list[Prompt]
) -> tuple[list[Episode], float]:
    """Greedy episodes of every held-out prompt (8 at a time) and the wall seconds taken."""
    gate = asyncio.Semaphore(8)
    t0 = time.perf_counter()

    async def one(prompt: Prompt) -> Episode:
        async with gate:
            return await workload.run_episode(client, AGENT, prompt, Sampling(temperature=0.0))

    episodes = await asyncio.gather(*(one(p) for p in prompts))
    return list(episodes), time.perf_counter() - t0


async def _user(
    client: AsyncOpenAI,
    sender: Any,
    workload: FamilyWorkload,
    pool: list[Prompt],
    rng: random.Random,
    cfg: LearningConfig,
    live: _Live,
) -> None:
    """One simulated user: request, judge, send the feedback, again (until cancelled)."""
    while True:
        prompt = rng.choice(pool)
        try:
            sampling = Sampling(cfg.temperature, 1.0, rng.randrange(2**31))
            episode = await workload.run_episode(client, AGENT, prompt, sampling)
            events = workload.feedback(AGENT, prompt, episode, event_id=uuid.uuid4().hex)
            receipt = await sender.send(events)
        except asyncio.CancelledError:
            raise
        except Exception:  # a refused request or a failed send: count it, go on
            live.errors += 1
            log.debug("simulated user failed", exc_info=True)
            await asyncio.sleep(1.0)
            continue
        live.requests += 1  # counted with its feedback, so events >= requests at any time
        live.events += len(events)
        live.rejected += len(receipt.rejected)
        live.outcomes.append(episode.reward > 0)
        if cfg.think_s > 0:  # reading the reply: exponential, so arrivals are not in lockstep
            await asyncio.sleep(rng.expovariate(1.0 / cfg.think_s))


def _served_version(server: LocalServer) -> int:
    return int(server.service.engine.stats().adapters.get(AGENT, 0))


async def _evaluation(
    client: AsyncOpenAI,
    workload: FamilyWorkload,
    held_out: list[Prompt],
    server: LocalServer,
    live: _Live,
    t_s: float,
    seen: int,
) -> EvalPoint:
    version = _served_version(server)
    episodes, eval_s = await evaluate_held_out(client, workload, held_out)
    classes = collections.Counter(answer_class(workload.family, e.answer) for e in episodes)
    top, count = classes.most_common(1)[0]
    answered = [v for e in episodes for v in e.versions]
    recent = live.outcomes[seen:]
    return EvalPoint(
        t_s=round(t_s, 1),
        version=version,
        versions=(min(answered), max(answered)),
        accuracy=sum(e.reward for e in episodes) / len(episodes),
        top_class=(top, count / len(episodes)),
        classes=dict(classes),
        live_accuracy=sum(recent) / len(recent) if recent else None,
        requests=live.requests,
        events=live.events,
        eval_s=round(eval_s, 2),
        wrong=[(p.text, e.answer or "") for p, e in zip(held_out, episodes, strict=True)
               if not e.reward][:3],
    )  # fmt: skip


async def stream(server: LocalServer, family: Family, cfg: LearningConfig, run: TaskRun) -> None:
    """The streaming loop of one task against a started service (fills `run`)."""
    from openai import AsyncOpenAI

    from clora_feedback.client import AsyncFeedbackClient

    workload = FamilyWorkload(family)
    pool = workload.tasks(cfg.seed, "train", cfg.train_pool)
    held_out = workload.tasks(cfg.seed, "eval", cfg.held_out)
    client = AsyncOpenAI(base_url=server.base_url, api_key="bench", max_retries=3, timeout=600)
    sender = AsyncFeedbackClient(server.url, source="simulated-users")
    live = _Live()
    users: list[asyncio.Task[None]] = []
    try:
        run.evals.append(await _evaluation(client, workload, held_out, server, live, 0.0, 0))
        _print_point(family.name, run.evals[-1])
        started = time.monotonic()
        for user in range(cfg.users):
            rng = random.Random(f"learning/{cfg.seed}/{family.name}/user-{user}")
            users.append(asyncio.create_task(_user(client, sender, workload, pool, rng, cfg, live)))
        deadline = started + 60 * cfg.minutes
        last_eval, seen = started, 0
        while time.monotonic() < deadline:
            await asyncio.sleep(0.5)
            fresh = _served_version(server) != run.evals[-1].version
            if fresh and time.monotonic() - last_eval >= cfg.eval_every_s:
                t_s = time.monotonic() - started
                point = await _evaluation(client, workload, held_out, server, live, t_s, seen)
                run.evals.append(point)
                _print_point(family.name, point)
                last_eval, seen = time.monotonic(), len(live.outcomes)
        await cancel_and_wait(users)
        users.clear()
        run.wall_s = time.monotonic() - started
        if _served_version(server) != run.evals[-1].version or len(run.evals) == 1:
            point = await _evaluation(client, workload, held_out, server, live, run.wall_s, seen)
            run.evals.append(point)
            _print_point(family.name, point)
    finally:
        await cancel_and_wait(users)
        await sender.aclose()
        await client.close()
    run.requests, run.events, run.rejected, run.errors = (
        live.requests, live.events, live.rejected, live.errors,
    )  # fmt: skip


def _print_point(task: str, p: EvalPoint) -> None:
    live = "-" if p.live_accuracy is None else f"{p.live_accuracy:.2f}"
    print(
        f"{task:<10} t {p.t_s:6.0f} s  v{p.version:<3} held-out {p.accuracy:.3f}  "
        f"top {p.top_class[0]} {p.top_class[1]:.2f}  live {live}  "
        f"requests {p.requests}  events {p.events}  (eval {p.eval_s:.0f} s)",
        flush=True,
    )


def _version_rows(registry: Any) -> list[dict[str, Any]]:
    from clora_feedback.errors import NotFoundError

    try:
        versions = registry.versions(AGENT)
    except NotFoundError:  # nothing was ever published
        return []
    rows = []
    for v in sorted(versions, key=lambda v: v.version):
        window = dict(v.feedback_window or {})
        rows.append(
            {
                "version": v.version, "parent": v.parent, "status": v.status, "step": v.step,
                "created_at": v.created_at, "metrics": dict(v.metrics),
                "samples": window.get("samples"), "rolled_back_reason": v.rolled_back_reason,
            }
        )  # fmt: skip
    return rows


def run_task(model_dir: Path, work_dir: Path, family: Family, cfg: LearningConfig) -> TaskRun:
    """One family on a fresh service (fresh stores and adapters under `work_dir`)."""
    from clora_feedback.service import build_service

    mode = {"api-call": "correction", "routing": "resolution+correction"}.get(
        family.name, "reward+correction"
    )
    if family.name == "routing" and resolutions_carry_answer():
        mode = "resolution.correct_answer"
    run = TaskRun(
        task=family.name,
        signals=family.signals,
        feedback_mode=mode,
        train_pairs=len(set(p.pair for p in family.prompts(cfg.seed, "train", cfg.train_pool))),
        held_out_pairs=len(set(p.pair for p in family.prompts(cfg.seed, "eval", cfg.held_out))),
        held_out=cfg.held_out,
    )
    release_freed_memory()  # else each step's activations stay resident: GBs per task
    t0 = time.monotonic()
    service = build_service(learning_settings(model_dir, work_dir, cfg))
    with LocalServer(service) as server:
        run.cold_start_s = time.monotonic() - t0
        asyncio.run(stream(server, family, cfg, run))
        run.versions = _version_rows(service.registry)
    return run


# -- entry point -----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    d = LearningConfig()
    p = argparse.ArgumentParser(
        prog="clora bench learning",
        description="Held-out accuracy against wall time and versions on task families the "
        "repo was not tuned for, with the default trainer settings.",
    )
    p.add_argument("--tasks", default=",".join(d.tasks), help=f"Comma list of {', '.join(FAMILIES)}.")  # fmt: skip
    p.add_argument("--minutes", type=float, default=d.minutes, help="Streaming time per task.")
    p.add_argument("--seed", type=int, default=d.seed, help="Prompts and the users' choices.")
    p.add_argument("--users", type=int, default=d.users, help="Concurrent simulated users.")
    p.add_argument("--think", type=float, default=d.think_s, help="Mean seconds a user waits between requests (exponential).")  # fmt: skip
    p.add_argument("--temperature", type=float, default=d.temperature, help="The users' sampling temperature.")  # fmt: skip
    p.add_argument("--held-out", type=int, default=d.held_out, help="Held-out prompts per task.")
    p.add_argument("--eval-every", type=float, default=d.eval_every_s, help="Least seconds between evaluations (each needs a new version).")  # fmt: skip
    p.add_argument("--max-model-len", type=int, default=d.max_model_len, help="Engine context.")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores).")  # fmt: skip
    p.add_argument("--model", default=None, help="Base model (default: the embedded default).")
    p.add_argument("--work", type=Path, default=None, help="Stores and adapters (default: a temporary directory).")  # fmt: skip
    p.add_argument("--replot", type=Path, default=None, help="Redraw OUT.* from this JSON record; run nothing.")  # fmt: skip
    p.add_argument("--trainer", action="append", default=[], metavar="KEY=VALUE", help="Override one trainer setting (repeatable; dotted keys, e.g. admission.min_batch=8): ablations, recorded with the results; the default is every default.")  # fmt: skip
    p.add_argument("--release", action="append", default=[], metavar="KEY=VALUE", help="Override one release setting (repeatable; dotted keys, e.g. enabled=false or gate.max_cases=48), recorded with the results.")  # fmt: skip
    p.add_argument("--out", type=Path, default=Path("var/bench/learning"), help="Writes OUT.json, OUT.md, OUT.png.")  # fmt: skip
    return p


def run(argv: Sequence[str]) -> int:
    """`clora bench learning [options]`; returns the exit status."""
    args = build_parser().parse_args(list(argv))
    if args.replot is not None:
        replot(args.replot, args.out)
        return 0
    tasks = tuple(t.strip() for t in args.tasks.split(",") if t.strip())
    unknown = [t for t in tasks if t not in FAMILIES]
    if unknown or not tasks:
        print(f"unknown tasks {unknown}; choose from {', '.join(FAMILIES)}")
        return 2
    from clora_feedback.config import DEFAULT_MODEL
    from clora_feedback.model.resolve import resolve_model_dir

    for name in ("httpx", "httpx2", "openai", "uvicorn.access"):  # a line per request otherwise
        logging.getLogger(name).setLevel(max(logging.WARNING, logging.getLogger().level))
    cfg = LearningConfig(
        tasks=tasks, minutes=args.minutes, seed=args.seed, users=args.users, think_s=args.think,
        temperature=args.temperature, held_out=args.held_out, eval_every_s=args.eval_every,
        max_model_len=args.max_model_len, num_threads=args.threads, trainer=tuple(args.trainer),
        release=tuple(args.release),
    )  # fmt: skip
    try:
        trainer = trainer_config(cfg.trainer)
        release_config(cfg.release)
    except ValueError as exc:
        print(exc)
        return 2
    model_dir = resolve_model_dir(args.model or DEFAULT_MODEL, Settings().model_cache_dir)
    work = args.work or Path(tempfile.mkdtemp(prefix="clora-bench-learning-"))
    load_before = machine_facts()["load average (1, 5, 15 min)"]
    code = code_version()  # at the start: the checkout may move while the tasks run
    runs = []
    for name in tasks:
        print(f"== {name}: {FAMILIES[name].signals}; {cfg.minutes:g} min", flush=True)
        runs.append(run_task(model_dir, work / name, FAMILIES[name], cfg))
    facts = cpu_facts()
    facts["load average at start"] = load_before
    facts["model"] = str(args.model or DEFAULT_MODEL)
    facts["code at start"] = code
    facts["trainer overrides"] = ", ".join(cfg.trainer) or "none (every default)"
    facts["release overrides"] = ", ".join(cfg.release) or "none (every default)"
    facts["trainer"] = (
        f"lr {trainer.lr:g}, warm-up {trainer.warmup_steps} steps, "
        f"admission {trainer.admission.min_batch}-{trainer.admission.max_batch} samples, "
        f"trigger {trainer.trigger_interval_s:g} s"
    )
    release = release_config(cfg.release)
    facts["release"] = (
        f"gate min {release.gate.min_cases} cases (holdout {release.gate.holdout_fraction:g}), "
        f"canary {release.canary.share:.0%} until {release.canary.min_feedback} rewards"
    )
    write(args.out, asdict(cfg), runs, facts)
    return 0


if __name__ == "__main__":
    raise SystemExit(run(sys.argv[1:]))
