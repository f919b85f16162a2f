"""Small SQL helpers shared by the SQLite stores (trajectories, feedback).

Not here: any table, schema or connection; each store owns its own.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

CHUNK = 500
"""Bound parameters per `IN (...)`: well under SQLite's limit (999 on old builds)."""


def in_chunks(values: Iterable[str]) -> Iterator[tuple[list[str], str]]:
    """Distinct `values`, first-seen order, in chunks of `CHUNK`, each with its `?,?,...` marks."""
    unique = list(dict.fromkeys(values))
    for start in range(0, len(unique), CHUNK):
        chunk = unique[start : start + CHUNK]
        yield chunk, ",".join("?" * len(chunk))
