"""The adapter registry: immutable adapter versions on disk and each agent's active pointer.

`core.AdapterRegistry` owns the connection, the transactions and every write;
`index` holds the tables and what a row means (the status rule); `rows` the row
reads and checks shared by the writes; `schema` creating, migrating and
claiming the index (and the PostgreSQL pointer channel); `releases` each version's
release state (candidate, gate verdict, canary, promoted, aborted) and the promotion
that moves the pointer.

Not here: the version directories' files (`store.artifact`), retention
(`store.retention`), base-model identity (`store.provenance`).
"""

from clora_feedback.store.registry.core import AdapterRegistry
from clora_feedback.store.versions import VersionInfo

__all__ = ["AdapterRegistry", "VersionInfo"]
