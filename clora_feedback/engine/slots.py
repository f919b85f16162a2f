"""The embedded engine's adapter slots: which agent's weights sit in which slot of the model.

`AdapterSlots` keeps, per agent, a host copy of its adapter (the source of
truth) and maps agents onto the model's preallocated LoRA slots (slot 0 is the
base model). A slot is written only where no running row reads it:

- a new (or re-added) agent is only recorded; the step writes its weights into
  a slot when a request first needs them (`acquire`), evicting the least
  recently used idle adapter if no slot is empty;
- an update of a resident agent is staged: `stage` writes the new weights into
  the one spare slot (no agent owns it, no row reads it) on the caller's
  thread while decoding goes on, and the next step only flips the agent and its
  running rows to that slot (`begin_step`); the old slot becomes the spare;
- everything else that changed (updates of non-resident agents, superseded
  flips, removals) is marked dirty and settled by the step (`apply_changes`).

The engine owns one instance and shares its step condition with it, so every
change wakes the step loop. As vLLM keeps its `worker_manager` (loading) apart
from its `model_manager` (slots), this module keeps slot bookkeeping apart from
scheduling.

Each host copy gets a fresh content tag when it is staged, and a slot records
the tag of the weights written into it, so `identity_in(slot)` names exactly
what a row computed with: (agent, version, tag). The prefix cache keys its
blocks by it, so even an in-place reload of the same version number never
reuses keys/values computed with other weights.

Not here: scheduling, sampling and the forward pass (see `embedded`), the slot
buffers themselves (see `model`), reading adapters from disk (see `lora.peft_io`).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from clora_feedback.engine.decoder import SlottedDecoder
from clora_feedback.engine.types import BASE_VERSION
from clora_feedback.errors import NotFoundError
from clora_feedback.lora.weights import LoRAWeights

HostAdapters = dict[str, tuple[int, LoRAWeights]]
"""agent -> (version, host copy of its weights)."""

SlotIdentity = tuple[str | None, int, int]
"""(agent, version, content tag) of the weights a slot holds; (None, BASE_VERSION, 0) = base model."""


class Row(Protocol):
    """A running sequence as the slots see it: the slot its decode reads."""

    slot: int


@dataclass
class _Slot:
    agent: str | None = None
    version: int = BASE_VERSION
    last_used: float = 0.0
    tag: int = 0  # content tag of the host copy written here (0: nothing)


class AdapterSlots:
    """Host copies of every agent's adapter and their placement in the model's slots.

    Args:
        model: the model whose slot buffers are written (`num_slots` includes the spare).
        lock: the engine's step condition; every method that changes state takes it and
            notifies, so the step loop wakes. Methods marked "caller holds `lock`" are
            for the step thread inside its own critical section.
    """

    def __init__(self, model: SlottedDecoder, lock: threading.Condition) -> None:
        self._model = model
        self._lock = lock
        self._adapters: HostAdapters = {}  # host copies: the source of truth
        # agents whose host copy changed since it was written to a slot
        self._dirty: set[str] = set()
        # A fresh tag per staged host copy; `_step_tags` is the step's snapshot of `_tags`,
        # taken with the host copies, so a slot write records the tag of what it wrote.
        self._tag_counter = itertools.count(1)
        self._tags: dict[str, int] = {}
        self._step_tags: dict[str, int] = {}
        self._slots = [_Slot() for _ in range(model.num_slots)]
        # Staged updates: `_spare` is the one slot no agent owns and no row reads; `stage`
        # writes into it outside the step, `_flips` hands it to the agent at the next step.
        self._spare = model.num_slots - 1
        self._flips: dict[str, tuple[int, int]] = {}  # agent -> (version, tag) in the spare slot
        self._stage_lock = threading.Lock()  # one writer of the spare slot at a time
        self.last_publish_s: float | None = None

    # -- callers' side (any thread) -------------------------------------------------

    def stage(self, agent: str, version: int, weights: LoRAWeights) -> None:
        """Serve `weights` (validated, and owned from now on) as `agent`'s `version`."""
        with self._lock:
            if agent not in self._adapters:  # new (or re-added): written by the step if resident
                self._adapters[agent] = (version, weights)
                self._tags[agent] = next(self._tag_counter)
                self._dirty.add(agent)
                self._lock.notify_all()
                return
        with self._stage_lock:
            t0 = time.perf_counter()
            with self._lock:
                spare = self._spare
                for other in self._flips:  # superseded: the spare slot is about to be rewritten
                    if other != agent:
                        self._dirty.add(other)  # written by the step instead when resident
                self._flips.clear()
            # No row reads the spare slot and the step never writes it, so this copy runs
            # on the caller's thread while the engine keeps decoding.
            self._model.write_slot(spare, weights)
            with self._lock:
                self._adapters[agent] = (version, weights)
                tag = self._tags[agent] = next(self._tag_counter)
                self._flips[agent] = (version, tag)
                self._dirty.discard(agent)
                self._lock.notify_all()
            self.last_publish_s = time.perf_counter() - t0

    def remove(self, agent: str) -> None:
        """Stop serving `agent`; running rows keep the old weights until they finish."""
        with self._lock:
            if agent not in self._adapters:
                raise NotFoundError(f"no adapter is loaded for agent {agent!r}", param="lora_name")
            del self._adapters[agent]
            self._tags.pop(agent, None)
            self._dirty.add(agent)
            self._lock.notify_all()

    def __contains__(self, agent: object) -> bool:
        with self._lock:
            return agent in self._adapters

    def get(self, agent: str) -> tuple[int, LoRAWeights] | None:
        """The live (version, host copy of the weights) of an agent's adapter; do not mutate."""
        with self._lock:
            return self._adapters.get(agent)

    def versions(self) -> dict[str, int]:
        """agent -> live version."""
        with self._lock:
            return {a: v for a, (v, _) in self._adapters.items()}

    # -- the step's side ------------------------------------------------------------

    @property
    def pending(self) -> bool:
        """Changes wait for the step (caller holds `lock`)."""
        return bool(self._dirty or self._flips)

    def begin_step(self, running: Iterable[Row]) -> tuple[set[str], HostAdapters]:
        """Apply staged flips and take the changes for this step (caller holds `lock`).

        Returns:
            the dirty agents (for `apply_changes`) and a snapshot of the host copies.
        """
        self._apply_flips(running)
        dirty, self._dirty = self._dirty, set()
        self._step_tags = dict(self._tags)
        return dirty, dict(self._adapters)

    def _apply_flips(self, running: Iterable[Row]) -> None:
        """Hand the staged spare slot to its agent (bookkeeping only).

        The agent's running rows move with it, so requests in flight take the new
        version from this step on (each token records its version). A flip for an
        agent that is not resident is dropped: its host copy is already current and
        is written when a request next needs it.
        """
        rows = list(running)
        for agent, (version, tag) in self._flips.items():
            old = self._slot_of(agent)
            entry = self._adapters.get(agent)
            if old is None or entry is None or entry[0] != version or self._tags[agent] != tag:
                continue
            new = self._spare
            self._slots[new] = _Slot(
                agent=agent, version=version, last_used=self._slots[old].last_used, tag=tag
            )
            self._slots[old] = _Slot()
            for row in rows:
                if row.slot == old:
                    row.slot = new
            self._spare = old
        self._flips.clear()
        self._lock.notify_all()

    def apply_changes(
        self, dirty: set[str], adapters: HostAdapters, running: Iterable[Row]
    ) -> None:
        """Rewrite or clear the slots of dirty resident agents (the step thread, no lock)."""
        busy = {row.slot for row in running}
        for agent in dirty:
            slot = self._slot_of(agent)
            if slot is None:
                continue
            if agent in adapters:
                version, weights = adapters[agent]
                self._model.write_slot(slot, weights)
                self._slots[slot].version = version
                self._slots[slot].tag = self._step_tags[agent]
            elif slot not in busy:
                self._model.clear_slot(slot)
                self._slots[slot] = _Slot()
            # else: removed while in use; running rows keep the old weights, freed when idle

    def acquire(self, agent: str, adapters: HostAdapters, running: Iterable[Row]) -> int | None:
        """The slot serving `agent`, written now if it is not resident; None when every
        slot is busy with other agents' running rows (the step thread, no lock)."""
        slot = self._slot_of(agent)
        if slot is None:
            busy = {row.slot for row in running} | {self._spare}
            idle = [i for i in range(1, len(self._slots)) if i not in busy]
            if not idle:
                return None
            # Prefer an empty slot, else evict the least recently used idle adapter.
            slot = min(
                idle, key=lambda i: (self._slots[i].agent is not None, self._slots[i].last_used)
            )
            version, weights = adapters[agent]
            self._model.write_slot(slot, weights)
            self._slots[slot] = _Slot(agent=agent, version=version, tag=self._step_tags[agent])
        self._slots[slot].last_used = time.monotonic()
        return slot

    def version_in(self, slot: int) -> int:
        """The adapter version slot `slot` holds now (`BASE_VERSION` for slot 0)."""
        return self._slots[slot].version

    def identity_in(self, slot: int) -> SlotIdentity:
        """What slot `slot` holds now: (agent, version, content tag) (the step thread)."""
        entry = self._slots[slot]
        return (entry.agent, entry.version, entry.tag)

    def _slot_of(self, agent: str) -> int | None:
        for i, slot in enumerate(self._slots):
            if i and slot.agent == agent:
                return i
        return None
