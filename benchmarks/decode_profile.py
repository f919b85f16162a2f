"""`python -m benchmarks.serve --decode-profile`: where a mixed-adapter decode step's time goes.

In process, on the default model, one torch thread, timed in CPU time
(`time.thread_time`: the calling thread is the only compute thread, so other
processes on a shared machine inflate it much less than wall time). Minimum
over `--reps` interleaved repetitions of:

- `SlottedDecoder.decode` for 8 rows: base model; one adapter; 8 adapters with the
  rows grouped by slot; 8 adapters with rows and slots permuted as the gateway
  hands them over (the engine then decodes in slot order);
- the LoRA update alone (`add_lora_update_` over every projection group of
  the 30 layers) for one adapter and for 8, reading the batch's real rank
  (8) or every rank of the slots (16: what the engine did before
  `LoRABatch.rank`).

Adapters are 9 random rank-8 adapters on all seven projections in rank-16
slots. Not a test: nothing here asserts.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

from clora_feedback.config import EngineConfig
from clora_feedback.engine.decoder import KVCache, SlottedDecoder
from clora_feedback.hardware import DTYPES
from clora_feedback.lora.ops import LoRABatch, add_lora_update_
from clora_feedback.lora.weights import random_lora_weights

ROWS = 8
SHUFFLED = [1, 2, 5, 8, 4, 3, 7, 6]  # the slots the gateway's rows 0..7 had in a probe


def profile(model_dir: Path, dtype: str, reps: int) -> dict[str, float]:
    """Minimum CPU milliseconds of each case (see the module docstring)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _profile(model_dir, DTYPES[dtype], reps)
    finally:
        torch.set_num_threads(threads)


def _profile(model_dir: Path, dtype: torch.dtype, reps: int) -> dict[str, float]:
    targets = tuple(EngineConfig().lora_target_modules)
    model = SlottedDecoder.from_dir(
        model_dir, max_loras=9, max_lora_rank=16, target_modules=targets, dtype=dtype
    )
    for slot in range(1, 10):
        model.write_slot(slot, random_lora_weights(model.limits, rank=8, seed=slot))
    cache = KVCache(model.config, 16, 256, dtype, model.device)
    vocab = min(1000, model.config.vocab_size)
    tokens = torch.randint(0, vocab, (ROWS,), generator=torch.Generator().manual_seed(0))
    positions = torch.full((ROWS,), 60)
    rows = list(range(ROWS))

    def decode(slots: list[int]) -> Callable[[], object]:
        return lambda: model.decode(tokens, rows, positions, LoRABatch.from_slots(slots), cache)

    fan_in = {"qkv": model.config.hidden_size, "o": model.config.hidden_size,
              "gate_up": model.config.hidden_size, "down": model.config.intermediate_size}  # fmt: skip
    groups = model.slots[0]
    xs = {g: torch.randn(ROWS, fan_in[g]).to(model.lora_dtype) for g in groups}
    ys = {g: torch.zeros(ROWS, groups[g].out_features, dtype=model.lora_dtype) for g in groups}

    def lora(slots: list[int], rank: int) -> Callable[[], object]:
        batch = LoRABatch.from_slots(slots, rank=rank)

        def run() -> None:
            with torch.inference_mode():
                for layer in model.slots:
                    for g, s in layer.items():
                        add_lora_update_(ys[g], xs[g], s.a, s.blocks, batch)

        return run

    cases = {
        "decode_base": decode([0] * ROWS),
        "decode_one": decode([1] * ROWS),
        "decode_mixed_grouped": decode(list(range(1, ROWS + 1))),
        "decode_mixed_permuted": decode(SHUFFLED),
        "lora_one_rank8": lora([1] * ROWS, 8),
        "lora_one_rank16": lora([1] * ROWS, 16),
        "lora_mixed_rank8": lora(list(range(1, ROWS + 1)), 8),
        "lora_mixed_rank16": lora(list(range(1, ROWS + 1)), 16),
    }
    for fn in cases.values():  # warm-up
        fn()
    best = dict.fromkeys(cases, float("inf"))
    for _ in range(reps):
        for name, fn in cases.items():
            t0 = time.thread_time()
            fn()
            best[name] = min(best[name], (time.thread_time() - t0) * 1e3)
    best["mixed_vs_one_decode"] = best["decode_one"] / best["decode_mixed_permuted"]
    return best


def table(values: dict[str, float], dtype: str) -> str:
    lines = [f"| case ({dtype}, 8 rows, 1 thread, min CPU ms) | value |", "|---|---|"]
    for name, value in values.items():
        text = f"{value:.2f}x" if name.endswith("vs_one_decode") else f"{value:.1f} ms"
        lines.append(f"| {name} | {text} |")
    return "\n".join(lines)
