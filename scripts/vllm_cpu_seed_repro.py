"""Reproduce vLLM-CPU's crash on seeded requests whose prefill is split (chunked).

vLLM 0.32's model runner rewinds a seeded request's `torch.Generator` after a
step that ran only part of its prompt (`gen.set_offset(gen.get_offset() - 4)` in
`GPUModelRunner._bookkeeping_sync`); a CPU generator has no offset, so the engine
dies with `RuntimeError: CPU Generator does not use offset` (then every request
gets EngineDeadError). A prompt is split when the waiting prompts do not fit in
one step's `--max-num-batched-tokens` (2048 by default on CPU) with chunked
prefill on (the default). This script sends `--n` requests at once, each with a
`--prompt-tokens`-token prompt, seeded unless `--no-seed`, to a running vLLM
server, then asks `/health`: it exits 0 when the server is still healthy and
every request answered 200, else 1.

    python3 scripts/vllm_cpu_seed_repro.py --url http://127.0.0.1:8133 --n 32 --prompt-tokens 100

Not here: starting the server (see docs/vllm.md, section 2b, for the flags).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys

import httpx


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8133")
    parser.add_argument("--model", default=None, help="served model name; default: the first")
    parser.add_argument("--n", type=int, default=32, help="requests sent at once")
    parser.add_argument("--prompt-tokens", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--no-seed", action="store_true", help="send no per-request seed")
    parser.add_argument("--salt", type=int, default=None,
                        help="varies the prompts; default: a fresh one, so the prefix cache "
                        "of an earlier run cannot serve them")  # fmt: skip
    args = parser.parse_args()
    salt = args.salt if args.salt is not None else random.randrange(1, 10_000)
    async with httpx.AsyncClient(base_url=args.url, timeout=300.0) as http:
        try:
            model = args.model or (await http.get("/v1/models")).json()["data"][0]["id"]
        except httpx.HTTPError as exc:
            print(f"no server at {args.url}: {exc}")
            return 1

        async def one(i: int) -> int:
            body: dict[str, object] = {
                "model": model,
                # distinct prompts (per request and per run): the prefix cache shares none
                "prompt": [100 + (i * 37 + j * salt) % 20000 for j in range(args.prompt_tokens)],
                "max_tokens": args.max_tokens,
                "temperature": 1.0,
            }
            if not args.no_seed:
                body["seed"] = 1000 + i
            try:
                return (await http.post("/v1/completions", json=body)).status_code
            except httpx.HTTPError:
                return -1

        codes = await asyncio.gather(*(one(i) for i in range(args.n)))
        try:
            healthy = (await http.get("/health")).status_code == 200
        except httpx.HTTPError:
            healthy = False
    counts = {code: codes.count(code) for code in sorted(set(codes))}
    print(f"n={args.n} prompt_tokens={args.prompt_tokens} seeded={not args.no_seed} "
          f"statuses={counts} healthy_after={healthy}")  # fmt: skip
    return 0 if healthy and set(codes) == {200} else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
