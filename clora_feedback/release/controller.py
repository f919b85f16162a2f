"""The release loop: moves each trainer candidate through the gate and the canary to serving or out.

Every `release.interval_s`, per agent:

1. a live canary (`store.registry.releases` state `canary`) is judged on its arms'
   live rewards (`canary.judge`): promote (the deployer installs it as the serving
   version, then the pointer and the state move in one transaction), abort (the
   canary's share drops to 0 in this process at once, then the state is recorded
   with the evidence and the arm unloaded), or wait;
2. otherwise its newest `candidate` (or `passed`: gated by an operator while a canary
   ran, canaried now without a second evaluation) is taken (older waiting ones become `skipped`:
   evaluating only the newest keeps the gate's cost per candidate, not per step) and
   judged offline against what serves (`gate.OfflineGate`) with the candidate loaded
   under `arms.gate_name`; `passed` starts a canary (`canary.enabled`) or promotes at
   once; `failed`, `inconclusive` and `invalid` are recorded with their evidence and never
   serve (only `failed` rejects: the trainer keeps the line of an undecided one).
   Every verdict is a compare-and-set on the state it was read in (another gateway's
   loop may have moved the version meanwhile: the verdict is then dropped). An
   `invalid` or `inconclusive` newest version is judged again when its evaluation set
   has grown past the cases it was judged on (and reaches `gate.min_cases`). Pinned agents are skipped
   (a pin stops the release path; a pinned agent's canary is never promoted by it).

Canary arms are restored from the registry on start and followed every look (another
process may have started or ended one), so a restart keeps routing the same share to
the same version and the rewards (read from the feedback store) keep counting.
Operators promote and abort through `promote` and `abort` (HTTP and `clora adapters`).

Not here: the statistics (`stats`), the cases (`evalset`), the per-request arm choice
(`gateway.agents` calls `route`), the engine (the deployer is the only loader).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

from clora_feedback.errors import CloraError, ConflictError, NotFoundError
from clora_feedback.lifecycle import BackgroundTask
from clora_feedback.release import arms
from clora_feedback.release.canary import CanaryDecision, CanarySettings, in_canary, judge
from clora_feedback.release.evalset import EvalSet
from clora_feedback.release.gate import GateVerdict, OfflineGate
from clora_feedback.store.registry.core import AdapterRegistry
from clora_feedback.store.registry.releases import ReleaseBook, ReleaseRecord

log = logging.getLogger(__name__)

T = TypeVar("T")

UNDECIDED = frozenset({"invalid", "inconclusive"})
"""Gate verdicts that decide nothing: judged again on more cases while newest."""

RewardSource = Callable[[str, int, float | None], Sequence[float]]
"""(agent, version, since) -> live rewards of the samples that version served whose feedback
joined at or after `since` (None: all), under the current policy."""


class ArmLoader(Protocol):
    """What loads the arms and moves the pointer engine-first: `engine.deployer.Deployer`."""

    def serving(self, agent: str) -> int | None: ...

    async def load_arm(self, name: str, agent: str, version: int) -> None: ...

    async def unload_arm(self, name: str) -> None: ...

    async def install_then(self, agent: str, version: int, move: Callable[[], T]) -> T: ...


class ReleaseController(BackgroundTask):
    """Drives candidates through gate and canary (see the module docstring).

    Args:
        registry: the adapter registry (versions, pointer).
        book: its release states.
        deployer: loads arms and installs promoted versions.
        gate: the offline gate (None: `gate.enabled` false, every candidate passes).
        evalset: each agent's cases (None with no gate).
        rewards: live rewards per (agent, version).
        canary: the canary's numbers (None: `canary.enabled` false, a pass promotes).
        interval_s: seconds between looks.
        min_cases: `gate.min_cases` (for retrying an evaluation that had too few).
        max_cases: `gate.max_cases`.
    """

    task_name = "clora-release"

    def __init__(
        self,
        registry: AdapterRegistry,
        book: ReleaseBook,
        deployer: ArmLoader,
        *,
        gate: OfflineGate | None,
        evalset: EvalSet | None,
        rewards: RewardSource,
        canary: CanarySettings | None,
        interval_s: float = 1.0,
        min_cases: int = 6,
        max_cases: int = 24,
    ) -> None:
        self.registry = registry
        self.book = book
        self.deployer = deployer
        self.gate = gate
        self.evalset = evalset
        self.rewards = rewards
        self.canary_settings = canary
        self.interval_s = interval_s
        self.min_cases = min_cases
        self.max_cases = max_cases
        self._canaries: dict[str, tuple[int, float]] = {}  # agent -> (version, share) routed here
        self.routed: Counter[tuple[str, int]] = Counter()
        """Requests routed to each canary (agent, version) by this process."""
        self.verdicts: Counter[tuple[str, str]] = Counter()
        """(stage, verdict) counts since start: gate passed|failed|inconclusive|invalid, canary promoted|aborted."""
        self._retried: dict[str, tuple[int, int]] = {}  # agent -> (version, cases) last retried
        self._looked: dict[str, tuple[int, int]] = {}  # agent -> (canary version, n_canary) judged
        self._busy = asyncio.Lock()  # one decision at a time (the loop, an operator)

    # -- routing (called by the gateway on every request) ------------------------------

    def route(self, agent: str, key: str) -> tuple[str, int] | None:
        """(engine name, version) of `agent`'s canary arm when the request with sticky `key`
        goes there, else None (the serving version serves it)."""
        live = self._canaries.get(agent)
        if live is None or not in_canary(agent, key, live[1]):
            return None
        self.routed[(agent, live[0])] += 1
        return arms.canary_name(agent), live[0]

    def canaries(self) -> dict[str, tuple[int, float]]:
        """Live canaries routed here: agent -> (version, share)."""
        return dict(self._canaries)

    # -- lifecycle --------------------------------------------------------------------

    async def start(self) -> None:
        """Restore the canary arms the registry records, then look every `interval_s`."""
        try:
            await self._follow_canaries()
        except CloraError as exc:
            log.error("release: restoring canaries failed: %s", exc.message)
        await super().start()

    async def _run(self) -> None:
        while True:
            try:
                await self.look()
            except CloraError as exc:  # the registry is briefly unavailable: next time
                log.error("release: a look failed: %s", exc.message)
            except Exception:
                log.exception("release: a look failed")
            await asyncio.sleep(self.interval_s)

    async def look(self) -> None:
        """One pass: follow canaries, judge them, then the newest candidate of each agent."""
        await self._follow_canaries()
        for agent in list(self._canaries):
            async with self._busy:
                await self._judge_canary(agent)
        waiting = await asyncio.to_thread(self.book.in_state, "candidate")
        waiting += await asyncio.to_thread(self.book.in_state, "passed")
        agents = {r.agent for r in waiting}
        retry: set[str] = set()
        for record in await asyncio.to_thread(self.book.newest_undecided):
            free = record.agent not in agents and record.agent not in self._canaries
            if free and await self._retry_due(record.agent, record):
                retry.add(record.agent)
        for agent in sorted(agents | retry):
            if agent in self._canaries:
                continue  # one release at a time per agent: candidates wait for the canary
            if await asyncio.to_thread(self.registry.is_pinned, agent):
                continue  # a pin stops the release path of the agent (operators still act)
            async with self._busy:
                await self._release_next(agent, retry=agent in retry)

    # -- canaries ------------------------------------------------------------------------

    async def _follow_canaries(self) -> None:
        """Bring this process's canary arms and routes to the registry's states."""
        live = {r.agent: r for r in await asyncio.to_thread(self.book.in_state, "canary")}
        for agent in [a for a in self._canaries if a not in live]:
            self._canaries.pop(agent, None)  # ended elsewhere (another process, a pointer move)
            self._looked.pop(agent, None)
            await self.deployer.unload_arm(arms.canary_name(agent))
        for agent, record in live.items():
            if self._canaries.get(agent, (None,))[0] == record.version:
                continue
            try:
                await self.deployer.load_arm(arms.canary_name(agent), agent, record.version)
            except CloraError as exc:
                log.error("agent %s: canary v%d cannot load here: %s", agent, record.version,
                          exc.message)  # fmt: skip
                continue
            self._canaries[agent] = (record.version, record.share or 0.0)

    async def _judge_canary(self, agent: str) -> None:
        record = await asyncio.to_thread(self.book.canary, agent)
        if record is None or self.canary_settings is None:
            return
        serving = record.serving or 0
        started = float(record.evidence.get("canary", {}).get("started_at", record.updated_at))
        # Both arms since the canary started: the concurrent comparison, and a bounded read.
        arm_rewards = await asyncio.to_thread(self.rewards, agent, record.version, started)
        base_rewards = await asyncio.to_thread(self.rewards, agent, serving, started)
        # One sequential look per new canary reward (the levels sum to alpha over looks).
        new_look = self._looked.get(agent) != (record.version, len(arm_rewards))
        self._looked[agent] = (record.version, len(arm_rewards))
        decision = judge(
            base_rewards,
            arm_rewards,
            elapsed_s=time.time() - started,
            settings=self.canary_settings,
            look=new_look,
        )
        if decision.action == "promote" and await asyncio.to_thread(self.registry.is_pinned, agent):
            return  # pinned: the canary waits (an operator promotes or aborts it)
        if decision.action == "continue":
            return
        decision.evidence |= {
            "started_at": started,
            "routed_here": self.routed[(agent, record.version)],
            "reason": decision.reason,
        }
        if decision.action == "abort":
            await self._abort(agent, record, decision)
        else:
            await self._promote(agent, record.version, serving, "canary", decision.evidence)

    async def _abort(
        self, agent: str, record: ReleaseRecord, decision: CanaryDecision, stage: str = "canary"
    ) -> None:
        self._canaries.pop(agent, None)  # share 0 here at once, before anything is written
        self._looked.pop(agent, None)
        await asyncio.to_thread(
            self.book.record, agent, record.version, "aborted",
            stage=stage, evidence=decision.evidence, expect={"canary"},
        )  # fmt: skip
        await self.deployer.unload_arm(arms.canary_name(agent))
        self.verdicts[(stage, "aborted")] += 1
        log.warning("agent %s: canary v%d aborted: %s", agent, record.version, decision.reason)

    async def _promote(
        self, agent: str, version: int, serving: int, stage: str, evidence: dict[str, Any]
    ) -> None:
        move = functools.partial(
            self.book.promote, agent, version,
            expected_active=serving or None, stage=stage, evidence=evidence,
        )  # fmt: skip
        await self.deployer.install_then(agent, version, move)
        self._looked.pop(agent, None)
        if self._canaries.pop(agent, None) is not None:  # `promote` ended it in the registry
            await self.deployer.unload_arm(arms.canary_name(agent))
        if self.gate is not None:
            self.gate.forget(agent, keep_version=version)
        self.verdicts[(stage, "promoted")] += 1
        log.info("agent %s: v%d promoted (%s): %s", agent, version, stage,
                 evidence.get("reason", ""))  # fmt: skip

    # -- candidates ------------------------------------------------------------------------

    async def _release_next(self, agent: str, *, retry: bool = False) -> None:
        records = await asyncio.to_thread(self.book.of_agent, agent)
        info = await asyncio.to_thread(self.registry.agent, agent)
        active = info.active_version or 0
        newest = max(records) if records else None
        waiting = sorted(v for v, r in records.items() if r.state in ("candidate", "passed"))
        for old in waiting[:-1]:
            await asyncio.to_thread(
                self.book.record, agent, old, "skipped",
                stage="gate", evidence={"reason": f"v{waiting[-1]} is newer"},
                expect={"candidate", "passed"},
            )  # fmt: skip
        if waiting and records[waiting[-1]].state == "passed":  # gated while a canary ran
            if self.canary_settings is None:
                evidence = {"reason": "passed the gate; canary off"}
                await self._promote(agent, waiting[-1], active, "gate", evidence)
            else:
                await self._start_canary(agent, waiting[-1], active)
            return
        if waiting:
            version = waiting[-1]
        elif retry and newest is not None and records[newest].state in UNDECIDED:
            version = newest
        else:
            return
        read = records[version].state  # every write below is a compare-and-set on it
        status = (await asyncio.to_thread(self.registry.get, agent, version)).status
        if status == "rolled_back" or version <= active:
            await asyncio.to_thread(
                self.book.record, agent, version, "skipped",
                stage="gate", evidence={"reason": f"status {status}, serving v{active}"},
                expect={read},
            )  # fmt: skip
            return
        verdict = await self._gate(agent, version, active)
        if not await self._record_verdict(agent, version, verdict, active, read):
            return
        log.log(
            logging.INFO if verdict.verdict == "passed" else logging.WARNING,
            "agent %s: gate %s v%d: %s", agent, verdict.verdict, version, verdict.reason,
        )  # fmt: skip
        if verdict.verdict != "passed":
            return
        if self.canary_settings is None:
            evidence = {"reason": "passed the gate; canary off"}
            await self._promote(agent, version, active, "gate", evidence)
            return
        await self._start_canary(agent, version, active)

    async def _record_verdict(
        self,
        agent: str,
        version: int,
        verdict: GateVerdict,
        active: int,
        read: str | None,
        by: dict[str, str] | None = None,
    ) -> bool:
        """Record the gate's verdict if `version` is still in the state `read` (another
        gateway may have moved it meanwhile); False: dropped."""
        recorded = await asyncio.to_thread(
            self.book.record, agent, version, verdict.verdict, stage="gate",
            evidence=verdict.evidence | {"reason": verdict.reason} | (by or {}),
            serving=active, expect={read},
        )  # fmt: skip
        if not recorded:
            log.info("agent %s: gate verdict on v%d dropped: its state moved from %s meanwhile",
                     agent, version, read)  # fmt: skip
            return False
        self.verdicts[("gate", verdict.verdict)] += 1
        return True

    async def _retry_due(self, agent: str, record: ReleaseRecord) -> bool:
        """An `invalid` or `inconclusive` newest version is evaluated again once its evaluation
        set has grown past the cases it was judged on (and reaches `gate.min_cases`)."""
        if record.state not in UNDECIDED or self.evalset is None:
            return False
        judged = int(record.evidence.get("gate", {}).get("cases", 0))
        cases = len(await asyncio.to_thread(self.evalset.cases, agent, limit=self.max_cases))
        if cases < self.min_cases or cases <= judged:
            return False
        if self._retried.get(agent) == (record.version, cases):
            return False
        self._retried[agent] = (record.version, cases)
        return True

    async def _gate(self, agent: str, version: int, active: int) -> GateVerdict:
        if self.gate is None or self.evalset is None:
            return GateVerdict("passed", "the offline gate is off", {"gate": "off"})
        cases = await asyncio.to_thread(self.evalset.cases, agent, limit=self.max_cases)
        if len(cases) < self.min_cases:
            return await self.gate.judge(
                agent, cases, candidate=("", version), serving=(None, active)
            )  # too few: invalid without touching the engine
        name = arms.gate_name(agent)
        try:
            await self.deployer.load_arm(name, agent, version)
        except CloraError as exc:
            return GateVerdict("invalid", f"the candidate cannot load: {exc.message}",
                               {"code": "load_failed", "cases": len(cases)})  # fmt: skip
        serving_name = agent if self.deployer.serving(agent) is not None else None
        try:
            return await self.gate.judge(
                agent, cases, candidate=(name, version), serving=(serving_name, active)
            )
        finally:
            await self.deployer.unload_arm(name)

    async def _start_canary(self, agent: str, version: int, serving: int) -> None:
        assert self.canary_settings is not None
        share = self.canary_settings.share
        try:
            await self.deployer.load_arm(arms.canary_name(agent), agent, version)
            await asyncio.to_thread(
                self.book.start_canary, agent, version, share=share, serving=serving,
                evidence={"started_at": time.time(), "share": share},
            )  # fmt: skip
        except CloraError as exc:
            await self.deployer.unload_arm(arms.canary_name(agent))
            log.error("agent %s: canary v%d not started: %s", agent, version, exc.message)
            return
        self._canaries[agent] = (version, share)
        self.verdicts[("canary", "started")] += 1
        log.info("agent %s: canary v%d serves %.0f%% of requests", agent, version, share * 100)

    # -- operators ---------------------------------------------------------------------

    async def promote(self, agent: str, version: int | None, *, reason: str) -> int:
        """An operator's promotion: `version` (default the live canary) serves everyone now.

        Returns:
            The promoted version.

        Raises:
            NotFoundError: no such version, or no canary to promote.
            ConflictError: the version is rejected or already serving.
        """
        async with self._busy:
            if version is None:
                record = await asyncio.to_thread(self.book.canary, agent)
                if record is None:
                    raise NotFoundError(f"agent {agent!r} has no canary", code="no_canary")
                version = record.version
            info = await asyncio.to_thread(self.registry.agent, agent)
            evidence = {"reason": reason, "by": "operator"}
            await self._promote(agent, version, info.active_version or 0, "operator", evidence)
            return version

    async def abort(self, agent: str, *, reason: str) -> int:
        """An operator's abort of the live canary (share 0 at once).

        Raises:
            NotFoundError: the agent has no canary.
        """
        async with self._busy:
            record = await asyncio.to_thread(self.book.canary, agent)
            if record is None:
                raise NotFoundError(f"agent {agent!r} has no canary", code="no_canary")
            decision = CanaryDecision("abort", reason, {"reason": reason, "by": "operator"})
            await self._abort(agent, record, decision, stage="operator")
            return record.version

    async def gate_now(self, agent: str, version: int) -> GateVerdict:
        """Run the offline gate on `version` against what serves now (an operator's release
        of that version), recording the verdict; a pass starts its canary as the loop would
        (canary off: promotes it); while another canary runs it stays `passed`, and the
        loop canaries it after that one ends unless a newer candidate came.

        Raises:
            NotFoundError: unknown agent or version.
            ConflictError: `version` is the serving one.
        """
        async with self._busy:
            await asyncio.to_thread(self.registry.get, agent, version)
            info = await asyncio.to_thread(self.registry.agent, agent)
            active = info.active_version or 0
            if version == active:
                raise ConflictError(f"v{version} is serving", code="already_active")
            before = await asyncio.to_thread(self.book.get, agent, version)
            read = None if before is None else before.state
            verdict = await self._gate(agent, version, active)
            if not await self._record_verdict(
                agent, version, verdict, active, read, by={"by": "operator"}
            ):
                return verdict
            if info.pinned:
                return verdict  # pinned: it waits as `passed` (an operator promotes it)
            if verdict.verdict == "passed" and agent not in self._canaries:
                if self.canary_settings is None:
                    evidence = {"reason": "passed the gate (operator); canary off"}
                    await self._promote(agent, version, active, "gate", evidence)
                else:
                    await self._start_canary(agent, version, active)
            return verdict
