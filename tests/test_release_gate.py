"""The release path on the tiny model's embedded engine: the held-out split, the offline gate
(a collapsed candidate fails, a faithful one passes, too few cases or an evaluator error is
invalid), and the controller (a failed candidate never serves a request; a passing one
canaries on a sticky share, is aborted at once when worse live, promoted when not; a restart
restores the same arm)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest

from clora_feedback.config import EngineConfig, FeedbackConfig
from clora_feedback.engine.deployer import Deployer
from clora_feedback.engine.embedded import EmbeddedEngine
from clora_feedback.engine.types import GenerationRequest, SamplingParams
from clora_feedback.feedback.rewards import DefaultRewardPolicy
from clora_feedback.feedback.store import TrainingSample
from clora_feedback.lora.weights import LoRAWeights, random_lora_weights
from clora_feedback.release import arms
from clora_feedback.release.canary import CanarySettings, in_canary, sticky_key
from clora_feedback.release.controller import ReleaseController
from clora_feedback.release.evalset import (
    EvalCase,
    EvalSet,
    HeldOutSplit,
    held_out,
    operator_key,
)
from clora_feedback.release.gate import GateSettings, OfflineGate, score
from clora_feedback.store.registry import AdapterRegistry
from clora_feedback.store.registry.releases import ReleaseBook

POLICY = DefaultRewardPolicy(FeedbackConfig())


@pytest.fixture
async def engine(tiny_model_dir: Path) -> AsyncIterator[EmbeddedEngine]:
    config = EngineConfig(model=str(tiny_model_dir), max_model_len=128, num_threads=1, max_loras=4)
    engine = EmbeddedEngine(tiny_model_dir, config, model_name="tiny-base")
    await engine.start()
    yield engine
    await engine.stop()


def _sample(cid: str, seq: int, *, target: str | None = None, confirmed: bool = False,
            prompt: list[int] | None = None) -> TrainingSample:  # fmt: skip
    return TrainingSample(
        completion_id=cid, sample_index=0, agent="a", adapter_version=0,
        prompt_token_ids=prompt or [1, 2, seq], completion_token_ids=[5, 6], logprobs=[-1.0, -1.0],
        token_versions=[0, 0], rewards=[], targets=[target] if target else [], last_seq=seq,
        created_at=0.0, reward=0.0, source="correction", confirmed=confirmed,
    )  # fmt: skip


class Source:
    def __init__(self, samples: list[TrainingSample]) -> None:
        self.samples = samples
        self.reward_policy_id = "p"

    def training_samples(
        self, agent: str, *, after_seq: int = 0, limit: int = 1000
    ) -> list[TrainingSample]:
        return [s for s in self.samples if s.last_seq > after_seq][:limit]

    def agents_with_rewards(self) -> list[str]:
        return ["a"]


def test_the_split_holds_out_labelled_samples_only_and_never_trains_them(tmp_path: Path) -> None:
    samples = [_sample(f"c{i}", i, target="x" if i % 2 else None) for i in range(1, 201)]
    split = HeldOutSplit(Source(samples), 0.25)
    trained = {s.completion_id for s in split.training_samples("a")}
    held = {s.completion_id for s in samples if split.is_held_out(s)}
    assert held and not held & trained  # never trained on
    assert all(int(c[1:]) % 2 for c in held)  # only labelled ones
    assert 0.15 < len(held) / 100 < 0.35  # about the fraction of the labelled
    assert held_out("a", "c1", 0, 0.25) == held_out("a", "c1", 0, 0.25)  # deterministic
    assert not held_out("a", "c1", 0, 0.0)
    # A page held out whole does not stall the trainer's cursor.
    only_held = [s for s in samples if s.completion_id in held]
    assert (
        HeldOutSplit(Source([*only_held, _sample("z", 999)]), 0.25)
        .training_samples("a", limit=3)[0]
        .completion_id
        == "z"
    )
    cases_dir = tmp_path / "cases"
    cases_dir.mkdir()
    (cases_dir / "a.jsonl").write_text(
        '{"prompt": "hi", "answer": "hello"}\nnot json\n{"messages": [], "answer": "x"}\n'
    )
    evalset = EvalSet(split, lambda ids: "decoded", cases_dir=cases_dir,
                      render=lambda messages: [9, len(messages)])  # fmt: skip
    cases = evalset.cases("a", limit=100)
    assert cases[0] == EvalCase(operator_key((9, 1), "hello"), (9, 1), "hello", "operator")
    assert len(cases) == 1 + len(held) and all(c.answer == "x" for c in cases[1:])
    with pytest.raises(Exception, match="answer"):
        evalset.add_operator_cases("a", [{"prompt": "q"}])
    assert evalset.add_operator_cases("a", [{"prompt": "q", "answer": "r"}]) == 1
    assert evalset.cases("a", limit=2)[1].key == operator_key((9, 1), "r")


def test_score_is_the_reward_policys_judgement_of_a_right_answer() -> None:
    assert score(POLICY, "a", " billing\n", "billing") == 1.0
    assert score(POLICY, "a", "sales", "billing") == 0.0


async def _greedy(engine: EmbeddedEngine, prompt: list[int], agent: str | None) -> str:
    request = GenerationRequest("r" + str(time.monotonic_ns()), agent, prompt,
                                SamplingParams(max_tokens=6, temperature=0.0))  # fmt: skip
    return "".join([out.text async for out in engine.add_request(request)])


async def _cases(engine: EmbeddedEngine, n: int) -> list[EvalCase]:
    """Cases whose right answer is what the base model answers (serving = the base)."""
    out = []
    for i in range(n):
        prompt = engine.tokenizer.encode(f"case {i}:")
        out.append(EvalCase(f"t{i}", tuple(prompt), await _greedy(engine, prompt, None), "t"))
    return out


def _collapsed(engine: EmbeddedEngine) -> LoRAWeights:
    return random_lora_weights(engine.lora_limits, rank=4, seed=1, std=2.0)


def _faithful(engine: EmbeddedEngine) -> LoRAWeights:
    return random_lora_weights(engine.lora_limits, rank=4, seed=2, std=1e-6)


async def test_gate_fails_a_collapsed_candidate_and_passes_a_faithful_one(
    engine: EmbeddedEngine,
) -> None:
    cases = await _cases(engine, 8)
    gate = OfflineGate(engine, POLICY, GateSettings(min_cases=6, max_tokens=6, slack_tokens=0))
    engine.set_adapter("a@gate", 5, _collapsed(engine))
    bad = await gate.judge("a", cases, candidate=("a@gate", 5), serving=(None, 0))
    assert bad.verdict == "failed", bad.reason
    assert bad.evidence["serving_mean"] == 1.0 and bad.evidence["lower_bound"] < -0.1
    engine.set_adapter("a@gate", 6, _faithful(engine))
    good = await gate.judge("a", cases, candidate=("a@gate", 6), serving=(None, 0))
    assert good.verdict == "passed", good.reason
    assert good.evidence["cpu_seconds"] >= 0 and good.evidence["n"] == 8
    few = await gate.judge("a", cases[:3], candidate=("a@gate", 6), serving=(None, 0))
    assert few.verdict == "invalid" and few.evidence["code"] == "too_few_cases"
    missing = await gate.judge("a", cases, candidate=("nobody@gate", 6), serving=(None, 0))
    assert missing.verdict == "invalid" and missing.evidence["code"] == "error"
    raced = await gate.judge("a", cases, candidate=("a@gate", 7), serving=(None, 0))
    assert raced.verdict == "invalid" and raced.evidence["code"] == "moved"
    slow = OfflineGate(engine, POLICY, GateSettings(min_cases=6, timeout_s=1e-4))
    late = await slow.judge("a", cases, candidate=("a@gate", 6), serving=(None, 0))
    assert late.verdict == "invalid" and late.evidence["code"] == "timeout"


class Rewards:
    def __init__(self) -> None:
        self.by_version: dict[int, list[float]] = {}

    def __call__(self, agent: str, version: int, since: float | None = None) -> Sequence[float]:
        return self.by_version.get(version, [])


def _candidate(registry: AdapterRegistry, book: ReleaseBook, weights: LoRAWeights) -> int:
    info = registry.publish("a", weights, optimizer_state=None, base_model="tiny-base",
                            parent=None, step=1, metrics={}, feedback_window=None,
                            activate=False)  # fmt: skip
    book.record("a", info.version, "candidate")
    return info.version


async def test_controller_rejects_canaries_aborts_promotes_and_restores(
    engine: EmbeddedEngine, tmp_path: Path
) -> None:
    cases = await _cases(engine, 8)

    class Cases:
        def cases(self, agent: str, *, limit: int) -> list[EvalCase]:
            return cases[:limit]

    registry = AdapterRegistry(tmp_path / "adapters", tmp_path / "registry.db")
    book = ReleaseBook(registry)
    deployer = Deployer(engine, registry)
    await deployer.start()
    rewards = Rewards()
    settings = CanarySettings(share=0.5, min_feedback=4, max_drop=0.1, timeout_s=600)

    def controller() -> ReleaseController:
        gate = OfflineGate(engine, POLICY, GateSettings(min_cases=6, max_tokens=6, slack_tokens=0))
        return ReleaseController(registry, book, deployer, gate=gate, evalset=Cases(),  # type: ignore[arg-type]
                                 rewards=rewards, canary=settings, min_cases=6)  # fmt: skip

    release = controller()
    bad = _candidate(registry, book, _collapsed(engine))
    await release.look()
    assert book.get("a", bad).state == "failed"  # type: ignore[union-attr]
    assert engine.adapter_version("a") is None and registry.agent("a").active_version is None
    assert release.route("a", "conversation:x") is None  # nothing new serves any request
    assert deployer.arms() == {}  # the gate arm is gone

    good = _candidate(registry, book, _faithful(engine))
    await release.look()
    assert book.get("a", good).state == "canary"  # type: ignore[union-attr]
    keys = [sticky_key(f"conv{i}", None, "r") for i in range(200)]
    routed = [k for k in keys if release.route("a", k) is not None]
    assert 60 < len(routed) < 140 and all(in_canary("a", k, 0.5) for k in routed)
    assert release.route("a", routed[0]) == (arms.canary_name("a"), good)  # sticky
    assert engine.adapter_version(arms.canary_name("a")) == good

    again = controller()  # a restart mid-canary: the same arm from the registry
    await again.start()
    assert again.canaries() == {"a": (good, 0.5)}
    await again.stop()

    # An operator gates another version while the canary runs: it passes and waits.
    waiting = registry.publish("a", _faithful(engine), optimizer_state=None, base_model="t",
                               parent=None, step=2, metrics={}, feedback_window=None,
                               activate=False).version  # fmt: skip
    assert (await release.gate_now("a", waiting)).verdict == "passed"
    assert book.get("a", waiting).state == "passed" and release.canaries()["a"][0] == good  # type: ignore[union-attr]

    rewards.by_version = {0: [1.0, 1.0, 1.0, 0.0] * 10, good: [0.0] * 8}  # worse live
    await release.look()
    record = book.get("a", good)
    assert record is not None and record.state == "aborted"
    assert (
        record.evidence["canary"]["n_canary"] == 8 and record.evidence["canary"]["routed_here"] > 0
    )
    # In the same look, the version an operator gated is canaried, not gated again.
    assert release.canaries() == {"a": (waiting, 0.5)}
    assert release.route("a", routed[0]) == (arms.canary_name("a"), waiting)
    await release.abort("a", reason="operator test")
    assert book.get("a", waiting).state == "aborted"  # type: ignore[union-attr]
    assert release.route("a", routed[0]) is None and deployer.arms() == {}

    better = _candidate(registry, book, _faithful(engine))
    await release.look()
    rewards.by_version[better] = [1.0, 1.0, 0.0, 1.0]
    await release.look()
    assert book.get("a", better).state == "promoted"  # type: ignore[union-attr]
    assert registry.agent("a").active_version == better and engine.adapter_version("a") == better
    assert (
        release.verdicts[("gate", "failed")] == 1 and release.verdicts[("canary", "aborted")] == 1
    )
    await deployer.stop()
    registry.close()
