"""Background threads run at a lower CPU priority than serving, and pass it on to their workers."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from clora_feedback.priority import lower_thread_priority

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice")


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def _in_thread(fn):  # type: ignore[no-untyped-def]
    out: list[object] = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    thread.join()
    return out[0]


@linux_only
def test_only_the_calling_thread_and_its_children_are_lowered() -> None:
    base = _nice()

    def lowered() -> tuple[bool, int, int]:
        changed = lower_thread_priority(5)
        return changed, _nice(), _in_thread(_nice)  # a thread it starts inherits the niceness

    changed, own, child = _in_thread(lowered)
    assert changed and own == min(19, base + 5) and child == own
    assert _nice() == base  # the rest of the process keeps its priority
    assert _in_thread(lambda: (lower_thread_priority(0), _nice())) == (False, base)
