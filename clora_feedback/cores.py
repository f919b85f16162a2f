"""How this process's compute threads share the CPU cores: OpenMP waits and team sizes.

On a CPU every torch GEMM and every large elementwise op is an OpenMP parallel
region; between regions the team's workers wait for the next one. Measured on
2-core VMs (docs/benchmarks.md, `python -m scripts.openmp_waits`):

- Workers that sleep (`OMP_WAIT_POLICY=PASSIVE`) pay a futex wake-up per region,
  ~100 us here: a one-row bf16 decode step of the default model takes 41 ms
  instead of 23, a swap step 0.93 s instead of 0.58. A brief spin
  (`GOMP_SPINCOUNT`, `SPIN_COUNT` pauses) keeps them awake between back-to-back
  regions and lets them sleep when the thread is idle.
- libgomp cuts that spin to 100 pauses for the whole process once its thread
  pools hold more threads than there are CPUs, and a pool lives as long as the
  thread that made it. So one full-width pool per process: the engine thread's
  (the serving path). The main thread computes with one OpenMP thread (no
  pool), and a trainer beside an engine with half the cores (on 2 cores: one,
  no pool either); a trainer with no engine in its process takes every core.
- Two teams that each want every core stall each other. While a trainer step
  computes, the engine narrows to the cores it leaves: on 2 cores, one thread
  each, and a team of one never waits on a barrier.
- Spinning workers stall other processes that want the same cores. The
  engine watches the other processes' CPU use (`OtherLoad`, /proc) and leaves
  them the cores they keep busy (on 2 cores: one thread, which never waits on a
  team).

The user's `OMP_WAIT_POLICY` or `GOMP_SPINCOUNT`, and `engine.num_threads`, win.
Every `clora` command calls `configure_waits` first and runs inside
`main_thread_alone`; so do `examples/*.py` (`demo.proof.main`). Code that builds the
service itself can do the same: `configure_waits()` before torch loads, its
compute inside `with main_thread_alone():`.

Not here: which kernels the CPU runs (`hardware`), thread priorities (`priority`).
"""

from __future__ import annotations

import ctypes
import math
import os
import threading
import time
from collections.abc import Callable, Iterator, MutableMapping
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path

SPIN_COUNT = 10_000
"""Pauses an idle OpenMP worker spins before it sleeps (libgomp's `GOMP_SPINCOUNT`).

Back-to-back regions of one step start within it; an idle thread's workers are
asleep within about a millisecond. `python -m scripts.openmp_waits --spins 1000,3000`:
of a swap step's sleeping cost, 1,000 pauses recover a fifth, 3,000 two thirds,
10,000 all of it."""

BUSY_CORES = 0.5
"""How much of a core other processes must use (averaged over `OtherLoad.interval_s`)
for the engine to leave that core to them."""


def configure_waits(environ: MutableMapping[str, str] | None = None) -> str:
    """Before torch loads: idle OpenMP workers spin `SPIN_COUNT` pauses, then sleep.

    OpenMP reads its variables once, when torch is first imported; after that
    this changes nothing. A wait policy or spin count the user set is kept.

    Returns:
        How the process's workers wait, for the start-up log.
    """
    env = os.environ if environ is None else environ
    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        if name in env:
            return f"OpenMP waits as set: {name}={env[name]}"
    env["GOMP_SPINCOUNT"] = str(SPIN_COUNT)
    return f"OpenMP workers spin {SPIN_COUNT} pauses, then sleep (GOMP_SPINCOUNT)"


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS has one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


@dataclass(frozen=True)
class _Runtime:
    """The per-thread thread-count setters of the runtimes torch loaded."""

    omp_set_num_threads: Callable[[int], object]
    mkl_set_num_threads_local: Callable[[int], object] | None


@cache
def _runtime() -> _Runtime | None:
    """libgomp's `omp_set_num_threads` (torch's OpenMP) and MKL's thread-local count
    (linked into libtorch_cpu), or None where torch runs on another OpenMP runtime."""
    import torch  # noqa: F401  (loads the libraries this looks for)

    maps = Path("/proc/self/maps")
    if not maps.exists():
        return None
    paths = {Path(line.rsplit(" ", 1)[-1]) for line in maps.read_text().splitlines()}
    gomp = next((p for p in paths if p.name.startswith("libgomp")), None)
    torch_cpu = next((p for p in paths if p.name.startswith("libtorch_cpu")), None)
    if gomp is None:
        return None
    try:
        omp = ctypes.CDLL(str(gomp)).omp_set_num_threads
        lib = ctypes.CDLL(str(torch_cpu)) if torch_cpu is not None else None
    except OSError:
        return None
    return _Runtime(omp, _mkl_setter(lib))


def _mkl_setter(lib: ctypes.CDLL | None) -> Callable[[int], object] | None:
    """MKL's per-thread count setter, checked once by reading the count back.

    The symbol libtorch_cpu exports is the by-reference (Fortran) entry point."""
    setter = getattr(lib, "mkl_set_num_threads_local", None)
    getter = getattr(lib, "mkl_get_max_threads", None)
    if setter is None or getter is None:
        return None

    def set_local(n: int) -> object:
        return setter(ctypes.byref(ctypes.c_int(n)))

    before = int(getter())
    set_local(1)
    works = int(getter()) == 1
    set_local(before)
    return set_local if works else None


def set_thread_teams(threads: int) -> None:
    """OpenMP teams (and MKL calls) of the calling thread have `threads` threads from now on.

    Both counts are per thread. torch's `set_num_threads` sets them too, but also
    the default of every thread that starts later, so it is only the fallback,
    where torch's runtime is not libgomp.
    """
    import torch

    n = max(1, threads)
    runtime = _runtime()
    if runtime is None:
        torch.set_num_threads(n)
        return
    # torch sets a thread's counts to the process default at its first op there: that
    # first, or it would undo these.
    torch.get_num_threads()
    runtime.omp_set_num_threads(n)
    if runtime.mkl_set_num_threads_local is not None:
        runtime.mkl_set_num_threads_local(n)


class OtherLoad:
    """How many cores other processes kept busy lately, from /proc (Linux).

    `cores()` re-reads at most once per `interval_s` and returns the average
    over the last interval: all CPUs' busy time less this process's own.
    Elsewhere it reads 0 (no other load is ever seen).
    """

    def __init__(
        self,
        interval_s: float = 1.0,
        *,
        stat: Path = Path("/proc/stat"),
        own: Path = Path("/proc/self/stat"),
        clock: Callable[[], float] = time.monotonic,
    ):
        self.interval_s = interval_s
        self._stat, self._own = stat, own
        self._clock = clock
        self._ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._last: tuple[float, int, int] | None = None
        self._cores = 0.0

    def cores(self) -> float:
        now = self._clock()
        if self._last is not None and now - self._last[0] < self.interval_s:
            return self._cores
        sample = self._sample()
        if sample is None:
            return 0.0
        busy, own = sample
        if self._last is not None:
            seconds = now - self._last[0]
            others = (busy - self._last[1]) - (own - self._last[2])
            self._cores = max(0.0, others / self._ticks / seconds)
        self._last = (now, busy, own)
        return self._cores

    def _sample(self) -> tuple[int, int] | None:
        """(all CPUs' busy ticks, this process's ticks), or None where /proc is not."""
        try:
            fields = self._stat.read_text().split("\n", 1)[0].split()[1:]
            own = self._own.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            return None
        ticks = [int(x) for x in fields]
        idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
        busy = sum(ticks[:8]) - idle  # user..steal; guest time is already in user
        return busy, int(own[11]) + int(own[12])  # utime + stime


class CoreShare:
    """The team size of each of the process's compute threads (see the module docstring).

    One per process (`process_share`); tests build their own.

    Args:
        cores: cores to share (default: `available_cores()`).
        load: other processes' CPU use; None: never narrow for them.

    Attributes:
        serving: an engine computes in this process (its thread owns the full-width pool).
    """

    def __init__(self, cores: int | None = None, *, load: OtherLoad | None = None):
        self.cores = cores or available_cores()
        self.load = load
        self.serving = False
        self._steps = 0  # trainer steps computing now
        self._lock = threading.Lock()

    def engine_threads(self, width: int) -> int:
        """The engine thread's team size now: at most `width` (the user's
        `engine.num_threads`, else every core), less the cores a trainer step takes while
        one computes and the cores other processes keep busy (each from `BUSY_CORES` of
        one), at least one."""
        free = self.cores
        if self._steps:
            free -= self.trainer_threads()
        if width > 1 and self.load is not None:
            free -= math.floor(self.load.cores() + 1 - BUSY_CORES)
        return max(1, min(width, free))

    @contextmanager
    def training(self) -> Iterator[None]:
        """A trainer step computes inside: the engine narrows to the cores it leaves."""
        with self._lock:
            self._steps += 1
        try:
            yield
        finally:
            with self._lock:
                self._steps -= 1

    def trainer_threads(self) -> int:
        """A trainer thread's team size: half the cores beside an engine, else every core."""
        return max(1, self.cores // 2) if self.serving else self.cores


@cache
def process_share() -> CoreShare:
    """The process's `CoreShare` (made on first use, watching other processes' load)."""
    return CoreShare(load=OtherLoad())


@contextmanager
def main_thread_alone() -> Iterator[None]:
    """Inside: the calling (main) thread, and every thread that starts meanwhile without a
    team size of its own (executor workers, the HTTP server's), compute with one OpenMP
    thread, so none holds a thread pool beside the engine's or the trainer's (see the
    module docstring). A process's entry point runs inside it; the count before is
    restored on the way out (an entry point called in-process, as tests do)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)  # this thread, and the default of every later thread
    try:
        yield
    finally:
        torch.set_num_threads(before)
