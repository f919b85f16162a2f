"""Incremental detokenisation with stop strings held back.

Text is released only when it is final: trailing replacement characters
(half a multi-byte UTF-8 sequence) wait for the next token, and the last
`len(longest stop) - 1` final characters before them wait until they cannot
start a stop string. As in vLLM, a stop string ends the sequence only when a
token after the first `min_tokens` completes it: the text of those first tokens
is never searched, though a stop string may start in its last characters.

Not here: token selection.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase


@dataclass
class Detokenizer:
    """Turns a growing list of token ids into text deltas for one sequence."""

    tokenizer: PreTrainedTokenizerBase
    stop: tuple[str, ...] = ()
    min_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    emitted: int = 0  # characters of the decoded text already released
    text: str = ""
    floor: int = 0  # characters of the first `min_tokens` tokens' text (never searched)

    def add(self, token_id: int | None) -> tuple[str, bool]:
        """Append a token (None: just flush nothing new). Returns (new final text, hit a stop string)."""
        if token_id is not None:
            self.token_ids.append(token_id)
            self.text = str(self.tokenizer.decode(self.token_ids, skip_special_tokens=True))
        searchable = len(self.token_ids) > self.min_tokens
        if not searchable:
            self.floor = len(self.text.rstrip("\ufffd"))
        for s in self.stop if searchable else ():
            at = self.text.find(s, max(0, max(self.emitted, self.floor) - len(s) + 1))
            if at != -1:
                self.text = self.text[:at]
                return self._release(len(self.text)), True
        hold = max((len(s) - 1 for s in self.stop), default=0)
        # Trailing replacement characters are half a character, not text yet; the hold-back
        # for stop strings counts from the last final character before them.
        end = len(self.text.rstrip("\ufffd")) - hold
        return self._release(end), False

    def flush(self) -> str:
        """Release everything left (the sequence finished without a stop string)."""
        return self._release(len(self.text))

    def _release(self, end: int) -> str:
        if end <= self.emitted:
            return ""
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta
