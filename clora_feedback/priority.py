"""Lower the CPU scheduling priority of the calling thread, so background work yields to serving.

Linux schedules threads individually and a thread's niceness is inherited by
the threads it creates, so lowering it before a thread first runs torch
makes its OpenMP workers (created on its first parallel region) background
work too. The engine thread keeps the process's priority and wins the cores
whenever both want them; when serving is idle, training gets all of them.

Elsewhere (`setpriority` would change the whole process) this does nothing.
Not here: which threads are background work (the trainer decides).
"""

from __future__ import annotations

import logging
import os
import sys
import threading

log = logging.getLogger(__name__)


def lower_thread_priority(increment: int) -> bool:
    """Raise the calling thread's niceness by `increment` (Linux only); True if it changed.

    Never fails: a refused change (e.g. a sandbox without the permission) is
    logged and the thread keeps its priority.
    """
    if increment <= 0 or not sys.platform.startswith("linux"):
        return False
    tid = threading.get_native_id()
    try:
        current = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, current + increment))
    except OSError as exc:
        log.warning("could not lower the priority of thread %d: %s", tid, exc)
        return False
    return True
