"""The trainer on the release path: candidates never serve, each continues from the newest
candidate that was not rejected, a rejection or a rollback restarts the line from serving's
side (and trains the rejected line's samples again), and staleness counts against serving."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from feedback_support import trainer_stores

from clora_feedback.config import AdmissionConfig, EngineConfig, TrainerConfig
from clora_feedback.engine.embedded import EmbeddedEngine
from clora_feedback.errors import NotFoundError
from clora_feedback.feedback.store import Incoming
from clora_feedback.model.tiny import build_tiny_model_dir
from clora_feedback.schemas.feedback import Correction
from clora_feedback.store.registry.releases import ReleaseBook
from clora_feedback.store.trajectories import SampleRecord, TrajectoryRecord
from clora_feedback.train.policy import DecoderPolicy
from clora_feedback.train.trainer import ContinualTrainer


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> EmbeddedEngine:
    d = build_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "m", seed=3)
    return EmbeddedEngine(d, EngineConfig(max_num_seqs=2, max_loras=4, max_model_len=128))


class World:
    """A trainer on the release path (a `ReleaseBook`), fed corrections of served outputs."""

    def __init__(self, root: Path, engine: EmbeddedEngine) -> None:
        self.engine = engine
        self.trajectories, self.feedback, self.registry = trainer_stores(root)
        self.book = ReleaseBook(self.registry)
        cfg = TrainerConfig(
            admission=AdmissionConfig(min_batch=2, max_batch=2, max_staleness=1), lr=1e-2
        )
        self.trainer = ContinualTrainer(
            DecoderPolicy.shared_with(engine), self.feedback, self.registry, cfg,
            releases=self.book,
        )  # fmt: skip
        self.n = 0

    def correct(self, agent: str, count: int, *, version: int = 0) -> None:
        """`count` outputs served by `version` (what serves), each corrected."""
        tok = self.engine.tokenizer
        for _ in range(count):
            self.n += 1
            cid = f"c{self.n}"
            out = tok.encode(f"answer {self.n}", add_special_tokens=False)
            sample = SampleRecord(0, f"answer {self.n}", out, [-1.0] * len(out),
                                  [version] * len(out), "stop")  # fmt: skip
            prompt = tok.encode(f"question {self.n}")
            self.trajectories.record(
                TrajectoryRecord(cid, agent, version, "chat", {}, prompt, [sample], time.time())
            )
            event = Correction(event_id=f"e{self.n}", agent=agent, completion_id=cid,
                               source="t", corrected_content=f"right {self.n}")  # fmt: skip
            assert self.feedback.apply([Incoming(event, "t")]).joined == [f"e{self.n}"]

    def step(self, agent: str = "a") -> int:
        """Two fresh corrections and one round; returns the candidate published."""
        self.correct(agent, 2, version=self.registry.agent(agent).active_version or 0
                     if self.n else 0)  # fmt: skip
        assert len(self.trainer.run_round()) == 1
        return max(v.version for v in self.registry.versions(agent))

    def close(self) -> None:
        self.feedback.close()
        self.trajectories.close()
        self.registry.close()


def test_candidates_chain_and_never_serve(engine: EmbeddedEngine, tmp_path: Path) -> None:
    world = World(tmp_path, engine)
    v1 = world.step()
    v2, v3 = world.step(), world.step()
    versions = {v.version: v for v in world.registry.versions("a")}
    assert [versions[v].parent for v in (v1, v2, v3)] == [None, v1, v2]  # a line of candidates
    assert world.registry.agent("a").active_version is None  # the pointer never moved
    assert engine.adapter_version("a") is None
    assert {world.book.get("a", v).state for v in (v1, v2, v3)} == {"candidate"}  # type: ignore[union-attr]
    # Four steps past serving (v0) with max_staleness 1: samples from serving still admitted.
    assert world.trainer.admission.stats["a"].dropped_stale == 0
    world.close()


def test_a_rejection_restarts_from_the_newest_good_candidate(
    engine: EmbeddedEngine, tmp_path: Path
) -> None:
    world = World(tmp_path, engine)
    v1, v2 = world.step(), world.step()
    world.book.record("a", v1, "passed")
    world.book.promote("a", v1, expected_active=None, stage="gate", evidence={})
    v3 = world.step()  # serving moved onto the line: the run continues from v2
    assert world.registry.get("a", v3).parent == v2
    world.book.record("a", v2, "failed", stage="gate", evidence={"reason": "collapsed"})
    v4 = world.step()
    info = world.registry.get("a", v4)
    # v3 descends from the rejected v2: the line restarts at serving v1, and the samples
    # v2 and v3 trained on are trained again from v1's cursor.
    assert info.parent == v1
    v1_seq = world.registry.get("a", v1).feedback_window["to_seq"]  # type: ignore[index]
    assert info.feedback_window["from_seq"] == v1_seq  # type: ignore[index]
    v2_window = world.registry.get("a", v2).feedback_window
    assert info.feedback_window["completion_ids"] == v2_window["completion_ids"]  # type: ignore[index]
    world.close()


def _serving_and_a_candidate(world: World) -> tuple[int, int, float]:
    """v1 serving (gated, promoted), v2 its child candidate; and v2's learning rate."""
    v1 = world.step()
    world.book.record("a", v1, "passed")
    world.book.promote("a", v1, expected_active=None, stage="gate", evidence={})
    v2 = world.step()
    return v1, v2, world.trainer.history[-1].lr


def test_a_retry_takes_a_smaller_step_and_sets_repeated_failures_aside(
    engine: EmbeddedEngine, tmp_path: Path
) -> None:
    """The same samples from the same weights would give the same rejected candidate
    again: each failed attempt from the restart version halves the learning rate, and
    after `max_retries` failed attempts their samples are set aside."""
    world = World(tmp_path, engine)
    v1, v2, base_lr = _serving_and_a_candidate(world)
    first_window = world.registry.get("a", v2).feedback_window
    rejected, lrs = [v2], []
    for _ in range(3):
        world.book.record("a", rejected[-1], "failed", stage="gate", evidence={})
        retry = world.step()
        info = world.registry.get("a", retry)
        assert info.parent == v1  # from the serving version, on the same samples
        assert info.feedback_window["completion_ids"] == first_window["completion_ids"]  # type: ignore[index]
        lrs.append(world.trainer.history[-1].lr / base_lr)
        rejected.append(retry)
    assert lrs == pytest.approx([0.5, 0.25, 0.125])
    weights = [world.registry.load("a", v)[0].tensors for v in rejected[:2]]
    key = next(iter(weights[0]))
    assert not torch.equal(weights[0][key][1], weights[1][key][1])  # not the same candidate
    world.book.record("a", rejected[-1], "failed", stage="gate", evidence={})
    after = world.step()
    info = world.registry.get("a", after)
    assert info.parent == v1
    assert world.trainer.history[-1].lr / base_lr == pytest.approx(0.125)
    ids = set(info.feedback_window["completion_ids"])  # type: ignore[index]
    assert not ids & set(first_window["completion_ids"])  # type: ignore[index]  # set aside
    assert info.feedback_window["from_seq"] >= first_window["to_seq"]  # type: ignore[index]
    world.book.record("a", after, "passed")
    world.book.promote("a", after, expected_active=v1, stage="gate", evidence={})
    world.step()  # the line's candidate serves: full steps again
    assert world.trainer.history[-1].lr == pytest.approx(base_lr)
    world.close()


def test_a_retry_that_fails_again_further_down_retries_smaller_still(
    engine: EmbeddedEngine, tmp_path: Path
) -> None:
    """Failed attempts count since the serving version, wherever on the line they branch
    off, and a restarted trainer reads them from the registry."""
    world = World(tmp_path, engine)
    _, v2, base_lr = _serving_and_a_candidate(world)
    world.book.record("a", v2, "failed", stage="gate", evidence={})
    v3 = world.step()  # the retry, from v1, at half the rate
    v4 = world.step()  # the line goes on from v3 at that rate
    assert world.registry.get("a", v4).parent == v3
    assert world.trainer.history[-1].lr / base_lr == pytest.approx(0.5)
    world.book.record("a", v4, "failed", stage="gate", evidence={})
    v5 = world.step()
    assert world.registry.get("a", v5).parent == v3
    assert world.trainer.history[-1].lr / base_lr == pytest.approx(0.25)
    world.close()
    again = World(tmp_path, engine)  # a restart resumes from v5 with the same back-off
    again.n = 100
    v6 = again.step()
    assert again.registry.get("a", v6).parent == v5
    assert again.trainer.history[-1].lr / base_lr == pytest.approx(0.25)
    again.close()


def test_an_undecided_verdict_keeps_the_line(engine: EmbeddedEngine, tmp_path: Path) -> None:
    """`inconclusive` and `invalid` do not reject: the trainer continues from that candidate
    (only `failed` and `aborted` restart the line), and the pointer stays where it was."""
    world = World(tmp_path, engine)
    v1 = world.step()
    world.book.record("a", v1, "inconclusive", stage="gate", evidence={"reason": "wide bound"})
    v2 = world.step()
    assert world.registry.get("a", v2).parent == v1
    world.book.record("a", v2, "invalid", stage="gate", evidence={"reason": "timeout"})
    v3 = world.step()
    assert world.registry.get("a", v3).parent == v2
    assert world.registry.agent("a").active_version is None
    world.close()


def test_a_rollback_moves_the_line_and_a_restart_resumes_it(
    engine: EmbeddedEngine, tmp_path: Path
) -> None:
    world = World(tmp_path, engine)
    v1 = world.step()
    world.book.promote("a", v1, expected_active=None, stage="operator", evidence={})
    world.step()
    v3 = world.step()
    world.book.promote("a", v3, expected_active=v1, stage="operator", evidence={})
    world.registry.rollback("a", v1, reason="operator", expected_active=v3)  # marks v2, v3
    v4 = world.step()
    assert world.registry.get("a", v4).parent == v1
    world.close()
    again = World(tmp_path, engine)  # a restart: continues from the newest good candidate
    again.n = 100
    v5 = again.step()
    assert again.registry.get("a", v5).parent == v4
    again.close()


def test_a_non_finite_step_publishes_no_candidate(
    engine: EmbeddedEngine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The release path checks a step's weights (and the trainer's lease) before writing a
    candidate, as the hand-off path does before serving one."""
    from clora_feedback.train import trainer as trainer_module

    real = trainer_module.train_step

    def diverging(*args: object, **kwargs: object) -> object:
        results = real(*args, **kwargs)  # type: ignore[arg-type]
        for batch in args[2]:  # type: ignore[attr-defined]
            batch.state.params.fill_(float("nan"))
        return results

    monkeypatch.setattr(trainer_module, "train_step", diverging)
    world = World(tmp_path, engine)
    world.correct("a", 2)
    assert world.trainer.run_round() == []
    with pytest.raises(NotFoundError):  # no version, no release record
        world.registry.versions("a")
    world.close()
