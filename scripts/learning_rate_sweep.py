"""How many optimizer steps the supervised path needs, per learning rate, on unseen tasks.

A development diagnostic behind the trainer's default learning rate and warm-up
(`TrainerConfig.lr`, `warmup_steps`): for each family of `clora bench learning`
and each learning rate, a fresh adapter takes `--steps` optimizer steps of the
trainer's own `train_step` on the right answers of `--batch` training prompts a
step (what corrections and resolutions carrying the right answer teach, plus
the trainer's replay of earlier examples; with `--pairs`, also the
preference pair of each prompt whose answer the current adapter gets wrong,
its greedy answer against the right one, at each `--preference-weights`
value), and after every `--eval-every`
steps the embedded engine answers the held-out prompts greedily with that
adapter. No gateway, no sampling, no policy gradient: it isolates the step
count the supervised signal needs, the quantity that bounds how fast the live
loop can learn (one step per admitted batch).

Run: `python scripts/learning_rate_sweep.py --families api-call,routing --lrs 2e-4,5e-4,1e-3,2e-3`
or, supervised-only against supervised + preference pairs at one learning rate:
`python scripts/learning_rate_sweep.py --lrs 1e-3 --pairs --preference-weights 0,1`
Prints one table (held-out accuracy per step count) and the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

from clora_feedback.bench.learning_tasks import FAMILIES, Family, Prompt
from clora_feedback.config import EngineConfig, Settings
from clora_feedback.engine.embedded import EmbeddedEngine
from clora_feedback.engine.types import GenerationRequest, SamplingParams
from clora_feedback.model.resolve import resolve_model_dir
from clora_feedback.train.loss import LossConfig
from clora_feedback.train.policy import DecoderPolicy
from clora_feedback.train.replay import ReplayBuffer
from clora_feedback.train.state import (
    AdamConfig,
    AgentTrainState,
    LoRALayout,
    TrainingSlot,
    init_lora,
)
from clora_feedback.train.step import AgentBatch, PreferencePair, SFTSample, train_step


def prompt_ids(engine: EmbeddedEngine, prompt: Prompt) -> list[int]:
    text = engine.tokenizer.apply_chat_template(
        prompt.messages(), tokenize=False, add_generation_prompt=True
    )
    return list(engine.tokenizer.encode(text, add_special_tokens=False))


def target_ids(engine: EmbeddedEngine, answer: str) -> list[int]:
    ids = list(engine.tokenizer.encode(answer, add_special_tokens=False))
    eos = engine.tokenizer.eos_token_id
    return ids + ([eos] if eos is not None else [])


async def greedy(
    engine: EmbeddedEngine, family: Family, prompts: list[Prompt], agent: str | None, tag: str
) -> list[list[int]]:
    """The engine's greedy answer ids to each prompt (with `agent`'s adapter, or the base)."""

    async def one(i: int, prompt: Prompt) -> list[int]:
        params = SamplingParams(max_tokens=family.max_tokens, temperature=0.0)
        request = GenerationRequest(f"{tag}-{i}", agent, prompt_ids(engine, prompt), params)
        ids: list[int] = []
        async for out in engine.add_request(request):
            ids += [t.token_id for t in out.tokens]
        return ids

    return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))


async def held_out_accuracy(
    engine: EmbeddedEngine, family: Family, prompts: list[Prompt], agent: str | None
) -> float:
    answers = await greedy(engine, family, prompts, agent, f"eval-{agent}")
    replies = [str(engine.tokenizer.decode(ids, skip_special_tokens=True)) for ids in answers]
    return sum(family.correct(p, r) for p, r in zip(prompts, replies, strict=True)) / len(prompts)


async def sweep(args: argparse.Namespace) -> None:
    model_dir = resolve_model_dir(args.model, Settings().model_cache_dir)
    engine = EmbeddedEngine(model_dir, EngineConfig(max_num_seqs=32, max_model_len=1024))
    await engine.start()
    policy = DecoderPolicy.shared_with(engine)
    targets = tuple(policy.lora_limits.target_modules)
    lrs = [float(x) for x in args.lrs.split(",")]
    weights = [float(x) for x in args.preference_weights.split(",")] if args.pairs else [0.0]
    steps_shown = list(range(0, args.steps + 1, args.eval_every))
    print(
        f"| family | lr | preference weight | {' | '.join(f'step {s}' for s in steps_shown)} "
        "| s/step |"
    )
    print("|---|---|---|" + "---|" * (len(steps_shown) + 1))
    try:
        for name in args.families.split(","):
            family = FAMILIES[name]
            train = family.prompts(args.seed, "train", 512)
            held = family.prompts(args.seed, "eval", args.held_out)
            base = await held_out_accuracy(engine, family, held, None)
            for lr, weight in [(lr, w) for lr in lrs for w in weights]:
                layout = LoRALayout.build(policy.lora_limits, 8, 16.0, targets)
                state = AgentTrainState.create("sweep", layout, init_lora(layout, seed=args.seed))
                slot = TrainingSlot(layout.numel, policy.device)
                adam = AdamConfig(lr=lr, warmup_steps=args.warmup)
                replay = ReplayBuffer(256, seed=args.seed)
                rng = random.Random(args.seed)
                row = [f"{base:.2f}"]
                spent = 0.0
                for step in range(1, args.steps + 1):
                    chosen = rng.sample(train, args.batch)
                    fresh = [
                        SFTSample(prompt_ids(engine, p), target_ids(engine, p.answer))
                        for p in chosen
                    ]
                    batch = AgentBatch(state, sft=fresh + replay.sample(args.replay))
                    replay.add(fresh)
                    if weight > 0:
                        engine.set_adapter("sweep", 10_000 + step, layout.to_weights(state.params))
                        outputs = await greedy(engine, family, chosen, "sweep", f"pairs-{step}")
                        for p, sample, ids in zip(chosen, fresh, outputs, strict=True):
                            reply = str(engine.tokenizer.decode(ids, skip_special_tokens=True))
                            if ids and not family.correct(p, reply):
                                batch.pairs.append(
                                    PreferencePair(sample.prompt_ids, sample.target_ids, ids)
                                )
                    loss = LossConfig(preference_weight=weight)
                    t0 = time.perf_counter()
                    train_step(policy, [slot], [batch], loss, adam)
                    spent += time.perf_counter() - t0
                    if step % args.eval_every == 0:
                        engine.set_adapter("sweep", step, layout.to_weights(state.params))
                        row.append(f"{await held_out_accuracy(engine, family, held, 'sweep'):.2f}")
                cells = " | ".join(row)
                print(
                    f"| {name} | {lr:g} | {weight:g} | {cells} | {spent / args.steps:.1f} |",
                    flush=True,
                )
    finally:
        await engine.stop()
    print(
        f"\nCPU: {platform.processor() or platform.machine()}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, load {os.getloadavg()}; batch {args.batch} "
        f"+ replay {args.replay}, warm-up {args.warmup}, held-out {args.held_out}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--families", default="api-call,routing")
    p.add_argument("--lrs", default="2e-4,5e-4,1e-3,2e-3")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--eval-every", type=int, default=3)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--replay", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--pairs", action="store_true", help="Also train preference pairs.")
    p.add_argument("--preference-weights", default="0,1", help="With --pairs: weights to compare.")
    p.add_argument("--held-out", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    asyncio.run(sweep(p.parse_args()))


if __name__ == "__main__":
    main()
