"""The continual trainer: rewarded samples in, new adapter versions out, serving never paused.

Each round (`run_round`), per agent in fair rotation:

1. pull newly rewarded samples from the `SampleSource` (a durable cursor: the
   highest reward sequence number already trained on, kept in each version's
   feedback window with the id of the reward policy the rewards came from, so
   a restart resumes without losing or repeating samples);
2. admit a mini-batch early (see `admission`) or, after `trigger_interval_s`
   with anything waiting, whatever is there;
3. build the agent's rows (`batch`): a policy-gradient row per sample
   with raw behaviour logprobs; a supervised row per right answer feedback gave
   and per output confirmed or rewarded above the agent's running mean; a
   preference pair
   per wrong output and its right answer; a few labelled examples of earlier
   steps (`replay`). A batch with nothing to teach (only settled confirmed
   outputs, rewards at the agent's running mean) is consumed without a step;
4. swap the agent's state in, step, swap out (see `step`); with
   `batched_agents > 1`, up to that many ready agents share one pass;
5. publish. On the release path (`releases` given; `release.enabled`, the default
   of `clora serve`) the registry writes an immutable **candidate** (PEFT files,
   optimizer state, manifest last) without moving the pointer, and it is marked
   for the release path (`clora_feedback.release`: gate, canary, promote or
   abort); nothing serves it until the release path promotes it. Without it,
   the new weights go to the deployer first (`PublishHandoff`), straight from
   memory, under a version number the registry reserved (served from the next
   decode step), then the registry writes the version and moves the pointer.

What the trainer continues from, on the release path: its newest candidate that
was not rejected, each step's candidate the parent of the next; after a rejection
or a rollback a run restarts from the newest candidate still good (`lineage`, the
release line). Staleness is counted against the serving version (samples come
from what serves, not from candidates).

Training is background work: rounds run on the trainer's own thread at a
lower scheduling priority (`TrainerConfig.nice`, Linux), so decode steps of
every agent win the cores whenever both want them.

The trainer never installs a version and never rolls back: rollbacks and
promotions move the registry's pointer through the deployer. Without the
release path the trainer follows the pointer: each round it compares every
run's version with the agent's active one, and a moved pointer makes the next
step start from the active version's weights and optimizer state; a step that
raced with it is discarded, because the registry refuses to publish a version
whose parent is no longer active.

Who trains: pinned agents are skipped (their samples wait). An agent whose
adapter was unloaded (it has versions but no active one) is not trained until
a load or a rollback activates a version again: otherwise its next publish
would bring the unloaded adapter back.

Ownership (several trainers on one registry, `clora train`): with `leases`, a
trainer trains only the agents whose lease it holds (`clora_feedback.store.lease`:
at most its fair share, renewed every `ttl / 3` by a task beside the rounds, so a
long step does not let them lapse). An agent whose lease is lost has its run and
its waiting samples dropped; when the lease comes back the run is read again from
the registry (the other trainer may have published meanwhile). Before a publish
the trainer checks that the lease is still its own; the registry's parent
compare-and-set stays the last guard.

Not here: the math of a step (`step`), which samples give which rows (`batch`), where a
run starts and its release line (`lineage`), the HTTP routes, judging versions (`release`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from typing import Protocol

import torch

from clora_feedback.config import TrainerConfig
from clora_feedback.cores import process_share, set_thread_teams
from clora_feedback.errors import CloraError, ConflictError, NotFoundError, StoreError
from clora_feedback.heap import trim_heap
from clora_feedback.lifecycle import BackgroundTask
from clora_feedback.lora.weights import LoRAWeights
from clora_feedback.priority import lower_thread_priority
from clora_feedback.store.lease import TrainerLeases
from clora_feedback.store.versions import AdapterRef, AdapterStore, VersionInfo
from clora_feedback.train.admission import Admission
from clora_feedback.train.batch import Admitted, agent_batch, teaches
from clora_feedback.train.lineage import AgentRun, ReleaseStates, fresh_seed, load_run
from clora_feedback.train.loss import LossConfig
from clora_feedback.train.policy import PolicyModel
from clora_feedback.train.samples import SampleSource
from clora_feedback.train.state import (
    AdamConfig,
    AgentTrainState,
    Residency,
    TrainingSlot,
    init_lora,
)
from clora_feedback.train.step import AgentBatch, StepResult, train_step

log = logging.getLogger(__name__)


class PublishHandoff(Protocol):
    """Where a co-located trainer hands a new version's weights (`engine.deployer.Deployer`)."""

    def handoff(self, ref: AdapterRef) -> AbstractContextManager[None]:
        """Serve `ref` from memory while the block moves the pointer; undone if it raises."""
        ...


def _trainer_thread(nice: int) -> None:
    """The trainer thread's set-up: background priority (`trainer.nice`) and its OpenMP
    team size (half the cores beside an engine, else all: `cores`)."""
    lower_thread_priority(nice)
    set_thread_teams(process_share().trainer_threads())


class ContinualTrainer(BackgroundTask):
    """Trains every agent with feedback, one round at a time, publishing in place."""

    def __init__(
        self,
        policy: PolicyModel,
        feedback: SampleSource,
        registry: AdapterStore,
        config: TrainerConfig,
        *,
        deployer: PublishHandoff | None = None,
        agents: Callable[[], Iterable[str]] | None = None,
        base_model: str | None = None,
        leases: TrainerLeases | None = None,
        releases: ReleaseStates | None = None,
    ):
        self.policy = policy
        self.deployer = deployer  # None: a deployer elsewhere follows the registry
        self.feedback = feedback
        self.registry = registry
        self.config = config
        self.admission = Admission(config.admission)
        self._loss = LossConfig(
            clip_eps=config.clip_eps,
            sft_weight=config.sft_weight,
            preference_weight=config.preference_weight,
            preference_beta=config.preference_beta,
            kl_coef=config.kl_coef,
        )
        self._adam = AdamConfig(
            lr=config.lr,
            weight_decay=config.weight_decay,
            max_grad_norm=config.max_grad_norm,
            warmup_steps=config.warmup_steps,
        )
        self._agents = agents or feedback.agents_with_rewards
        self._base_model = base_model or policy.model_name
        self._runs: dict[str, AgentRun] = {}
        self._slots: list[TrainingSlot] = []
        self._lock = threading.RLock()  # one round at a time
        self._turn = 0
        self.history: list[StepResult] = []
        self.last_publish: dict[str, float] = {}
        self._executor: ThreadPoolExecutor | None = None
        self._halt = threading.Event()  # set by `stop`: a round in progress ends after its step
        self.leases = leases  # None: this trainer trains every agent (one trainer in all)
        self.releases = releases  # None: every version serves at once (no release path)
        self._candidates: list[str] | None = None  # the last round's trainable agents
        self.skipped_pg = 0  # samples kept out of the policy gradient (not raw logprobs)
        self.settled_batches = 0  # admitted batches with nothing to learn (no step)
        self.ready_waits: deque[float] = deque(maxlen=4096)
        """Seconds each of the latest ready batches waited for its step (`run_round`)."""
        self.residency = Residency(config.max_resident_agents, self._restore)
        """Whose training buffers stay in host memory (`trainer.max_resident_agents`)."""

    # -- lifecycle ----------------------------------------------------------------------

    task_name = "clora-trainer"

    async def run_round_async(self) -> list[StepResult]:
        """`run_round` on the trainer's own thread, at the configured lower priority."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                max_workers=1,
                thread_name_prefix="clora-trainer",
                initializer=_trainer_thread,
                initargs=(self.config.nice,),
            )
        return await asyncio.get_running_loop().run_in_executor(self._executor, self.run_round)

    async def start(self) -> None:
        self._halt.clear()
        await super().start()

    async def stop(self) -> None:
        """Stop the loop; a round in progress ends after the step it is in (the batches it
        had not reached are offered again from their cursors), then the thread ends.
        Leases are released, so another trainer takes the agents at once."""
        self._halt.set()
        await super().stop()
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False)
        if self.leases is not None:
            try:
                await asyncio.to_thread(self.leases.release)
            except StoreError as exc:  # they expire after the TTL anyway
                log.warning("trainer: releasing the leases failed: %s", exc.message)

    async def _run(self) -> None:
        keeper = None if self.leases is None else asyncio.create_task(self._keep_leases())
        try:
            while True:
                try:
                    await self.run_round_async()
                except asyncio.CancelledError:
                    raise
                except Exception:  # keep training other agents; the error is in the log
                    log.exception("trainer round failed")
                await asyncio.sleep(self.config.poll_interval_s)
        finally:
            if keeper is not None:
                keeper.cancel()

    async def _keep_leases(self) -> None:
        """Renew the leases every `ttl / 3` while rounds run (a step may outlast a renewal)."""
        assert self.leases is not None
        while True:
            await asyncio.sleep(self.leases.renew_interval_s)
            candidates = self._candidates
            if candidates is None:
                continue  # no round yet: the first round refreshes them itself
            try:
                await asyncio.to_thread(self.leases.refresh, candidates)
            except StoreError as exc:  # held() lapses by itself after the TTL
                log.error("trainer: renewing the leases failed: %s", exc.message)

    # -- state ----------------------------------------------------------------------------

    def _run_for(self, agent: str) -> AgentRun:
        run = self._runs.get(agent)
        if run is None:
            run = load_run(
                agent, self.registry, self.policy.lora_limits, self.config, self.releases
            )
            self._runs[agent] = run
            self.residency.add(run.state)
        return run

    def _restore(self, state: AgentTrainState) -> None:
        """Read a dropped state's buffers back: its version's weights and Adam moments
        (exactly what it held: a state is dropped only between steps, when its version
        holds it), or a fresh adapter's for an agent that never published."""
        if state.version == 0:
            seed = fresh_seed(self.config.seed, state.agent)  # as `load_run` made it
            state.restore(init_lora(state.layout, seed=seed), None)
            return
        limits = self.policy.lora_limits
        weights, optimizer = self.registry.load(state.agent, state.version, limits=limits)
        state.restore(state.layout.from_weights(weights), optimizer)

    def _slots_for(self, states: list[AgentTrainState]) -> list[TrainingSlot]:
        need = max(s.layout.numel for s in states)
        if not self._slots or self._slots[0].capacity < need or len(self._slots) < len(states):
            count = max(len(states), len(self._slots))
            self._slots = [TrainingSlot(need, self.policy.device) for _ in range(count)]
        return self._slots[: len(states)]

    # -- one round ------------------------------------------------------------------------

    def run_round(self) -> list[StepResult]:
        """Pull rewards, admit, step and publish every ready agent once (blocking).

        Fairness: every agent whose batch is ready when a round admits gets its step in
        that round, in an order that rotates by one agent each round; one whose batch
        becomes ready during a round gets it in the next. So an agent waits at most
        `2R - 1` steps for its own (R: agents with ready batches), whatever its traffic;
        `ready_waits` records how long each ready batch waited for its step (seconds).
        Serving keeps its priority: rounds run on the lower-priority trainer thread.
        """
        with self._lock:
            agents = self._owned([a for a in self._agents() if self._trainable(a)])
            if not agents:
                return []
            self._turn = (self._turn + 1) % len(agents)
            agents = agents[self._turn :] + agents[: self._turn]  # fair rotation
            ready: list[tuple[str, Admitted]] = []
            for agent in agents:
                batch = self._admit(agent)
                if batch:
                    ready.append((agent, batch))
            results: list[StepResult] = []
            k = self.config.batched_agents
            admitted_at = time.monotonic()
            for i in range(0, len(ready), k):
                if self._halt.is_set():  # stopping: the rest is trained from the registry's
                    for agent, _ in ready[i:]:  # cursors by the next run (samples not lost)
                        self._drop(agent)
                    log.info("trainer: stopping; %d ready batches left", len(ready) - i)
                    break
                waited = time.monotonic() - admitted_at
                self.ready_waits.extend([waited] * len(ready[i : i + k]))
                results += self._step(ready[i : i + k])
                # The least recently stepped beyond the cap, after every step: a round of
                # many agents restores each in turn (100 agents held 79 states at once when
                # this ran once a round), then this step's freed memory back to the OS.
                self.residency.trim()
                trim_heap()
            return results

    def _owned(self, agents: list[str]) -> list[str]:
        """The agents of `agents` this trainer holds the lease of (all, without leases);
        drops the runs of agents it no longer holds."""
        if self.leases is None:
            return agents
        self._candidates = agents
        if self.leases.due():
            try:
                self.leases.refresh(agents)
            except StoreError as exc:
                log.error("trainer: refreshing the leases failed: %s", exc.message)
        held = self.leases.held()
        for agent in [a for a in self._runs if a not in held]:
            self._drop(agent)
            log.info("agent %s: lease not held; its training state is dropped", agent)
        return [a for a in agents if a in held]

    def _drop(self, agent: str) -> None:
        """Forget `agent`'s run and waiting samples; the next round reloads it from the registry."""
        self._runs.pop(agent, None)
        self.residency.forget(agent)
        self.admission.discard(agent)

    def _trainable(self, agent: str) -> bool:
        """Whether `agent` trains this round; drops a run whose version is no longer active.

        Pinned agents wait. An unloaded agent (versions exist, none active) is not
        trained until a load or a rollback activates a version again, so an unload
        sticks. A rollback (by an operator) moved the pointer away from
        the run's version: the run is dropped and reloaded from the active version.
        """
        try:
            info = self.registry.agent(agent)
        except NotFoundError:
            return True  # never published: trained from a fresh adapter
        run = self._runs.get(agent)
        active = info.active_version or 0
        if run is not None and self.releases is None and run.state.version != active:
            self._drop(agent)  # its waiting samples are offered again from the new run's cursor
        elif run is not None and self.releases is not None:
            if active != run.serving and active in run.chain:
                run.state.lr_scale = 1.0  # a candidate of the line serves: the back-off ends
            run.serving = active
            rolled_back = info.activated_by == "rollback" and info.activated_at != run.moved_at
            if (
                rolled_back
                or active not in run.chain
                or self.releases.rejected(agent, run.chain - {active})
            ):
                # An operator rolled back (the versions after the target are marked), or the
                # release path rejected a version of the line: continue from the newest
                # candidate still good.
                self._drop(agent)
            run.moved_at = info.activated_at
        return not info.pinned and not info.deactivated

    def _admit(self, agent: str) -> Admitted:
        run = self._run_for(agent)
        new = self.feedback.training_samples(agent, after_seq=run.pulled_seq)
        if new:
            run.pulled_seq = max(s.last_seq for s in new)
            self.admission.offer(agent, new)
        overdue = time.monotonic() - run.last_step_at >= self.config.trigger_interval_s
        # On the release path samples come from what serves, not from the newest candidate:
        # staleness counts versions behind serving.
        current = run.state.version if self.releases is None else run.serving
        return self.admission.admit(agent, current, force=overdue)

    def _step(self, group: list[tuple[str, Admitted]]) -> list[StepResult]:
        runs, batches, kept = [], [], []
        for agent, admitted in group:
            run = self._run_for(agent)
            if not teaches(admitted, run.state.baseline, self.config):
                # Every sample was already settled: a step would only sharpen what the
                # agent answers anyway (and Adam turns even a tiny gradient into a full-size
                # move), which is how held-out answers drift. Consumed, nothing published.
                self.settled_batches += 1
                run.last_step_at = time.monotonic()
                log.info("agent %s: %d settled samples, nothing to learn", agent, len(admitted))
                continue
            runs.append(run)
            batch, skipped_pg = agent_batch(
                run.state, run.replay, admitted, self.policy, self.config
            )
            self.skipped_pg += skipped_pg
            batches.append(batch)
            kept.append((agent, admitted))
        if not batches:
            return []
        group = kept
        runs, batches, group = self._make_resident(runs, batches, group)
        if not batches:
            return []
        slots = self._slots_for([b.state for b in batches])
        with process_share().training():  # an engine beside it narrows meanwhile
            results = train_step(self.policy, slots, batches, self._loss, self._adam)
        published = []
        for run, (agent, admitted), result in zip(runs, group, results, strict=True):
            window = {
                "from_seq": run.trained_seq,
                "to_seq": max(s.last_seq for s, _ in admitted),
                "samples": len(admitted),
                "completion_ids": sorted({s.completion_id for s, _ in admitted})[:1000],
                "reward_policy": self.feedback.reward_policy_id,
            }
            if self._publish(agent, run, result, window):
                published.append(result)
        self.history += published
        return published

    def _make_resident(
        self,
        runs: list[AgentRun],
        batches: list[AgentBatch],
        group: list[tuple[str, Admitted]],
    ) -> tuple[list[AgentRun], list[AgentBatch], list[tuple[str, Admitted]]]:
        """Restore dropped states before the step; an agent whose version cannot be read
        (pruned, corrupted) starts over from the registry next round."""
        keep = []
        for i, run in enumerate(runs):
            try:
                self.residency.use(run.state)
            except CloraError as exc:
                log.error("agent %s: cannot restore v%d (%s); reloading", run.state.agent,
                          run.state.version, exc.message)  # fmt: skip
                self._drop(run.state.agent)
                continue
            keep.append(i)
        return [runs[i] for i in keep], [batches[i] for i in keep], [group[i] for i in keep]

    def _publish(
        self, agent: str, run: AgentRun, result: StepResult, window: dict[str, object]
    ) -> bool:
        """Hand the new weights to the deployer under a reserved version, then publish it.

        The trainer installs nothing itself: the deployer's hand-off serves the
        weights from memory (no disk round trip) under a version number the registry
        has reserved, while the registry writes the immutable directory and moves
        the active pointer (parent compare-and-set). If the registry refuses (pinned
        or rolled back meanwhile), the deployer brings the engine back to the
        pointer and the step is void. A crash in between loses only the
        not-yet-durable version: on restart the last complete one is active and its
        samples are trained again. Without a deployer here, one in another process
        follows the pointer.
        """
        state = run.state
        try:
            active = self.registry.active(agent)
        except NotFoundError:
            active = None
        serving = active.version if active else 0
        moved = serving not in run.chain if self.releases is not None else serving != state.version
        if self.registry.is_pinned(agent) or moved:
            log.warning("agent %s: step discarded (pinned or rolled back during the step)", agent)
            self._drop(agent)
            return False
        if self.leases is not None and not self.leases.holds(agent):
            log.warning("agent %s: step discarded (its lease moved to another trainer)", agent)
            self._drop(agent)
            return False
        t0 = time.perf_counter()
        if not bool(torch.isfinite(state.params).all()):  # one check over the flat buffer
            log.error("agent %s: step %d produced non-finite weights; discarded", agent, state.step)
            self._drop(agent)  # the next round reloads the last good version
            return False
        if self.releases is not None:
            return self._publish_candidate(agent, run, result, window)
        # Built in the engine's own layout and checked above; the engine keeps this copy.
        weights = state.layout.to_weights(state.params)
        version = self.registry.next_version(agent)
        ref = AdapterRef(agent, version, None, weights)
        handoff = nullcontext() if self.deployer is None else self.deployer.handoff(ref)
        try:
            with handoff:  # served from the next decode step; undone if the registry refuses
                served = time.perf_counter()
                self._write(agent, state, weights, result, window, version=version)
        except Exception as exc:
            self._drop(agent)
            if isinstance(exc, ConflictError):  # pinned or rolled back meanwhile: the step is void
                log.warning("agent %s: step discarded (%s)", agent, exc.message)
                return False
            raise
        written = time.perf_counter()
        state.version = version
        run.trained_seq = int(window["to_seq"])  # type: ignore[call-overload]
        run.last_step_at = time.monotonic()
        self.last_publish = {"handoff_s": served - t0, "durable_s": written - t0}
        log.info(
            "agent %s: v%d live (step %d, loss %.4f, reward %.3f, %d policy-gradient + %d "
            "supervised rows, %d pairs, staleness %.2f, "
            "swap %.1f ms of %.0f ms step, hand-off %.1f ms, durable after %.0f ms)",
            agent, version, state.step, result.loss, result.reward_mean, result.num_pg,
            result.num_sft, result.num_pairs, result.staleness_mean, result.swap_s * 1e3,
            result.step_s * 1e3,
            (served - t0) * 1e3, (written - t0) * 1e3,
        )  # fmt: skip
        return True

    def _write(
        self,
        agent: str,
        state: AgentTrainState,
        weights: LoRAWeights,
        result: StepResult,
        window: dict[str, object],
        *,
        activate: bool = True,
        version: int | None = None,
    ) -> VersionInfo:
        """The registry's immutable version of this step: under a reserved `version`
        (the hand-off path), or a candidate (`activate=False`, the release path)."""
        return self.registry.publish(
            agent,
            weights,
            optimizer_state=state.optimizer_state(),
            base_model=self._base_model,
            parent=state.version or None,
            step=state.step,
            metrics=result.metrics(),
            feedback_window=window,
            activate=activate,
            version=version,
        )

    def _publish_candidate(
        self, agent: str, run: AgentRun, result: StepResult, window: dict[str, object]
    ) -> bool:
        """The release path: write the step as an immutable candidate (the pointer does not
        move; nothing serves it) and mark it for the gate. A crash between the two leaves a
        version with no release state, which the release path never serves."""
        state = run.state
        weights = state.layout.to_weights(state.params)
        t0 = time.perf_counter()
        try:
            info = self._write(agent, state, weights, result, window, activate=False)
        except ConflictError as exc:  # pinned meanwhile: the step is void
            self._drop(agent)
            log.warning("agent %s: step discarded (%s)", agent, exc.message)
            return False
        assert self.releases is not None
        self.releases.record(agent, info.version, "candidate")
        state.version = info.version
        run.chain.add(info.version)
        run.trained_seq = int(window["to_seq"])  # type: ignore[call-overload]
        run.last_step_at = time.monotonic()
        self.last_publish = {"durable_s": time.perf_counter() - t0}
        log.info(
            "agent %s: v%d candidate (step %d, loss %.4f, reward %.3f, %d policy-gradient + %d "
            "supervised rows, %d pairs, serving v%d)",
            agent, info.version, state.step, result.loss, result.reward_mean,
            result.num_pg, result.num_sft, result.num_pairs, run.serving,
        )  # fmt: skip
        return True

    # -- observability -----------------------------------------------------------------------

    def metrics(self) -> dict[str, dict[str, float]]:
        """Per agent: steps, version, last loss/reward, admission counters and staleness."""
        out: dict[str, dict[str, float]] = {}
        last: dict[str, StepResult] = {r.agent: r for r in self.history}
        for agent, run in list(self._runs.items()):
            stats = self.admission.stats[agent]
            recent = stats.staleness[-100:]
            row = {
                "steps": float(run.state.step),
                "version": float(run.state.version),
                "pending_samples": float(self.admission.pending(agent)),
                "admitted_samples": float(stats.admitted),
                "dropped_stale_samples": float(stats.dropped_stale),
                "staleness_mean": sum(recent) / len(recent) if recent else 0.0,
                "staleness_max": float(max(recent, default=0)),
            }
            if agent in last:
                r = last[agent]
                row |= {
                    "loss": r.loss,
                    "reward_mean": r.reward_mean,
                    "swap_seconds": r.swap_s,
                    "step_seconds": r.step_s,
                }
            out[agent] = row
        return out
