"""Pydantic error locations as the JSON paths a caller wrote, e.g. `messages[0].content`.

One translation for every wire family: the OpenAI routes (`gateway.errors`),
feedback events on the webhook and in the SDK (`schemas.feedback`) and the
dead-letter reasons of Kafka records (`feedback.records`). Each caller says
which location items are not fields (union member names, discriminator tags).

Not here: error messages or HTTP status (see `clora_feedback.errors`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

Item = int | str
Skip = Callable[[str, Item | None], bool]
"""(item, the item before it or None) -> True when `item` is not a field name."""


def json_path(loc: Sequence[Item], *, skip: Skip | None = None) -> str:
    """Join a location into a path: list indices as `[i]`, fields with dots.

    `("messages", 2, "content")` -> `"messages[2].content"`; `(0, "outcome")` ->
    `"[0].outcome"`; `()` -> `""`. Items for which `skip(item, previous)` holds
    are left out (their position still counts as `previous` for the next item).
    """
    parts: list[str] = []
    previous: Item | None = None
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif skip is None or not skip(item, previous):
            parts.append(f".{item}" if parts else item)
        previous = item
    return "".join(parts)
