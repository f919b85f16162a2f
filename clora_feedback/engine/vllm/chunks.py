"""One streamed `/v1/completions` chunk of vLLM as our token events.

vLLM (with `return_token_ids`, `logprobs` and `return_tokens_as_token_ids`)
sends each chunk's sampled token ids, the logprob of each, and the top
alternatives keyed `token_id:<id>`; `chunk_tokens` turns them into
`TokenEvent`s carrying the request's adapter version, and the text the
detokenizer releases, stopping at a stop token or a stop string.

Not here: the HTTP stream (see `client`), the request's lifecycle (see `engine`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from clora_feedback.engine.detok import Detokenizer
from clora_feedback.engine.types import FinishReason, TokenEvent
from clora_feedback.errors import EngineError


def _top(entry: Any, k: int) -> tuple[tuple[int, float], ...]:
    """The `k` most likely (token id, logprob) of one position's `top_logprobs` dict."""
    if k <= 0 or not isinstance(entry, dict):
        return ()
    pairs = [(_token_id(key), float(value)) for key, value in entry.items()]
    pairs.sort(key=lambda p: -p[1])
    return tuple(pairs[:k])


def _token_id(text: str) -> int:
    """`token_id:123` (vLLM's `return_tokens_as_token_ids` form) -> 123."""
    try:
        return int(str(text).removeprefix("token_id:"))
    except ValueError as exc:
        raise EngineError("the vLLM server sent a logprob for an unnamed token") from exc


def chunk_tokens(
    choice: Mapping[str, Any],
    version: int,
    detok: Detokenizer,
    stop_ids: frozenset[int],
    top_logprobs: int,
) -> tuple[list[TokenEvent], str, FinishReason | None]:
    """One chunk's tokens as events (`version` on each), the text they release, and "stop"
    if a stop token or string ended the request (the tokens after it are dropped)."""
    ids = choice.get("token_ids") or []
    logprobs = choice.get("logprobs") or {}
    values = logprobs.get("token_logprobs") or []
    tops = logprobs.get("top_logprobs") or []
    if len(values) != len(ids):
        raise EngineError("the vLLM server sent tokens without their logprobs")
    k = top_logprobs
    events: list[TokenEvent] = []
    text = ""
    for i, token_id in enumerate(ids):
        value = values[i]
        if value is None:
            raise EngineError("the vLLM server sent a token without its logprob")
        top = _top(tops[i], k) if i < len(tops) else ()
        events.append(TokenEvent(int(token_id), float(value), version, top))
        if token_id in stop_ids:
            return events, text, "stop"  # kept as a token (the policy chose it), no text
        delta, hit_stop = detok.add(int(token_id))
        text += delta
        if hit_stop:
            return events, text, "stop"
    return events, text, None
