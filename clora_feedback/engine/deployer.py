"""The deployer: makes the engine serve what the adapter registry's active pointer says.

The registry's active pointer is the one truth of what serves. Everything that
changes it (a release's promotion, a trainer publish with the release path off,
operator rollback, the runtime load/unload routes) goes through here or only
moves the pointer, and the deployer brings the engine to it. A release also
loads extra arms under names that are not agents (`release.arms`: a canary
beside the serving version, a candidate while the gate evaluates it):
`load_arm` / `unload_arm`, checked like every load. `serving(agent)` is the one
source that every reporter reads (`/v1/models`, the gateway's routes, the agent
table).

One order, everywhere a move starts in this process:

1. resolve the target and install it in the engine (the engine validates it
   against its limits before evicting anything, and stages it beside what
   serves; it serves from the next decode step);
2. move the pointer with the registry's compare-and-set;
3. if the move fails, bring the engine back to what the pointer still names.

Why engine first: loading is what proves a version servable, so a version that
fails to load never reaches the pointer and the previous one keeps serving;
and a trainer's publish stays as fast as before (its hand-off lands while the
registry writes the version durably, and is undone if the registry refuses).
The engine and the pointer disagree at most for the duration of one move.

A pointer moved elsewhere (another process on the same registry) is followed
at once on PostgreSQL: with `listen_url`, the deployer LISTENs for the registry's
`NOTIFY clora_adapters, '<agent>'` (`store.notify`) and syncs that agent when one
arrives (reconnecting on failure, and resynchronising every agent after each
reconnect). A watcher that polls the registry every `poll_interval_s` is the
fallback, and the only path on SQLite. There the pointer moved first; a version
that fails to load here is logged, the previous one keeps serving (`serving`
says so), and it is not retried until the pointer moves again. The watcher never
moves the pointer back: other engines may serve it.

Start-up and every move on an engine that reads adapters lazily (the embedded
one, `LazyAdapters`) read metadata only: the version is checked
(`check_loadable`: its row and manifest) and registered by its directory, and
the engine reads the weights when a request first needs them (its host cache,
`engine.host_adapter_cache_mb`, may drop them again and re-read them later).
At start-up every agent is registered in one pass off the event loop. A
trainer's hand-off is served from memory and named by its directory once the
registry has written it, so it too may leave the host cache.

Every load is checked first (`AdapterRegistry.check_loadable` / `load`,
`check_source` for a runtime load): a version whose payload retention pruned,
or whose manifest records another base model (weights, tokenizer, chat
template digests), is refused before the engine is touched, so the previous
version keeps serving. Each newly served version is reported to `on_installed`
(the no-op probe, `engine.probe`, runs there, off the serving path); the versions
`start` restores are not (they served before; probing them would read every
agent's weights at start-up).

One exception to "engine first": a runtime load (`adopt`) on an engine that reads
adapters from a directory (vLLM) publishes first, so the engine is given the
registry's immutable copy rather than the caller's directory, and moves the
pointer back if the engine then refuses it.

Not here: the registry's durability (`clora_feedback.store.registry`), the
engine's slots (`embedded`), what to release (`clora_feedback.release`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypeVar, runtime_checkable

from clora_feedback.engine.base import Engine
from clora_feedback.errors import CloraError, NotFoundError
from clora_feedback.lifecycle import BackgroundTask
from clora_feedback.lora.peft_io import load_peft_adapter
from clora_feedback.store.versions import AdapterRef, AdapterStore, VersionInfo, check_pointer_move

if TYPE_CHECKING:
    from clora_feedback.lora.weights import LoRAWeights

log = logging.getLogger(__name__)

T = TypeVar("T")


@runtime_checkable
class InMemoryAdapters(Protocol):
    """An engine in this process that takes adapter tensors directly (the embedded one).

    The deployer uses it for a co-located trainer's hand-off (a slot copy, no disk
    read) and to undo one; every other move goes through the `Engine` Protocol.
    """

    def set_adapter(
        self,
        agent: str,
        version: int,
        weights: LoRAWeights,
        *,
        checked: bool = False,
        owned: bool = False,
    ) -> None: ...

    def remove_adapter(self, agent: str) -> None: ...

    def adapter_weights(self, agent: str) -> tuple[int, LoRAWeights] | None: ...


@runtime_checkable
class LazyAdapters(Protocol):
    """An engine that takes a registry version by its directory and reads the weights
    when a request first needs them (the embedded one), so start-up reads no weights."""

    def register_adapter(self, agent: str, version: int, path: Path) -> None: ...

    def set_adapter_source(self, agent: str, version: int, path: Path) -> None: ...


class Deployer(BackgroundTask):
    """Brings one engine to the registry's active pointers, and moves them in one order.

    Args:
        engine: the engine to keep in step (started before `start`).
        registry: the adapter store whose active pointers say what serves.
        poll_interval_s: how often the watcher reads the pointers (moves made
            elsewhere are followed within this).
        base_model: recorded in versions adopted at runtime (default the engine's name).
        on_stop: called by `stop` (e.g. to close a registry the deployer was given to own).
        listen_url: the registry's `postgresql://` URL to LISTEN on for pointer moves
            (None: polling only).
        on_installed: called on the event loop with (agent, version) each time the engine
            starts serving a version (e.g. `NoopProbe.schedule`); it must not block.
    """

    def __init__(
        self,
        engine: Engine,
        registry: AdapterStore,
        *,
        poll_interval_s: float = 1.0,
        base_model: str | None = None,
        on_stop: Callable[[], None] | None = None,
        listen_url: str | None = None,
        on_installed: Callable[[str, int], None] | None = None,
    ) -> None:
        self.engine = engine
        self._on_installed = on_installed
        self.registry = registry
        self.poll_interval_s = poll_interval_s
        self.base_model = base_model or engine.model_name
        # An engine that promises in-memory adapters gets the trainer's tensors directly.
        in_memory = engine.capabilities.in_memory_adapters
        self._in_memory = engine if in_memory and isinstance(engine, InMemoryAdapters) else None
        self._lazy = engine if in_memory and isinstance(engine, LazyAdapters) else None
        self._on_stop = on_stop
        self._serving: dict[str, int] = {}  # what the engine serves, by this deployer's hand
        self._handoffs: dict[str, int] = {}  # trainer hand-offs whose pointer has not moved yet
        self._failed: dict[str, int] = {}  # pointer versions that failed to load here
        self._arms: dict[str, int] = {}  # release arms (`release.arms` names) -> version
        self._serial = asyncio.Lock()  # one move at a time on the event loop
        # Held by every move while it changes the engine; the trainer's thread holds it
        # only for one staged slot write (or its undo), so the event loop waits briefly.
        self._engine_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None  # for hand-offs from threads
        self._restoring = False  # `start`'s reconcile: installs are not reported
        self.listen_url = listen_url
        self._listener: asyncio.Task[None] | None = None
        self._nudges: set[asyncio.Task[None]] = set()
        self.notifications: dict[str, int] = {}
        """Pointer notifications received, by agent (observability; tests wait on it)."""
        self.listening = asyncio.Event()
        """Set once LISTEN is in place and the agents were resynchronised after it."""

    # -- lifecycle ------------------------------------------------------------------------

    task_name = "clora-deployer"

    async def start(self) -> None:
        """Bring every agent to its pointer, then follow the pointers in the background."""
        self._loop = asyncio.get_running_loop()
        if self._lazy is not None:
            await self._register_all()
        self._restoring = True  # what served before the start is no newly served version
        try:
            await self.reconcile()
        finally:
            self._restoring = False
        await super().start()
        if self.listen_url is not None and self._listener is None:
            from clora_feedback.store.notify import listen_pointer_moves

            self._listener = asyncio.create_task(
                listen_pointer_moves(self.listen_url, self._on_notified, self._caught_up),
                name="clora-deployer-listen",
            )

    async def stop(self) -> None:
        listener, self._listener = self._listener, None
        for task in [*([listener] if listener is not None else []), *self._nudges]:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await super().stop()
        if self._on_stop is not None:
            self._on_stop()

    async def _register_all(self) -> None:
        """Start-up on a lazy engine: every active version registered by its directory in
        one pass off the event loop (a registry row, a manifest, an adapter config and a
        safetensors header per agent; no weights), so start-up is O(agents) in metadata.
        A version that cannot serve is logged and left to `reconcile`'s rules. Restoring
        what served before is not a newly served version: `on_installed` (the no-op probe,
        which reads the weights) is not told, so 1,000 agents start without 1,000 reads."""
        lazy = self._lazy
        assert lazy is not None

        def register() -> list[tuple[str, int]]:
            done = []
            for info in self.registry.agents():
                agent, version = info.agent, info.active_version
                if version is None:
                    continue
                try:
                    path = self.registry.check_loadable(agent, version).path
                    lazy.register_adapter(agent, version, path)
                except CloraError as exc:
                    log.error("agent %s: cannot serve active version %s (%s)", agent, version,
                              exc.message)  # fmt: skip
                    self._failed[agent] = version
                    continue
                done.append((agent, version))
            return done

        t0 = time.perf_counter()
        async with self._moving():
            done = await asyncio.to_thread(register)
        for agent, version in done:
            self._serving[agent] = version
        log.info("deployer: %d agents registered by directory in %.2f s (weights read on "
                 "first use)", len(done), time.perf_counter() - t0)  # fmt: skip

    def _on_notified(self, agent: str) -> None:
        """A pointer moved (`NOTIFY`): sync that agent now, off the listener's loop."""
        self.notifications[agent] = self.notifications.get(agent, 0) + 1
        task = asyncio.create_task(self._nudge(agent), name=f"clora-deployer-sync-{agent}")
        self._nudges.add(task)
        task.add_done_callback(self._nudges.discard)

    async def _caught_up(self) -> None:
        """After every LISTEN (re)connect: moves made while nothing listened were missed."""
        try:
            await self.reconcile()
        except CloraError as exc:
            log.error("deployer: reading the registry failed: %s", exc.message)
        self.listening.set()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval_s)
            try:
                await self.reconcile()
            except CloraError as exc:  # e.g. the registry is briefly locked: try next time
                log.error("deployer: reading the registry failed: %s", exc.message)

    # -- what serves ----------------------------------------------------------------------

    def serving(self, agent: str) -> int | None:
        """The version the engine serves for `agent` (None: the base model). The one source."""
        return self._serving.get(agent)

    def served(self) -> dict[str, int]:
        """Every agent with a served version."""
        return dict(self._serving)

    async def reconcile(self) -> None:
        """Bring every agent whose pointer moved to it; failures are logged per agent."""
        for info in await asyncio.to_thread(self.registry.agents):
            agent, want = info.agent, info.active_version
            if want == self.serving(agent) or agent in self._handoffs:
                continue
            if want is not None and self._failed.get(agent) == want:
                continue  # already failed here: wait for the pointer to move again
            try:
                await self.sync(agent)
            except CloraError as exc:
                log.error(
                    "agent %s: cannot serve active version %s (%s); still serving %s",
                    agent, want, exc.message, self.serving(agent),
                )  # fmt: skip

    async def sync(self, agent: str) -> int | None:
        """Bring `agent` to its pointer now; returns the version now served.

        Raises:
            CloraError: the pointer's version cannot be loaded (the previous one keeps serving).
        """
        async with self._moving():
            return await self._follow(agent)

    # -- moves that start here: engine first, then the pointer ----------------------------

    async def activate(
        self, agent: str, version: int, *, expected_active: int | None, reason: str
    ) -> VersionInfo:
        """Serve `version` again and make it active (a rollback), if `expected_active` still is.

        Raises:
            NotFoundError: unknown agent or version.
            ConflictError: `version` is already active (`already_active`) or the active
                version is not `expected_active` (`active_changed`); nothing changed.
            AdapterError, StoreError: the version cannot be loaded; nothing changed.
        """
        async with self._moving():
            active = await asyncio.to_thread(self._pointer, agent)
            check_pointer_move(agent, active, version, expected_active)
            await self._install(await self._ref(agent, version))
            rollback = functools.partial(
                self.registry.rollback, agent, version, reason=reason, expected_active=active
            )
            return await self._then_move(agent, rollback)

    async def adopt(self, agent: str, path: Path) -> int:
        """Serve the PEFT adapter at `path` as a new immutable version of `agent` and activate it.

        Returns:
            The new version number.

        Raises:
            AdapterError: the adapter is missing, malformed or exceeds the engine's limits
                (read and checked before anything changes); `BaseMismatchError` when its
                manifest records another base model.
            ConflictError: the agent is pinned; the previous version keeps serving.
        """
        path = Path(path)
        await asyncio.to_thread(self.registry.check_source, path)  # base digests or name hint
        weights = await asyncio.to_thread(load_peft_adapter, path, limits=self.engine.lora_limits)
        async with self._moving():
            active = await asyncio.to_thread(self._pointer, agent)
            version = await asyncio.to_thread(self.registry.next_version, agent)
            publish = functools.partial(
                self.registry.publish,
                agent,
                weights,
                optimizer_state=None,
                base_model=self.base_model,
                parent=active,
                step=0,
                metrics={},
                feedback_window={"source": str(path.resolve())},
                version=version,
            )
            if self._in_memory is not None:  # the checked tensors go in first, from memory
                await self._install(AdapterRef(agent, version, path, weights))
                info = await self._then_move(agent, publish)
                self._stored(agent, version, info.path)
                return version
            # An engine that reads a directory (vLLM) gets the registry's immutable copy, which
            # exists once published: publish, then load it; undo the move if it cannot load.
            info = await asyncio.to_thread(publish)
            try:
                await self._install(AdapterRef(agent, version, info.path, None))
            except BaseException:
                await asyncio.to_thread(self._undo_adopt, agent, version, active)
                raise
            return version

    def _undo_adopt(self, agent: str, version: int, previous: int | None) -> None:
        """Move the pointer back from an adopted `version` the engine could not load."""
        reason = f"adopted version {version} failed to load"
        try:
            if previous is None:
                self.registry.deactivate(agent, expected_active=version)
            else:
                self.registry.rollback(agent, previous, reason=reason, expected_active=version)
        except CloraError as exc:  # the pointer moved meanwhile: it is someone else's now
            log.error("agent %s: could not undo the adoption of v%d: %s", agent, version,
                      exc.message)  # fmt: skip

    async def install_then(self, agent: str, version: int, move: Callable[[], T]) -> T:
        """Serve `version` as `agent`'s serving version, then run `move` (the pointer's
        compare-and-set, e.g. a release's promotion); if `move` raises, the engine goes
        back to the pointer. The one order of every move, for a caller that moves the
        pointer its own way.

        Raises:
            CloraError: the version cannot be loaded (nothing changed), or `move`'s error.
        """
        async with self._moving():
            await self._install(await self._ref(agent, version))
            return await self._then_move(agent, move)

    # -- release arms: extra engine names beside the serving version ----------------------

    async def load_arm(self, name: str, agent: str, version: int) -> None:
        """Load `agent`'s `version` under the engine name `name` (a canary or a gate arm,
        `release.arms`), beside its serving version; checked like every load.

        Raises:
            CloraError: the version cannot be loaded (nothing served changes).
        """
        info = await asyncio.to_thread(self.registry.get, agent, version)
        ref = await self._ref_of(info)
        async with self._moving():
            await self.engine.load_adapter(AdapterRef(name, version, ref.path, ref.weights))
            self._arms[name] = version

    async def unload_arm(self, name: str) -> None:
        """Unload the arm `name` (a no-op when it is not loaded)."""
        async with self._moving():
            await self.engine.unload_adapter(name)
            self._arms.pop(name, None)

    def arms(self) -> dict[str, int]:
        """Release arms loaded by this deployer: engine name -> version."""
        return dict(self._arms)

    async def deactivate(self, agent: str) -> None:
        """Stop serving `agent`'s adapter and point it at no version (an unload).

        Raises:
            NotFoundError: the agent has no active version.
        """
        async with self._moving():
            active = await asyncio.to_thread(self._pointer, agent)
            if active is None:
                raise NotFoundError(
                    f"agent {agent!r} has no active adapter version", code="no_active_version"
                )
            await self.engine.unload_adapter(agent)
            self._serving.pop(agent, None)
            move = functools.partial(self.registry.deactivate, agent, expected_active=active)
            await self._then_move(agent, move)

    # -- a co-located trainer's hand-off ---------------------------------------------------

    @contextlib.contextmanager
    def handoff(self, ref: AdapterRef) -> Iterator[None]:
        """Serve `ref` from memory now, while the caller (a trainer's thread) moves the pointer.

        With an in-process engine, `ref.weights` go straight into its spare slot (no
        disk read; they must already fit `engine.lora_limits` and are never mutated
        afterwards). If the block raises (the registry refused the publish), the engine
        goes back to what the pointer names. Other engines (vLLM) are told to load the
        version from its directory as soon as the block ends (the pointer moved); the
        watcher is the fallback. Thread-safe; blocking.
        """
        engine, agent = self._in_memory, ref.agent
        with self._engine_lock:
            previous = engine.adapter_weights(agent) if engine is not None else None
            if engine is not None and ref.weights is not None:
                engine.set_adapter(agent, ref.version, ref.weights, checked=True, owned=True)
                self._serving[agent] = ref.version
            self._handoffs[agent] = ref.version
        try:
            yield
        except BaseException:
            with self._engine_lock:
                self._handoffs.pop(agent, None)
                try:
                    self._revert_in_memory(agent, previous)
                except Exception:  # the watcher retries; the caller's error matters more
                    log.exception(
                        "agent %s: could not undo the hand-off of v%d", agent, ref.version
                    )
            raise
        with self._engine_lock:
            self._handoffs.pop(agent, None)
        self._stored(agent, ref.version)
        if engine is not None and self._on_installed is not None and self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                self._loop.call_soon_threadsafe(self._on_installed, agent, ref.version)
        if engine is None and self._loop is not None and not self._loop.is_closed():
            # An engine that loads from the registry's directory (vLLM): load the version
            # now rather than at the watcher's next poll, which adds up to poll_interval_s.
            asyncio.run_coroutine_threadsafe(self._nudge(agent), self._loop)

    def _stored(self, agent: str, version: int, path: Path | None = None) -> None:
        """`version` is durable now: a lazy engine may drop its host copy and read it
        back from the version's directory (blocking: one registry read without `path`)."""
        if self._lazy is None:
            return
        try:
            path = path or self.registry.get(agent, version).path
            self._lazy.set_adapter_source(agent, version, path)
        except CloraError as exc:  # the copy stays in memory: only the budget suffers
            log.warning("agent %s: v%d stays in host memory: %s", agent, version, exc.message)

    async def _nudge(self, agent: str) -> None:
        try:
            await self.sync(agent)
        except CloraError as exc:  # the watcher retries
            log.warning("deployer: agent %s: loading the new version failed: %s", agent,
                        exc.message)  # fmt: skip

    def _revert_in_memory(self, agent: str, previous: tuple[int, LoRAWeights] | None) -> None:
        engine = self._in_memory
        if engine is None:
            return
        pointer = self._pointer(agent)
        if pointer is None:
            if self.engine.adapter_version(agent) is not None:
                engine.remove_adapter(agent)
            self._serving.pop(agent, None)
            return
        if previous is not None and previous[0] == pointer:
            weights = previous[1]  # the engine's own copy: already checked, never mutated
        else:  # the pointer moved meanwhile (a rollback raced the publish)
            weights, _ = self.registry.load(agent, pointer, limits=self.engine.lora_limits)
        engine.set_adapter(agent, pointer, weights, checked=True, owned=True)
        self._serving[agent] = pointer

    # -- plumbing --------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _moving(self) -> AsyncIterator[None]:
        async with self._serial:
            with self._engine_lock:
                yield

    def _active(self, agent: str) -> VersionInfo | None:
        try:
            return self.registry.active(agent)
        except NotFoundError:
            return None

    def _pointer(self, agent: str) -> int | None:
        info = self._active(agent)
        return None if info is None else info.version

    async def _ref(self, agent: str, version: int) -> AdapterRef:
        """The version as the engine is asked to serve it."""
        return await self._ref_of(await asyncio.to_thread(self.registry.get, agent, version))

    async def _ref_of(self, info: VersionInfo) -> AdapterRef:
        """`info` as the engine is asked to serve it: its directory (an engine that reads it
        itself: no further registry read), and for an in-process engine its tensors, read
        with the registry's content-hash check."""
        weights = None
        if self._lazy is not None:  # manifests only: the engine reads weights on first use
            await asyncio.to_thread(self.registry.check_loadable, info.agent, info.version)
        elif self._in_memory is not None:  # `load` refuses a pruned or other-base version
            weights, _ = await asyncio.to_thread(
                self.registry.load, info.agent, info.version, limits=self.engine.lora_limits
            )
        else:  # the engine reads the directory: the same refusals, from the manifest
            await asyncio.to_thread(self.registry.check_loadable, info.agent, info.version)
        return AdapterRef(info.agent, info.version, info.path, weights)

    async def _install(self, ref: AdapterRef) -> None:
        if self._lazy is not None and ref.weights is None and ref.path is not None:
            # A registry version by its directory: checked (config, header), read on first use.
            await asyncio.to_thread(self._lazy.register_adapter, ref.agent, ref.version, ref.path)
        else:
            await self.engine.load_adapter(ref)
        self._serving[ref.agent] = ref.version
        self._failed.pop(ref.agent, None)
        if self._on_installed is not None and not self._restoring:
            self._on_installed(ref.agent, ref.version)

    async def _then_move(self, agent: str, move: Callable[[], T]) -> T:
        """Step 2 of a move: the pointer; on failure, step 3: the engine back to the pointer."""
        try:
            return await asyncio.to_thread(move)
        except BaseException:
            try:
                await self._follow(agent)
            except Exception:
                log.exception("agent %s: could not bring the engine back to its pointer", agent)
            raise

    async def _follow(self, agent: str) -> int | None:
        """Bring the engine to `agent`'s pointer (the caller holds the move locks)."""
        info = await asyncio.to_thread(self._active, agent)  # one read: the version and its path
        want = None if info is None else info.version
        if want == self.serving(agent):
            return want
        if info is None:
            await self.engine.unload_adapter(agent)
            self._serving.pop(agent, None)
            log.info("agent %s: serving the base model (no active version)", agent)
            return None
        try:
            await self._install(await self._ref_of(info))
        except CloraError:
            self._failed[agent] = info.version
            raise
        log.info("agent %s: serving active version %d", agent, info.version)
        return info.version
