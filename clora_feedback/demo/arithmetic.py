"""Arithmetic word problems in the style of GSM8K, with a calculator and a final-answer tool.

The C-LoRA workload: the agent reads a short word problem, may call
`calculator` (an arithmetic expression, evaluated here exactly) any number of
times within its turn budget, and must end with `final_answer`. The reward is
1.0 only when `final_answer` carries the right number, else 0.0.

Problems are generated in code from templates with one or two operations on
small integers, so the answer is known exactly. Names and objects are split
between training and held-out problems, like the support tickets' fillers.

Pure Python: the generator, the tool schemas in OpenAI format, a safe
evaluator for the calculator (an AST walk over numbers and + - * / // % and
parentheses; nothing else is evaluated) and the grader. The chat loop that
calls the tools lives in `clora_feedback.demo.workloads`.
"""

from __future__ import annotations

import ast
import json
import math
import operator
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

Split = Literal["train", "eval"]

SYSTEM_PROMPT = (
    "Solve the math problem. Use calculator for arithmetic, then call final_answer with the number."
)

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression, e.g. 12*4+3.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "final_answer",
            "description": "Give the final answer as a number.",
            "parameters": {
                "type": "object",
                "properties": {"answer": {"type": "number"}},
                "required": ["answer"],
            },
        },
    },
]
"""The two tools in OpenAI `tools` format."""

_NAMES = (
    "Mia", "Tom", "Ana", "Leo", "Sara", "Ben", "Zoe", "Omar",
    "Lily", "Max", "Nina", "Raj", "Eva", "Sam", "Ivy", "Kai",
)  # fmt: skip
_ITEMS = (
    "apples", "stickers", "marbles", "pencils", "cookies", "books", "cards", "shells",
    "stamps", "coins", "beads", "balloons", "candles", "toys", "plums", "buttons",
)  # fmt: skip


@dataclass(frozen=True)
class Problem:
    """A word problem and its exact answer.

    Attributes:
        id: stable id within its generator (`"train-4"`).
        text: the problem statement.
        answer: the exact integer answer.
        expression: one expression that computes it (what a perfect agent would send).
        kind: template name (for analysis).
    """

    id: str
    text: str
    answer: int
    expression: str
    kind: str

    def messages(self) -> list[dict[str, Any]]:
        """The opening chat messages."""
        return [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": self.text},
        ]


_Template = Callable[[random.Random, str, str], tuple[str, int, str]]


def _add(rng: random.Random, name: str, item: str) -> tuple[str, int, str]:
    a, b = rng.randint(3, 40), rng.randint(2, 30)
    return (
        f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?",
        a + b,
        f"{a}+{b}",
    )


def _sub(rng: random.Random, name: str, item: str) -> tuple[str, int, str]:
    a = rng.randint(12, 60)
    b = rng.randint(2, a - 1)
    return f"{name} had {a} {item} and gave away {b}. How many {item} are left?", a - b, f"{a}-{b}"


def _mul(rng: random.Random, name: str, item: str) -> tuple[str, int, str]:
    a, b = rng.randint(2, 12), rng.randint(2, 9)
    return (
        f"{name} buys {b} boxes with {a} {item} in each box. How many {item} is that?",
        a * b,
        f"{b}*{a}",
    )


def _div(rng: random.Random, name: str, item: str) -> tuple[str, int, str]:
    a, b = rng.randint(2, 12), rng.randint(2, 8)
    return (
        f"{name} shares {a * b} {item} equally among {b} friends. How many {item} does each friend get?",
        a,
        f"{a * b}/{b}",
    )


def _mul_sub(rng: random.Random, name: str, item: str) -> tuple[str, int, str]:
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    c = rng.randint(1, a * b - 1)
    return (
        f"{name} buys {a} packs of {b} {item} and gives away {c}. How many {item} are left?",
        a * b - c,
        f"{a}*{b}-{c}",
    )


def _add_mul(rng: random.Random, name: str, item: str) -> tuple[str, int, str]:
    a, b, c = rng.randint(2, 9), rng.randint(2, 9), rng.randint(1, 20)
    return (
        f"{name} has {c} {item} and buys {a} bags of {b} {item}. How many {item} does {name} have?",
        c + a * b,
        f"{c}+{a}*{b}",
    )


TEMPLATES: dict[str, _Template] = {
    "add": _add,
    "sub": _sub,
    "mul": _mul,
    "div": _div,
    "mul_sub": _mul_sub,
    "add_mul": _add_mul,
}
"""Problem kinds: four one-step, two two-step."""


def _half(values: tuple[str, ...], split: Split) -> tuple[str, ...]:
    half = len(values) // 2
    return values[:half] if split == "train" else values[half:]


def make_problem(rng: random.Random, split: Split, index: int) -> Problem:
    """One problem of a random kind, with a name and an object from `split`'s half."""
    kind = rng.choice(sorted(TEMPLATES))
    name = rng.choice(_half(_NAMES, split))
    item = rng.choice(_half(_ITEMS, split))
    text, answer, expression = TEMPLATES[kind](rng, name, item)
    return Problem(f"{split}-{index}", text, answer, expression, kind)


def problems(seed: int, split: Split, count: int) -> list[Problem]:
    """`count` problems of `split`, deterministic in `seed`."""
    rng = random.Random(f"arithmetic/{split}/{seed}")
    return [make_problem(rng, split, i) for i in range(count)]


# -- the calculator ----------------------------------------------------------------------

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_MAX_ABS = 1e12  # keeps a runaway expression from building huge integers


class CalculatorError(ValueError):
    """An expression the calculator refuses (syntax, a name, a call, division by zero, ...)."""


def _eval(node: ast.AST) -> float:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return float(node.value)  # type: ignore[arg-type]  # an int or a float, checked above
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _eval(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        try:
            value = float(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError as exc:
            raise CalculatorError("division by zero") from exc
        if not math.isfinite(value) or abs(value) > _MAX_ABS:
            raise CalculatorError("result out of range")
        return value
    raise CalculatorError(f"unsupported expression element: {type(node).__name__}")


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression exactly as a calculator would; the result as text.

    Raises:
        CalculatorError: the expression is not plain arithmetic on numbers.
    """
    text = expression.strip().replace("x", "*").replace("×", "*").replace("÷", "/")
    if not text or len(text) > 200:
        raise CalculatorError("empty or too long")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as exc:
        raise CalculatorError("not an arithmetic expression") from exc
    value = _eval(tree)
    return str(int(value)) if value == int(value) else f"{value:.6g}"


def tool_result(name: str, arguments: str) -> str:
    """What a tool call returns to the model (errors as text, as a real tool would)."""
    if name != "calculator":
        return f"error: unknown tool {name!r}"
    try:
        args = json.loads(arguments or "{}")
        expression = args.get("expression") if isinstance(args, dict) else None
        if not isinstance(expression, str | int | float):
            return "error: expected {'expression': '<arithmetic>'}"
        return calculate(str(expression))
    except (ValueError, CalculatorError) as exc:
        return f"error: {exc}"


def final_value(arguments: str) -> float | None:
    """The number in a `final_answer` call's arguments, or None when there is none."""
    try:
        args = json.loads(arguments or "{}")
    except ValueError:
        return None
    value = args.get("answer") if isinstance(args, dict) else None
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip().replace(",", ""))
        except ValueError:
            return None
    return None


def grade(problem: Problem, answer: float | None) -> float:
    """1.0 when `answer` is the problem's exact answer, else 0.0."""
    return 1.0 if answer is not None and abs(answer - problem.answer) < 1e-9 else 0.0


@dataclass(frozen=True)
class Call:
    """What the agent did in one turn.

    Attributes:
        name: the tool it called first (None: it made no call).
        arguments: that call's arguments as JSON text.
        result: the calculator's answer to it (None for other tools).
    """

    name: str | None
    arguments: str = "{}"
    result: str | None = None


@dataclass(frozen=True)
class Fix:
    """A developer's correction of one turn: what that turn should have called.

    Attributes:
        turn: index of the corrected turn.
        name: the tool the turn should have called.
        arguments: the arguments it should have passed.
    """

    turn: int
    name: str
    arguments: dict[str, Any]


def review(problem: Problem, calls: list[Call]) -> Fix | None:
    """The first wrong turn of an episode and its fix, as a developer reading the trace would.

    A turn is right when it computes the answer with the calculator (the first
    time), or calls `final_answer` with the right number. The first turn that
    is neither is corrected: to `final_answer` with the answer when the
    calculator already produced it, else to `calculator` with the reference
    expression. None when the episode ended with the right answer.
    """
    computed = False
    for turn, call in enumerate(calls):
        if call.name == "final_answer" and grade(problem, final_value(call.arguments)) == 1.0:
            return None
        good_calc = (
            call.name == "calculator"
            and not computed
            and call.result is not None
            and _number(call.result) == problem.answer
        )
        if good_calc:
            computed = True
            continue
        if computed:
            return Fix(turn, "final_answer", {"answer": problem.answer})
        return Fix(turn, "calculator", {"expression": problem.expression})
    return None


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None
