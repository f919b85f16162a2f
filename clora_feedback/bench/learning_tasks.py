"""Task families of `clora bench learning`: generated prompts, reference replies, held-out splits.

Four families the demo and the examples never use, each a deterministic
generator (seeded) with its ground truth:

- `api-call`: a one-line client convention, `client.call("<service>", "<method>", <id>)`,
  for a request that names a service and a method in words; taught by a
  developer's corrections (the right line, or accepted as-is).
- `routing`: internal requests routed to one of four desks (legal, security,
  hr, press: each a single token of the default model's vocabulary); taught by
  an operator's resolutions that name the right desk when the agent was wrong.
- `extract`: an order sentence, its fields mentioned in any order and wording,
  written as one fixed line `name=<name>; city=<city>; qty=<n>`; taught by a
  validator's reward (share of fields right) and a correction when not exact.
- `escalation`: shop-order confirmations; an order of age-restricted goods must
  get the fixed escalation phrase instead; taught by a policy checker's reward
  and a correction when wrong.

**Held-out by construction.** Every prompt combines one part of axis A with
one part of axis B (service x method, request cue x sender, sentence frame x
city, item x sentence frame). A pair (i, j) is held out iff `(i + j) % 4 == 0`:
every part of either axis occurs in training, but no held-out prompt combines
two parts that any training prompt combines. Other slots (ids, names,
quantities) are drawn freely.

Pure Python: no HTTP, no model. `clora_feedback.bench.learning` sends the
prompts through the gateway and the events through the webhook.

Not here: the loop, the evaluation, the report (`learning`).
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

Split = Literal["train", "eval"]
HOLD_OUT_MODULUS = 4
"""Pair (i, j) of a family's two axes is held out iff `(i + j) % HOLD_OUT_MODULUS == 0`."""


@dataclass(frozen=True)
class Prompt:
    """One generated request and its ground truth.

    Attributes:
        id: stable id within its family and split (`"train-17"`, `"eval-3"`).
        family: the family's name.
        system: the system prompt the agent gets.
        text: the user's request.
        answer: the one reply the simulated user accepts as right.
        pair: (index on axis A, index on axis B): the combination the split is by.
        label: the class of the answer where the family has classes (desk, `escalate`/`answer`).
    """

    id: str
    family: str
    system: str
    text: str
    answer: str
    pair: tuple[int, int]
    label: str | None = None

    def messages(self) -> list[dict[str, str]]:
        """The chat messages the agent receives."""
        return [{"role": "system", "content": self.system}, {"role": "user", "content": self.text}]


def held_out(pair: tuple[int, int]) -> bool:
    """Whether a combination belongs to the held-out split."""
    return (pair[0] + pair[1]) % HOLD_OUT_MODULUS == 0


def split_pairs(size_a: int, size_b: int, split: Split) -> list[tuple[int, int]]:
    """Every (i, j) of a `size_a` x `size_b` grid that belongs to `split`."""
    pairs = [(i, j) for i in range(size_a) for j in range(size_b)]
    return [p for p in pairs if held_out(p) == (split == "eval")]


def first_line(reply: str | None) -> str:
    """A reply's first non-empty line, stripped (how every family reads a one-line answer)."""
    for line in (reply or "").splitlines():
        if line.strip():
            return line.strip()
    return ""


# -- api-call: a one-line client convention ---------------------------------------------------

SERVICES = ("billing", "inventory", "shipping", "search", "profile", "calendar", "storage", "mail")
METHODS = ("get", "create", "update", "delete", "archive", "restore", "export", "share")
_API_SYSTEM = (
    "You write the one line of Python that makes the requested call with our internal "
    "client object `client`. Reply with that line only."
)
_API_FRAMES = (
    "Use the {service} service to {method} record {id}.",
    "{Method} record {id} in {service}.",
    "I need {service} to {method} record {id}.",
    "Please {method} record {id} via the {service} API.",
    "Call {service} and {method} record number {id}.",
)


def _api_call(rng: random.Random, pair: tuple[int, int]) -> tuple[str, str, str | None]:
    service, method = SERVICES[pair[0]], METHODS[pair[1]]
    record = rng.randrange(10, 1000)
    frame = rng.choice(_API_FRAMES)
    text = frame.format(service=service, method=method, Method=method.capitalize(), id=record)
    return text, f'client.call("{service}", "{method}", {record})', None


# -- routing: four desks ----------------------------------------------------------------------

DESKS = ("legal", "security", "hr", "press")
_ROUTING_SYSTEM = (
    "Route each internal request to one desk: legal, security, hr or press. "
    "Reply with the desk name only."
)
_CUES: tuple[tuple[str, str], ...] = (
    ("legal", "a supplier says they will sue us over the cancelled contract"),
    ("legal", "can we reuse this licence clause in the new customer agreement"),
    ("legal", "we received a court order asking for our records"),
    ("legal", "a former employee's lawyer sent us a letter"),
    ("security", "someone shared a password in the public channel"),
    ("security", "my laptop was stolen from the car last night"),
    ("security", "a strange email asks me to confirm my login on a fake page"),
    ("security", "I found a USB stick in the car park and plugged it in"),
    ("hr", "I want to ask about my parental leave dates"),
    ("hr", "a colleague keeps making rude remarks in meetings"),
    ("hr", "my payslip is missing the overtime from last month"),
    ("hr", "I need to report a conflict with my manager"),
    ("press", "a journalist called asking for a comment on the layoffs"),
    ("press", "a TV crew wants to film in our lobby next week"),
    ("press", "a reporter is asking about the product recall"),
    ("press", "a blogger wants an interview with our CEO"),
)
"""(desk, cue) pairs: the cue decides the desk; axis A of `routing`."""
_SENDERS = (
    "the contracts team", "the IT help desk", "the recruiting team", "the communications office",
    "the Berlin office", "a warehouse shift lead", "the finance team", "a new intern",
)  # fmt: skip
"""Who writes: axis B of `routing`. The first four sound like a desk on purpose, so a
model that routes by the sender instead of the request fails the held-out pairs."""
_ROUTING_FRAMES = (
    "Message from {sender}: {cue}.",
    "Hi, this is {sender}. {Cue}.",
    "{Cue} (sent by {sender})",
)


def _routing(rng: random.Random, pair: tuple[int, int]) -> tuple[str, str, str | None]:
    desk, cue = _CUES[pair[0]]
    frame = rng.choice(_ROUTING_FRAMES)
    text = frame.format(sender=_SENDERS[pair[1]], cue=cue, Cue=cue[0].upper() + cue[1:])
    return text, desk, desk


def desk_of(reply: str | None) -> str | None:
    """The desk a reply routes to: its first word, if that is a desk (case-insensitive)."""
    word = re.search(r"[A-Za-z]+", reply or "")
    name = word.group(0).lower() if word else None
    return name if name in DESKS else None


# -- extract: one fixed key=value line --------------------------------------------------------

CITIES = ("Lyon", "Osaka", "Lima", "Perth", "Oslo", "Quito", "Pune", "Accra")
_NAMES = ("Ana", "Ben", "Chloe", "Dev", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jonas")
_EXTRACT_SYSTEM = (
    "Extract the order as one line in exactly this format: name=<name>; city=<city>; "
    "qty=<number>. Reply with that line only."
)
_EXTRACT_FRAMES = (
    "{name} from {city} ordered {qty} boxes.",
    "Ship {qty} boxes to {city} for {name}.",
    "In {city}, {name} needs {qty} boxes.",
    "{qty} boxes, please. Name: {name}. City: {city}.",
    "Order for {name}: {qty} boxes, delivered in {city}.",
    "Deliver to {city}: {qty} boxes (customer {name}).",
    "Customer {name} wants {qty} boxes sent to {city}.",
    "{city} branch, {qty} boxes, contact {name}.",
)
"""Axis A of `extract` (the fields in every order); axis B is the city."""
EXTRACT_KEYS = ("name", "city", "qty")


def _extract(rng: random.Random, pair: tuple[int, int]) -> tuple[str, str, str | None]:
    name, city, qty = rng.choice(_NAMES), CITIES[pair[1]], rng.randrange(2, 10)
    text = _EXTRACT_FRAMES[pair[0]].format(name=name, city=city, qty=qty)
    return text, f"name={name}; city={city}; qty={qty}", None


def fields_of(line: str) -> dict[str, str]:
    """`key=value` pairs of a `;`-separated line (keys lower-cased, values stripped)."""
    out: dict[str, str] = {}
    for part in line.split(";"):
        key, sep, value = part.partition("=")
        if sep:
            out.setdefault(key.strip().lower(), value.strip())
    return out


def fields_right(answer: str, reply: str | None) -> float:
    """Share of the reference line's fields that the reply's first line gets right, in [0, 1]."""
    want, got = fields_of(answer), fields_of(first_line(reply))
    return sum(got.get(k) == v for k, v in want.items()) / len(want)


# -- escalation: answer, or the fixed escalation phrase ---------------------------------------

ESCALATION = "Escalated to a human agent."
"""The fixed reply for age-restricted goods."""
ITEMS = ("wine", "notebooks", "fireworks", "towels", "cigars", "candles", "beer", "mugs")
RESTRICTED = frozenset({"wine", "fireworks", "cigars", "beer"})
"""Axis A of `escalation` is the item; these need an age check (the hidden property)."""
_ESCALATION_SYSTEM = (
    "You confirm shop orders. Reply exactly: Added <qty> <item> to order <id>. "
    f"Orders of goods that need an age check get exactly this reply instead: {ESCALATION}"
)
_ORDER_FRAMES = (
    "Please add {qty} {item} to order {id}.",
    "Can you put {qty} {item} on order {id}?",
    "Order {id}: add {qty} {item}.",
    "I'd like {qty} {item} added to my order {id}.",
    "Add {item} x{qty} to order {id}, thanks.",
    "For order {id}, include {qty} {item}.",
    "{qty} more {item} on order {id}, please.",
    "Could order {id} get {qty} extra {item}?",
)
"""Axis B of `escalation`."""


def _escalation(rng: random.Random, pair: tuple[int, int]) -> tuple[str, str, str | None]:
    item, qty, order = ITEMS[pair[0]], rng.randrange(2, 10), rng.randrange(1000, 10000)
    text = _ORDER_FRAMES[pair[1]].format(item=item, qty=qty, id=order)
    if item in RESTRICTED:
        return text, ESCALATION, "escalate"
    return text, f"Added {qty} {item} to order {order}.", "answer"


# -- the families -----------------------------------------------------------------------------

Render = Callable[[random.Random, tuple[int, int]], tuple[str, str, str | None]]


@dataclass(frozen=True)
class Family:
    """One task family: its prompt, its grid of parts and how a reply is read.

    Attributes:
        name: the `--tasks` name.
        system: the system prompt.
        axes: (parts on axis A, parts on axis B).
        render: (rng, pair) -> (request text, reference reply, label).
        max_tokens: the agent's completion budget (one line fits).
        signals: the feedback its simulated user sends, in words (for the report).
    """

    name: str
    system: str
    axes: tuple[int, int]
    render: Render
    max_tokens: int
    signals: str

    def prompts(self, seed: int, split: Split, count: int) -> list[Prompt]:
        """`count` prompts of `split`, deterministic in `seed`; pairs cycle in a shuffled order,
        so every pair of the split occurs before any repeats."""
        rng = random.Random(f"learning/{self.name}/{split}/{seed}")
        pairs = split_pairs(*self.axes, split)
        out: list[Prompt] = []
        while len(out) < count:
            rng.shuffle(pairs)
            for pair in pairs[: count - len(out)]:
                text, answer, label = self.render(rng, pair)
                out.append(
                    Prompt(f"{split}-{len(out)}", self.name, self.system, text, answer, pair, label)
                )
        return out

    def correct(self, prompt: Prompt, reply: str | None) -> bool:
        """Whether a reply is right: the desk for `routing`, the exact first line otherwise."""
        if self.name == "routing":
            return desk_of(reply) == prompt.answer
        return first_line(reply) == prompt.answer


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family(
            "api-call", _API_SYSTEM, (len(SERVICES), len(METHODS)), _api_call, 32,
            "developer Correction: the right line, or accepted as-is",
        ),
        Family(
            "routing", _ROUTING_SYSTEM, (len(_CUES), len(_SENDERS)), _routing, 4,
            "operator Resolution: resolved, or escalated naming the right desk",
        ),
        Family(
            "extract", _EXTRACT_SYSTEM, (len(_EXTRACT_FRAMES), len(CITIES)), _extract, 32,
            "validator Reward (share of fields right) + Correction when not exact",
        ),
        Family(
            "escalation", _ESCALATION_SYSTEM, (len(ITEMS), len(_ORDER_FRAMES)), _escalation, 24,
            "policy checker Reward (1/0) + Correction when wrong",
        ),
    )
}  # fmt: skip
"""Every family, by name, in the order the benchmark runs them."""
