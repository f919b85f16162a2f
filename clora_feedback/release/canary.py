"""The canary: which requests a passing candidate serves, and when its live rewards decide.

**Arms.** While a canary runs, `share` of its agent's requests go to the candidate
(the canary arm) and the rest to the serving version. The choice is sticky: the
key is the request's `conversation_id` (its `metadata`), else its `user`, else
the request itself, hashed with the agent name (sha256), so a conversation never
switches arms mid-way and the split is the same in every gateway process.

**Decision** (`judge`), on the live rewards of each arm under the current reward
policy (the feedback store's `rewards_by_version`, both arms' rewards joined since
the canary started), judged once per new canary reward (the timeout at every look):

- **abort** at once when the canary arm is worse at `canary.confidence`
  (`stats.sequential_worse`, one look per canary reward);
- **promote** once the canary arm has `canary.min_feedback` rewards and its mean is
  not below serving's by more than `canary.max_drop`;
- after `canary.timeout_s` without either, `canary.on_timeout` decides (`abort`,
  the default: what has not shown itself not worse does not serve everyone).

Not here: routing requests (`gateway.agents` asks `arm`), loading the arms (the
deployer), the states (`store.registry.releases`).
"""

from __future__ import annotations

import hashlib
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from clora_feedback.release.stats import sequential_worse

__all__ = ["CanaryDecision", "CanarySettings", "in_canary", "judge", "sticky_key"]


def sticky_key(conversation_id: str | None, user: str | None, request_id: str) -> str:
    """What keeps a request on one arm: its conversation, else its user, else itself."""
    if conversation_id:
        return f"conversation:{conversation_id}"
    if user:
        return f"user:{user}"
    return f"request:{request_id}"


def in_canary(agent: str, key: str, share: float) -> bool:
    """Whether the request with sticky `key` goes to `agent`'s canary arm (deterministic)."""
    if share <= 0.0:
        return False
    digest = hashlib.sha256(f"{agent}\0{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64 < share


@dataclass(frozen=True)
class CanarySettings:
    """The canary's numbers (from `release.canary`, see `config.CanaryConfig`)."""

    share: float = 0.25
    min_feedback: int = 8
    max_drop: float = 0.1
    confidence: float = 0.95
    timeout_s: float = 900.0
    on_timeout: Literal["abort", "promote"] = "abort"


@dataclass
class CanaryDecision:
    """What the live rewards say now."""

    action: Literal["promote", "abort", "continue"]
    reason: str
    evidence: dict[str, Any] = field(default_factory=dict)


def _mean(values: Sequence[float]) -> float | None:
    return statistics.fmean(values) if values else None


def judge(
    serving: Sequence[float],
    canary: Sequence[float],
    *,
    elapsed_s: float,
    settings: CanarySettings,
    look: bool = True,
) -> CanaryDecision:
    """Decide on the two arms' live rewards (see the module docstring).

    Args:
        look: False when the canary arm has no new reward since the last judgement: only
            the timeout is checked (the sequential test spends its level once per canary
            reward count, so repeating a look at the same count would inflate it).
    """
    cfg = settings
    mean_s, mean_c = _mean(serving), _mean(canary)
    evidence: dict[str, Any] = {
        "n_serving": len(serving),
        "n_canary": len(canary),
        "mean_serving": None if mean_s is None else round(mean_s, 6),
        "mean_canary": None if mean_c is None else round(mean_c, 6),
        "elapsed_s": round(elapsed_s, 1),
        "confidence": cfg.confidence,
        "max_drop": cfg.max_drop,
        "min_feedback": cfg.min_feedback,
    }
    worse, test, level = False, None, 0.0
    if look:
        worse, test, level = sequential_worse(serving, canary, confidence=cfg.confidence)
    if test is not None:
        evidence |= {"p_worse": test.p, "level": level, "t": test.t, "df": test.df}
    if worse:
        return CanaryDecision(
            "abort",
            f"worse live: canary mean {mean_c:.3f} (n={len(canary)}) vs serving {mean_s:.3f} "
            f"(n={len(serving)}), one-sided Welch p={test.p:.3g} < {level:.3g}",  # type: ignore[union-attr]
            evidence,
        )
    drop = None if mean_s is None or mean_c is None else mean_s - mean_c
    if look and len(canary) >= cfg.min_feedback and drop is not None and drop <= cfg.max_drop:
        return CanaryDecision(
            "promote",
            f"not worse live: canary mean {mean_c:.3f} (n={len(canary)}) vs serving "
            f"{mean_s:.3f} (n={len(serving)}), drop {drop:+.3f} <= {cfg.max_drop:g}",
            evidence,
        )
    if elapsed_s >= cfg.timeout_s:
        return CanaryDecision(
            "abort" if cfg.on_timeout == "abort" else "promote",
            f"timed out after {cfg.timeout_s:g} s with {len(canary)} canary rewards "
            f"(need {cfg.min_feedback} and a drop <= {cfg.max_drop:g}); on_timeout="
            f"{cfg.on_timeout}",
            evidence | {"timeout": True},
        )
    return CanaryDecision("continue", "waiting for live rewards", evidence)
