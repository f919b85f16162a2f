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

Host copies have a budget (`host_cache_bytes`, from `engine.host_adapter_cache_mb`).
A host copy whose version lives in a directory (its `source`: the registry's
immutable version directory) may be dropped, least recently used first, when
the copies exceed the budget; the agent stays registered (cold) and its
weights are read again, on a reader thread, when a request next needs them
(`warm`, started by `add_request` before the request waits for a row). A
version given only as tensors (a trainer's hand-off, before the registry has
written it) stays until `set_source` names its directory. `register` records a
version by its directory alone, so start-up reads no weights at all.

Not here: scheduling, sampling and the forward pass (see `embedded`), the slot
buffers themselves (see `decoder`), reading adapters from disk (see `lora.peft_io`).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from clora_feedback.engine.decoder import SlottedDecoder
from clora_feedback.engine.types import BASE_VERSION
from clora_feedback.errors import NotFoundError
from clora_feedback.lora.weights import LoRAWeights

log = logging.getLogger(__name__)

HostAdapters = dict[str, tuple[int, LoRAWeights | None]]
"""agent -> (version, host copy of its weights; None while cold: not in host memory)."""

AdapterReader = Callable[[Path], LoRAWeights]
"""Reads (and validates) a version directory's weights; runs on a reader thread."""

SlotIdentity = tuple[str | None, int, int]
"""(agent, version, content tag) of the weights a slot holds; (None, BASE_VERSION, 0) = base model."""


class Row(Protocol):
    """A running sequence as the slots see it: the slot its decode reads."""

    slot: int


@dataclass
class _Host:
    """One agent's registered version: its weights when in host memory, where they live."""

    version: int
    weights: LoRAWeights | None
    source: Path | None = None  # the version's directory (None: only in memory, never dropped)
    reading: bool = False  # a reader thread is reading `source`
    error: Exception | None = None  # the last read failed: handed to the next request once
    size: int = 0  # bytes of `weights` when held

    def __post_init__(self) -> None:
        self.hold(self.weights)

    def hold(self, weights: LoRAWeights | None) -> None:
        self.weights = weights
        self.size = 0 if weights is None else weights.num_bytes()

    @property
    def nbytes(self) -> int:
        return 0 if self.weights is None else self.size


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
        host_cache_bytes: the budget of host copies (None: unbounded); copies with a
            source directory beyond it are dropped, least recently used first.
        reader: reads a cold agent's version directory (validating it); required for
            `register` and for dropping copies.
    """

    def __init__(
        self,
        model: SlottedDecoder,
        lock: threading.Condition,
        *,
        host_cache_bytes: int | None = None,
        reader: AdapterReader | None = None,
    ) -> None:
        self._model = model
        self._lock = lock
        self._adapters: OrderedDict[str, _Host] = OrderedDict()  # least recently used first
        self.host_cache_bytes = host_cache_bytes
        self._reader = reader
        self._readers = ThreadPoolExecutor(max_workers=2, thread_name_prefix="clora-adapter-read")
        self.reads = 0  # version directories read for cold agents (observability, tests)
        self.drops = 0  # host copies dropped to stay within the budget
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
            entry = self._adapters.get(agent)
            if entry is None or self._slot_of(agent) is None:
                # new, re-added or not in a slot: written by the step when a request needs it
                self._put(agent, _Host(version, weights))
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
                self._put(agent, _Host(version, weights))
                self._flips[agent] = (version, self._tags[agent])
                self._dirty.discard(agent)
                self._lock.notify_all()
            self.last_publish_s = time.perf_counter() - t0

    def register(self, agent: str, version: int, source: Path) -> None:
        """Serve `agent`'s `version` from the directory `source`, read when first needed
        (checked by the caller; a read that fails then fails the requests waiting for it)."""
        if self._reader is None:
            raise ValueError("registering an adapter by its directory needs a reader")
        with self._lock:
            self._put(agent, _Host(version, None, source))
            self._dirty.add(agent)
            self._lock.notify_all()

    def set_source(self, agent: str, version: int, source: Path) -> None:
        """`agent`'s `version` now also lives in `source`: its host copy may be dropped."""
        with self._lock:
            entry = self._adapters.get(agent)
            if entry is not None and entry.version == version and self._reader is not None:
                entry.source = source
                self._trim()

    def _put(self, agent: str, entry: _Host) -> None:
        """Record `entry` as `agent`'s (most recently used) version, fresh tag (holds `lock`)."""
        self._adapters[agent] = entry
        self._adapters.move_to_end(agent)
        self._tags[agent] = next(self._tag_counter)
        self._trim()

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
        """The live (version, host copy) of an agent's adapter; do not mutate. A cold
        agent's weights are read on the caller's thread (and kept, as by `warm`)."""
        with self._lock:
            entry = self._adapters.get(agent)
            if entry is None:
                return None
            if entry.weights is not None:
                return entry.version, entry.weights
        assert self._reader is not None and entry.source is not None  # cold: has a source
        weights = self._reader(entry.source)
        with self._lock:
            self.reads += 1
            if self._adapters.get(agent) is entry and entry.weights is None:
                entry.hold(weights)
                self._adapters.move_to_end(agent)
                self._trim(keep=agent)
        return entry.version, weights

    def version(self, agent: str) -> int | None:
        """The live version of `agent` (None: not registered), in host memory or not."""
        with self._lock:
            entry = self._adapters.get(agent)
            return None if entry is None else entry.version

    def versions(self) -> dict[str, int]:
        """agent -> live version."""
        with self._lock:
            return {a: e.version for a, e in self._adapters.items()}

    def host_bytes(self) -> int:
        """Bytes of host copies held now."""
        with self._lock:
            return sum(e.nbytes for e in self._adapters.values())

    # -- the host cache: drop least recently used copies, read them back on demand -----

    def warm(self, agent: str, *, hint: bool = False) -> Exception | None:
        """Start reading `agent`'s weights if they are not in host memory (any thread).

        Args:
            hint: a prefetch: a failed earlier read is left for the next request to report.

        Returns:
            the error of a failed earlier read (once; the next call reads again), else None.
        """
        with self._lock:
            entry = self._adapters.get(agent)
            if entry is None or entry.weights is not None or entry.reading:
                return None
            if entry.error is not None and hint:
                return None
            if entry.error is not None:
                error, entry.error = entry.error, None
                return error
            if entry.source is None:  # cannot happen: a copy without a source is never dropped
                return NotFoundError(f"the adapter of agent {agent!r} is not in memory")
            entry.reading = True
            self._readers.submit(self._read, agent, entry)
            return None

    def _read(self, agent: str, entry: _Host) -> None:
        assert self._reader is not None and entry.source is not None
        t0 = time.perf_counter()
        try:
            weights = self._reader(entry.source)
        except Exception as exc:  # handed to the requests that wait for it
            log.error("agent %s: reading v%d from %s failed: %s", agent, entry.version,
                      entry.source, exc)  # fmt: skip
            with self._lock:
                entry.reading, entry.error = False, exc
                self._lock.notify_all()
            return
        with self._lock:
            entry.reading = False
            self.reads += 1
            if self._adapters.get(agent) is entry:  # not replaced meanwhile
                entry.hold(weights)
                self._adapters.move_to_end(agent)
                self._trim(keep=agent)
            self._lock.notify_all()
        log.debug("agent %s: v%d read in %.1f ms", agent, entry.version,
                  (time.perf_counter() - t0) * 1e3)  # fmt: skip

    def _trim(self, keep: str | None = None) -> None:
        """Drop least recently used host copies that have a source until within budget
        (holds `lock`). A dropped agent's slot keeps its weights while it stays resident."""
        budget = self.host_cache_bytes
        if budget is None or self._reader is None:
            return
        held = sum(e.nbytes for e in self._adapters.values())
        for agent, entry in list(self._adapters.items()):
            if held <= budget:
                return
            if agent == keep or entry.weights is None or entry.source is None:
                continue
            if agent in self._flips or agent in self._dirty:
                continue  # the step still writes these weights into a slot
            held -= entry.nbytes
            entry.hold(None)
            self.drops += 1

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
        return dirty, {a: (e.version, e.weights) for a, e in self._adapters.items()}

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
            if old is None or entry is None or entry.version != version or self._tags[agent] != tag:
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
        """Rewrite or clear the slots of dirty resident agents (the step thread, no lock).

        A dirty agent whose new version is not in host memory (registered by its
        directory) leaves its slot: running rows finish on the old weights, and the
        new version is written into a slot once read."""
        busy = {row.slot for row in running}
        for agent in dirty:
            slot = self._slot_of(agent)
            if slot is None:
                continue
            version, weights = adapters.get(agent, (BASE_VERSION, None))
            if weights is not None:
                self._model.write_slot(slot, weights)
                self._slots[slot].version = version
                self._slots[slot].tag = self._step_tags[agent]
            elif slot not in busy:
                self._model.clear_slot(slot)
                self._slots[slot] = _Slot()
            else:  # in use: its rows keep the old weights (and version); freed when idle
                self._slots[slot].agent = None

    def acquire(self, agent: str, adapters: HostAdapters, running: Iterable[Row]) -> int | None:
        """The slot serving `agent`, written now if it is not resident; None when every
        slot is busy with other agents' running rows, or its weights are not in host
        memory yet (`warm` reads them) (the step thread, no lock)."""
        slot = self._slot_of(agent)
        if slot is None:
            version, weights = adapters[agent]
            if weights is None:
                return None
            busy = {row.slot for row in running} | {self._spare}
            idle = [i for i in range(1, len(self._slots)) if i not in busy]
            if not idle:
                return None
            # Prefer an empty slot, else evict the least recently used idle adapter.
            slot = min(
                idle, key=lambda i: (self._slots[i].agent is not None, self._slots[i].last_used)
            )
            self._model.write_slot(slot, weights)
            self._slots[slot] = _Slot(agent=agent, version=version, tag=self._step_tags[agent])
        self._slots[slot].last_used = time.monotonic()
        return slot

    def resident(self, agent: str) -> bool:
        """Whether `agent` holds a slot (the step thread)."""
        return self._slot_of(agent) is not None

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
