"""Each agent's evaluation set: held-out labelled feedback plus optional operator cases.

**The reserve.** A rewarded sample is *labelled* when feedback says what its right
answer is: a correction's content or a kept edit, a resolution's `correct_answer`
(the sample's `targets`), or an accepted output (`confirmed`: the output itself).
A labelled sample is *held out* when the hash of (agent, completion id, sample
index) falls below `holdout_fraction` (sha256, so the split is the same in every
process and after every restart, and needs no storage). `HeldOutSplit` wraps the
trainer's `SampleSource` and never returns a held-out sample, so nothing the gate
judges by was trained on; unlabelled samples (scalar rewards only) all train,
because they cannot make a case. The split is by completion, not by prompt: an
agent's traffic repeats prompts, and holding every repeat of a prompt out would
keep the agent from ever learning it; the cases are deduplicated by prompt
(newest answer wins). One edge, documented: a sample judged first without a label
(trained on) and labelled later becomes a case.

**Operator cases** (optional): `<cases_dir>/<agent>.jsonl`, one JSON object a line,
`{"messages": [OpenAI chat messages], "answer": "the right reply"}` or
`{"prompt": "user text", "answer": "..."}` (a single user message). They are
rendered with the base model's chat template (`render`) and always part of the
set; `POST /v1/adapters/{agent}/cases` appends to the file.

A case is scored by the reward policy as a resolution with `correct_answer` would
score an output (see `gate.score`), so the gate and the trainer agree on what
right means.

Not here: answering the cases (`gate`), the reward mapping (`feedback.rewards`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from clora_feedback.errors import InvalidRequestError, StoreError
from clora_feedback.feedback.store import TrainingSample

log = logging.getLogger(__name__)

__all__ = [
    "EvalCase",
    "EvalSet",
    "HeldOutSplit",
    "held_out",
    "labelled",
    "operator_key",
    "parse_operator_case",
]

Render = Callable[[list[dict[str, Any]]], list[int]]
"""Chat messages -> prompt token ids (the base model's chat template, generation prompt added)."""


@dataclass(frozen=True)
class EvalCase:
    """One case both versions answer."""

    key: str
    """Stable id: `fb:<completion_id>:<sample_index>`, or `op:<sha256 of the prompt's token ids
    and the answer>` (`operator_key`: an edit of the cases file never gives a cached answer of
    one case to another)."""
    prompt_token_ids: tuple[int, ...]
    """[P] the prompt exactly as the engine sees it."""
    answer: str
    """The right reply."""
    source: str
    """`feedback` or `operator`."""


def operator_key(prompt_token_ids: Sequence[int], answer: str) -> str:
    """The key of an operator case: what it asks and answers, not where its line is."""
    text = json.dumps([list(prompt_token_ids), answer], ensure_ascii=False)
    return "op:" + hashlib.sha256(text.encode()).hexdigest()[:32]


def labelled(sample: TrainingSample) -> bool:
    """Whether feedback says what `sample`'s right answer is (a target, or a confirmed output)."""
    return bool(sample.targets) or sample.confirmed


def held_out(agent: str, completion_id: str, sample_index: int, fraction: float) -> bool:
    """Whether a labelled sample belongs to the evaluation reserve (deterministic, stateless)."""
    if fraction <= 0.0:
        return False
    digest = hashlib.sha256(f"{agent}\0{completion_id}\0{sample_index}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64 < fraction


class Source(Protocol):
    """The part of `train.samples.SampleSource` the split reads (`train` sits above `release`)."""

    @property
    def reward_policy_id(self) -> str: ...

    def training_samples(
        self, agent: str, *, after_seq: int = 0, limit: int = 1000
    ) -> list[TrainingSample]: ...

    def agents_with_rewards(self) -> list[str]: ...


class HeldOutSplit:
    """A `SampleSource` without the held-out samples: what the trainer reads.

    Args:
        source: the feedback store (any `SampleSource`).
        fraction: share of labelled samples held out (`release.gate.holdout_fraction`).
    """

    def __init__(self, source: Source, fraction: float) -> None:
        self.source = source
        self.fraction = fraction

    @property
    def reward_policy_id(self) -> str:
        return self.source.reward_policy_id

    def agents_with_rewards(self) -> list[str]:
        return self.source.agents_with_rewards()

    def is_held_out(self, sample: TrainingSample) -> bool:
        return labelled(sample) and held_out(
            sample.agent, sample.completion_id, sample.sample_index, self.fraction
        )

    def training_samples(
        self, agent: str, *, after_seq: int = 0, limit: int = 1000
    ) -> list[TrainingSample]:
        """The source's samples minus the held-out ones; pages on past a page held out whole,
        so the largest `last_seq` returned stays a safe cursor."""
        while True:
            page = self.source.training_samples(agent, after_seq=after_seq, limit=limit)
            kept = [s for s in page if not self.is_held_out(s)]
            if kept or not page:
                return kept
            after_seq = max(s.last_seq for s in page)


def parse_operator_case(obj: Any, *, where: str) -> dict[str, Any]:
    """Check one operator case (`{"messages" | "prompt", "answer"}`) and return its canonical form.

    Raises:
        InvalidRequestError: not an object, no answer, or neither messages nor prompt.
    """
    if not isinstance(obj, dict):
        raise InvalidRequestError(f"{where}: a case must be a JSON object", param="cases")
    answer = obj.get("answer")
    if not isinstance(answer, str) or not answer.strip():
        raise InvalidRequestError(f"{where}: `answer` must be a non-empty string", param="answer")
    messages = obj.get("messages")
    if messages is None and isinstance(obj.get("prompt"), str):
        messages = [{"role": "user", "content": obj["prompt"]}]
    valid = (
        isinstance(messages, list)
        and messages
        and all(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
            for m in messages
        )
    )
    if not valid:
        raise InvalidRequestError(
            f"{where}: give `messages` (a list of {{role, content}} strings) or `prompt`",
            param="messages",
        )
    return {"messages": messages, "answer": answer}


class EvalSet:
    """Every agent's evaluation cases, read incrementally from the feedback store.

    Thread-safe; `cases` blocks on the store (call it off the event loop).

    Args:
        split: the trainer's `HeldOutSplit` (its source and fraction).
        decode: token ids -> text (an accepted output's text is its own answer).
        cases_dir: where operator case files live (None: no operator cases).
        render: chat messages -> prompt token ids, for operator cases.
    """

    def __init__(
        self,
        split: HeldOutSplit,
        decode: Callable[[Sequence[int]], str],
        *,
        cases_dir: Path | None = None,
        render: Render | None = None,
    ) -> None:
        self.split = split
        self.decode = decode
        self.cases_dir = cases_dir
        self.render = render
        self._lock = threading.Lock()
        self._cursor: dict[str, int] = {}
        self._held: dict[str, dict[tuple[int, ...], EvalCase]] = {}
        self._operator: dict[str, tuple[float, list[EvalCase]]] = {}  # by file mtime

    def cases(self, agent: str, *, limit: int) -> list[EvalCase]:
        """The agent's operator cases, then its newest held-out cases, `limit` in all."""
        with self._lock:
            held = self._read_new(agent)
            ops = self._operator_cases(agent)
        newest = list(held.values())[::-1]  # dict order is insertion order: newest last
        return (ops + newest)[:limit]

    def _read_new(self, agent: str) -> dict[tuple[int, ...], EvalCase]:
        held = self._held.setdefault(agent, {})
        cursor = self._cursor.get(agent, 0)
        source = self.split.source
        while True:
            page = source.training_samples(agent, after_seq=cursor)
            if not page:
                break
            cursor = max(s.last_seq for s in page)
            for sample in page:
                if self.split.is_held_out(sample):
                    case = self._case(sample)
                    key = case.prompt_token_ids
                    held.pop(key, None)  # re-insert: newest last
                    held[key] = case
        self._cursor[agent] = cursor
        return held

    def _case(self, sample: TrainingSample) -> EvalCase:
        answer = sample.targets[-1] if sample.targets else self.decode(sample.completion_token_ids)
        return EvalCase(
            f"fb:{sample.completion_id}:{sample.sample_index}",
            tuple(sample.prompt_token_ids),
            answer,
            "feedback",
        )

    def operator_path(self, agent: str) -> Path | None:
        return None if self.cases_dir is None else self.cases_dir / f"{agent}.jsonl"

    def _operator_cases(self, agent: str) -> list[EvalCase]:
        path = self.operator_path(agent)
        if path is None or self.render is None or not path.exists():
            return []
        mtime = path.stat().st_mtime
        cached = self._operator.get(agent)
        if cached is not None and cached[0] == mtime:
            return cached[1]
        out: list[EvalCase] = []
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                case = parse_operator_case(json.loads(line), where=f"{path}:{number}")
                ids = self.render(case["messages"])
            except (ValueError, InvalidRequestError) as exc:  # one bad line never hides the rest
                log.warning("operator case %s:%d skipped: %s", path, number, exc)
                continue
            out.append(EvalCase(operator_key(ids, case["answer"]), tuple(ids), case["answer"],
                                "operator"))  # fmt: skip
        self._operator[agent] = (mtime, out)
        return out

    def add_operator_cases(self, agent: str, cases: Sequence[Any]) -> int:
        """Append checked cases to `<cases_dir>/<agent>.jsonl` (fsynced); returns how many.

        Raises:
            InvalidRequestError: a case is malformed (nothing is written), or there is no
                cases directory.
            StoreError: the file cannot be written.
        """
        path = self.operator_path(agent)
        if path is None:
            raise InvalidRequestError("operator cases are not configured", param="cases")
        lines = [
            json.dumps(parse_operator_case(c, where=f"case {i}"), ensure_ascii=False)
            for i, c in enumerate(cases)
        ]
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with self._lock, open(path, "a", encoding="utf-8") as f:
                f.write("".join(line + "\n" for line in lines))
                f.flush()
                os.fsync(f.fileno())
        except OSError as exc:
            raise StoreError(f"writing operator cases to {path} failed: {exc}") from exc
        return len(lines)
