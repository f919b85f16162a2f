"""The release path's wiring: what `clora serve` and `clora train` add for it.

`trainer_parts` gives a trainer what the release path needs from it: the
sample source without the held-out evaluation reserve (`evalset.HeldOutSplit`)
and the registry's release states to record candidates in and read rejections
from (both None with `release.enabled` off: every trainer version serves at
once). `build_release` assembles the release loop of a gateway (gate, evaluation
set, canary settings over the engine, the deployer and the feedback store's live
rewards) and routes the agents' requests through its canary arms;
`release_families` are its `/metrics` rows (bounded labels: stage and verdict).

Not here: the release path itself (`clora_feedback.release`), the other parts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from clora_feedback.config import Settings
from clora_feedback.engine.base import Engine
from clora_feedback.engine.deployer import Deployer
from clora_feedback.feedback.store import FeedbackStore
from clora_feedback.gateway.agents import AgentRegistry
from clora_feedback.gateway.metrics import Family
from clora_feedback.release.canary import CanarySettings
from clora_feedback.release.controller import ReleaseController
from clora_feedback.release.evalset import EvalSet, HeldOutSplit
from clora_feedback.release.gate import GateSettings, OfflineGate
from clora_feedback.store.registry import AdapterRegistry
from clora_feedback.store.registry.releases import ReleaseBook


def trainer_parts(
    settings: Settings, feedback: FeedbackStore, registry: AdapterRegistry
) -> tuple[FeedbackStore | HeldOutSplit, ReleaseBook | None]:
    """(the trainer's sample source, its release record); the store itself and None when
    the release path is off."""
    if not settings.release.enabled:
        return feedback, None
    gate = settings.release.gate
    fraction = gate.holdout_fraction if gate.enabled else 0.0
    return HeldOutSplit(feedback, fraction), ReleaseBook(registry)


def build_release(
    settings: Settings,
    engine: Engine,
    registry: AdapterRegistry,
    deployer: Deployer,
    feedback: FeedbackStore,
    split: FeedbackStore | HeldOutSplit,
    agents: AgentRegistry,
) -> ReleaseController | None:
    """The gateway's release loop (None when `release.enabled` is off)."""
    cfg = settings.release
    if not cfg.enabled:
        return None
    gate = evalset = None
    if cfg.gate.enabled and isinstance(split, HeldOutSplit):
        tokenizer = engine.tokenizer
        cases_dir = cfg.gate.cases_dir or settings.data_dir / "cases"

        def decode(ids: Sequence[int]) -> str:
            return str(tokenizer.decode(list(ids), skip_special_tokens=True))

        def render(messages: list[dict[str, Any]]) -> list[int]:
            text = tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
            return list(tokenizer.encode(str(text), add_special_tokens=False))

        evalset = EvalSet(split, decode, cases_dir=cases_dir, render=render)
        gate = OfflineGate(
            engine,
            feedback.policy,
            GateSettings(
                min_cases=cfg.gate.min_cases, max_cases=cfg.gate.max_cases,
                max_drop=cfg.gate.max_drop, confidence=cfg.gate.confidence,
                max_tokens=cfg.gate.max_tokens, concurrency=cfg.gate.concurrency,
                timeout_s=cfg.gate.timeout_s,
            ),
        )  # fmt: skip
    canary = None
    if cfg.canary.enabled:
        c = cfg.canary
        canary = CanarySettings(
            share=c.share, min_feedback=c.min_feedback, max_drop=c.max_drop,
            confidence=c.confidence, timeout_s=c.timeout_s, on_timeout=c.on_timeout,
        )  # fmt: skip
    controller = ReleaseController(
        registry, ReleaseBook(registry), deployer,
        gate=gate, evalset=evalset, rewards=feedback.rewards_by_version, canary=canary,
        interval_s=cfg.interval_s, min_cases=cfg.gate.min_cases, max_cases=cfg.gate.max_cases,
    )  # fmt: skip
    agents.canary_route = controller.route
    return controller


def release_families(controller: ReleaseController) -> list[Family]:
    """`/metrics`: verdicts by stage and verdict since start, live canaries, gate CPU seconds."""
    return [
        Family(
            "clora_release_verdicts_total", "counter",
            "Release verdicts since start: gate passed|failed|inconclusive|invalid, canary "
            "started|promoted|aborted, operator promoted|aborted.",
            ("stage", "verdict"), dict(controller.verdicts),
        ),
        Family(
            "clora_release_canaries", "gauge", "Canaries routed by this process.",
            (), {"": float(len(controller.canaries()))},
        ),
        Family(
            "clora_release_gate_cpu_seconds_total", "counter",
            "Process CPU seconds spent while offline gates evaluated (an upper bound).",
            (), {"": controller.gate.cpu_seconds if controller.gate is not None else 0.0},
        ),
    ]  # fmt: skip
