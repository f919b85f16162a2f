"""SIGKILL the trainer inside a step or a publish, restart: nothing half-written, nothing lost."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from clora_feedback.config import AdmissionConfig, EngineConfig, FeedbackConfig, TrainerConfig
from clora_feedback.engine.embedded import EmbeddedEngine
from clora_feedback.feedback.rewards import DefaultRewardPolicy
from clora_feedback.feedback.store import FeedbackStore, Incoming
from clora_feedback.schemas.feedback import Reward
from clora_feedback.store.registry import AdapterRegistry
from clora_feedback.store.trajectories import SampleRecord, TrajectoryRecord, TrajectoryStore
from clora_feedback.train.policy import DecoderPolicy
from clora_feedback.train.trainer import ContinualTrainer

CHILD = Path(__file__).with_name("crash_trainer_child.py")


def _reward(feedback: FeedbackStore, i: int, agent: str = "a") -> None:
    sample = SampleRecord(0, "x", [40 + i, 41, 42], [-1.0, -1.0, -1.0], [0, 0, 0], "stop")
    feedback.trajectories.record(
        TrajectoryRecord(f"c{i}", agent, 0, "chat", {}, [1, 2, 3], [sample], time.time())
    )
    feedback.apply(
        [
            Incoming(
                Reward(
                    event_id=f"e{i}", agent=agent, completion_id=f"c{i}", source="t", value=i % 2
                ),
                "t",
            )
        ]
    )


def _open(root: Path, model_dir: Path) -> tuple[FeedbackStore, AdapterRegistry, ContinualTrainer]:
    engine = EmbeddedEngine(model_dir, EngineConfig(max_num_seqs=2, max_loras=2, max_model_len=256))
    feedback = FeedbackStore(
        root / "t.db",
        trajectories=TrajectoryStore(root / "t.db"),
        policy=DefaultRewardPolicy(FeedbackConfig()),
    )
    registry = AdapterRegistry(root / "adapters", root / "registry.db")
    config = TrainerConfig(admission=AdmissionConfig(min_batch=2, max_batch=4), lr=1e-2)
    trainer = ContinualTrainer(DecoderPolicy.shared_with(engine), feedback, registry, config)
    return feedback, registry, trainer


@pytest.mark.slow
@pytest.mark.parametrize("where", ["step", "publish"])
def test_kill_during_step_or_publish_then_resume(
    tiny_model_dir: Path, tmp_path: Path, where: str
) -> None:
    feedback, registry, trainer = _open(tmp_path, tiny_model_dir)
    for i in range(2):
        _reward(feedback, i)
    assert len(trainer.run_round()) == 1  # version 1 is complete and active
    for i in range(2, 4):
        _reward(feedback, i)
    feedback.close()
    registry.close()

    child = subprocess.run(
        [sys.executable, str(CHILD), str(tmp_path), str(tiny_model_dir), where],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert child.returncode == -9, child.stderr[-2000:]

    feedback, registry, trainer = _open(tmp_path, tiny_model_dir)
    active = registry.active("a")
    assert active is not None and active.version == 1  # the last complete version
    assert [v.version for v in registry.versions("a")] == [1]  # nothing half-written is visible
    assert not [p for p in (tmp_path / "adapters" / "a").iterdir() if p.name not in ("1",)]
    registry.verify("a", 1)
    results = trainer.run_round()  # training resumes with the samples the crash interrupted
    assert len(results) == 1 and results[0].num_pg == 2
    latest = registry.active("a")
    assert latest is not None and latest.version > 1 and latest.parent == 1
    windows = [v.feedback_window for v in registry.versions("a")]
    assert [w["to_seq"] for w in windows if w] == [
        2,
        4,
    ]  # every rewarded sample trained exactly once
    feedback.close()
    registry.close()
