"""Coding tasks: one-line Python expressions, reviewed by a simulated developer who knows the answer.

Each task asks for an expression over a named variable ("the largest value
in the list `scores`"); the reference is known by construction (`max(scores)`)
together with the equivalent forms a reviewer would also accept
(`scores[::-1]` or `list(reversed(scores))`). The developer accepts the
agent's output as-is when, after trivial clean-up (surrounding backticks,
spaces, a trailing semicolon), it is one of those forms; otherwise they
replace it with the reference. That edit is a `Correction`: its corrected
content becomes a supervised target and its size sets the reward.

Variable names are split between training and held-out tasks.

Pure Python: no HTTP, no model, nothing is executed.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Literal

Split = Literal["train", "eval"]

SYSTEM_PROMPT = "Write one Python expression that does what is asked. Reply with the code only."

# (request, reference, other accepted forms); {v} is the variable name.
_LIST_OPS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("the number of items in the list `{v}`", "len({v})", ()),
    ("the sum of the numbers in the list `{v}`", "sum({v})", ()),
    ("the largest value in the list `{v}`", "max({v})", ()),
    ("the smallest value in the list `{v}`", "min({v})", ()),
    ("a sorted copy of the list `{v}`", "sorted({v})", ()),
    ("the list `{v}` in reverse order", "{v}[::-1]", ("list(reversed({v}))",)),
    ("the first item of the list `{v}`", "{v}[0]", ()),
    ("the last item of the list `{v}`", "{v}[-1]", ("{v}[len({v})-1]",)),
)
_TEXT_OPS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("the string `{v}` in upper case", "{v}.upper()", ()),
    ("the string `{v}` in lower case", "{v}.lower()", ()),
    ("the string `{v}` without leading and trailing spaces", "{v}.strip()", ()),
    ("the number of words in the string `{v}`", "len({v}.split())", ()),
)
_LIST_NAMES = ("scores", "prices", "items", "values", "ages", "sizes", "counts", "weights")
_TEXT_NAMES = ("name", "title", "line", "text", "word", "label", "city", "query")


@dataclass(frozen=True)
class CodingTask:
    """A request for one expression, and what the developer accepts.

    Attributes:
        id: stable id within its generator.
        request: what is asked (shown to the agent).
        reference: the developer's own solution.
        accepted: every form accepted as-is (the reference included).
    """

    id: str
    request: str
    reference: str
    accepted: frozenset[str]

    def messages(self) -> list[dict[str, str]]:
        return [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": f"Write a Python expression for {self.request}."},
        ]


def _half(values: tuple[str, ...], split: Split) -> tuple[str, ...]:
    half = len(values) // 2
    return values[:half] if split == "train" else values[half:]


def make_task(rng: random.Random, split: Split, index: int) -> CodingTask:
    """One task: a random operation on a variable name from `split`'s half."""
    if rng.random() < len(_LIST_OPS) / (len(_LIST_OPS) + len(_TEXT_OPS)):
        request, reference, others = rng.choice(_LIST_OPS)
        var = rng.choice(_half(_LIST_NAMES, split))
    else:
        request, reference, others = rng.choice(_TEXT_OPS)
        var = rng.choice(_half(_TEXT_NAMES, split))
    forms = frozenset(normalize(f.format(v=var)) for f in (reference, *others))
    return CodingTask(f"{split}-{index}", request.format(v=var), reference.format(v=var), forms)


def tasks(seed: int, split: Split, count: int) -> list[CodingTask]:
    """`count` tasks of `split`, deterministic in `seed`."""
    rng = random.Random(f"coding/{split}/{seed}")
    return [make_task(rng, split, i) for i in range(count)]


_FENCE = re.compile(r"^```(?:python)?\s*|\s*```$")


def normalize(code: str) -> str:
    """Trivial clean-up a reviewer ignores: code fences, backticks, spaces, a trailing `;`."""
    text = _FENCE.sub("", code.strip()).strip().strip("`").strip()
    text = text.rstrip(";").strip()
    return re.sub(r"\s+", "", text)


@dataclass(frozen=True)
class Review:
    """The developer's verdict.

    Attributes:
        accepted: the output was kept as-is.
        corrected: what the developer left in place (the output itself when accepted).
        reward: 1.0 when accepted else 0.0 (the accuracy the curves show; the
            server's reward policy scores the edit itself by similarity).
    """

    accepted: bool
    corrected: str
    reward: float


class SimulatedDeveloper:
    """Accepts a correct expression as-is; otherwise replaces it with the reference."""

    def review(self, task: CodingTask, output: str) -> Review:
        if normalize(output) in task.accepted:
            return Review(True, output, 1.0)
        return Review(False, task.reference, 0.0)
