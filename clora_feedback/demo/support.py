"""Support triage: generated tickets with a hidden correct team, and the operator who judges routing.

A ticket is rendered from a template written for one team (payment,
delivery, technical, account: each a single token of the default model's
vocabulary, so a reply's first token decides its routing), so its correct team is known by construction and never
shown to the agent. Templates carry the team's keyword cues ("charged twice",
"tracking number", "error code", "reset my password") and slots filled from
word lists. The filler lists (products, amounts, devices, ...) are split in
two: training tickets draw from one half, held-out tickets from the other,
and every template has at least one slot, so no held-out ticket was ever
seen verbatim in training.

The agent is asked to answer with the team name only. `route_of` reads its
routing the way a helpdesk macro would: the first word of the reply, which
must be a team name. `SimulatedOperator` closes the case: `resolved` when the
ticket was routed to its team, `escalated` otherwise (wrong team, or a reply
that names no team).

Pure Python: no HTTP, no model. The demo and the experiments send the
operator's verdicts as `Resolution` events.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Literal

TEAMS: tuple[str, ...] = ("payment", "delivery", "technical", "account")
"""Teams a ticket can be routed to."""

Split = Literal["train", "eval"]

SYSTEM_PROMPT = (
    "Route each ticket to one team: payment, delivery, technical or account. "
    "Reply with the team name only."
)

EXAMPLES: tuple[tuple[str, str], ...] = (
    ("I was charged twice.", "payment"),
    ("My order never arrived.", "delivery"),
    ("I can't log in.", "account"),
    ("The app shows an error.", "technical"),
    ("My package is at the wrong address.", "delivery"),
    ("The screen freezes after the update.", "technical"),
)
"""Six worked examples shown before every ticket as earlier chat turns (few-shot).
They fix the reply format, which a 135M model does not follow from the
instruction alone: measured on held-out tickets with SmolLM2-135M-Instruct,
almost no zero-shot reply starts with a team name; with these examples about
60% of greedy replies route correctly. None of them is a generated ticket."""

_TEMPLATES: dict[str, tuple[str, ...]] = {
    "payment": (
        "I was charged twice for my {product} this month. Please refund the extra {amount}.",
        "My invoice for the {product} shows {amount} but the price was lower. Why?",
        "The payment for my {product} failed but my card was still debited {amount}.",
        "Can I get a refund of {amount}? I cancelled the {product} subscription.",
        "Why does my bank statement show a {amount} charge from you I don't recognise?",
        "I need a receipt for the {amount} I paid for the {product}.",
    ),
    "delivery": (
        "My {product} still hasn't arrived after {days} days. Where is my package?",
        "The tracking number for my {product} hasn't updated in {days} days.",
        "The courier left my {product} at the wrong address.",
        "My parcel with the {product} arrived damaged in the box.",
        "Can you change the delivery address for my {product} order?",
        "The delivery of my {product} is {days} days late.",
    ),
    "technical": (
        "The {device} app crashes every time I open it.",
        "I get error code {code} when I try to sync my {product} on {device}.",
        "The {product} keeps disconnecting from wifi on my {device}.",
        "After the last update the {device} app shows a blank screen.",
        "My {product} won't turn on after the firmware update.",
        "The {device} app freezes when I upload a photo. Error {code}.",
    ),
    "account": (
        "I forgot my password and the reset email never reaches my {device}.",
        "Please change the email address on my account to {email}.",
        "I want to delete my account and all my data, including my {product} orders.",
        "My account is locked after {days} failed login attempts.",
        "How do I turn on two-factor authentication for my account on {device}?",
        "Someone else may have logged into my account from {city}.",
    ),
}

# Fillers: the first half of each list feeds training tickets, the second half held-out ones.
_FILLERS: dict[str, tuple[str, ...]] = {
    "product": (
        "headphones", "smart watch", "coffee maker", "camera", "blender", "keyboard",
        "speaker", "tablet", "router", "vacuum", "monitor", "printer",
    ),
    "amount": ("$19.99", "$45", "$120", "$7.50", "$89", "$230", "$12", "$64.90", "$310", "$5"),
    "days": ("3", "5", "7", "10", "12", "14", "4", "9", "15", "21"),
    "device": ("iPhone", "Android", "iPad", "Windows", "Mac", "Linux", "Pixel", "Galaxy"),
    "code": ("E101", "503", "0x80070005", "ERR_42", "E7", "404", "1129", "X-12"),
    "email": (
        "anna@example.com", "li.wei@example.org", "sam@mail.test", "jo@corp.example",
        "omar@post.test", "eva@inbox.example", "raj@web.test", "kim@home.example",
    ),
    "city": ("Lagos", "Lyon", "Osaka", "Lima", "Perth", "Oslo", "Quito", "Pune"),
}  # fmt: skip

_SLOT = re.compile(r"\{(\w+)\}")
_WORD = re.compile(r"[A-Za-z]+")


@dataclass(frozen=True)
class Ticket:
    """A support ticket and its ground truth.

    Attributes:
        id: stable id within its generator (`"train-17"`, `"eval-3"`).
        text: what the customer wrote (all the agent sees, with the system prompt).
        team: the hidden correct team.
        template: index of the template it came from (for analysis).
    """

    id: str
    text: str
    team: str
    template: int

    def messages(self) -> list[dict[str, str]]:
        """The chat messages the agent receives: instruction, worked examples, the ticket."""
        messages = [{"role": "system", "content": SYSTEM_PROMPT}]
        for question, team in EXAMPLES:
            messages += [
                {"role": "user", "content": question},
                {"role": "assistant", "content": team},
            ]
        return [*messages, {"role": "user", "content": self.text}]


def _fillers(name: str, split: Split) -> tuple[str, ...]:
    values = _FILLERS[name]
    half = len(values) // 2
    return values[:half] if split == "train" else values[half:]


def make_ticket(rng: random.Random, split: Split, index: int) -> Ticket:
    """One ticket: a random team, one of its templates, slots filled from `split`'s fillers."""
    team = rng.choice(TEAMS)
    template = rng.randrange(len(_TEMPLATES[team]))
    text = _SLOT.sub(lambda m: rng.choice(_fillers(m.group(1), split)), _TEMPLATES[team][template])
    return Ticket(id=f"{split}-{index}", text=text, team=team, template=template)


def tickets(seed: int, split: Split, count: int) -> list[Ticket]:
    """`count` tickets of `split`, deterministic in `seed`, teams balanced in expectation."""
    rng = random.Random(f"support/{split}/{seed}")
    return [make_ticket(rng, split, i) for i in range(count)]


def route_of(reply: str | None) -> str | None:
    """The team a reply routes to: its first word, if that is a team name (case-insensitive)."""
    if not reply:
        return None
    word = _WORD.search(reply)
    if word is None:
        return None
    name = word.group(0).lower()
    return name if name in TEAMS else None


@dataclass(frozen=True)
class Verdict:
    """The operator's decision on one ticket.

    Attributes:
        outcome: `resolved` (routed to the right team) or `escalated`.
        routed_to: the team the reply named, or None when it named none.
        reward: 1.0 when resolved, else 0.0 (the default reward policy's values).
    """

    outcome: Literal["resolved", "escalated"]
    routed_to: str | None
    reward: float


class SimulatedOperator:
    """Closes each ticket: the team it was routed to resolves it only if it is the right one."""

    def judge(self, ticket: Ticket, reply: str | None) -> Verdict:
        routed = route_of(reply)
        if routed == ticket.team:
            return Verdict("resolved", routed, 1.0)
        return Verdict("escalated", routed, 0.0)
