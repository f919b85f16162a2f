"""Coding tasks: one-line Python expressions, judged by a simulated developer who runs them.

Each task asks for an expression over a named variable ("the largest value
in the list `scores`"); the developer's own solution is known by construction
(`max(scores)`). The developer runs the agent's expression, after trivial
clean-up (code fences, surrounding backticks, a trailing semicolon), on a few
test inputs and compares the results with the reference's: equal on every
input, the output is accepted as-is, whatever its spelling (`scores[::-1]`,
`list(reversed(scores))`, `sorted(scores, reverse=False)[::-1][::-1]`...);
anything else (an error, a wrong value, prose, a `def`) is replaced with the
reference. That edit is a `Correction` whose content is the training target.

Running model output is done in a closed interpreter (`run_expression`): the
expression is parsed, and only a small set of syntax (names, calls, attribute
access without underscores, subscripts and slices, small literals, + and -,
comparisons; no comprehension, lambda, `*` or `**`) and of builtins is allowed,
so nothing outside the given variable can be reached and nothing can grow or
run long.

Variable names are split between training and held-out tasks.

Pure Python: no HTTP, no model.
"""

from __future__ import annotations

import ast
import copy
import random
import re
from dataclasses import dataclass
from typing import Literal

Split = Literal["train", "eval"]

SYSTEM_PROMPT = "Write one Python expression that does what is asked. Reply with the code only."

# (request, reference); {v} is the variable name.
_LIST_OPS: tuple[tuple[str, str], ...] = (
    ("the number of items in the list `{v}`", "len({v})"),
    ("the sum of the numbers in the list `{v}`", "sum({v})"),
    ("the largest value in the list `{v}`", "max({v})"),
    ("the smallest value in the list `{v}`", "min({v})"),
    ("a sorted copy of the list `{v}`", "sorted({v})"),
    ("the list `{v}` in reverse order", "{v}[::-1]"),
    ("the first item of the list `{v}`", "{v}[0]"),
    ("the last item of the list `{v}`", "{v}[-1]"),
)
_TEXT_OPS: tuple[tuple[str, str], ...] = (
    ("the string `{v}` in upper case", "{v}.upper()"),
    ("the string `{v}` in lower case", "{v}.lower()"),
    ("the string `{v}` without leading and trailing spaces", "{v}.strip()"),
    ("the number of words in the string `{v}`", "len({v}.split())"),
)
_LIST_INPUTS: tuple[list[int], ...] = ([3, 1, 2], [5, -4, 9, 9, 0], [7])
_TEXT_INPUTS: tuple[str, ...] = ("  Hello World ", "abc", " two  Words here")
_LIST_NAMES = ("scores", "prices", "items", "values", "ages", "sizes", "counts", "weights")
_TEXT_NAMES = ("name", "title", "line", "text", "word", "label", "city", "query")


@dataclass(frozen=True)
class CodingTask:
    """A request for one expression, and how the developer checks it.

    Attributes:
        id: stable id within its generator.
        request: what is asked (shown to the agent).
        reference: the developer's own solution.
        variable: the name the expression works on.
        inputs: the test values the developer runs it on.
    """

    id: str
    request: str
    reference: str
    variable: str
    inputs: tuple[object, ...]

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
    inputs: tuple[object, ...]
    if rng.random() < len(_LIST_OPS) / (len(_LIST_OPS) + len(_TEXT_OPS)):
        request, reference = rng.choice(_LIST_OPS)
        var, inputs = rng.choice(_half(_LIST_NAMES, split)), _LIST_INPUTS
    else:
        request, reference = rng.choice(_TEXT_OPS)
        var, inputs = rng.choice(_half(_TEXT_NAMES, split)), _TEXT_INPUTS
    return CodingTask(
        f"{split}-{index}", request.format(v=var), reference.format(v=var), var, inputs
    )


def tasks(seed: int, split: Split, count: int) -> list[CodingTask]:
    """`count` tasks of `split`, deterministic in `seed`."""
    rng = random.Random(f"coding/{split}/{seed}")
    return [make_task(rng, split, i) for i in range(count)]


_FENCE = re.compile(r"^```(?:python)?\s*|\s*```$")


def clean(code: str) -> str:
    """Trivial clean-up a reviewer ignores: code fences, backticks, a trailing `;`."""
    text = _FENCE.sub("", code.strip()).strip().strip("`").strip()
    return text.rstrip(";").strip()


_BUILTINS: dict[str, object] = {
    f.__name__: f for f in (len, sum, max, min, sorted, reversed, list, tuple, str, int, abs)
}
_NODES = (
    ast.Expression, ast.Name, ast.Load, ast.Call, ast.keyword, ast.Attribute, ast.Subscript,
    ast.Slice, ast.Constant, ast.UnaryOp, ast.USub, ast.BinOp, ast.Add, ast.Sub,
    ast.Compare, ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE, ast.List, ast.Tuple,
)  # fmt: skip


def _small(value: object) -> bool:
    """Constants that cannot make anything big (with + and - only, nothing grows fast)."""
    if isinstance(value, bool) or value is None:
        return True
    if isinstance(value, int):
        return abs(value) <= 1000
    return isinstance(value, str) and len(value) <= 32


class RejectedCode(Exception):
    """The expression is not one the developer runs (syntax or names outside the sandbox)."""


def run_expression(code: str, variable: str, value: object) -> object:
    """Evaluate `code` with `variable` bound to (a copy of) `value`, in a closed interpreter.

    Raises:
        RejectedCode: not a single expression of the allowed syntax and names.
        Exception: whatever the expression itself raises (a wrong program).
    """
    try:
        tree = ast.parse(code, mode="eval")
    except SyntaxError as exc:
        raise RejectedCode(str(exc)) from exc
    for node in ast.walk(tree):
        if not isinstance(node, _NODES):
            raise RejectedCode(f"{type(node).__name__} is not allowed")
        if isinstance(node, ast.Attribute) and node.attr.startswith("_"):
            raise RejectedCode(f"attribute {node.attr!r} is not allowed")
        if isinstance(node, ast.Name) and node.id not in _BUILTINS and node.id != variable:
            raise RejectedCode(f"name {node.id!r} is not defined")
        if isinstance(node, ast.Constant) and not _small(node.value):
            raise RejectedCode("constant too large")
    scope = {variable: copy.deepcopy(value)}
    result = eval(compile(tree, "<agent>", "eval"), {"__builtins__": _BUILTINS}, scope)
    return list(result) if isinstance(result, reversed) else result


@dataclass(frozen=True)
class Review:
    """The developer's verdict.

    Attributes:
        accepted: the output gave the reference's result on every test input.
        corrected: what the developer left in place (the output itself when accepted).
        reward: 1.0 when accepted else 0.0: the same value the server's reward policy
            gives the correction it becomes (`accepted` 1.0, `corrected` 0.0).
        reason: why it was rejected (empty when accepted).
    """

    accepted: bool
    corrected: str
    reward: float
    reason: str = ""


class SimulatedDeveloper:
    """Runs the output on the task's test inputs; accepts it when every result equals the
    reference's, otherwise replaces it with the reference."""

    def review(self, task: CodingTask, output: str) -> Review:
        code = clean(output)
        for value in task.inputs:
            want = run_expression(task.reference, task.variable, value)
            try:
                got = run_expression(code, task.variable, value)
            except RejectedCode as exc:
                return Review(False, task.reference, 0.0, f"not run: {exc}")
            except Exception as exc:
                return Review(False, task.reference, 0.0, f"{type(exc).__name__}: {exc}")
            if got != want or type(got) is not type(want):
                return Review(False, task.reference, 0.0, f"{got!r} != {want!r} for {value!r}")
        return Review(True, output, 1.0)
