"""Give freed memory back to the OS (glibc `malloc_trim`), so a long run's resident set stays flat.

A training step allocates gigabytes of activations of varying shapes and frees
them when it ends. glibc keeps freed heap memory mapped for reuse, and the
shapes change from step to step, so what it keeps grows: measured with
`scripts/soak.py` (two agents serving and training SmolLM2-135M), the heap's
freed-but-kept memory rose from 37 MB to 2.4 GB in 8 minutes, most of the
resident set's growth beyond the prefix cache filling to its bound.
`trim_heap` after each training round returns those pages (`malloc_trim(0)`
releases whole free pages anywhere in every arena, not only at the top), at a
cost of milliseconds per step, without changing how serving allocates.

No effect (and no error) where glibc is absent. Not here: bounds on what is
still in use (the host adapter cache, trainer residency, the prefix cache).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Any


@functools.cache
def _libc() -> Any:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") else None


def trim_heap() -> bool:
    """Return freed heap pages of every arena to the OS; True if glibc released any."""
    libc = _libc()
    return bool(libc.malloc_trim(0)) if libc is not None else False
