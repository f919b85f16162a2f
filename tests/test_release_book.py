"""The registry's release states: compare-and-set moves, one canary per agent, promotion
moving the pointer in the same transaction, rejection seen by the trainer, restart-safe."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from clora_feedback.errors import ConflictError, GoneError, NotFoundError
from clora_feedback.lora.weights import LoRALimits, random_lora_weights
from clora_feedback.store.registry import AdapterRegistry
from clora_feedback.store.registry.releases import ReleaseBook

LIMITS = LoRALimits(
    max_rank=4,
    target_modules=("q_proj", "v_proj"),
    num_layers=1,
    shapes={"q_proj": (8, 8), "v_proj": (8, 4)},
)


def _publish(reg: AdapterRegistry, version: int, *, activate: bool) -> None:
    reg.publish(
        "support",
        random_lora_weights(LIMITS, rank=2, seed=version),
        optimizer_state=None,
        base_model="tiny",
        parent=version - 1 or None,
        step=version,
        metrics={},
        feedback_window=None,
        activate=activate,
    )


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[AdapterRegistry]:
    with AdapterRegistry(tmp_path / "adapters", tmp_path / "registry.db") as reg:
        _publish(reg, 1, activate=True)
        for version in (2, 3):  # two candidates: the pointer stays on v1
            _publish(reg, version, activate=False)
        yield reg


def test_states_move_by_compare_and_set_and_keep_every_stage(registry: AdapterRegistry) -> None:
    book = ReleaseBook(registry)
    assert book.record("support", 2, "candidate")
    assert not book.record("support", 2, "passed", expect={"canary"})  # not a canary: refused
    assert book.record(
        "support", 2, "passed", stage="gate", evidence={"n": 8}, expect={"candidate"}
    )
    book.start_canary("support", 2, share=0.2, serving=1, evidence={"started": 1})
    record = book.canary("support")
    assert record is not None and record.version == 2 and record.share == 0.2
    assert record.evidence == {"gate": {"n": 8}, "canary": {"started": 1}}
    book.record("support", 3, "passed")
    with pytest.raises(ConflictError) as exc:
        book.start_canary("support", 3, share=0.2, serving=1, evidence={})
    assert exc.value.code == "canary_running"
    assert book.record("support", 2, "aborted", stage="canary", evidence={"p": 0.001})
    assert book.rejected("support", {1, 2, 3}) == {2}
    assert book.kept("support") == {3}  # passed, waiting: retention keeps it
    assert registry.active("support").version == 1  # type: ignore[union-attr]
    assert [r.version for r in book.in_state("aborted")] == [2]
    assert [r.version for r in book.in_state("passed")] == [3]
    with pytest.raises(NotFoundError):
        book.record("support", 9, "candidate")


def test_promote_moves_the_pointer_once_and_refuses_rejected_or_raced(
    registry: AdapterRegistry, tmp_path: Path
) -> None:
    book = ReleaseBook(registry)
    book.record("support", 3, "failed")
    with pytest.raises(ConflictError) as exc:
        book.promote("support", 3, expected_active=1, stage="operator", evidence={})
    assert exc.value.code == "version_rejected"
    book.record("support", 2, "canary")
    with pytest.raises(ConflictError) as exc:
        book.promote("support", 2, expected_active=7, stage="canary", evidence={})
    assert exc.value.code == "active_changed"
    book.promote("support", 2, expected_active=1, stage="canary", evidence={"n": 10})
    info = registry.agent("support")
    assert info.active_version == 2 and info.activated_by == "publish"
    assert book.get("support", 2).state == "promoted"  # type: ignore[union-attr]
    assert registry.get("support", 1).status == "superseded"
    with pytest.raises(ConflictError):  # a second promotion of the same version
        book.promote("support", 2, expected_active=2, stage="canary", evidence={})
    registry.close()
    with AdapterRegistry(tmp_path / "adapters", tmp_path / "registry.db") as again:
        record = ReleaseBook(again).get("support", 2)
        assert record is not None and record.state == "promoted"
        assert record.evidence == {"canary": {"n": 10}} and record.serving == 1


def test_promoting_a_pruned_version_is_gone(registry: AdapterRegistry) -> None:
    _publish(registry, 4, activate=False)
    registry.prune("support", keep_last=1)  # keeps v4 and the active v1
    with pytest.raises(GoneError):
        ReleaseBook(registry).promote(
            "support", 2, expected_active=1, stage="operator", evidence={}
        )
