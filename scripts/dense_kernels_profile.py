"""What oneDNN's packed fp32 weights buy over the `blocked` kernel: per shape and end to end.

Two measurements on the default model, this CPU, 2 threads by default:

1. Each projection shape (qkv, o, gate_up, down: 30 distinct fp32 weights,
   read in turn as a step reads them, so caches are cold; lm_head: 1) for 1,
   2, 8 and 48 rows: the `blocked` kernel against oneDNN's packed layout for
   batch hints 1, 8 and 64 (`torch.ops.mkldnn._reorder_linear_weight`); the
   minimum of 4 passes, microseconds per weight, and the per-step total of
   the 30 layers plus the lm_head.
2. `SlottedDecoder` with the `packed` kernel as built against the same model with
   `blocked` kernels swapped in, interleaved: one decode step of 1 row and of
   8 rows on 8 different random rank-8 adapters (all seven projections), and
   the prefill of a 48-token chunk on one adapter after 256 cached positions;
   the minimum wall ms over 9 interleaved passes (decode: 16 steps a pass).
   With `--dtype bfloat16` the model is bf16 (`upcast`) and what is swapped
   is the fp32 copy's kernel (used from 4 rows on).

    OMP_WAIT_POLICY=PASSIVE python3 scripts/dense_kernels_profile.py [--threads 2] [--dtype float32]

Not a test: nothing here asserts. Not here: the kernels (`clora_feedback.engine.dense`).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path

import torch

from clora_feedback.bench.timing import best_wall_s
from clora_feedback.config import EngineConfig
from clora_feedback.engine.decoder import KVCache, SlottedDecoder
from clora_feedback.engine.dense import DenseKernels, Linear, _blocked, _packed, _Upcast
from clora_feedback.lora.ops import LoRABatch
from clora_feedback.lora.weights import random_lora_weights
from clora_feedback.model.resolve import resolve_model_dir

ROWS = (1, 2, 8, 48)
PASSES = 9  # end to end: interleaved passes per case (minimum kept)
HINTS = (1, 8, 64)


def kernels(shapes: dict[str, tuple[int, int, int]]) -> None:
    gen = torch.Generator().manual_seed(0)
    names = ["blocked"] + [f"packed, hint {h}" for h in HINTS]
    totals = {(n, m): 0.0 for n in names for m in ROWS}
    print("| shape | rows | " + " | ".join(f"{n} (us)" for n in names) + " |")
    print("|---" * (len(names) + 2) + "|")
    for shape, (out, fan_in, copies) in shapes.items():
        ws = [torch.randn(out, fan_in, generator=gen) for _ in range(copies)]
        built = {"blocked": [_blocked(w) for w in ws]}
        built |= {f"packed, hint {h}": [_packed(w, h) for w in ws] for h in HINTS}
        per_step = 1 if shape == "lm_head" else 30
        for m in ROWS:
            x = torch.randn(m, fan_in, generator=gen)
            cells = []
            for name in names:
                kernels = built[name]

                def run(ks: list[Linear] = kernels, x: torch.Tensor = x) -> list[torch.Tensor]:
                    return [k(x) for k in ks]

                with torch.inference_mode():
                    us = best_wall_s(run, 4) * 1e6 / copies
                totals[name, m] += us * per_step
                cells.append(f"{us:.0f}")
            print(f"| {shape} {out}x{fan_in} | {m} | " + " | ".join(cells) + " |")
    print(
        "\n| rows | "
        + " | ".join(f"{n}, step (ms)" for n in names)
        + " | blocked / packed hint 8 |"
    )
    print("|---" * (len(names) + 2) + "|")
    for m in ROWS:
        cells = [f"{totals[n, m] / 1e3:.1f}" for n in names]
        ratio = totals["blocked", m] / totals["packed, hint 8", m]
        print(f"| {m} | " + " | ".join(cells) + f" | {ratio:.2f}x |")


def _blocked_kernels(model: SlottedDecoder) -> DenseKernels:
    """The model's dense kernels with `blocked` in place of packed fp32 (bf16: inside `upcast`)."""
    built = model._dense
    if built.name == "upcast":

        def swap(k: Callable[[torch.Tensor], torch.Tensor]) -> _Upcast:
            assert isinstance(k, _Upcast)
            other = _Upcast.__new__(_Upcast)
            other.weight, other.reduced_rows = k.weight, k.reduced_rows
            other.fp32 = _blocked(k.weight.float())
            return other

        layers: list[dict[str, Linear]] = [
            {g: swap(k) for g, k in layer.items()} for layer in built.layers
        ]
        name = "upcast (blocked fp32 copy)"
        return DenseKernels(layers, swap(built.lm_head), name, built.compute_dtype)
    base = model.base
    weights = [{g: layer[g] for g in built.layers[0]} for layer in base.layers]
    return DenseKernels.build(weights, base.lm_head, "blocked")


def end_to_end(model: SlottedDecoder) -> None:
    for slot in range(1, 9):
        model.write_slot(slot, random_lora_weights(model.limits, rank=8, seed=slot))
    cache = KVCache(model.config, 8, 512, model.dtype, model.device)
    gen = torch.Generator().manual_seed(0)
    chunk = torch.randint(0, 1000, (48,), generator=gen)
    model.prefill(torch.randint(0, 1000, (256,), generator=gen), cache, 0, 1)

    def decode(n: int) -> Callable[[], object]:
        tokens = torch.randint(0, 1000, (n,), generator=gen)
        lora = LoRABatch.from_slots(list(range(1, n + 1)))

        def run() -> None:
            for s in range(16):
                model.decode(tokens, list(range(n)), torch.full((n,), 300 + s), lora, cache)

        return run

    cases: dict[str, tuple[Callable[[], object], int]] = {
        "decode, 1 row (one adapter)": (decode(1), 16),
        "decode, 8 rows on 8 adapters": (decode(8), 16),
        "prefill, 48 tokens after 256 cached": (lambda: model.prefill(chunk, cache, 0, 1, 256), 1),
    }
    kinds = {"as built": model._dense, "blocked": _blocked_kernels(model)}
    print(
        f"\n| case | {model._dense.name} as built (ms) | {kinds['blocked'].name} (ms) | speedup |"
    )
    print("|---|---|---|---|")
    for case, (fn, steps) in cases.items():
        best = dict.fromkeys(kinds, float("inf"))
        for rep in range(PASSES):
            for kind in kinds if rep % 2 == 0 else list(kinds)[::-1]:
                model._dense = kinds[kind]
                best[kind] = min(best[kind], best_wall_s(fn, 1) / steps * 1e3)
        model._dense = kinds["as built"]
        ratio = best["blocked"] / best["as built"]
        print(f"| {case} | {best['as built']:.1f} | {best['blocked']:.1f} | {ratio:.2f}x |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--cache-dir", default="var/models")
    parser.add_argument("--skip-shapes", action="store_true", help="Only the end-to-end part.")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"threads {args.threads}, load {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    model = SlottedDecoder.from_dir(
        resolve_model_dir(args.model, Path(args.cache_dir)),
        max_loras=8, max_lora_rank=8, target_modules=tuple(EngineConfig().lora_target_modules),
        dtype=getattr(torch, args.dtype),
    )  # fmt: skip
    c = model.config
    print(f"dense kernel: {model._dense.name}")
    if not args.skip_shapes:
        qkv = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
        kernels({"qkv": (qkv, c.hidden_size, 30), "o": (c.hidden_size, c.hidden_size, 30),
                 "gate_up": (2 * c.intermediate_size, c.hidden_size, 30),
                 "down": (c.hidden_size, c.intermediate_size, 30),
                 "lm_head": (c.vocab_size, c.hidden_size, 1)})  # fmt: skip
    end_to_end(model)
    print(f"load at end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
