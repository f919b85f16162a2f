"""The no-op probe: flags an adapter version whose greedy outputs equal the base model's.

An adapter that loads fine and changes nothing (B all zero, a scaling of 0, a
target module the engine ignores, a training run that never moved) is a known
failure of other engines. Each time the deployer starts serving a version it
reports it here (`Deployer(on_installed=probe.schedule)`); the probe runs in a
background task, off the request path: a few fixed prompts, greedy, a handful
of tokens, once through the base model (cached per process) and once through
the agent's adapter, through the engine's own queue like any request (so it
costs `prompts x max_tokens` decode rows, measured in `seconds`). A version
whose every output equals the base's, token for token and each token's logprob
within `tolerance`, is flagged `noop` (the greedy tokens alone flagged an agent
trained on its own domain: it answers generic prompts with the base's words,
at other probabilities); the result is recorded
once in the registry (`AdapterRegistry.record_probe`: `probe` on the version,
shown by `GET /v1/adapters/{agent}/versions` as `noop` and `probe`) and a
warning is logged. It only flags: a no-op version still serves.

A result is discarded when a token came from another version (the pointer
moved while the probe ran); a version already probed (by any process) is not
probed again.

Not here: loading or refusing adapters (`deployer`, `store.provenance`).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

from clora_feedback.engine.base import Engine
from clora_feedback.engine.types import GenerationRequest, SamplingParams
from clora_feedback.errors import CloraError, NotFoundError
from clora_feedback.store.versions import AdapterStore

log = logging.getLogger(__name__)


@dataclass
class _Output:
    """One prompt's greedy tokens, their logprobs and the adapter version of each."""

    tokens: list[int]
    logprobs: list[float]
    versions: list[int]


def _logprob_change(output: _Output, base: _Output) -> float:
    """The largest logprob difference of two outputs, position by position (over the
    shorter one: outputs of different lengths differ in their tokens already)."""
    pairs = zip(output.logprobs, base.logprobs, strict=False)
    return max((abs(a - b) for a, b in pairs), default=0.0)


PROBE_PROMPTS = (
    "Hello! How can I help you today?",
    "The capital of France is",
    "def add(a, b):\n",
    '{"label": "',
)
"""Fixed prompts (plain text, no chat template): short, and different in kind."""


class NoopProbe:
    """Runs the probe for each newly served version, one at a time, in the background.

    Args:
        engine: the serving engine (started before the first `schedule`).
        registry: where the result is recorded.
        prompts: the probe prompts.
        max_tokens: greedy tokens per prompt.
        tolerance: the largest logprob change of a token that still counts as none (the
            same adapter-free rows in batches of other shapes differ by rounding).
        wait_s: how long to wait for the version's registry row (a runtime load serves
            the version a moment before its row commits).
    """

    def __init__(
        self,
        engine: Engine,
        registry: AdapterStore,
        *,
        prompts: tuple[str, ...] = PROBE_PROMPTS,
        max_tokens: int = 4,
        tolerance: float = 0.02,
        wait_s: float = 10.0,
    ) -> None:
        self.engine = engine
        self.registry = registry
        self.prompts = prompts
        self.max_tokens = max_tokens
        self.tolerance = tolerance
        self.wait_s = wait_s
        self._base: list[_Output] | None = None
        self._queue: asyncio.Queue[tuple[str, int]] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self.results: dict[tuple[str, int], dict[str, Any]] = {}
        """Results of this process's probes, by (agent, version) (tests and logs read it)."""
        self.counts = {"noop": 0, "changed": 0}
        """Versions probed here, by result (`/metrics`: `clora_probe_versions_total`)."""

    def schedule(self, agent: str, version: int) -> None:
        """Queue a probe of `agent`'s `version` (on the event loop; never blocks)."""
        self._queue.put_nowait((agent, version))
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._drain(), name="clora-probe")

    async def idle(self) -> None:
        """Wait until every queued probe has run (tests)."""
        while self._task is not None and not self._task.done():
            await asyncio.sleep(0.01)

    async def start(self) -> None:
        """Nothing to start: probes run when `schedule` queues one."""

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _drain(self) -> None:
        while not self._queue.empty():
            agent, version = self._queue.get_nowait()
            try:
                await self.probe(agent, version)
            except CloraError as exc:  # an engine or store hiccup: the flag is optional
                log.warning("probe of agent %s v%d failed: %s", agent, version, exc.message)

    async def probe(self, agent: str, version: int) -> dict[str, Any] | None:
        """Probe one version now; returns the recorded result (None: skipped or discarded)."""
        if not await self._unprobed(agent, version):
            return None
        started = time.perf_counter()
        if self._base is None:
            self._base = await self._outputs(None)
        outputs = await self._outputs(agent)
        if any(v != version for out in outputs for v in out.versions):
            return None  # another version served part of it
        same_tokens = [o.tokens for o in outputs] == [b.tokens for b in self._base]
        pairs = zip(outputs, self._base, strict=True)
        change = max((_logprob_change(o, base) for o, base in pairs), default=0.0)
        noop = same_tokens and change <= self.tolerance
        result = {
            "noop": noop,
            "same_tokens": same_tokens,
            "max_logprob_change": round(change, 6),
            "prompts": len(self.prompts),
            "tokens": self.max_tokens,
            "seconds": round(time.perf_counter() - started, 4),
            "at": time.time(),
        }
        self.results[(agent, version)] = result
        self.counts["noop" if noop else "changed"] += 1
        await asyncio.to_thread(self.registry.record_probe, agent, version, result)
        if noop:
            log.warning(
                "agent %s: version %d answers the %d probe prompts exactly like the base "
                "model, every token's logprob within %.3g (a no-op adapter?)",
                *(agent, version, len(self.prompts), self.tolerance),
            )
        return result

    async def _unprobed(self, agent: str, version: int) -> bool:
        deadline = time.monotonic() + self.wait_s
        while True:
            try:
                info = await asyncio.to_thread(self.registry.get, agent, version)
            except NotFoundError:
                if time.monotonic() > deadline:
                    return False
                await asyncio.sleep(0.05)
                continue
            return info.probe is None

    async def _outputs(self, agent: str | None) -> list[_Output]:
        """The greedy output of each prompt through `agent`; the prompts go in together,
        so the engine batches them (one decode row each)."""
        return list(await asyncio.gather(*(self._greedy(agent, p) for p in self.prompts)))

    async def _greedy(self, agent: str | None, prompt: str) -> _Output:
        request = GenerationRequest(
            request_id=f"probe-{uuid.uuid4().hex}",
            agent=agent,
            prompt_token_ids=list(self.engine.tokenizer.encode(prompt, add_special_tokens=False)),
            sampling=SamplingParams(max_tokens=self.max_tokens, temperature=0.0),
            background=True,
        )
        out = _Output([], [], [])
        async for chunk in self.engine.add_request(request):
            out.tokens.extend(t.token_id for t in chunk.tokens)
            out.logprobs.extend(t.logprob for t in chunk.tokens)
            out.versions.extend(t.adapter_version for t in chunk.tokens)
        return out
