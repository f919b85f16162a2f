"""The canary's decision and arm choice on synthetic numbers: sticky keys, the share, abort when
worse, promote when not worse after min_feedback, wait otherwise, and the timeout policy."""

from __future__ import annotations

from clora_feedback.release.canary import CanarySettings, in_canary, judge, sticky_key

SETTINGS = CanarySettings(share=0.25, min_feedback=8, max_drop=0.1, confidence=0.95, timeout_s=60)


def test_sticky_key_prefers_the_conversation_then_the_user() -> None:
    assert sticky_key("c1", "u1", "r1") == "conversation:c1"
    assert sticky_key(None, "u1", "r1") == "user:u1"
    assert sticky_key(None, None, "r1") == "request:r1"


def test_the_share_is_met_and_the_choice_is_stable_per_agent() -> None:
    keys = [f"conversation:{i}" for i in range(4000)]
    chosen = [k for k in keys if in_canary("support", k, 0.25)]
    assert 0.22 < len(chosen) / len(keys) < 0.28
    assert chosen == [k for k in keys if in_canary("support", k, 0.25)]  # deterministic
    assert chosen != [k for k in keys if in_canary("billing", k, 0.25)]  # per agent
    assert not any(in_canary("support", k, 0.0) for k in keys)


def test_worse_aborts_not_worse_promotes_and_too_few_waits() -> None:
    serving = [1.0, 1.0, 1.0, 0.0] * 10
    abort = judge(serving, [0.0] * 8, elapsed_s=5, settings=SETTINGS)
    assert abort.action == "abort" and abort.evidence["p_worse"] < abort.evidence["level"]
    promote = judge(serving, [1.0, 1.0, 0.0, 1.0] * 2, elapsed_s=5, settings=SETTINGS)
    assert promote.action == "promote" and promote.evidence["n_canary"] == 8
    wait = judge(serving, [1.0, 0.0, 1.0], elapsed_s=5, settings=SETTINGS)
    assert wait.action == "continue"
    slightly = judge(serving, [1.0, 0.0] * 4, elapsed_s=5, settings=SETTINGS)  # 0.5 vs 0.75
    assert slightly.action == "continue"  # not shown worse, not within max_drop: wait


def test_the_timeout_decides_by_policy() -> None:
    serving, canary = [1.0, 1.0, 1.0, 0.0] * 10, [1.0, 0.0] * 4
    late = judge(serving, canary, elapsed_s=61, settings=SETTINGS)
    assert late.action == "abort" and late.evidence["timeout"]
    lenient = CanarySettings(timeout_s=60, on_timeout="promote")
    assert judge(serving, canary, elapsed_s=61, settings=lenient).action == "promote"
