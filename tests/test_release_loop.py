"""The release loop without an engine (a fake deployer, synthetic rewards): a pointer move ends
the live canary everywhere, verdicts are compare-and-set, a pin stops the path, an evaluator
crash is invalid, operator cases are keyed by content, one sequential look per canary reward,
bounded reads, and routing checks the key before choosing an arm."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import pytest
from pydantic import ValidationError

from clora_feedback.config import FeedbackConfig, GateConfig
from clora_feedback.errors import ConflictError
from clora_feedback.feedback.rewards import DefaultRewardPolicy
from clora_feedback.gateway.agents import Route
from clora_feedback.gateway.auth import Principal
from clora_feedback.gateway.serving import Serving
from clora_feedback.lora.weights import LoRALimits, random_lora_weights
from clora_feedback.release import controller as controller_module
from clora_feedback.release.canary import CanarySettings, judge
from clora_feedback.release.evalset import EvalCase, EvalSet
from clora_feedback.release.gate import GateSettings, GateVerdict, OfflineGate
from clora_feedback.store.registry import AdapterRegistry
from clora_feedback.store.registry.releases import ReleaseBook

T = TypeVar("T")

LIMITS = LoRALimits(
    max_rank=4,
    target_modules=("q_proj", "v_proj"),
    num_layers=1,
    shapes={"q_proj": (8, 8), "v_proj": (8, 4)},
)
SETTINGS = CanarySettings(share=0.5, min_feedback=4, max_drop=0.1, timeout_s=600)


def _publish(reg: AdapterRegistry, *, activate: bool = False) -> int:
    info = reg.publish(
        "a", random_lora_weights(LIMITS, rank=2, seed=1), optimizer_state=None,
        base_model="tiny", parent=None, step=1, metrics={}, feedback_window=None,
        activate=activate,
    )  # fmt: skip
    return info.version


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[AdapterRegistry]:
    with AdapterRegistry(tmp_path / "adapters", tmp_path / "registry.db") as reg:
        _publish(reg, activate=True)  # v1 serves
        yield reg


class FakeDeployer:
    """Arms by name; `install_then` as the deployer: install, move, put back on error."""

    def __init__(self, registry: AdapterRegistry) -> None:
        self.registry = registry
        self.arms: dict[str, int] = {}
        self.installed: list[int] = []

    def serving(self, agent: str) -> int | None:
        return self.registry.agent(agent).active_version

    async def load_arm(self, name: str, agent: str, version: int) -> None:
        self.arms[name] = version

    async def unload_arm(self, name: str) -> None:
        self.arms.pop(name, None)

    async def install_then(self, agent: str, version: int, move: Callable[[], T]) -> T:
        self.installed.append(version)
        return move()


class Rewards:
    def __init__(self) -> None:
        self.by_version: dict[int, list[float]] = {}
        self.since: list[float | None] = []

    def __call__(self, agent: str, version: int, since: float | None = None) -> Sequence[float]:
        self.since.append(since)
        return self.by_version.get(version, [])


def _loop(registry: AdapterRegistry, **kw: Any) -> tuple[Any, FakeDeployer, Rewards]:
    deployer, rewards = FakeDeployer(registry), Rewards()
    kw = {"gate": None, "evalset": None, "canary": SETTINGS} | kw
    loop = controller_module.ReleaseController(
        registry, ReleaseBook(registry), deployer, rewards=rewards, min_cases=2, **kw
    )
    return loop, deployer, rewards


def _candidate(registry: AdapterRegistry) -> int:
    version = _publish(registry)
    ReleaseBook(registry).record("a", version, "candidate")
    return version


# -- 1. a pointer move ends the live canary ----------------------------------------------


def test_every_pointer_move_ends_the_live_canary_in_its_transaction(
    registry: AdapterRegistry,
) -> None:
    book = ReleaseBook(registry)

    def canary() -> int:
        version = _publish(registry)
        book.record("a", version, "passed")
        active = registry.agent("a").active_version or 0
        book.start_canary("a", version, share=0.25, serving=active, evidence={})
        return version

    live, other = canary(), _publish(registry)
    book.promote("a", other, expected_active=1, stage="operator", evidence={})
    record = book.get("a", live)
    assert record is not None and record.state == "aborted"
    assert record.evidence["operator"]["code"] == "superseded" and book.canary("a") is None
    live = canary()
    registry.rollback("a", 1, reason="bad")
    assert book.get("a", live).state == "aborted"  # type: ignore[union-attr]
    live = canary()
    registry.deactivate("a", expected_active=1)
    assert book.get("a", live).state == "aborted"  # type: ignore[union-attr]
    live = canary()
    registry.rollback("a", live, reason="undo")  # the canary itself now serves everyone
    assert book.get("a", live).state == "promoted" and book.canary("a") is None  # type: ignore[union-attr]


async def test_an_operator_rollback_stops_the_canary_and_it_never_installs(
    registry: AdapterRegistry,
) -> None:
    loop, deployer, rewards = _loop(registry)
    version = _candidate(registry)
    await loop.look()
    assert loop.canaries() == {"a": (version, 0.5)} and deployer.arms == {"a@canary": version}
    registry.deactivate("a", expected_active=1)  # an unload (or a rollback) elsewhere
    rewards.by_version = {1: [1.0, 0.0] * 4, version: [1.0] * 8}  # would promote
    await loop.look()
    assert loop.canaries() == {} and deployer.arms == {} and deployer.installed == []
    assert loop.route("a", "conversation:x") is None
    assert ReleaseBook(registry).get("a", version).state == "aborted"  # type: ignore[union-attr]


async def test_an_operator_promotion_of_another_version_ends_the_canary(
    registry: AdapterRegistry,
) -> None:
    loop, _, _ = _loop(registry)
    canary = _candidate(registry)
    await loop.look()
    other = _publish(registry)
    await loop.promote("a", other, reason="hotfix")
    other_loop, other_deployer, _ = _loop(registry)  # another gateway follows the registry
    await other_loop.look()
    assert loop.canaries() == {} == other_loop.canaries() and other_deployer.arms == {}
    assert ReleaseBook(registry).get("a", canary).state == "aborted"  # type: ignore[union-attr]
    assert registry.agent("a").active_version == other


# -- 2. verdicts are compare-and-set -----------------------------------------------------


class RacedGate:
    """A gate during whose evaluation another gateway canaries the version."""

    def __init__(self, registry: AdapterRegistry, verdict: str) -> None:
        self.book = ReleaseBook(registry)
        self.verdict = verdict

    async def judge(self, agent: str, cases: Any, *, candidate: Any, serving: Any) -> GateVerdict:
        version = candidate[1]
        self.book.record(agent, version, "passed")
        self.book.start_canary(agent, version, share=0.3, serving=serving[1], evidence={})
        return GateVerdict(self.verdict, "raced", {"cases": len(cases)})  # type: ignore[arg-type]

    def forget(self, agent: str, keep_version: int | None = None) -> None:
        pass


class Cases:
    def __init__(self, n: int) -> None:
        self.n = n

    def cases(self, agent: str, *, limit: int) -> list[EvalCase]:
        return [EvalCase(f"c{i}", (1, i), "x", "t") for i in range(self.n)][:limit]


async def test_a_gate_verdict_never_overwrites_another_gateways_move(
    registry: AdapterRegistry,
) -> None:
    loop, _, _ = _loop(registry, gate=RacedGate(registry, "failed"), evalset=Cases(4))
    version = _candidate(registry)
    await loop.look()
    assert ReleaseBook(registry).get("a", version).state == "canary"  # type: ignore[union-attr]
    assert loop.verdicts[("gate", "failed")] == 0
    other = _publish(registry)  # an operator's gate of a version with no record
    await loop.abort("a", reason="t")
    assert (await loop.gate_now("a", other)).verdict == "failed"
    assert ReleaseBook(registry).get("a", other).state == "canary"  # type: ignore[union-attr]


# -- 3. a pin stops the release path -----------------------------------------------------


async def test_a_pinned_agent_is_never_promoted_by_the_release_path(
    registry: AdapterRegistry,
) -> None:
    loop, deployer, rewards = _loop(registry)
    canary = _candidate(registry)
    await loop.look()
    waiting = _candidate(registry)
    registry.pin("a")
    rewards.by_version = {1: [1.0, 0.0] * 4, canary: [1.0] * 8}  # would promote
    await loop.look()
    book = ReleaseBook(registry)
    assert book.get("a", canary).state == "canary" and deployer.installed == []  # type: ignore[union-attr]
    await loop.abort("a", reason="t")
    await loop.look()
    assert book.get("a", waiting).state == "candidate" and loop.canaries() == {}  # type: ignore[union-attr]
    with pytest.raises(ConflictError) as exc:
        book.promote("a", waiting, expected_active=1, stage="canary", evidence={})
    assert exc.value.code == "agent_pinned"
    assert await loop.promote("a", waiting, reason="operator") == waiting  # operators still act


# -- 4. an evaluator crash is invalid ----------------------------------------------------


class CrashingTokenizer:
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        raise RuntimeError("evaluator bug")


class CrashingEngine:
    tokenizer = CrashingTokenizer()
    max_model_len = 64


async def test_an_evaluator_crash_is_invalid_not_an_exception() -> None:
    gate = OfflineGate(
        CrashingEngine(),  # type: ignore[arg-type]
        DefaultRewardPolicy(FeedbackConfig()),
        GateSettings(min_cases=2),
    )
    verdict = await gate.judge(
        "a", Cases(3).cases("a", limit=3), candidate=("a@gate", 2), serving=(None, 0)
    )
    assert verdict.verdict == "invalid" and verdict.evidence["code"] == "error"
    assert "RuntimeError" in verdict.reason


# -- 5. operator cases are keyed by what they ask ----------------------------------------


class NoSamples:
    def training_samples(self, agent: str, *, after_seq: int = 0, limit: int = 1000) -> list:
        return []

    def is_held_out(self, sample: Any) -> bool:
        return False


def test_operator_case_keys_follow_their_content_not_their_line(tmp_path: Path) -> None:
    split = NoSamples()
    split.source = split  # type: ignore[attr-defined]
    path = tmp_path / "a.jsonl"
    path.write_text('{"prompt": "one", "answer": "1"}\n{"prompt": "two", "answer": "2"}\n')
    evalset = EvalSet(split, str, cases_dir=tmp_path,  # type: ignore[arg-type]
                      render=lambda m: [ord(c) for c in m[-1]["content"]])  # fmt: skip
    before = {c.answer: c.key for c in evalset.cases("a", limit=10)}
    path.write_text('{"prompt": "two", "answer": "2"}\n')  # an edit moves "two" up a line
    import os

    os.utime(path, (1, 1))
    after = {c.answer: c.key for c in evalset.cases("a", limit=10)}
    assert after == {"2": before["2"]} and before["1"] != before["2"]


# -- 6. one sequential look per canary reward; 7. bounded reads --------------------------


async def test_the_canary_test_looks_once_per_new_reward_on_rewards_since_its_start(
    registry: AdapterRegistry, monkeypatch: pytest.MonkeyPatch
) -> None:
    looks: list[bool] = []

    def spy(*args: Any, **kwargs: Any) -> Any:
        looks.append(kwargs.get("look", True))
        return judge(*args, **kwargs)

    monkeypatch.setattr(controller_module, "judge", spy)
    loop, _, rewards = _loop(registry)
    version = _candidate(registry)
    await loop.look()
    rewards.by_version = {1: [1.0, 0.0] * 4, version: [1.0, 0.0]}
    await loop.look()
    await loop.look()  # no new canary reward: no new test
    rewards.by_version[version].append(1.0)
    await loop.look()
    assert looks == [True, False, True]
    started = ReleaseBook(registry).canary("a").evidence["canary"]["started_at"]  # type: ignore[union-attr]
    assert rewards.since and all(s == started for s in rewards.since)
    assert judge([1.0, 0.0] * 4, [0.0] * 8, elapsed_s=0, settings=SETTINGS, look=False).action == (
        "continue"
    )


@pytest.mark.parametrize("undecided", ["invalid", "inconclusive"])
async def test_an_old_invalid_version_is_not_regated_every_look(
    registry: AdapterRegistry, monkeypatch: pytest.MonkeyPatch, undecided: str
) -> None:
    """Only an agent's newest undecided version is judged again, once its cases grew."""
    evalset = Cases(1)
    loop, _, _ = _loop(registry, gate=RacedGate(registry, "passed"), evalset=evalset)
    book = ReleaseBook(registry)
    old = _publish(registry)
    book.record("a", old, "invalid", stage="gate", evidence={"cases": 1, "code": "error"})
    newer = _publish(registry)
    book.record("a", newer, "failed")  # the agent's newest record is not invalid
    calls: list[str] = []
    real = loop._release_next

    async def spy(agent: str, **kw: Any) -> None:
        calls.append(agent)
        await real(agent, **kw)

    monkeypatch.setattr(loop, "_release_next", spy)
    evalset.n = 5
    await loop.look()
    assert calls == [] and book.get("a", old).state == "invalid"  # type: ignore[union-attr]
    newest = _publish(registry)
    book.record("a", newest, undecided, stage="gate", evidence={"cases": 5})
    await loop.look()
    assert calls == []  # its evaluation set has not grown
    evalset.n = 6
    await loop.look()
    assert calls == ["a"] and book.get("a", newest).state == "canary"  # type: ignore[union-attr]
    with registry.database.read() as conn:
        names = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='index'")}
    assert "releases_by_state" in names


# -- 8. settings that could never gate ----------------------------------------------------


def test_min_cases_above_max_cases_is_refused() -> None:
    with pytest.raises(ValidationError, match="min_cases"):
        GateConfig(min_cases=10, max_cases=8)
    assert GateConfig(min_cases=8, max_cases=8).max_cases == 8


# -- 9. the key is checked before a canary is chosen -------------------------------------


class CountingAgents:
    def __init__(self) -> None:
        self.sticky: list[str] = []

    def resolve(self, model: str, *, sticky: str | None = None) -> Route:
        if sticky is not None:
            self.sticky.append(sticky)
        return Route(model, model, engine_agent=model, adapter_version=1)


def test_a_refused_request_never_counts_as_canary_exposure() -> None:
    serving = Serving.__new__(Serving)
    serving.agents = CountingAgents()  # type: ignore[assignment]
    prefetched: list[str] = []

    class Engine:
        def prefetch(self, agent: str) -> None:
            prefetched.append(agent)

    serving.engine = Engine()  # type: ignore[assignment]

    class Body:
        model = "a"
        user = None
        metadata = None

    with pytest.raises(Exception, match="model"):
        serving.route(Body(), Principal(admin=False, agents=frozenset({"b"})))  # type: ignore[arg-type]
    assert serving.agents.sticky == []  # type: ignore[attr-defined]
    assert serving.route(Body(), Principal(admin=True)).agent == "a"  # type: ignore[arg-type]
    assert len(serving.agents.sticky) == 1  # type: ignore[attr-defined]
    assert prefetched == ["a"]  # only the admitted request reads its adapter
