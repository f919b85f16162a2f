"""Where an agent's run starts: the release line, the version and cursor it resumes from.

An `AgentRun` is one agent's training run as the trainer keeps it between rounds:
its state (weights, Adam moments), its reward cursors and, on the release path,
its line of candidates. `load_run` reads a fresh one from the registry, starting
where `resume_point` says.

What the trainer continues from, on the release path: **its newest candidate
that was not rejected**. Each step's candidate is the parent of the next, so
learning does not wait for the gate and the canary; the line starts at the
serving version. When the release path rejects a version of the line (the gate
failed it, its canary was aborted) or serving moves off the line (an operator's
rollback), the run restarts from the newest candidate that descends from serving
through no rejected or rolled-back version, else from serving itself, and the
samples after that version's cursor are trained again (the rejected line's
steps are not lost data, only lost weights). Tested in
`tests/test_trainer_release.py`.

A restart backs off: the same samples from the same weights and optimizer state
would give the same rejected candidate again (a run once reproduced one rejected
candidate 19 times). Each failed attempt since the serving version (a branch off
the line from serving to the restart version that holds a rejected version)
multiplies the learning rate by `trainer.retry_lr_factor`, so a retry that fails
again retries smaller still; after `trainer.max_retries` failed attempts the
samples those attempts trained on are set aside (the cursor moves past them) and
the line waits for newer feedback at the smallest rate. A candidate of the line
that comes to serve resets the rate (`trainer`): attempts count from it.

Without the release path a run starts from the active version, with the highest
cursor any version trained on (a rollback does not train the same samples again).

Not here: noticing that a run must restart, and extending its line with each
candidate (`trainer`), judging versions (`release`), the release states
themselves (`store.registry.releases`).
"""

from __future__ import annotations

import logging
import time
import zlib
from dataclasses import dataclass, field
from typing import Literal, Protocol

from clora_feedback.config import TrainerConfig
from clora_feedback.errors import NotFoundError
from clora_feedback.lora.weights import LoRALimits, LoRAWeights
from clora_feedback.store.versions import AdapterStore
from clora_feedback.train.replay import ReplayBuffer
from clora_feedback.train.state import AgentTrainState, LoRALayout, init_lora

log = logging.getLogger(__name__)


class ReleaseStates(Protocol):
    """The release path's record of versions (`store.registry.releases.ReleaseBook`)."""

    def rejected(self, agent: str, versions: set[int]) -> set[int]:
        """Which of `versions` the release path rejected (failed the gate, aborted canary)."""
        ...

    def record(self, agent: str, version: int, state: Literal["candidate"]) -> bool:
        """Mark a newly published version a candidate for the release path."""
        ...


@dataclass
class AgentRun:
    """One agent's training run, kept by the trainer between rounds."""

    state: AgentTrainState
    pulled_seq: int  # highest reward seq offered to admission
    trained_seq: int  # highest reward seq covered by a published version
    last_step_at: float = field(default_factory=time.monotonic)
    replay: ReplayBuffer = field(default_factory=lambda: ReplayBuffer(0))
    chain: set[int] = field(default_factory=set)  # release path: where it started + its candidates
    serving: int = 0  # release path: the active version at the last check
    moved_at: float | None = None  # release path: when the pointer last moved, at the last check


def fresh_seed(seed: int, agent: str) -> int:
    """The init seed of `agent`'s fresh adapter (one that never published): `trainer.seed`
    plus a stable digest of the name (not `hash`, which Python salts per process), so the
    same settings give the same first weights in every process and every run."""
    return seed + zlib.crc32(agent.encode()) % 10_000


def load_run(
    agent: str,
    registry: AdapterStore,
    limits: LoRALimits,
    config: TrainerConfig,
    releases: ReleaseStates | None,
) -> AgentRun:
    """Training state of `agent`: the registry version `resume_point` names, else a fresh
    adapter (`config.rank`, `config.alpha`) that fits `limits`.

    Every adapter the engine serves is a registry version (start-up imports,
    runtime loads and publishes all go through the registry), so the
    registry is the only place to read weights from.
    """
    targets = tuple(limits.target_modules)
    optimizer_state = None
    version = 0
    try:
        info = registry.active(agent)
    except NotFoundError:
        info = None
    serving = 0 if info is None else info.version
    resume = resume_point(registry, agent, serving, releases)
    start, trained = resume.version, resume.seq
    if resume.failed_attempts > config.max_retries:
        trained = max(trained, resume.attempted_seq)  # set aside: not trained a fifth time
    weights: LoRAWeights | None = None
    if start:
        weights, optimizer_state = registry.load(agent, start, limits=limits)
        version = start
    if weights is not None:
        layout = LoRALayout.build(limits, weights.rank, weights.alpha, targets)
        params = layout.from_weights(weights)
    else:
        layout = LoRALayout.build(limits, config.rank, config.alpha, targets)
        params = init_lora(layout, seed=fresh_seed(config.seed, agent))
    state = AgentTrainState.create(agent, layout, params, version=version)
    state.load_optimizer_state(optimizer_state)
    state.lr_scale = config.retry_lr_factor ** min(resume.failed_attempts, config.max_retries)
    if resume.failed_attempts:
        log.warning(
            "agent %s: %d failed attempt(s) from v%d: learning rate x%g%s", agent,
            resume.failed_attempts, start, state.lr_scale,
            f", samples up to seq {trained} set aside" if trained > resume.seq else "",
        )  # fmt: skip
    replay = ReplayBuffer(config.replay_buffer, seed=config.seed)
    run = AgentRun(state, pulled_seq=trained, trained_seq=trained, replay=replay)
    run.chain, run.serving = {serving, version}, serving
    try:
        run.moved_at = registry.agent(agent).activated_at
    except NotFoundError:
        run.moved_at = None
    return run


@dataclass(frozen=True)
class Resume:
    """Where a fresh run of an agent starts.

    Attributes:
        version: the version to train from (0: a fresh adapter).
        seq: the reward seq cursor of that version's line (samples after it train).
        failed_attempts: release path: attempts since the serving version that the release
            path refused: branches off the line from serving to `version` that hold a
            rejected version.
        attempted_seq: the highest reward seq those failed attempts trained on.
    """

    version: int
    seq: int
    failed_attempts: int = 0
    attempted_seq: int = 0


def resume_point(
    registry: AdapterStore, agent: str, serving: int, releases: ReleaseStates | None
) -> Resume:
    """Where a fresh run of `agent` starts: the version, its cursor, its failed attempts.

    Without the release path (`releases` None): the active version (`serving`), and
    the highest seq any version trained on (a rollback does not train the same samples
    again). On the release path: the newest candidate that descends from the serving
    version through no rejected or rolled-back version (else serving itself), and the
    highest seq of that line, so samples a rejected chain trained on are trained again
    from there.
    """
    try:
        versions = {v.version: v for v in registry.versions(agent)}
    except NotFoundError:
        return Resume(serving, 0)

    def seq(version: int) -> int:
        info = versions.get(version)
        return 0 if info is None else int((info.feedback_window or {}).get("to_seq", 0))

    if releases is None:
        return Resume(serving, max((seq(v) for v in versions), default=0))
    rejected = releases.rejected(agent, set(versions))

    def line(version: int, stop: int | None) -> list[int] | None:
        """`version` and its ancestors down to `stop` (exclusive; None: the root), or
        None when that line passes a version that must not be trained from."""
        out: list[int] = []
        cursor: int | None = version
        while cursor is not None and cursor != stop:
            info = versions.get(cursor)
            if info is None or cursor in rejected or info.status == "rolled_back":
                return None
            out.append(cursor)
            cursor = info.parent
        return out if cursor == stop else None

    below, cursor = [], serving or None  # serving's own line: what it has seen
    while cursor is not None and cursor in versions:
        below.append(seq(cursor))
        cursor = versions[cursor].parent
    start, cursor_seq = serving, max(below, default=0)
    for newest in sorted((v for v in versions if v > serving), reverse=True):
        found = line(newest, serving or None)
        if found is not None and not versions[newest].payload_pruned:
            start, cursor_seq = newest, max([seq(v) for v in found] + below, default=0)
            break

    # The line from serving to `start`; a failed attempt is a branch off it (a child of
    # one of its versions, not on it) that holds a rejected version.
    on_line: set[int | None] = {serving or None}
    up: int | None = start or None
    while up is not None and up != serving and up in versions:
        on_line.add(up)
        up = versions[up].parent

    def branch(version: int) -> int | None:
        """The first version off the line on `version`'s way up to it (None: not below it)."""
        child: int | None = None
        up: int | None = version
        while up not in on_line and up in versions:
            child, up = up, versions[up].parent
        return child if up in on_line else None

    failed = {b for b in map(branch, rejected) if b is not None}
    if not failed:  # the usual case: no walk over every version
        return Resume(start, cursor_seq)
    attempted = [seq(v) for v in versions if v > serving and branch(v) in failed]
    return Resume(start, cursor_seq, len(failed), max(attempted, default=0))
