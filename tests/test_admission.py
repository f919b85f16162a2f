"""Admission: early release, staleness limit, source balance, full-batch baseline."""

from __future__ import annotations

from clora_feedback.config import AdmissionConfig
from clora_feedback.feedback.store import TrainingSample
from clora_feedback.train.admission import Admission, sample_staleness


def _sample(i: int, versions: list[int], kind: str = "resolution") -> TrainingSample:
    return TrainingSample(
        completion_id=f"c{i}", sample_index=0, agent="a", adapter_version=versions[0], prompt_token_ids=[1],
        completion_token_ids=[2] * len(versions), logprobs=[-1.0] * len(versions), token_versions=versions,
        rewards=[(f"e{i}", kind, 1.0)], targets=[], last_seq=i, created_at=0.0, reward=1.0, source=kind,
    )  # fmt: skip


def test_early_admission_releases_at_min_batch() -> None:
    adm = Admission(AdmissionConfig(min_batch=3, max_batch=8))
    adm.offer("a", [_sample(i, [5]) for i in range(2)])
    assert adm.admit("a", 5) == [] and adm.pending("a") == 2
    adm.offer("a", [_sample(2, [5])])
    batch = adm.admit("a", 5)
    assert [s.completion_id for s, _ in batch] == ["c0", "c1", "c2"] and adm.pending("a") == 0


def test_full_batch_baseline_waits() -> None:
    adm = Admission(AdmissionConfig(min_batch=1, max_batch=4, full_batch=True))
    adm.offer("a", [_sample(i, [1]) for i in range(3)])
    assert adm.admit("a", 1) == []
    adm.offer("a", [_sample(3, [1]), _sample(4, [1])])
    assert len(adm.admit("a", 1)) == 4 and adm.pending("a") == 1


def test_stale_samples_dropped_and_counted() -> None:
    adm = Admission(AdmissionConfig(min_batch=1, max_staleness=2))
    adm.offer("a", [_sample(0, [1, 1]), _sample(1, [3, 4]), _sample(2, [4])])
    batch = adm.admit("a", 4)
    assert [(s.completion_id, st) for s, st in batch] == [("c1", 1), ("c2", 0)]
    assert adm.stats["a"].dropped_stale == 1
    assert sample_staleness(_sample(9, [2, 7]), 7) == 5  # the oldest token decides


def test_sources_balanced() -> None:
    adm = Admission(AdmissionConfig(min_batch=4, max_batch=4, max_source_fraction=0.5))
    adm.offer(
        "a",
        [_sample(i, [0], "correction") for i in range(6)]
        + [_sample(10 + i, [0], "reward") for i in range(2)],
    )
    kinds = [s.rewards[0][1] for s, _ in adm.admit("a", 0)]
    assert kinds.count("correction") == 2 and kinds.count("reward") == 2
    assert adm.pending("a") == 4


def test_force_releases_a_partial_batch() -> None:
    adm = Admission(AdmissionConfig(min_batch=8))
    adm.offer("a", [_sample(0, [0])])
    assert adm.admit("a", 0) == [] and len(adm.admit("a", 0, force=True)) == 1
