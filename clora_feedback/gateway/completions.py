"""`POST /v1/completions`: the legacy text-completion endpoint, one prompt or several.

A prompt is text (tokenised with the tokenizer's own special-token rules) or a
list of engine token ids used as is; `prompt` may also be a list of prompts,
as OpenAI and vLLM accept it (LangChain's `OpenAI(...).batch` sends one). All
prompts' choices run in one `GenerationRun`, submitted together so they share
the engine's batches; choices are indexed prompt by prompt (`n` each), and
every prompt is recorded as its own trajectory (the response id for a single
prompt, `{id}-p{index}` for each of several, named by the choice's
`clora.completion_id`). `max_tokens` defaults to 16, as in OpenAI's
documentation for this endpoint. Responses and SSE chunks are the `openai`
package's `Completion` objects with the `clora` extension; the trajectories
are committed before the response or `[DONE]`.

Not here: chat templates and tools (see `chat`), what both handlers share (see `serving`).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from openai.types import Completion
from starlette.requests import Request

from clora_feedback.engine.base import Engine
from clora_feedback.engine.types import RequestOutput
from clora_feedback.gateway.agents import AgentRegistry, Route
from clora_feedback.gateway.auth import Principal
from clora_feedback.gateway.capture import build_record, prompt_completion_id
from clora_feedback.gateway.generation import ChoiceState, GenerationRun, plan_sampling
from clora_feedback.gateway.logprobs import completion_logprobs
from clora_feedback.gateway.metrics import Metrics
from clora_feedback.gateway.offload import off_loop
from clora_feedback.gateway.serving import Serving
from clora_feedback.gateway.sse import (
    SSEResponse,
    openai_stream,
    run_unless_disconnected,
    sse_event,
)
from clora_feedback.schemas.openai import (
    CompletionRequest,
    choice_extension,
    include_usage,
    stop_list,
)
from clora_feedback.store.trajectories import AsyncTrajectoryStore


@dataclass(frozen=True)
class CompletionTurn:
    """One text-completion request on its way, built once by `create`.

    Attributes:
        completion_id: the response id.
        body: the request.
        principal: the caller.
        route: how `body.model` is served.
        run: the engine work: n choices for each of `run.prompts`.
    """

    completion_id: str
    body: CompletionRequest
    principal: Principal
    route: Route
    run: GenerationRun

    def trajectory_id(self, choice: ChoiceState) -> str | None:
        """The id of the trajectory recording `choice` when it is not the response id."""
        prompts = len(self.run.prompts)
        return (
            None
            if prompts == 1
            else prompt_completion_id(self.completion_id, choice.prompt_index, prompts)
        )


class CompletionHandler:
    """Serves text completions for every agent on one engine."""

    def __init__(
        self, engine: Engine, agents: AgentRegistry, store: AsyncTrajectoryStore, metrics: Metrics
    ):
        self._serving = Serving(engine, agents, store, metrics)

    async def create(self, body: CompletionRequest, principal: Principal, request: Request) -> Any:
        """Answer one request: a JSON-able dict, or an `SSEResponse` when streaming."""
        serving = self._serving
        route = serving.route(body, principal)
        prompts = await self._token_ids(body)
        sampling = plan_sampling(
            prompt_len=max(len(p) for p in prompts),
            max_model_len=serving.engine.max_model_len,
            max_tokens=body.max_tokens,
            max_tokens_param="max_tokens",
            prompt_param="prompt",
            stop=stop_list(body.stop),
            logprobs=body.logprobs is not None,
            top_logprobs=body.logprobs or 0,
            controls=body,
        )
        route, completion_id, run = serving.start(
            route, id_prefix="cmpl", prompts=prompts, sampling=sampling, n=body.n or 1
        )
        turn = CompletionTurn(completion_id, body, principal, route, run)
        if body.stream:
            name = f"completion stream {completion_id}"
            return SSEResponse(
                openai_stream(self._stream(turn), name=name, on_exit=run.abort), on_close=run.abort
            )
        await run_unless_disconnected(request, run.run())
        await self._record(turn)
        return self._response(turn)

    async def _token_ids(self, body: CompletionRequest) -> list[list[int]]:
        """Every prompt as engine token ids (text encoded off the event loop when big)."""
        prompts = body.prompts
        encode = self._serving.engine.tokenizer.encode
        size = sum(len(p) for p in prompts if isinstance(p, str))
        return await off_loop(
            lambda: [list(encode(p)) if isinstance(p, str) else list(p) for p in prompts],
            size=size,
        )

    # -- results --------------------------------------------------------------------

    def _choice(
        self,
        turn: CompletionTurn,
        state: ChoiceState,
        out: RequestOutput | None = None,
        text_offset: int = 0,
    ) -> dict[str, Any]:
        """A choice: the whole of `state`, or (in a stream) what engine chunk `out` added."""
        body = turn.body
        start = len(state.token_ids) - len(out.tokens) if out is not None else 0
        token_ids = state.token_ids[start:]
        lp = None
        if body.logprobs is not None:
            lp = completion_logprobs(
                self._serving.pieces,
                token_ids,
                state.logprobs[start:],
                state.top_logprobs[start:],
                body.logprobs,
                text_offset=text_offset,
            ).model_dump()
        final = out is None or out.finished
        return {
            "index": state.index,
            "text": state.text if out is None else out.text,
            "logprobs": lp,
            # The legacy endpoint has no "abort"; aborted runs never get here.
            "finish_reason": (state.finish_reason or "stop") if final else None,
            "clora": choice_extension(token_ids, state.versions[start:], turn.trajectory_id(state)),
        }

    def _payload(self, turn: CompletionTurn, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": turn.completion_id,
            "object": "text_completion",
            "created": int(turn.run.created_at),
            "model": turn.body.model,
            "choices": choices,
        }

    def _extension(self, turn: CompletionTurn) -> dict[str, Any]:
        prompts = turn.run.prompts
        return self._serving.capture.extension(
            turn.route, prompts[0] if len(prompts) == 1 else None
        )

    def _response(self, turn: CompletionTurn) -> dict[str, Any]:
        payload = self._payload(turn, [self._choice(turn, c) for c in turn.run.choices])
        payload["usage"] = turn.run.usage()
        payload["clora"] = self._extension(turn)
        return Completion.model_validate(payload).model_dump(mode="json", exclude_unset=True)

    async def _record(self, turn: CompletionTurn) -> None:
        """One trajectory per prompt, each with that prompt's choices."""
        run, body = turn.run, turn.body
        request = body.model_dump(mode="json", exclude_none=True)
        prompts = body.prompts
        for p, prompt_ids in enumerate(run.prompts):
            record = build_record(
                completion_id=prompt_completion_id(turn.completion_id, p, len(run.prompts)),
                kind="completion",
                route=turn.route,
                principal=turn.principal,
                request=request if len(prompts) == 1 else {**request, "prompt": prompts[p]},
                prompt_token_ids=prompt_ids,
                run=run,
                outputs=[(c, c.text, c.finish_reason or "stop", None) for c in run.of_prompt(p)],
                capabilities=self._serving.engine.capabilities,
            )
            await self._serving.capture.commit(record, "completions")

    # -- streaming ------------------------------------------------------------------

    def _chunk(self, payload: dict[str, Any], body: CompletionRequest) -> str:
        # Sent as built, not through `Completion`: its `finish_reason` cannot be null, yet
        # OpenAI streams null on every chunk but the last (the SDK parses chunks leniently).
        if include_usage(body) and "usage" not in payload:
            payload["usage"] = None
        return sse_event(payload)

    async def _stream(self, turn: CompletionTurn) -> AsyncGenerator[str, None]:
        """The chunks of one streamed request; `openai_stream` adds `[DONE]` and errors."""
        run, body = turn.run, turn.body
        offsets = {c.index: 0 for c in run.choices}
        first = True
        async with aclosing(run.events()) as events:  # closed with us: pumps stop
            async for choice, out in events:
                if not out.tokens and not out.text and not out.finished:
                    continue
                payload = self._payload(
                    turn, [self._choice(turn, choice, out, offsets[choice.index])]
                )
                offsets[choice.index] += len(out.text)
                if first:
                    payload["clora"] = self._extension(turn)
                    first = False
                yield self._chunk(payload, body)
        await self._record(turn)
        if include_usage(body):
            payload = self._payload(turn, [])
            payload["usage"] = run.usage()
            yield self._chunk(payload, body)
