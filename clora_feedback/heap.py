"""Give freed memory back to the OS (glibc), so a long run's resident set stays flat.

A training step allocates gigabytes of activations of varying shapes and frees
them when it ends. glibc keeps freed heap memory mapped for reuse, and the
shapes change from step to step, so what it keeps grows: measured with
`python -m benchmarks.soak` (two agents serving and training SmolLM2-135M), the heap's
freed-but-kept memory rose from 37 MB to 2.4 GB in 8 minutes, most of the
resident set's growth beyond the prefix cache filling to its bound.
`trim_heap` after each training round returns those pages (`malloc_trim(0)`
releases whole free pages anywhere in every arena, not only at the top), at a
cost of milliseconds per step, without changing how serving allocates.

`release_freed_memory` goes further for a whole process that trains (the demo,
the learning benchmark): allocations above a threshold are served by mmap, so
freeing them unmaps them at once. Measured there, a support experiment's
resident set grew from ~3 GB to 14 GB after the first steps and stayed; with
the threshold it shrank back to ~3 GB between steps, for a small cost in page
faults.

A serving process that also trains (`clora serve` with its trainer, `clora
train`) sets a higher threshold, `TRAINING_MMAP_THRESHOLD` (1 MiB): a training
step's activations (megabytes each) are mapped and unmapped, while serving's
small per-step tensors stay on the heap. glibc otherwise raises its mmap
threshold on the first free of a mapped chunk (up to 32 MiB), after which those
activations come from the heap; measured with 100 agents serving and training
for 30 minutes, the heap's freed-but-kept memory then grew from 2.3 to 3.6 GB
while what was in use stayed at 3.4 GB.

No effect (and no error) where glibc is absent. Not here: bounds on what is
still in use (the host adapter cache, trainer residency, the prefix cache).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
from typing import Any

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
TRAINING_MMAP_THRESHOLD = 1 << 20
"""`release_freed_memory`'s threshold in a process that serves and trains."""


@functools.cache
def _libc() -> Any:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None


def trim_heap() -> bool:
    """Return freed heap pages of every arena to the OS; True if glibc released any."""
    libc = _libc()
    return bool(libc.malloc_trim(0)) if libc is not None else False


def release_freed_memory(threshold: int = 64 * 1024) -> bool:
    """Serve allocations of at least `threshold` bytes with mmap (and trim above it), so
    freed training buffers leave the process; True if glibc took both settings."""
    libc = _libc()
    if libc is None:
        return False
    ok = bool(libc.mallopt(_M_MMAP_THRESHOLD, threshold))
    ok = bool(libc.mallopt(_M_TRIM_THRESHOLD, threshold)) and ok
    if not ok:
        log.debug("mallopt refused the thresholds; the heap keeps freed memory")
    return ok
