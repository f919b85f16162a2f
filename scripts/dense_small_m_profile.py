"""Where the `upcast` kernel's bf16 rows pay: bf16 GEMV vs the fp32 copy, per shape and end to end.

Two measurements on the default model's shapes, bf16 weights, this CPU:

1. Each projection shape (qkv, o, gate_up, down: 30 distinct weights each,
   read in turn as a decode step reads them, so caches are cold; lm_head: 2)
   for 1..4 rows: the fp32 path of `upcast` (`fp32_kernel` on the fp32 copy:
   oneDNN-packed, or `blocked` without oneDNN) against `F.linear` on the bf16
   weight with the casts `upcast` does (fp32 in, fp32 out); minimum of 6 passes, microseconds per weight.
2. `SlottedDecoder.decode` in bf16 for 1, 2, 3 and 8 rows with every kernel's
   `reduced_rows` as built (`_REDUCED_ROWS`) against none (the fp32 copy for
   every row count), interleaved; minimum wall ms per step over 5 x 16 steps.

    OMP_WAIT_POLICY=PASSIVE python3 scripts/dense_small_m_profile.py [--threads 2]

Not a test: nothing here asserts. Not here: the kernels (`clora_feedback.engine.dense`).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from clora_feedback.bench.timing import best_wall_s
from clora_feedback.config import EngineConfig
from clora_feedback.engine.decoder import KVCache, SlottedDecoder
from clora_feedback.engine.dense import fp32_kernel
from clora_feedback.lora.ops import LoRABatch
from clora_feedback.model.resolve import resolve_model_dir


def _shape(name: str, out: int, fan_in: int, copies: int, gen: torch.Generator) -> None:
    w16 = [torch.randn(out, fan_in, generator=gen).bfloat16() for _ in range(copies)]
    k32 = [fp32_kernel(w.float()) for w in w16]
    for m in (1, 2, 3, 4):
        x = torch.randn(m, fan_in, generator=gen).bfloat16().float()
        with torch.inference_mode():
            t32 = best_wall_s(lambda: [k(x) for k in k32], 6) * 1e6 / copies  # noqa: B023
            t16 = best_wall_s(lambda: [F.linear(x.bfloat16(), w).float() for w in w16], 6)  # noqa: B023
        t16 *= 1e6 / copies
        print(f"| {name} {out}x{fan_in} | {m} | {t32:.0f} | {t16:.0f} | {t32 / t16:.2f}x |")


def kernels(hidden: int, inter: int, qkv: int, vocab: int) -> None:
    shapes = {"qkv": (qkv, hidden, 30), "o": (hidden, hidden, 30),
              "gate_up": (2 * inter, hidden, 30), "down": (hidden, inter, 30),
              "lm_head": (vocab, hidden, 2)}  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    print("| shape | rows | fp32 copy (us) | bf16 (us) | fp32 / bf16 |\n|---|---|---|---|---|")
    for name, (out, fan_in, copies) in shapes.items():
        _shape(name, out, fan_in, copies, gen)


def decode(model: SlottedDecoder) -> None:
    dense = model._dense
    every = [k for layer in dense.layers for k in layer.values()] + [dense.lm_head]
    built = {id(k): getattr(k, "reduced_rows", range(0)) for k in every}

    def use_reduced(on: bool) -> None:
        for k in every:
            if hasattr(k, "reduced_rows"):
                k.reduced_rows = built[id(k)] if on else range(0)

    cache = KVCache(model.config, 8, 256, model.dtype, model.device)
    print("| rows | reduced rows as built (ms/step) | fp32 copy always (ms/step) | ratio |")
    print("|---|---|---|---|")
    for n in (1, 2, 3, 8):
        tokens = torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(0))
        lora = LoRABatch.from_slots([0] * n)

        def steps(tokens: torch.Tensor = tokens, lora: LoRABatch = lora, n: int = n) -> None:
            for s in range(16):
                model.decode(tokens, list(range(n)), torch.full((n,), 60 + s), lora, cache)

        best = {True: float("inf"), False: float("inf")}
        for rep in range(5):
            for on in (True, False) if rep % 2 == 0 else (False, True):
                use_reduced(on)
                best[on] = min(best[on], best_wall_s(steps, 1) / 16 * 1e3)
        use_reduced(True)
        print(f"| {n} | {best[True]:.1f} | {best[False]:.1f} | {best[False] / best[True]:.2f}x |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--cache-dir", default="var/models")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"threads {args.threads}, load {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    model = SlottedDecoder.from_dir(
        resolve_model_dir(args.model, Path(args.cache_dir)),
        max_loras=1, max_lora_rank=8, target_modules=tuple(EngineConfig().lora_target_modules),
        dtype=torch.bfloat16,
    )  # fmt: skip
    c = model.config
    print(f"dense kernel: {model._dense.name}")
    kernels(c.hidden_size, c.intermediate_size, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim,
            c.vocab_size)  # fmt: skip
    decode(model)
    print(f"load at end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
