"""Child process for tests/test_trainer_crash.py: train until a planned SIGKILL.

Usage: python crash_trainer_child.py ROOT MODEL_DIR {step|publish|serve-swap}

`step` kills the process inside the optimizer step (after forward/backward);
`publish` kills it while the version directory is being written (after the
weights file is fsynced, before the manifest and the rename).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import clora_feedback.store.artifact as artifact
import clora_feedback.train.step as step_module
from clora_feedback.config import AdmissionConfig, EngineConfig, FeedbackConfig, TrainerConfig
from clora_feedback.engine.embedded import EmbeddedEngine
from clora_feedback.feedback.rewards import DefaultRewardPolicy
from clora_feedback.feedback.store import FeedbackStore
from clora_feedback.store.registry import AdapterRegistry
from clora_feedback.store.trajectories import TrajectoryStore
from clora_feedback.train.policy import DecoderPolicy
from clora_feedback.train.trainer import ContinualTrainer


def main() -> None:
    root, model_dir, where = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    engine = EmbeddedEngine(model_dir, EngineConfig(max_num_seqs=2, max_loras=2, max_model_len=256))
    feedback = FeedbackStore(
        root / "t.db",
        trajectories=TrajectoryStore(root / "t.db"),
        policy=DefaultRewardPolicy(FeedbackConfig()),
    )
    registry = AdapterRegistry(root / "adapters", root / "registry.db")
    config = TrainerConfig(admission=AdmissionConfig(min_batch=2, max_batch=4), lr=1e-2)
    trainer = ContinualTrainer(DecoderPolicy.shared_with(engine), feedback, registry, config)

    def die(*_: object, **__: object) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    if where == "step":
        step_module.adam_step = die  # type: ignore[assignment]
    elif where == "publish":
        real_write = artifact.write_files

        def write_then_die(directory: Path, files: Any) -> Any:
            written = real_write(directory, files)  # payload written and fsynced
            if artifact.OPTIMIZER_NAME in files:
                die()  # before the manifest and the rename
            return written

        artifact.write_files = write_then_die  # type: ignore[assignment]
    print("ready", flush=True)
    while True:
        trainer.run_round()


if __name__ == "__main__":
    main()
