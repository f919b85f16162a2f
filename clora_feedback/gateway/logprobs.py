"""Logprobs in OpenAI's shapes, with each token's exact text and bytes.

OpenAI reports every token as a string plus its raw UTF-8 `bytes` (a token can
hold half a multi-byte character, so the string alone cannot be concatenated
back). `TokenPieces` recovers the bytes from the tokenizer's vocabulary:
byte-level BPE pieces (GPT-2 / SmolLM2 / Qwen / the tiny test tokenizer) map
back through the byte-to-unicode table, SentencePiece byte-fallback pieces
(`<0x0A>`) are single bytes, and anything else is its decoded text.

A chat reply's `logprobs.content` lists exactly the tokens its `content` is made
of: special tokens (the end-of-turn `<|im_end|>`, which the detokeniser leaves
out of the text) are skipped there, while the `clora` extension's token ids keep
every generated token, as training needs.

Not here: computing logprobs (the engine does; they are log-softmax of the raw
logits, before temperature and top-p).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from openai.types.chat.chat_completion import ChoiceLogprobs
from openai.types.completion_choice import Logprobs as CompletionLogprobs
from transformers import PreTrainedTokenizerBase

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _byte_level_table() -> dict[str, int]:
    """Inverse of the GPT-2 byte -> printable character table used by ByteLevel tokenizers."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {chr(b): b for b in printable}
    shift = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + shift)] = b
            shift += 1
    return table


def _uses_byte_level(tokenizer: PreTrainedTokenizerBase) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    try:
        decoder = json.loads(backend.to_str()).get("decoder")
    except (AttributeError, ValueError):
        return False
    return "ByteLevel" in json.dumps(decoder)


class TokenPieces:
    """Per-token text and bytes for one tokenizer, cached by token id."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tokenizer = tokenizer
        self._special = set(tokenizer.all_special_ids)
        self._byte_table = _byte_level_table() if _uses_byte_level(tokenizer) else None
        self._cache: dict[int, tuple[str, bytes]] = {}

    def is_special(self, token_id: int) -> bool:
        """A special token: it has no text in the content (the detokeniser skips it)."""
        return token_id in self._special

    def get(self, token_id: int) -> tuple[str, bytes]:
        """(text, raw bytes) of one token; text has U+FFFD where a character is split."""
        cached = self._cache.get(token_id)
        if cached is not None:
            return cached
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        raw = self._piece_bytes(token_id, str(piece) if piece is not None else "")
        result = (raw.decode("utf-8", errors="replace"), raw)
        self._cache[token_id] = result
        return result

    def _piece_bytes(self, token_id: int, piece: str) -> bytes:
        if token_id in self._special:
            return piece.encode()
        fallback = _BYTE_FALLBACK.match(piece)
        if fallback is not None:
            return bytes([int(fallback.group(1), 16)])
        table = self._byte_table
        if table is not None and piece and all(c in table for c in piece):
            return bytes(table[c] for c in piece)
        if piece.startswith("▁"):  # SentencePiece word boundary
            return (" " + piece[1:]).replace("▁", " ").encode()
        return str(self._tokenizer.decode([token_id])).encode()


def chat_logprobs(
    pieces: TokenPieces,
    token_ids: Sequence[int],
    logprobs: Sequence[float],
    top: Sequence[tuple[tuple[int, float], ...]],
    top_n: int,
) -> ChoiceLogprobs:
    """`choices[i].logprobs` of a chat completion (or of one streamed delta).

    Special tokens are left out, so the entries' texts join to the content.
    """
    content: list[dict[str, Any]] = []
    for token_id, logprob, alternatives in zip(token_ids, logprobs, top, strict=True):
        if pieces.is_special(token_id):
            continue
        text, raw = pieces.get(token_id)
        content.append(
            {
                "token": text,
                "bytes": list(raw),
                "logprob": logprob,
                "top_logprobs": [
                    {
                        "token": pieces.get(alt)[0],
                        "bytes": list(pieces.get(alt)[1]),
                        "logprob": alt_lp,
                    }
                    for alt, alt_lp in alternatives[:top_n]
                ],
            }
        )
    return ChoiceLogprobs.model_validate({"content": content, "refusal": None})


def completion_logprobs(
    pieces: TokenPieces,
    token_ids: Sequence[int],
    logprobs: Sequence[float],
    top: Sequence[tuple[tuple[int, float], ...]],
    top_n: int,
    *,
    text_offset: int = 0,
) -> CompletionLogprobs:
    """`choices[i].logprobs` of a legacy completion: parallel lists plus character offsets."""
    tokens: list[str] = []
    offsets: list[int] = []
    tops: list[dict[str, float]] = []
    position = text_offset
    for token_id, alternatives in zip(token_ids, top, strict=True):
        text = pieces.get(token_id)[0]
        tokens.append(text)
        offsets.append(position)
        position += len(text)
        tops.append({pieces.get(alt)[0]: alt_lp for alt, alt_lp in alternatives[:top_n]})
    return CompletionLogprobs.model_validate(
        {
            "tokens": tokens,
            "token_logprobs": list(logprobs),
            "top_logprobs": tops if top_n else None,
            "text_offset": offsets,
        }
    )
