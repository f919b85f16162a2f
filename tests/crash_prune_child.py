"""Child process for tests/test_retention.py: prune until a planned SIGKILL.

Usage: python crash_prune_child.py ROOT DB_URL {before_commit|after_mark|mid_delete}

Publishes versions 1..6 of agent `a`, rolls back to 4 and pins it (5 and 6 are newer than
what serves), then prunes with keep_last=2 and keep={3} (versions 1 and 2 go),
and SIGKILLs itself: `before_commit` inside the prune's transaction (after its
updates, before the commit), `after_mark` after the commit before any file is
deleted, `mid_delete` after the first payload file of the first version is gone.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from clora_feedback.config import DEFAULT_TARGET_MODULES
from clora_feedback.lora.weights import LoRALimits, random_lora_weights
from clora_feedback.store.artifact import VersionDirs, payload_names
from clora_feedback.store.registry import AdapterRegistry

LIMITS = LoRALimits(
    max_rank=8,
    target_modules=DEFAULT_TARGET_MODULES,
    num_layers=2,
    shapes={"q_proj": (64, 64), "k_proj": (64, 32), "v_proj": (64, 32), "o_proj": (64, 64)},
)


def _kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    root, url, where = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    registry = AdapterRegistry(root / "adapters", db=url)
    for version in range(1, 7):
        registry.publish(
            "a", random_lora_weights(LIMITS, rank=2, seed=version, target_modules=["q_proj"]),
            optimizer_state=None, base_model="tiny", parent=version - 1 or None, step=version,
            metrics={}, feedback_window=None,
        )  # fmt: skip
    registry.rollback("a", 4, reason="test")
    registry.pin("a")  # a pinned agent: its serving version is kept like any active one
    if where == "before_commit":
        original = AdapterRegistry._transaction

        @contextlib.contextmanager
        def killing(self: AdapterRegistry, action: str) -> Iterator[Any]:
            with original(self, action) as conn:
                yield conn
                if action == "prune":
                    _kill()

        AdapterRegistry._transaction = killing  # type: ignore[method-assign]
    elif where == "after_mark":
        VersionDirs.prune_payload = lambda self, agent, version: _kill()  # type: ignore[assignment,method-assign,return-value]
    else:

        def one_file_then_die(self: VersionDirs, agent: str, version: int) -> bool:
            (self.path(agent, version) / payload_names(True)[0]).unlink()
            _kill()
            return True

        VersionDirs.prune_payload = one_file_then_die  # type: ignore[method-assign]
    print("pruning", flush=True)
    registry.prune("a", keep_last=2, keep=[3])
    sys.exit(3)  # never reached: the kill comes first


if __name__ == "__main__":
    main()
