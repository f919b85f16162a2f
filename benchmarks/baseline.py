"""The reference point for engine efficiency: Hugging Face `generate()` on the same model.

Greedy, exactly `new_tokens` per sequence (`min_new_tokens` suppresses EOS),
the same prompt repeated for a batch (equal lengths, so no padding), the same
torch threads as the engine. The model is loaded once per dtype and freed by
the caller dropping the `HFBaseline`.

Not here: the engine side of the comparison (see `serve`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import torch


class HFBaseline:
    """`AutoModelForCausalLM.generate` timed on one prompt."""

    def __init__(self, model_dir: Path, dtype: torch.dtype):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
        self.pad_id = int(self.model.config.eos_token_id or 0)

    def generate(self, prompt: Sequence[int], batch: int, new_tokens: int) -> list[list[int]]:
        """Greedy-generate `new_tokens` for `batch` copies of `prompt`; returns the new ids."""
        ids = torch.tensor([list(prompt)] * batch)
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=self.pad_id,
            )
        return [row[ids.shape[1] :].tolist() for row in out]

    def timed(self, prompt: Sequence[int], batch: int, new_tokens: int) -> float:
        """Wall seconds to generate `new_tokens` for `batch` copies of `prompt`."""
        start = time.perf_counter()
        out = self.generate(prompt, batch, new_tokens)
        wall = time.perf_counter() - start
        if any(len(row) != new_tokens for row in out):
            raise RuntimeError("generate() stopped early")
        return wall

    def rates(self, prompt: Sequence[int], batch: int, new_tokens: int) -> tuple[float, float]:
        """(tokens/s of wall time, decode-only tokens/s).

        Decode-only subtracts a one-token generate (prefill + first token), so it
        counts the `new_tokens - 1` later tokens over the time they took. With few
        tokens on a busy machine the one-token run can take longer than the whole
        one; the pair is then measured again (three tries, else NaN).
        """
        for _ in range(3):
            total = self.timed(prompt, batch, new_tokens)
            first = self.timed(prompt, batch, 1)
            if total > first:
                return batch * new_tokens / total, batch * (new_tokens - 1) / (total - first)
        return batch * new_tokens / total, float("nan")
