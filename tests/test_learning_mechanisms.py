"""Learning mechanisms: credit from corrections and resolutions, preference pairs, settled
batches, replay, warm-up, and one meaning of behaviour logprobs (ratio 1 on a fresh sample).

Each test pins a mechanism the learning issue named; several fail on the reward mapping
and trainer that came before them (the similarity-credit of corrections, resolutions
without a right answer, training on all-accepted batches, temperature-scaled logprobs).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from clora_feedback.config import (
    AdmissionConfig,
    EngineConfig,
    FeedbackConfig,
    RewardPolicyConfig,
    TrainerConfig,
)
from clora_feedback.engine.embedded import EmbeddedEngine
from clora_feedback.engine.types import GenerationRequest, SamplingParams
from clora_feedback.feedback.rewards import DefaultRewardPolicy
from clora_feedback.feedback.store import FeedbackStore, Incoming
from clora_feedback.lora.weights import LoRAWeights, random_lora_weights
from clora_feedback.model.tiny import build_tiny_model_dir
from clora_feedback.schemas.feedback import Correction, Event, Resolution, Reward
from clora_feedback.store.registry import AdapterRegistry
from clora_feedback.store.trajectories import SampleRecord, TrajectoryRecord, TrajectoryStore
from clora_feedback.train.forward import PackedBatch, TrainLoRA
from clora_feedback.train.loss import LossConfig, advantages
from clora_feedback.train.policy import DecoderPolicy
from clora_feedback.train.replay import ReplayBuffer
from clora_feedback.train.state import (
    AdamConfig,
    AgentTrainState,
    LoRALayout,
    TrainingSlot,
    init_lora,
)
from clora_feedback.train.step import AgentBatch, PreferencePair, SFTSample, train_step
from clora_feedback.train.trainer import ContinualTrainer

POLICY = DefaultRewardPolicy(FeedbackConfig())


def _event(kind: type[Event], n: int, cid: str = "c1", **fields: object) -> Event:
    return kind(event_id=f"e{n}", agent="a", completion_id=cid, source="t", **fields)  # type: ignore[arg-type]


# -- the reward mapping ---------------------------------------------------------------------


def test_the_five_verdicts_have_their_documented_values() -> None:
    def signal(**fields: object):
        return POLICY.signal(_event(Correction, 1, **fields), "the output")

    assert signal().value == 1.0 and signal().confirmed  # accepted (nothing changed)
    assert signal(verdict="accepted").value == 1.0
    kept = signal(verdict="edited_and_kept", corrected_content="the output, edited")
    assert kept.value == 0.5 and kept.target == "the output, edited" and not kept.wrong
    fixed = signal(corrected_content="the output!")
    assert fixed.value == 0.0 and fixed.wrong and fixed.target == "the output!"
    assert fixed.similarity is not None and fixed.similarity > 0.9  # close, and still 0.0
    rejected = signal(verdict="rejected")
    assert rejected.value == 0.0 and rejected.wrong and rejected.target is None
    assert signal(verdict="ignored").value == 0.25
    with pytest.raises(ValidationError, match="needs corrected_content"):
        _event(Correction, 1, verdict="corrected")
    with pytest.raises(ValidationError, match="takes no corrected_content"):
        _event(Correction, 1, verdict="rejected", corrected_content="x")


def test_a_resolution_can_carry_the_right_answer() -> None:
    wrong = POLICY.signal(
        _event(Resolution, 1, outcome="resolved", correct_answer="billing"), "shipping"
    )
    assert wrong.value == 0.0 and wrong.wrong and wrong.target == "billing"
    right = POLICY.signal(
        _event(Resolution, 2, outcome="resolved", correct_answer="billing"), " billing\n"
    )
    assert right.value == 1.0 and right.confirmed and right.target is None
    with pytest.raises(ValidationError, match="completion_id alone"):
        Resolution(
            event_id="e",
            agent="a",
            conversation_id="conv",
            source="t",
            outcome="resolved",
            correct_answer="billing",
        )


def test_several_events_on_one_output_combine_by_the_documented_rule() -> None:
    def reward(*events: Event, output: str = "out") -> float:
        from clora_feedback.feedback.rewards import Judgement

        judged = [Judgement(e.event_id, e.kind, POLICY.signal(e, output)) for e in events]
        return POLICY.reward(judged)

    # No event says the output was wrong: the mean.
    assert reward(_event(Reward, 1, value=0.2), _event(Reward, 2, value=0.6)) == pytest.approx(0.4)
    assert reward(_event(Resolution, 1, outcome="resolved"), _event(Reward, 2, value=0.5)) == 0.75
    # Some event says it was wrong: the lowest value, whatever else was said.
    assert reward(_event(Correction, 1), _event(Correction, 2, corrected_content="outt")) == 0.0
    assert reward(_event(Reward, 1, value=1.0), _event(Correction, 2, verdict="rejected")) == 0.0


def _record(
    store: TrajectoryStore, cid: str, output: str, ids: list[int], mode: str = "raw"
) -> None:
    sample = SampleRecord(0, output, ids, [-0.7] * len(ids), [0] * len(ids), "stop")
    store.record(
        TrajectoryRecord(
            cid,
            "a",
            0,
            "chat",
            {},
            [1, 2, 3],
            [sample],
            time.time(),
            logprobs_mode=mode,  # type: ignore[arg-type]
        )
    )


def test_a_corrected_turn_never_outscores_a_right_one(tmp_path: Path) -> None:
    """Two turns of one failed episode: turn 1 computed the right call, turn 2 handed a wrong
    number to `final_answer` and was corrected (one digit off: similarity ~0.95). The right
    turn's advantage must not be below the wrong one's (it was: mean(0, 0.95) ~ 0.48 > 0)."""
    with TrajectoryStore(tmp_path / "t.db") as trajectories:
        _record(trajectories, "turn1", 'calculator {"expression": "12+30"}', [5, 6])
        _record(trajectories, "turn2", 'final_answer {"answer": 41}', [7, 8])
        feedback = FeedbackStore(tmp_path / "t.db", trajectories=trajectories, policy=POLICY)
        episode = Reward(
            event_id="outcome", agent="a", completion_ids=["turn1", "turn2"], source="t", value=0.0
        )
        fix = _event(Correction, 2, cid="turn2", corrected_content='final_answer {"answer": 42}')
        feedback.apply([Incoming(episode, "t"), Incoming(fix, "t")])
        samples = {s.completion_id: s for s in feedback.training_samples("a")}
        assert samples["turn2"].reward <= samples["turn1"].reward
        adv, _ = advantages(
            [samples["turn1"].reward, samples["turn2"].reward], ["turn1", "turn2"], 0.2
        )
        assert adv[0] >= adv[1]
        assert (
            samples["turn2"].targets == ['final_answer {"answer": 42}'] and samples["turn2"].wrong
        )
        feedback.close()


# -- the trainer ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> EmbeddedEngine:
    d = build_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "m", seed=4)
    return EmbeddedEngine(d, EngineConfig(max_num_seqs=4, max_loras=4, max_model_len=256))


class _World:
    """Stores and a trainer on the tiny model; samples are recorded by hand."""

    def __init__(self, root: Path, engine: EmbeddedEngine, **trainer: object):
        self.engine = engine
        self.trajectories = TrajectoryStore(root / "t.db")
        self.feedback = FeedbackStore(root / "t.db", trajectories=self.trajectories, policy=POLICY)
        self.registry = AdapterRegistry(root / "adapters", root / "registry.db")
        config = TrainerConfig(
            admission=AdmissionConfig(min_batch=2, max_batch=8),
            lr=1e-2,
            **trainer,  # type: ignore[arg-type]
        )
        self.trainer = ContinualTrainer(
            DecoderPolicy.shared_with(engine), self.feedback, self.registry, config
        )
        self.n = 0

    def served(self, text: str, logprob: float = -1.0, mode: str = "raw") -> str:
        self.n += 1
        cid = f"c{self.n}"
        ids = self.engine.tokenizer.encode(text, add_special_tokens=False)
        prompt = self.engine.tokenizer.encode(f"question {self.n % 3}")
        version = self.engine.adapter_version("a") or 0
        sample = SampleRecord(0, text, ids, [logprob] * len(ids), [version] * len(ids), "stop")
        self.trajectories.record(
            TrajectoryRecord(
                cid,
                "a",
                version,
                "chat",
                {},
                prompt,
                [sample],
                time.time(),
                logprobs_mode=mode,  # type: ignore[arg-type]
            )
        )
        return cid

    def judge(self, cid: str, **fields: object) -> None:
        self.n += 1
        kind = Resolution if "outcome" in fields else Reward if "value" in fields else Correction
        event = kind(event_id=f"e{self.n}", agent="a", completion_id=cid, source="t", **fields)  # type: ignore[arg-type]
        assert self.feedback.apply([Incoming(event, "t")]).joined

    def close(self) -> None:
        self.feedback.close()
        self.trajectories.close()
        self.registry.close()


def test_a_wrong_output_with_its_right_answer_trains_as_a_pair_and_a_target(
    engine: EmbeddedEngine, tmp_path: Path
) -> None:
    world = _World(tmp_path, engine)
    world.judge(world.served("shipping"), outcome="escalated", correct_answer="billing")
    world.judge(world.served("billing"), outcome="resolved", correct_answer="billing")
    [result] = world.trainer.run_round()
    # pairs: the wrong output against its right answer; supervised: the answer, and the
    # confirmed output the agent was unsure of (per-token probability e^-1).
    assert result.num_pairs == 1 and result.num_sft == 2 and result.num_pg == 2
    assert result.pref_loss > 0 and result.lr == pytest.approx(1e-2 / 2)  # warm-up step 1 of 2
    world.close()


def test_outputs_rewarded_above_the_mean_are_imitated_so_every_class_is_taught(
    engine: EmbeddedEngine, tmp_path: Path
) -> None:
    """A two-class task (confirm or escalate) judged by a 1/0 reward plus a correction when
    wrong: the agent confirms everything. Supervising only the corrected ones would teach
    "escalate" alone (and the next version would escalate everything); the confirmations
    that earned 1.0 are imitated too."""
    world = _World(tmp_path, engine)
    # The right one was generated with near certainty: it still anchors its class.
    right, wrong = world.served("confirmed", logprob=-0.01), world.served("confirmed")
    world.judge(right, value=1.0)
    world.judge(wrong, value=0.0)
    world.judge(wrong, corrected_content="escalated")
    [result] = world.trainer.run_round()
    assert result.num_sft == 2 and result.num_pairs == 1  # "escalated" and the right "confirmed"
    world.close()


def test_imitating_outputs_above_the_mean_can_be_switched_off_for_an_ablation(
    engine: EmbeddedEngine, tmp_path: Path
) -> None:
    """`imitate_above_mean=False`: the same batch supervises only the corrected answer."""
    world = _World(tmp_path, engine, imitate_above_mean=False)
    right, wrong = world.served("confirmed", logprob=-0.01), world.served("confirmed")
    world.judge(right, value=1.0)
    world.judge(wrong, value=0.0)
    world.judge(wrong, corrected_content="escalated")
    [result] = world.trainer.run_round()
    assert result.num_sft == 1 and result.num_pairs == 1  # "escalated" alone
    world.close()


def test_processed_logprobs_never_enter_the_policy_gradient(
    engine: EmbeddedEngine, tmp_path: Path
) -> None:
    world = _World(tmp_path, engine)
    world.judge(world.served("one", mode="processed"), corrected_content="two")
    world.judge(world.served("three"), corrected_content="four")
    [result] = world.trainer.run_round()
    assert result.num_pg == 1 and world.trainer.skipped_pg == 1
    assert result.num_sft == 2 and result.num_pairs == 2  # the targets still train
    world.close()


def test_settled_all_accepted_batches_publish_nothing(
    engine: EmbeddedEngine, tmp_path: Path
) -> None:
    """Continued feedback that only confirms what the agent already answers with near
    certainty must not move the adapter (that is how held-out answers drifted)."""
    world = _World(tmp_path, engine)
    world.judge(world.served("alpha"), corrected_content="beta")
    world.judge(world.served("gamma"), corrected_content="delta")
    assert len(world.trainer.run_round()) == 1
    before = world.registry.active("a")
    assert before is not None
    for _ in range(2):  # accepted, and generated at per-token probability 0.99
        world.judge(world.served("beta", logprob=-0.01))
    assert world.trainer.run_round() == [] and world.trainer.settled_batches == 1
    after = world.registry.active("a")
    assert after is not None and after.version == before.version
    for _ in range(2):  # accepted, but the agent was unsure: still something to learn
        world.judge(world.served("beta", logprob=-1.5))
    assert len(world.trainer.run_round()) == 1
    world.close()


def test_replay_brings_earlier_labelled_examples_into_later_steps(
    engine: EmbeddedEngine, tmp_path: Path
) -> None:
    world = _World(tmp_path, engine, replay=4)
    world.judge(world.served("w1"), corrected_content="r1")
    world.judge(world.served("w2"), corrected_content="r2")
    assert world.trainer.run_round()[0].num_sft == 2
    world.judge(world.served("w3"), corrected_content="r3")
    world.judge(world.served("w4"), corrected_content="r4")
    assert world.trainer.run_round()[0].num_sft == 4  # 2 fresh + 2 replayed
    world.close()


def test_replay_buffer_keeps_the_newest_and_samples_without_repeats() -> None:
    buffer = ReplayBuffer(3, seed=1)
    buffer.add([SFTSample([i], [i]) for i in range(5)])
    assert len(buffer) == 3
    drawn = buffer.sample(5)
    assert sorted(s.prompt_ids[0] for s in drawn) == [2, 3, 4]
    assert ReplayBuffer(0).sample(2) == []


def test_warm_up_raises_the_learning_rate_linearly() -> None:
    adam = AdamConfig(lr=1e-3, warmup_steps=4)
    assert [adam.lr_at(s) for s in (1, 2, 4, 9)] == pytest.approx([2.5e-4, 5e-4, 1e-3, 1e-3])
    assert AdamConfig(lr=1e-3).lr_at(1) == 1e-3


def test_the_preference_loss_orders_a_pair(engine: EmbeddedEngine) -> None:
    policy = DecoderPolicy.shared_with(engine)
    targets = tuple(policy.lora_limits.target_modules)
    layout = LoRALayout.build(policy.lora_limits, 4, 8.0, targets)
    state = AgentTrainState.create("a", layout, init_lora(layout, seed=0))
    slot = TrainingSlot(layout.numel, policy.device)
    pair = PreferencePair([1, 2, 3, 4], [10, 11, 2], [20, 21, 2])
    cfg = LossConfig(sft_weight=0.0, preference_weight=1.0)

    def margin() -> float:
        rows = [([1, 2, 3, 4], pair.chosen_ids), ([1, 2, 3, 4], pair.rejected_ids)]
        lora = TrainLoRA([layout], [state.params.clone()], torch.tensor([0, 0]))
        lp = policy.token_logprobs(PackedBatch.build(rows), lora).detach()
        return float(lp[:3].sum() - lp[3:].sum())

    start = margin()
    for _ in range(5):
        train_step(policy, [slot], [AgentBatch(state, pairs=[pair])], cfg, AdamConfig(lr=1e-2))
    assert margin() > start + 1.0


# -- one meaning of behaviour logprobs ------------------------------------------------------


def trainer_logprobs(
    policy: DecoderPolicy, weights: LoRAWeights | None, prompt: list[int], completion: list[int]
) -> torch.Tensor:
    """What the trainer scores a recorded sample with: [C] logprobs of `completion`."""
    batch = PackedBatch.build([(prompt, completion)])
    if weights is None:
        return policy.token_logprobs(batch, None)
    targets = tuple(policy.lora_limits.target_modules)
    layout = LoRALayout.build(policy.lora_limits, weights.rank, weights.alpha, targets)
    lora = TrainLoRA([layout], [layout.from_weights(weights)], torch.tensor([0]))
    return policy.token_logprobs(batch, lora)


def test_a_fresh_embedded_sample_has_ratio_one_at_temperature_and_top_p(
    tmp_path: Path,
) -> None:
    model_dir = build_tiny_model_dir(tmp_path / "m", seed=6)
    engine = EmbeddedEngine(model_dir, EngineConfig(max_num_seqs=2, max_loras=2))
    weights = random_lora_weights(engine.lora_limits, seed=3, std=0.2, rank=8)
    prompt = engine.tokenizer.encode("Once upon a time")
    params = SamplingParams(max_tokens=24, temperature=0.7, top_p=0.9, seed=11, ignore_eos=True)

    async def generate() -> tuple[list[int], list[float]]:
        await engine.start()
        try:
            engine.set_adapter("fresh", 1, weights)
            ids: list[int] = []
            lps: list[float] = []
            async for out in engine.add_request(GenerationRequest("r", "fresh", prompt, params)):
                ids += [t.token_id for t in out.tokens]
                lps += [t.logprob for t in out.tokens]
            return ids, lps
        finally:
            await engine.stop()

    ids, behaviour = asyncio.run(generate())
    now = trainer_logprobs(DecoderPolicy.shared_with(engine), weights, prompt, ids)
    ratio = torch.exp(now - torch.tensor(behaviour))
    assert len(ids) == 24 and float((ratio - 1).abs().max()) < 0.02


def test_reward_policy_config_needs_every_verdict() -> None:
    with pytest.raises(ValidationError, match="verdict_rewards lacks"):
        RewardPolicyConfig(verdict_rewards={"accepted": 1.0})


def test_a_pair_reuses_the_rows_of_its_two_sides(engine: EmbeddedEngine) -> None:
    from clora_feedback.train.step import PGSample, _rows

    policy = DecoderPolicy.shared_with(engine)
    layout = LoRALayout.build(policy.lora_limits, 4, 8.0, tuple(policy.lora_limits.target_modules))
    state = AgentTrainState.create("a", layout, init_lora(layout, seed=0))
    prompt, wrong, right = [1, 2, 3], [7, 8], [9, 2]
    batch = AgentBatch(
        state,
        pg=[PGSample("c", prompt, wrong, [-1.0, -1.0], 0.0)],
        sft=[SFTSample(prompt, right)],
        pairs=[PreferencePair(prompt, right, wrong)],
    )
    seqs, owner, [rows] = _rows([batch], [[(batch.pg[0], -0.5)]])
    assert seqs == [(prompt, wrong), (prompt, right)] and owner == [0, 0]
    assert rows.pg == [0] and rows.sft == [1] and rows.pairs == [(1, 0)]


def test_the_quickstart_shows_the_trainer_defaults() -> None:
    """Every trainer value the quickstart's config file sets is the default itself."""
    import re

    import yaml

    text = (Path(__file__).parents[1] / "docs" / "quickstart.md").read_text()
    block = re.search(r"cat > clora.yaml <<'EOF'\n(.*?)\nEOF", text, re.S)
    assert block is not None
    trainer = yaml.safe_load(block.group(1))["trainer"]
    defaults = TrainerConfig()
    for key, value in trainer.items():
        if isinstance(value, dict):
            section = getattr(defaults, key)
            assert {k: getattr(section, k) for k in value} == value, key
        else:
            assert getattr(defaults, key) == value, key


def test_samples_without_an_advantage_get_no_row(engine: EmbeddedEngine) -> None:
    """Before the first right answer every reward is 0, like the baseline: those samples
    carry no policy gradient, so the pass does not compute them (they were 16 of 40 rows)."""
    from clora_feedback.train.step import PGSample

    policy = DecoderPolicy.shared_with(engine)
    layout = LoRALayout.build(policy.lora_limits, 4, 8.0, tuple(policy.lora_limits.target_modules))
    state = AgentTrainState.create("a", layout, init_lora(layout, seed=0))
    state.baseline = 0.0
    pg = [PGSample(f"c{i}", [1, 2, 3], [7, 8, 9], [-1.0] * 3, 0.0) for i in range(4)]
    batch = AgentBatch(state, pg=pg, sft=[SFTSample([1, 2, 3], [9, 2])])
    slot = TrainingSlot(layout.numel, policy.device)
    [result] = train_step(policy, [slot], [batch], LossConfig(), AdamConfig(lr=1e-3))
    assert result.num_pg == 4 and result.tokens == 2 and result.pg_loss == 0.0
