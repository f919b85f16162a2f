"""The offline gate: a candidate and the serving version answer the same held-out cases.

`OfflineGate.judge` takes the agent's evaluation cases (`evalset`), has each
version answer each case through the `Engine` Protocol with the same greedy
decoding (temperature 0, `max_tokens` = the answer's length + `slack_tokens`,
capped by `gate.max_tokens`), scores every answer with the reward policy
(`score`: what a resolution naming that right answer would give the output), and
decides on the paired differences (`stats.paired_verdict`):

- **passed**: not worse than serving by more than `gate.max_drop` at
  `gate.confidence` (one-sided lower bound);
- **failed**: shown worse than serving (the one-sided upper bound of the mean
  difference below 0, and the sign test of the differing cases agreeing); the candidate is rejected, kept on disk with this evidence,
  and the trainer stops continuing from it;
- **inconclusive**: neither (two versions of about the same quality that answer many
  cases differently: on a learning agent, most successive versions). It does not
  serve and is not rejected: the trainer keeps its line, and a newer candidate (or
  this one, once its cases have grown) is judged again;
- **invalid**: fewer than `gate.min_cases` cases, an engine or evaluator error (any
  exception, logged with its traceback), a timeout, or an
  answer attributed to another version than the one asked for (a move raced the
  evaluation): nothing is decided and the candidate does not serve (fail-closed).

Cost, bounded: at most `gate.max_cases` cases x 2 versions, each at most
`gate.max_tokens` tokens, at most `gate.concurrency` rows in the engine at a time,
all within `gate.timeout_s`. The requests join the same decode batches as live
traffic (no pause of any agent) as background requests: while a client request runs
or waits, the embedded engine runs one of them, on a credit of
`engine.background_tokens_per_step` tokens a step, and fills free rows otherwise
(`GenerationRequest.background`); serving's answers are cached per (version, case),
so a chain of candidates against one serving version pays for serving once.
Measured on this box's 2 shared cores with SmolLM2-135M (`clora bench release`):
another agent keeps 0.98x of its throughput while gates run back to back, and a
full evaluation (24 cases x 2 versions) beside it takes about 60 s.

Not here: which versions to judge and what follows a verdict (`controller`), loading
the candidate into the engine (the deployer), the case split (`evalset`).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from clora_feedback.engine.base import Engine
from clora_feedback.engine.types import GenerationRequest, SamplingParams
from clora_feedback.errors import CloraError
from clora_feedback.feedback.rewards import RewardPolicy
from clora_feedback.release.evalset import EvalCase
from clora_feedback.release.stats import paired_verdict
from clora_feedback.schemas.feedback import Resolution

__all__ = ["GateSettings", "GateVerdict", "OfflineGate", "score"]

log = logging.getLogger(__name__)

Verdict = Literal["passed", "failed", "inconclusive", "invalid"]


def score(policy: RewardPolicy, agent: str, output: str, answer: str) -> float:
    """The reward `policy` gives `output` when the right answer is `answer`: the value of a
    `resolved` resolution carrying `correct_answer` (equal after stripping: its reward;
    anything else: at most the reward of a corrected output)."""
    event = Resolution(
        event_id="gate",
        source="gate",
        agent=agent,
        completion_id="gate",
        outcome="resolved",
        correct_answer=answer,
    )
    return float(policy.signal(event, output).value)


@dataclass(frozen=True)
class GateSettings:
    """The gate's numbers (from `release.gate`, see `config.GateConfig`)."""

    min_cases: int = 8
    max_cases: int = 24
    max_drop: float = 0.1
    confidence: float = 0.9
    max_tokens: int = 64
    slack_tokens: int = 8
    concurrency: int = 8
    timeout_s: float = 120.0


@dataclass
class GateVerdict:
    """One candidate judged against the serving version."""

    verdict: Verdict
    reason: str
    evidence: dict[str, Any] = field(default_factory=dict)


class _Invalid(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class OfflineGate:
    """Judges candidates against the serving version on evaluation cases.

    Args:
        engine: the engine both versions are served by (the candidate under its own
            engine name, `arms.gate_name`).
        policy: the reward policy the trainer's rewards come from.
        settings: sizes, confidence, budget.
    """

    def __init__(self, engine: Engine, policy: RewardPolicy, settings: GateSettings) -> None:
        self.engine = engine
        self.policy = policy
        self.settings = settings
        self._cache: dict[tuple[str, int, str], str] = {}  # (agent, version, case) -> answer
        self.cpu_seconds = 0.0
        """Process CPU seconds spent by judgements so far (all threads: an upper bound)."""

    async def judge(
        self,
        agent: str,
        cases: Sequence[EvalCase],
        *,
        candidate: tuple[str, int],
        serving: tuple[str | None, int],
    ) -> GateVerdict:
        """Answer `cases` with both versions and decide.

        Args:
            agent: the public agent (its reward mapping scores the answers).
            cases: the evaluation cases (at most `max_cases` are used).
            candidate: (engine name the candidate is loaded under, its version).
            serving: (engine name of the serving version, None for the base model, its
                version: 0 for the base model).
        """
        cfg = self.settings
        cases = list(cases)[: cfg.max_cases]
        evidence: dict[str, Any] = {
            "candidate": candidate[1],
            "serving": serving[1],
            "cases": len(cases),
            "max_drop": cfg.max_drop,
            "confidence": cfg.confidence,
            "reward_policy": self.policy.id,
        }
        if len(cases) < cfg.min_cases:
            return GateVerdict(
                "invalid",
                f"too few cases: {len(cases)} < gate.min_cases {cfg.min_cases}",
                evidence | {"code": "too_few_cases"},
            )
        t0, cpu0 = time.monotonic(), time.process_time()
        try:
            async with asyncio.timeout(cfg.timeout_s):
                new, old = await asyncio.gather(
                    self._answers(agent, candidate, cases, cache=False),
                    self._answers(agent, serving, cases, cache=True),
                )
        except TimeoutError:
            return GateVerdict(
                "invalid", f"evaluation timed out after {cfg.timeout_s:g} s",
                evidence | {"code": "timeout"},
            )  # fmt: skip
        except _Invalid as exc:
            return GateVerdict("invalid", exc.reason, evidence | {"code": "moved"})
        except CloraError as exc:
            return GateVerdict(
                "invalid", f"evaluator error: {exc.message}", evidence | {"code": "error"}
            )
        except Exception as exc:  # fail-closed: a crash decides nothing, the candidate waits
            log.exception("agent %s: the offline gate of v%d crashed", agent, candidate[1])
            return GateVerdict(
                "invalid", f"evaluator error: {type(exc).__name__}: {exc}",
                evidence | {"code": "error"},
            )  # fmt: skip
        finally:
            cpu = time.process_time() - cpu0
            self.cpu_seconds += cpu
            evidence |= {"seconds": round(time.monotonic() - t0, 3), "cpu_seconds": round(cpu, 3)}
        scores_new = [
            score(self.policy, agent, a, c.answer) for a, c in zip(new, cases, strict=True)
        ]
        scores_old = [
            score(self.policy, agent, a, c.answer) for a, c in zip(old, cases, strict=True)
        ]
        result = paired_verdict(
            [n - o for n, o in zip(scores_new, scores_old, strict=True)],
            max_drop=cfg.max_drop,
            confidence=cfg.confidence,
        )
        evidence |= result.as_evidence() | {
            "candidate_mean": round(sum(scores_new) / len(cases), 6),
            "serving_mean": round(sum(scores_old) / len(cases), 6),
            "examples": [
                {"case": c.key, "answer": c.answer[:200], "candidate": n[:200], "serving": o[:200]}
                for c, n, o in list(zip(cases, new, old, strict=True))[:3]
            ],
        }
        bound = result.reason(cfg.max_drop, cfg.confidence)
        words = (
            f"v{candidate[1]} scored {evidence['candidate_mean']:.3f} against serving "
            f"v{serving[1]}'s {evidence['serving_mean']:.3f} on {len(cases)} cases; mean "
            f"difference {result.mean:+.3f}, {bound}"
        )
        return GateVerdict(result.outcome, words, evidence)

    async def _answers(
        self,
        agent: str,
        arm: tuple[str | None, int],
        cases: list[EvalCase],
        *,
        cache: bool,
    ) -> list[str]:
        name, version = arm
        limit = asyncio.Semaphore(max(1, self.settings.concurrency // 2))

        async def one(case: EvalCase) -> str:
            key = (agent, version, case.key)
            if cache and key in self._cache:
                return self._cache[key]
            async with limit:
                text = await self._generate(name, version, case)
            if cache:
                self._cache[key] = text
            return text

        return list(await asyncio.gather(*(one(c) for c in cases)))

    async def _generate(self, name: str | None, version: int, case: EvalCase) -> str:
        tokens = len(self.engine.tokenizer.encode(case.answer, add_special_tokens=False))
        budget = self.engine.max_model_len - len(case.prompt_token_ids)
        max_tokens = min(self.settings.max_tokens, tokens + self.settings.slack_tokens, budget)
        if max_tokens < 1:
            raise _Invalid(f"case {case.key} leaves no room to answer in the context")
        request = GenerationRequest(
            request_id=f"gate-{uuid.uuid4().hex[:12]}",
            agent=name,
            prompt_token_ids=list(case.prompt_token_ids),
            sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0),
            background=True,  # evaluation yields rows to clients (the engine's rule)
        )
        parts: list[str] = []
        async for out in self.engine.add_request(request):
            for token in out.tokens:
                if token.adapter_version != version:
                    raise _Invalid(
                        f"case {case.key}: a token came from v{token.adapter_version}, not "
                        f"v{version} (a move raced the evaluation)"
                    )
            parts.append(out.text)
        return "".join(parts)

    def forget(self, agent: str, keep_version: int | None = None) -> None:
        """Drop cached serving answers of `agent` except those of `keep_version`."""
        for key in [k for k in self._cache if k[0] == agent and k[1] != keep_version]:
            del self._cache[key]
