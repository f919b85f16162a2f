"""Engine work for one HTTP request: n sequences submitted together, merged, accumulated.

`GenerationRun` submits one `GenerationRequest` per choice, for every prompt
at once (n choices per prompt, indexed prompt by prompt: choice `p * n + j` is
prompt p's j-th, seeded `(seed + j) mod 2**64`, see `engine.types.choice_seed`,
so a prompt's answers do not depend on the prompts beside it); they are all
submitted before the engine's next step, so they share its batches. It
merges their streams into one async sequence of `(choice, chunk)` events (one
choice: its stream read as it is, without a merge task) and
accumulates per-choice token ids, behaviour logprobs and adapter versions. It
owns every engine request it started: leaving `events()` early for any reason
(client disconnect, cancellation, error) aborts them all at once, so batch rows
are freed before the next decode step.

`plan_sampling` turns the OpenAI parameters shared by both endpoints into
`SamplingParams`, including the context-window check and the sampling controls
(penalties, `logit_bias`, vLLM's `top_k`/`min_tokens`/`ignore_eos`) of any
request that has them (`SamplingControls`).

Not here: chat templates and tools (see `chat`), response shapes (see
`chat`/`completions`), persistence (see `capture`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from clora_feedback.engine.base import Engine, RequestStream
from clora_feedback.engine.types import (
    FinishReason,
    GenerationRequest,
    GuidedDecoding,
    RequestOutput,
    SamplingParams,
    choice_seed,
)
from clora_feedback.errors import ContextLengthError, EngineError, InvalidRequestError
from clora_feedback.lifecycle import cancel_and_wait
from clora_feedback.schemas.openai import logit_bias_pairs


@dataclass
class ChoiceState:
    """Everything generated so far for one choice.

    Attributes:
        index: choice index (`choices[i].index`).
        request_id: the engine request id.
        prompt_index: which of the run's prompts this choice continues.
        token_ids: generated engine token ids.
        logprobs: behaviour logprob per token.
        versions: adapter version per token.
        top_logprobs: (token_id, logprob) alternatives per token (empty tuples unless asked).
        text: detokenised text released so far (stop strings removed).
        finish_reason: the engine's reason, once finished.
        first_token_at: `time.monotonic()` of the first token, if any.
        per_token_versions: the engine attributes versions per token; when false every
            token records the version the request was admitted under (the first one
            reported), as `EngineCapabilities.per_token_versions` promises.
    """

    index: int
    request_id: str
    prompt_index: int = 0
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    top_logprobs: list[tuple[tuple[int, float], ...]] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    first_token_at: float | None = None
    per_token_versions: bool = True

    def apply(self, out: RequestOutput) -> None:
        """Fold one engine chunk into this choice."""
        if out.tokens and self.first_token_at is None:
            self.first_token_at = time.monotonic()
        for event in out.tokens:
            self.token_ids.append(event.token_id)
            self.logprobs.append(event.logprob)
            exact = self.per_token_versions or not self.versions
            self.versions.append(event.adapter_version if exact else self.versions[0])
            self.top_logprobs.append(event.top_logprobs)
        self.text += out.text
        if out.finished:
            self.finish_reason = out.finish_reason


class SamplingControls(Protocol):
    """The sampling controls of a request (both OpenAI request models have them); None
    means the default (temperature and top_p 1, the rest off)."""

    temperature: float | None
    top_p: float | None
    seed: int | None
    frequency_penalty: float | None
    presence_penalty: float | None
    logit_bias: dict[str, float] | None
    top_k: int | None
    min_tokens: int | None
    ignore_eos: bool | None


def plan_sampling(
    *,
    prompt_len: int,
    max_model_len: int,
    max_tokens: int | None,
    max_tokens_param: str,
    prompt_param: str,
    stop: tuple[str, ...],
    logprobs: bool,
    top_logprobs: int,
    controls: SamplingControls,
) -> SamplingParams:
    """Sampling parameters for one choice (`seeded` derives each choice's seed).

    An absent `max_tokens` means "the rest of the context window"; `prompt_len` is the
    longest prompt's length when a request has several.

    Raises:
        ContextLengthError: the prompt leaves no room (param `prompt_param`), or
            prompt + `max_tokens` exceed `max_model_len` (param `max_tokens_param`).
        InvalidRequestError: `min_tokens` exceeds the completion budget.
    """
    room = max_model_len - prompt_len
    if room < 1:
        raise ContextLengthError(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"{prompt_param} resulted in {prompt_len} tokens, leaving no room for a completion. "
            f"Please reduce the length of the {prompt_param}.",
            param=prompt_param,
        )
    if max_tokens is not None and max_tokens > room:
        raise ContextLengthError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the {prompt_param}, {max_tokens} in "
            f"the completion). Please reduce the length of the {prompt_param} or {max_tokens_param}.",
            param=max_tokens_param,
        )
    budget = max_tokens if max_tokens is not None else room
    params = SamplingParams(
        max_tokens=budget,
        temperature=1.0 if controls.temperature is None else controls.temperature,
        top_p=1.0 if controls.top_p is None else controls.top_p,
        seed=controls.seed,
        stop=stop,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
    )
    return _with_controls(params, controls, max_tokens_param)


def _with_controls(
    params: SamplingParams, controls: SamplingControls, max_tokens_param: str
) -> SamplingParams:
    min_tokens = controls.min_tokens or 0
    if min_tokens > params.max_tokens:
        raise InvalidRequestError(
            f"min_tokens ({min_tokens}) must not exceed {max_tokens_param} ({params.max_tokens})",
            param="min_tokens",
        )
    return replace(
        params,
        ignore_eos=bool(controls.ignore_eos),
        top_k=max(controls.top_k or 0, 0),  # vLLM's -1 means off, like 0
        min_tokens=min_tokens,
        presence_penalty=controls.presence_penalty or 0.0,
        frequency_penalty=controls.frequency_penalty or 0.0,
        logit_bias=logit_bias_pairs(controls.logit_bias),
    )


def seeded(sampling: SamplingParams, index: int) -> SamplingParams:
    """Choice `index`'s parameters: seed `(seed + index) mod 2**64` (`choice_seed`), so n
    seeded choices differ yet repeat and no request seed overflows the engine's range."""
    if sampling.seed is None:
        return sampling
    return replace(sampling, seed=choice_seed(sampling.seed, index))


class GenerationRun:
    """The engine requests behind one completion request: n per prompt.

    Args:
        engine: the engine to submit to.
        completion_id: the response id; engine request ids are `{completion_id}-{i}`.
        agent: `GenerationRequest.agent` (None = base model).
        prompts: the prompts' token ids (one for chat), each continued by n choices.
        sampling: parameters before the per-choice seed offset.
        n: number of choices per prompt.
        guided: the declarative constraint every choice generates under (forced tool
            call, JSON schema); one spec object for all, so the engine compiles it once.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        completion_id: str,
        agent: str | None,
        prompts: Sequence[list[int]],
        sampling: SamplingParams,
        n: int,
        guided: GuidedDecoding | None = None,
    ) -> None:
        per_token = engine.capabilities.per_token_versions
        self.prompts = list(prompts)
        self.n = n
        self.choices = [
            ChoiceState(p * n + j, f"{completion_id}-{p * n + j}", p, per_token_versions=per_token)
            for p in range(len(self.prompts))
            for j in range(n)
        ]
        self.created_at = time.time()
        self.started = time.monotonic()
        self.finished_at: float | None = None
        self._streams: list[RequestStream] = []
        try:
            requests = [
                GenerationRequest(
                    request_id=choice.request_id,
                    agent=agent,
                    prompt_token_ids=self.prompts[choice.prompt_index],
                    sampling=seeded(sampling, choice.index - choice.prompt_index * n),
                    guided=guided,
                )
                for choice in self.choices
            ]
            # Together, for one step; raises OverloadedError / ContextLengthError /
            # NotFoundError / InvalidRequestError synchronously, with none queued.
            self._streams = list(engine.add_requests(requests))
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        """Abort every engine request that has not finished (idempotent)."""
        for stream in self._streams:
            stream.abort()

    async def events(self) -> AsyncGenerator[tuple[ChoiceState, RequestOutput], None]:
        """Chunks of all choices as they arrive, each already folded into its choice.

        Raises:
            EngineError: the engine aborted a sequence nobody asked to abort.
            CloraError: whatever the engine raised for a sequence.
        """
        if len(self._streams) == 1:  # n == 1: read the one stream itself, no pump task
            async with contextlib.aclosing(self._single()) as single:
                async for event in single:
                    yield event
            return
        queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

        async def pump(index: int, stream: RequestStream) -> None:
            try:
                async for out in stream:
                    queue.put_nowait((index, out))
                queue.put_nowait((index, None))
            except Exception as exc:
                queue.put_nowait((index, exc))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(self._streams)]
        try:
            remaining = len(tasks)
            while remaining:
                index, item = await queue.get()
                if item is None:
                    remaining -= 1
                    continue
                if isinstance(item, BaseException):
                    raise item
                yield self._fold(index, item)
            self.finished_at = time.monotonic()
        finally:
            # Abort first (synchronous, immediate), then stop the pumps.
            self.abort()
            await cancel_and_wait(tasks)

    async def _single(self) -> AsyncGenerator[tuple[ChoiceState, RequestOutput], None]:
        """`events` of a run with one choice: the same events, errors and aborts, read
        straight from its stream (the per-choice task and merge queue are for n > 1)."""
        chunks = aiter(self._streams[0])
        try:
            async for item in chunks:
                yield self._fold(0, item)
            self.finished_at = time.monotonic()
        finally:
            self.abort()  # first, as `events` does: the engine request ends at once
            close = getattr(chunks, "aclose", None)
            if close is not None:
                await close()

    def _fold(self, index: int, item: RequestOutput) -> tuple[ChoiceState, RequestOutput]:
        """Fold a chunk into choice `index`; raises if the engine aborted it unasked."""
        choice = self.choices[index]
        choice.apply(item)
        if item.finished and item.finish_reason == "abort":
            raise EngineError("the engine aborted the request")
        return choice, item

    async def run(self) -> list[ChoiceState]:
        """Drive every choice to the end; returns the finished choices."""
        async for _ in self.events():
            pass
        return self.choices

    def of_prompt(self, prompt_index: int) -> list[ChoiceState]:
        """The choices that continue prompt `prompt_index`, in order."""
        return self.choices[prompt_index * self.n : (prompt_index + 1) * self.n]

    def usage(self) -> dict[str, int]:
        """OpenAI's `usage`: every prompt's tokens and every choice's generated tokens."""
        prompt = sum(len(p) for p in self.prompts)
        completion = sum(len(c.token_ids) for c in self.choices)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

    def timings(self) -> dict[str, float]:
        """`ttft_s` (admission to the first token of any choice) and `total_s` (to the last)."""
        firsts = [c.first_token_at for c in self.choices if c.first_token_at is not None]
        end = self.finished_at if self.finished_at is not None else time.monotonic()
        ttft = (min(firsts) - self.started) if firsts else end - self.started
        return {"ttft_s": ttft, "total_s": end - self.started}
