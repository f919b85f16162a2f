"""`clora bench learning`: held-out splits by construction, the simulated users' judgements and
events, and a few seconds of the streaming loop end to end on the tiny model.

The smoke run checks that the loop ran and the record has its shape, never the
accuracy (a tiny random model learns nothing in seconds).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from clora_feedback.bench import BENCHMARKS
from clora_feedback.bench.learning import (
    FamilyWorkload,
    answer_class,
    resolutions_carry_answer,
    run,
)
from clora_feedback.bench.learning_tasks import (
    ESCALATION,
    FAMILIES,
    HOLD_OUT_MODULUS,
    RESTRICTED,
    fields_right,
    split_pairs,
)
from clora_feedback.demo.workloads import Episode
from clora_feedback.schemas.feedback import Correction, Resolution, Reward


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_held_out_prompts_combine_parts_never_seen_together(name: str) -> None:
    family = FAMILIES[name]
    train = family.prompts(0, "train", 2000)
    held_out = family.prompts(0, "eval", 64)
    train_pairs = {p.pair for p in train}
    held_out_pairs = {p.pair for p in held_out}
    assert not train_pairs & held_out_pairs
    assert not {p.text for p in train} & {p.text for p in held_out}
    # Every part of a held-out pair is taught in training, only never in that combination.
    for axis in (0, 1):
        assert {p[axis] for p in held_out_pairs} <= {p[axis] for p in train_pairs}
    # The two splits tile the grid; the held-out share is 1 / HOLD_OUT_MODULUS.
    size_a, size_b = family.axes
    grid = set(split_pairs(size_a, size_b, "train")) | set(split_pairs(size_a, size_b, "eval"))
    assert len(grid) == size_a * size_b
    assert len(split_pairs(size_a, size_b, "eval")) * HOLD_OUT_MODULUS == size_a * size_b
    assert train_pairs == set(split_pairs(size_a, size_b, "train"))  # a big pool covers them all


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_prompts_are_deterministic_and_cover_the_held_out_pairs(name: str) -> None:
    family = FAMILIES[name]
    first, again = family.prompts(3, "eval", 32), family.prompts(3, "eval", 32)
    assert first == again
    assert first != family.prompts(4, "eval", 32)
    pairs = [p.pair for p in first]
    size = len(split_pairs(*family.axes, "eval"))
    assert len(set(pairs[:size])) == min(size, 32)  # every pair before any repeats


def test_classes_are_balanced_on_the_held_out_set() -> None:
    routing = [p.label for p in FAMILIES["routing"].prompts(0, "eval", 32)]
    assert {routing.count(d) for d in ("legal", "security", "hr", "press")} == {8}
    escalation = FAMILIES["escalation"].prompts(0, "eval", 32)
    assert sum(p.label == "escalate" for p in escalation) == 16
    for p in escalation:
        words = set(re.findall(r"[a-z]+", p.text))
        assert (p.answer == ESCALATION) == bool(words & RESTRICTED)


def _episode(answer: str, reward: float) -> Episode:
    return Episode("t", completion_ids=["chatcmpl-1"], reward=reward, answer=answer, versions=[0])


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_the_reference_reply_is_right_and_a_wrong_one_is_corrected(name: str) -> None:
    family = FAMILIES[name]
    workload = FamilyWorkload(family)
    prompt = family.prompts(0, "train", 1)[0]
    assert family.correct(prompt, prompt.answer + "\n(more text)")
    assert not family.correct(prompt, "I cannot help with that.")
    right = workload.feedback("a", prompt, _episode(prompt.answer, 1.0), event_id="e1")
    wrong = workload.feedback("a", prompt, _episode("nonsense", 0.0), event_id="e2")
    assert len({e.event_id for e in right + wrong}) == len(right + wrong)
    assert all(e.targets() == ["chatcmpl-1"] for e in right + wrong)
    targets = [e.corrected_content for e in wrong if isinstance(e, Correction)]
    targets += [getattr(e, "correct_answer", None) for e in wrong if isinstance(e, Resolution)]
    assert prompt.answer in targets  # every wrong reply is taught the right one
    assert not any(isinstance(e, Correction) and not e.accepted_as_is for e in right)
    if name == "routing":
        assert [e.outcome for e in right if isinstance(e, Resolution)] == ["resolved"]
        assert [e.outcome for e in wrong if isinstance(e, Resolution)] == ["escalated"]
        assert len(wrong) == (1 if resolutions_carry_answer() else 2)
    if name in ("extract", "escalation"):
        values = [e.value for e in right + wrong if isinstance(e, Reward)]
        assert values[0] == 1.0 and values[1] == 0.0


def test_extract_rewards_the_share_of_fields_right() -> None:
    answer = "name=Ana; city=Lyon; qty=3"
    assert fields_right(answer, answer) == 1.0
    assert fields_right(answer, "city=Lyon; name=Ana; qty=4") == pytest.approx(2 / 3)
    assert fields_right(answer, "Ana from Lyon") == 0.0


def test_answer_classes_show_what_a_reply_chose() -> None:
    assert answer_class(FAMILIES["routing"], "Security.") == "security"
    assert answer_class(FAMILIES["routing"], "I think") == "other"
    assert answer_class(FAMILIES["escalation"], ESCALATION) == "escalate"
    assert answer_class(FAMILIES["escalation"], "Added 2 mugs to order 1.") == "answer"
    assert answer_class(FAMILIES["api-call"], 'client.call("mail", "get", 3)') == "mail"
    assert answer_class(FAMILIES["extract"], "name=A; city=Oslo; qty=2") == "Oslo"


def test_learning_is_a_registered_benchmark() -> None:
    assert "learning" in BENCHMARKS


def test_a_few_seconds_of_streaming_end_to_end(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out" / "learning-smoke"
    argv = ["--tasks", "routing", "--minutes", "0.15", "--held-out", "4", "--users", "2"]
    argv += ["--think", "0", "--threads", "1", "--max-model-len", "2048", "--eval-every", "1"]
    argv += ["--model", str(tiny_model_dir), "--work", str(tmp_path / "work"), "--out", str(out)]
    assert run(argv) == 0
    record = json.loads(out.with_suffix(".json").read_text())
    assert record["config"]["tasks"] == ["routing"]
    assert "cpu flags (kernel-relevant)" in record["facts"]
    assert record["facts"]["trainer"].startswith("lr ")
    assert record["facts"]["trainer overrides"] == "none (every default)"
    (task,) = record["tasks"]
    assert task["requests"] > 0 and task["events"] >= task["requests"]
    assert task["errors"] == 0 and task["rejected"] == 0
    evals = task["evals"]
    assert len(evals) >= 2 and evals[0]["t_s"] == 0.0 and evals[0]["version"] == 0
    assert task["wall_s"] >= 0.15 * 60 and 0 < evals[-1]["t_s"] <= task["wall_s"] + 0.1
    for point in evals:
        assert 0.0 <= point["accuracy"] <= 1.0
        assert sum(point["classes"].values()) == 4
    assert "| routing |" in out.with_suffix(".md").read_text()
    if task["versions"]:
        assert task["versions"][0]["version"] == 1
    again = tmp_path / "again" / "learning-smoke"
    assert run(["--replot", str(out.with_suffix(".json")), "--out", str(again)]) == 0
    assert again.with_suffix(".md").read_text() == out.with_suffix(".md").read_text()
    pytest.importorskip("matplotlib")
    assert out.with_suffix(".png").stat().st_size > 1000


def test_trainer_overrides_change_only_what_they_name() -> None:
    from clora_feedback.bench.learning import build_parser, trainer_config
    from clora_feedback.config import TrainerConfig

    assert trainer_config([]) == TrainerConfig()
    config = trainer_config(["replay=0", "admission.min_batch=8", "imitate_above_mean=false"])
    assert (config.replay, config.admission.min_batch, config.imitate_above_mean) == (0, 8, False)
    assert config.lr == TrainerConfig().lr
    for bad in ("nope=1", "admission=3", "replay=-1", "admission.nope.x=1", "replay"):
        with pytest.raises(ValueError, match="--trainer"):
            trainer_config([bad])
    args = build_parser().parse_args(["--trainer", "replay=0", "--trainer", "warmup_steps=0"])
    assert args.trainer == ["replay=0", "warmup_steps=0"]


def test_release_overrides_change_only_what_they_name() -> None:
    from clora_feedback.bench.learning import build_parser, release_config
    from clora_feedback.config import ReleaseConfig

    assert release_config([]) == ReleaseConfig()
    config = release_config(["enabled=false", "gate.max_cases=48"])
    assert (config.enabled, config.gate.max_cases) == (False, 48)
    assert config.canary == ReleaseConfig().canary
    with pytest.raises(ValueError, match="--release"):
        release_config(["gate.max_cases=1"])
    args = build_parser().parse_args(["--release", "enabled=false"])
    assert args.release == ["enabled=false"]
