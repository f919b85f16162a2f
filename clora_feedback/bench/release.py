"""`clora bench release`: the release path end to end over HTTP, with a good and two bad candidates.

One fresh service with every default (the release path on), one agent on a
learning-bench task family (`routing` by default), simulated users sending
requests and feedback through the real gateway, as `clora bench learning` does.
Four phases:

1. **learn** (`--minutes`): the trainer's candidates go through the gate and the
   canary; recorded: the time from the first feedback to the first promoted
   version serving 100%, every version's release state, and the held-out
   accuracy of what serves at each new serving version (the best so far and
   the largest drop below it).
2. **collapsed candidate**: a candidate whose answers collapse (a random adapter
   of large norm, published as the trainer would, on top of serving) is released
   by the operator route (`POST /v1/adapters/{agent}/gate`); expected `failed`,
   and no request is ever served by it (exposure 0).
3. **worse live**: a copy of the serving weights (it passes offline: the same
   answers) is released the same way; it canaries, and the simulated users judge
   every reply the canary served as wrong. Expected `aborted`; the requests it
   served are counted against the requests of its agent meanwhile (bounded by
   `canary.share` until the sequential test fires).

4. **gate cost**: a second agent (`OTHER`, declared beside the learning one and
   serving a near-zero adapter) gets a steady closed-loop stream (`--other-clients`
   clients, each one greedy chat completion of `--other-max-tokens` at a time), measured
   in alternating windows of `--gate-window` seconds, `--gate-pairs` times: without a
   gate, then while the operator route gates a collapsed candidate of the learning
   agent back to back (a full evaluation each: serving's cached answers are dropped
   first, as for the first candidate after a promotion). Recorded: the other agent's
   requests and tokens per second in each window, the ratio of tokens/s with a gate to
   without (alternation cancels a shared box's drift), and each evaluation's wall and
   CPU seconds (process CPU while it ran, an upper bound: serving runs meanwhile).

The agent is pinned for phases 2 to 4 (its trainer publishes nothing newer that
would take the bad candidate's turn), once any running canary has ended, except
while phase 3's candidate waits for and runs its canary (a pin stops the release
path: pinned, a version that passed the operator's gate waits as `passed`); its
simulated users keep sending throughout.

It prints a table and writes `release.json` under `--out`. A program, not a test:
its figures go to `docs/benchmarks.md`.

Not here: the release path (`clora_feedback.release`), the tasks (`learning_tasks`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from clora_feedback.bench.learning import (
    AGENT,
    FamilyWorkload,
    LearningConfig,
    evaluate_held_out,
    learning_settings,
)
from clora_feedback.bench.learning_tasks import FAMILIES
from clora_feedback.demo.server import LocalServer
from clora_feedback.demo.workloads import Sampling
from clora_feedback.lifecycle import cancel_and_wait
from clora_feedback.lora.weights import random_lora_weights
from clora_feedback.schemas.feedback import Resolution

log = logging.getLogger(__name__)

OTHER = "bystander"
"""The agent whose serving throughput phase 4 measures while the learning agent is gated."""


@dataclass
class Live:
    """Requests so far, by the version that served them (shared by the users)."""

    by_version: dict[int, int] = field(default_factory=dict)
    first_feedback_at: float | None = None
    bad_version: int | None = None  # replies served by it are judged wrong (phase 3)
    errors: int = 0

    def total(self) -> int:
        return sum(self.by_version.values())


@dataclass
class ReleaseRun:
    """What one run measured (written to `release.json`)."""

    task: str
    minutes: float
    first_promotion_s: float | None = None
    promotions: list[dict[str, Any]] = field(default_factory=list)
    states: dict[str, int] = field(default_factory=dict)
    held_out: list[dict[str, Any]] = field(default_factory=list)
    worst_drop_below_best: float = 0.0
    collapsed: dict[str, Any] = field(default_factory=dict)
    worse_live: dict[str, Any] = field(default_factory=dict)
    gate_cpu_s: float | None = None  # phases 1-3
    gate_cost: dict[str, Any] = field(default_factory=dict)


async def _user(client: Any, sender: Any, workload: FamilyWorkload, pool: list[Any],
                rng: random.Random, think_s: float, live: Live) -> None:  # fmt: skip
    """One simulated user: request, judge (replies of `live.bad_version` as wrong), send."""
    while True:
        prompt = rng.choice(pool)
        try:
            sampling = Sampling(0.8, 1.0, rng.randrange(2**31))
            episode = await workload.run_episode(client, AGENT, prompt, sampling)
            version = episode.versions[0] if episode.versions else 0
            if live.bad_version is not None and version == live.bad_version:
                events: list[Any] = [Resolution(
                    event_id=uuid.uuid4().hex, source="simulated-operator", agent=AGENT,
                    completion_id=episode.completion_ids[-1], outcome="reopened",
                )]  # fmt: skip
            else:
                events = workload.feedback(AGENT, prompt, episode, event_id=uuid.uuid4().hex)
            await sender.send(events)
        except asyncio.CancelledError:
            raise
        except Exception:
            live.errors += 1
            await asyncio.sleep(1.0)
            continue
        live.by_version[version] = live.by_version.get(version, 0) + 1
        if live.first_feedback_at is None:
            live.first_feedback_at = time.monotonic()
        if think_s > 0:
            await asyncio.sleep(rng.expovariate(1.0 / think_s))


async def _versions(admin: httpx.AsyncClient) -> list[dict[str, Any]]:
    response = await admin.get(f"/v1/adapters/{AGENT}/versions")
    return list(response.json().get("data", [])) if response.status_code == 200 else []


def _state(v: dict[str, Any]) -> str:
    return str((v.get("release") or {}).get("state") or "-")


async def _learn(server: LocalServer, admin: httpx.AsyncClient, workload: FamilyWorkload,
                 held_out: list[Any], client: Any, minutes: float, live: Live,
                 run: ReleaseRun) -> None:  # fmt: skip
    """Phase 1: promotions and the held-out accuracy of what serves."""
    started, serving, best = time.monotonic(), -1, None
    while time.monotonic() - started < 60 * minutes:
        await asyncio.sleep(2.0)
        versions = await _versions(admin)
        active = next((v["version"] for v in versions if v["status"] == "active"), 0)
        if active == serving:
            continue
        serving = active
        if active and run.first_promotion_s is None and live.first_feedback_at is not None:
            run.first_promotion_s = round(time.monotonic() - live.first_feedback_at, 1)
        episodes, _ = await evaluate_held_out(client, workload, held_out)
        accuracy = sum(e.reward for e in episodes) / len(episodes)
        best = accuracy if best is None else max(best, accuracy)
        run.worst_drop_below_best = max(run.worst_drop_below_best, best - accuracy)
        point = {"t_s": round(time.monotonic() - started, 1), "version": active,
                 "accuracy": round(accuracy, 3)}  # fmt: skip
        run.held_out.append(point)
        print(f"learn  t {point['t_s']:6.0f} s  serving v{active:<3} held-out {accuracy:.3f}",
              flush=True)  # fmt: skip
    versions = await _versions(admin)
    for v in versions:
        run.states[_state(v)] = run.states.get(_state(v), 0) + 1
        if _state(v) == "promoted":
            run.promotions.append({"version": v["version"], "reason": _reason(v)})


def _reason(v: dict[str, Any]) -> str:
    evidence = (v.get("release") or {}).get("evidence") or {}
    for stage in ("operator", "canary", "gate"):
        if (evidence.get(stage) or {}).get("reason"):
            return str(evidence[stage]["reason"])
    return ""


def _publish_candidate(server: LocalServer, collapsed: bool) -> int:
    """A candidate on top of serving, as the trainer writes one (no release record: only
    the operator's gate releases it). The agent is pinned meanwhile (the trainer publishes
    nothing newer that would take its turn); the publish itself unpins for an instant."""
    registry = server.service.registry
    active = registry.active(AGENT)
    if collapsed or active is None:
        limits = server.service.engine.lora_limits
        weights = random_lora_weights(limits, rank=8, seed=7, std=1.0 if collapsed else 1e-6)
    else:
        weights, _ = registry.load(AGENT, active.version, limits=server.service.engine.lora_limits)
    if any(a.agent == AGENT for a in registry.agents()):  # else nothing published yet
        registry.unpin(AGENT)
    try:
        info = registry.publish(AGENT, weights, optimizer_state=None, base_model="bench",
                                parent=None if active is None else active.version, step=0,
                                metrics={}, feedback_window={"source": "clora bench release"},
                                activate=False)  # fmt: skip
    finally:
        registry.pin(AGENT)
    return int(info.version)


async def _quiet(admin: httpx.AsyncClient, timeout_s: float) -> None:
    """Pin the agent (its trainer stops publishing) and wait for a running canary to end."""
    await admin.post(f"/v1/adapters/{AGENT}/pin")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(_state(v) in ("canary", "passed") for v in await _versions(admin)):
            return
        await asyncio.sleep(1.0)


async def _release(admin: httpx.AsyncClient, server: LocalServer, live: Live, *, collapsed: bool,
                   timeout_s: float) -> dict[str, Any]:  # fmt: skip
    """Phases 2 and 3: publish a bad candidate, release it by the operator route, wait.

    A pin stops the release path, so a candidate that passes the operator's gate waits
    as `passed`; the agent is unpinned then (what an operator does to canary it) and
    pinned again once it is decided."""
    await _quiet(admin, timeout_s)
    version = await asyncio.to_thread(_publish_candidate, server, collapsed)
    if not collapsed:
        live.bad_version = version
    before, served_before = live.total(), live.by_version.get(version, 0)
    t0 = time.monotonic()
    response = await admin.post(f"/v1/adapters/{AGENT}/gate", json={"version": version},
                                timeout=300)  # fmt: skip
    gate = response.json()
    state = str(gate.get("state", "error"))
    if state == "passed":  # pinned, it waits as `passed`: unpinned, the loop canaries it
        await admin.post(f"/v1/adapters/{AGENT}/unpin")
    while state in ("passed", "canary") and time.monotonic() - t0 < timeout_s:
        await asyncio.sleep(1.0)
        record = next((v for v in await _versions(admin) if v["version"] == version), {})
        state = _state(record)
    await admin.post(f"/v1/adapters/{AGENT}/pin")
    served = live.by_version.get(version, 0) - served_before
    total = live.total() - before
    result = {
        "version": version, "state": state, "seconds": round(time.monotonic() - t0, 1),
        "gate": gate.get("reason"), "served_by_it": served, "requests_meanwhile": total,
        "exposure": round(served / total, 3) if total else 0.0,
    }  # fmt: skip
    live.bad_version = None
    print(f"{'collapsed' if collapsed else 'worse live'}: v{version} {state} after "
          f"{result['seconds']} s; served {served} of {total} requests", flush=True)  # fmt: skip
    return result


@dataclass
class Stream:
    """The other agent's completed requests: (finish time, generated tokens) each."""

    done: list[tuple[float, int]] = field(default_factory=list)
    errors: int = 0

    def window(self, t0: float, t1: float) -> tuple[int, int]:
        """Requests and tokens that finished in [t0, t1)."""
        tokens = [n for t, n in self.done if t0 <= t < t1]
        return len(tokens), sum(tokens)


async def _other_client(client: Any, stream: Stream, index: int, max_tokens: int) -> None:
    """One closed-loop client of `OTHER`: a greedy chat completion, again (until cancelled)."""
    messages = [{"role": "user", "content": f"Tell a long story about lighthouse {index}."}]
    while True:
        try:
            reply = await client.chat.completions.create(
                model=OTHER, messages=messages, max_tokens=max_tokens, temperature=0.0
            )
        except asyncio.CancelledError:
            raise
        except Exception:
            stream.errors += 1
            await asyncio.sleep(1.0)
            continue
        stream.done.append((time.monotonic(), reply.usage.completion_tokens if reply.usage else 0))


def _publish_other(server: LocalServer) -> int:
    """Serve `OTHER` from an adapter of near-zero weights (the adapter path, the base
    model's answers); returns its version."""
    limits = server.service.engine.lora_limits
    weights = random_lora_weights(limits, rank=8, seed=11, std=1e-6)
    info = server.service.registry.publish(
        OTHER, weights, optimizer_state=None, base_model="bench", parent=None, step=0,
        metrics={}, feedback_window={"source": "clora bench release"}, activate=True,
    )  # fmt: skip
    return int(info.version)


async def _gate_once(admin: httpx.AsyncClient, server: LocalServer, version: int) -> dict[str, Any]:
    """One full evaluation of `version` by the operator route: its verdict, wall and CPU s."""
    release = server.service.release
    if release is not None and release.gate is not None:
        release.gate.forget(AGENT)  # serving answers too, as after a promotion
    response = await admin.post(f"/v1/adapters/{AGENT}/gate", json={"version": version},
                                timeout=300)  # fmt: skip
    body = response.json()
    evidence = body.get("evidence") or {}
    if "seconds" not in evidence:  # decided without the engine (e.g. too few cases)
        await asyncio.sleep(0.5)
    return {"state": str(body.get("state", "error")), "seconds": evidence.get("seconds"),
            "cpu_seconds": evidence.get("cpu_seconds")}  # fmt: skip


async def _gate_cost(admin: httpx.AsyncClient, server: LocalServer, client: Any,
                     args: argparse.Namespace) -> dict[str, Any]:  # fmt: skip
    """Phase 4: `OTHER`'s throughput in windows without and with a gate running."""
    await _quiet(admin, args.canary_timeout)
    other = await asyncio.to_thread(_publish_other, server)
    deadline = time.monotonic() + 60
    while server.service.engine.stats().adapters.get(OTHER) != other:
        if time.monotonic() > deadline:
            break
        await asyncio.sleep(0.5)
    version = await asyncio.to_thread(_publish_candidate, server, True)
    stream = Stream()
    clients = [
        asyncio.create_task(_other_client(client, stream, i, args.other_max_tokens))
        for i in range(args.other_clients)
    ]
    windows: list[dict[str, Any]] = []
    evaluations: list[dict[str, Any]] = []
    try:
        await asyncio.sleep(args.gate_window)  # warm-up: every client in flight
        for _ in range(args.gate_pairs):
            for gating in (False, True):
                t0 = time.monotonic()
                while gating and time.monotonic() - t0 < args.gate_window:
                    evaluations.append(await _gate_once(admin, server, version))
                if not gating:
                    await asyncio.sleep(args.gate_window)
                t1 = time.monotonic()
                requests, tokens = stream.window(t0, t1)
                windows.append({"gate": gating, "seconds": round(t1 - t0, 2),
                                "requests": requests, "tokens": tokens})  # fmt: skip
    finally:
        await cancel_and_wait(clients)
    return _gate_cost_summary(windows, evaluations, stream.errors, version)


def _gate_cost_summary(windows: list[dict[str, Any]], evaluations: list[dict[str, Any]],
                       errors: int, version: int) -> dict[str, Any]:  # fmt: skip
    """Pooled rates of the windows with and without a gate, and per-evaluation costs."""

    def rate(gating: bool, key: str) -> float:
        chosen = [w for w in windows if w["gate"] == gating]
        seconds = sum(w["seconds"] for w in chosen)
        return sum(w[key] for w in chosen) / seconds if seconds else 0.0

    without, with_gate = rate(False, "tokens"), rate(True, "tokens")
    evaluated = [e for e in evaluations if e["seconds"] is not None]
    states: dict[str, int] = {}
    for e in evaluations:
        states[e["state"]] = states.get(e["state"], 0) + 1

    def mean(key: str) -> float | None:
        return round(sum(e[key] for e in evaluated) / len(evaluated), 2) if evaluated else None

    result = {
        "candidate": version, "pairs": len(windows) // 2, "windows": windows,
        "tokens_per_s_without": round(without, 2), "tokens_per_s_with": round(with_gate, 2),
        "requests_per_s_without": round(rate(False, "requests"), 3),
        "requests_per_s_with": round(rate(True, "requests"), 3),
        "ratio": round(with_gate / without, 3) if without else None,
        "evaluations": len(evaluations), "states": states,
        "gate_wall_s": mean("seconds"), "gate_cpu_s": mean("cpu_seconds"), "errors": errors,
    }  # fmt: skip
    print(f"gate cost: {OTHER} {without:.1f} tokens/s without a gate, {with_gate:.1f} with "
          f"(ratio {result['ratio']}, {result['pairs']} pairs); {len(evaluations)} evaluations "
          f"{states}, {result['gate_wall_s']} s and {result['gate_cpu_s']} CPU s each",
          flush=True)  # fmt: skip
    return result


async def _run(server: LocalServer, args: argparse.Namespace, run: ReleaseRun) -> None:
    from openai import AsyncOpenAI

    from clora_feedback.client import AsyncFeedbackClient

    workload = FamilyWorkload(FAMILIES[args.task])
    pool = workload.tasks(args.seed, "train", 512)
    held_out = workload.tasks(args.seed, "eval", args.held_out)
    client = AsyncOpenAI(base_url=server.base_url, api_key="bench", max_retries=3, timeout=600)
    sender = AsyncFeedbackClient(server.url, source="simulated-users")
    admin = httpx.AsyncClient(base_url=server.url, timeout=60)
    live = Live()
    users = [
        asyncio.create_task(_user(client, sender, workload, pool,
                                  random.Random(f"release/{args.seed}/{i}"), args.think, live))
        for i in range(args.users)
    ]  # fmt: skip
    try:
        await _learn(server, admin, workload, held_out, client, args.minutes, live, run)
        run.collapsed = await _release(admin, server, live, collapsed=True,
                                       timeout_s=args.canary_timeout)  # fmt: skip
        run.worse_live = await _release(admin, server, live, collapsed=False,
                                        timeout_s=args.canary_timeout)  # fmt: skip
        metrics = (await admin.get("/metrics")).text
        for line in metrics.splitlines():
            if line.startswith("clora_release_gate_cpu_seconds_total"):
                run.gate_cpu_s = float(line.split()[-1])
        run.gate_cost = await _gate_cost(admin, server, client, args)
        await admin.post(f"/v1/adapters/{AGENT}/unpin")
    finally:
        await cancel_and_wait(users)
        await sender.aclose()
        await client.close()
        await admin.aclose()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="clora bench release", description=__doc__.split("\n")[0])
    p.add_argument("--task", default="routing", choices=sorted(FAMILIES))
    p.add_argument("--minutes", type=float, default=6.0, help="Length of the learn phase.")
    p.add_argument("--users", type=int, default=4)
    p.add_argument("--think", type=float, default=1.0, help="Mean pause between a user's requests.")
    p.add_argument("--held-out", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--canary-timeout", type=float, default=600.0,
        help="How long each bad candidate may take to be decided (seconds).",
    )  # fmt: skip
    p.add_argument("--gate-pairs", type=int, default=3,
                   help="Phase 4: window pairs (without a gate, with one).")  # fmt: skip
    p.add_argument("--gate-window", type=float, default=30.0,
                   help="Phase 4: seconds per window (a gated one ends with its last gate).")  # fmt: skip
    p.add_argument("--other-clients", type=int, default=4,
                   help="Phase 4: closed-loop clients of the other agent.")  # fmt: skip
    p.add_argument("--other-max-tokens", type=int, default=64,
                   help="Phase 4: max_tokens of each of its requests (greedy).")  # fmt: skip
    p.add_argument("--model", default=None, help="Default: the embedded default model.")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--work", type=Path, default=None, help="Data directory (default: a temp dir).")
    p.add_argument("--out", type=Path, default=Path("var/bench/release"))
    p.add_argument("--omp-wait-policy", default="product")
    return p


def run(argv: Sequence[str]) -> int:
    """`clora bench release [options]`; returns the exit status."""
    args = build_parser().parse_args(list(argv))
    from clora_feedback.config import DEFAULT_MODEL, AgentConfig, Settings
    from clora_feedback.model.resolve import resolve_model_dir
    from clora_feedback.service import build_service

    for name in ("httpx", "httpx2", "openai", "uvicorn.access"):
        logging.getLogger(name).setLevel(logging.WARNING)
    model_dir = resolve_model_dir(args.model or DEFAULT_MODEL, Settings().model_cache_dir)
    work = args.work or Path(tempfile.mkdtemp(prefix="clora-bench-release-"))
    cfg = LearningConfig(tasks=(args.task,), users=args.users, num_threads=args.threads)
    settings = learning_settings(model_dir, work, cfg)
    settings.agents.append(AgentConfig(name=OTHER))  # phase 4's other agent
    run_ = ReleaseRun(task=args.task, minutes=args.minutes)
    with LocalServer(build_service(settings)) as server:
        asyncio.run(_run(server, args, run_))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "release.json").write_text(json.dumps(asdict(run_), indent=2))
    print(json.dumps({k: v for k, v in asdict(run_).items() if k not in ("held_out",)}, indent=2))
    return 0
