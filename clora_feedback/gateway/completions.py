"""`POST /v1/completions`: the legacy text-completion endpoint, one prompt per request.

The prompt is text (tokenised with the tokenizer's own special-token rules)
or a list of engine token ids used as is. `max_tokens` defaults to 16, as in
OpenAI's documentation for this endpoint. Responses and SSE chunks are the
`openai` package's `Completion` objects with the `clora` extension; the
trajectory is committed before the response or `[DONE]`.

Not here: chat templates and tools (see `chat`).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

from openai.types import Completion
from starlette.requests import Request

from clora_feedback.engine.base import Engine
from clora_feedback.engine.types import RequestOutput
from clora_feedback.errors import CloraError, EngineError
from clora_feedback.gateway.agents import AgentRegistry, Route, sticky_key
from clora_feedback.gateway.auth import Principal
from clora_feedback.gateway.capture import build_record, version_attribution
from clora_feedback.gateway.errors import error_event
from clora_feedback.gateway.generation import ChoiceState, GenerationRun, plan_sampling
from clora_feedback.gateway.logprobs import TokenPieces, completion_logprobs
from clora_feedback.gateway.metrics import Metrics
from clora_feedback.gateway.offload import off_loop
from clora_feedback.gateway.sse import DONE, SSEResponse, run_unless_disconnected, sse_event
from clora_feedback.schemas.openai import (
    CloraResponseExtension,
    CompletionRequest,
    choice_extension,
    include_usage,
    stop_list,
)
from clora_feedback.store.trajectories import AsyncTrajectoryStore

log = logging.getLogger(__name__)


class CompletionHandler:
    """Serves text completions for every agent on one engine."""

    def __init__(
        self, engine: Engine, agents: AgentRegistry, store: AsyncTrajectoryStore, metrics: Metrics
    ):
        self._engine = engine
        self._agents = agents
        self._store = store
        self._metrics = metrics
        self._pieces = TokenPieces(engine.tokenizer)

    async def create(self, body: CompletionRequest, principal: Principal, request: Request) -> Any:
        """Answer one request: a JSON-able dict, or an `SSEResponse` when streaming."""
        route = self._agents.resolve(body.model, sticky=sticky_key(body, uuid.uuid4().hex))
        principal.check_model(body.model, route.agent)
        text = body.prompt_text
        if text is not None:
            encode = self._engine.tokenizer.encode  # a big prompt: off the event loop
            prompt_ids = list(await off_loop(lambda: encode(text), size=len(text)))
        else:
            prompt_ids = body.prompt_token_ids
        sampling = plan_sampling(
            prompt_len=len(prompt_ids),
            max_model_len=self._engine.max_model_len,
            max_tokens=body.max_tokens,
            max_tokens_param="max_tokens",
            prompt_param="prompt",
            temperature=body.temperature,
            top_p=body.top_p,
            seed=body.seed,
            stop=stop_list(body.stop),
            logprobs=body.logprobs is not None,
            top_logprobs=body.logprobs or 0,
            controls=body,
        )
        completion_id = f"cmpl-{uuid.uuid4().hex}"
        run = GenerationRun(
            self._engine,
            completion_id=completion_id,
            agent=route.engine_agent,
            prompt_token_ids=prompt_ids,
            sampling=sampling,
            n=body.n or 1,
        )
        if body.stream:
            return SSEResponse(
                self._stream(body, principal, route, prompt_ids, run, completion_id),
                on_close=run.abort,
            )
        await run_unless_disconnected(request, run.run())
        await self._record(body, principal, route, prompt_ids, run, completion_id)
        choices = [
            self._choice(body, c, c.token_ids, c.logprobs, c.top_logprobs, c.text, final=True)
            for c in run.choices
        ]
        payload = self._payload(body, run, completion_id, choices)
        payload["usage"] = self._usage(prompt_ids, run)
        payload["clora"] = self._extension(route, prompt_ids)
        return Completion.model_validate(payload).model_dump(mode="json", exclude_unset=True)

    def _choice(
        self,
        body: CompletionRequest,
        state: ChoiceState,
        token_ids: list[int],
        logprobs: list[float],
        top: list[tuple[tuple[int, float], ...]],
        text: str,
        *,
        final: bool,
        text_offset: int = 0,
    ) -> dict[str, Any]:
        lp = None
        if body.logprobs is not None:
            lp = completion_logprobs(
                self._pieces, token_ids, logprobs, top, body.logprobs, text_offset=text_offset
            ).model_dump()
        versions = state.versions[len(state.token_ids) - len(token_ids) :]
        return {
            "index": state.index,
            "text": text,
            "logprobs": lp,
            # The legacy endpoint has no "abort"; aborted runs never get here.
            "finish_reason": (state.finish_reason or "stop") if final else None,
            "clora": choice_extension(token_ids, versions),
        }

    def _payload(
        self,
        body: CompletionRequest,
        run: GenerationRun,
        completion_id: str,
        choices: list[dict[str, Any]],
    ) -> dict[str, Any]:
        return {
            "id": completion_id,
            "object": "text_completion",
            "created": int(run.created_at),
            "model": body.model,
            "choices": choices,
        }

    def _usage(self, prompt_ids: list[int], run: GenerationRun) -> dict[str, int]:
        completion = sum(len(c.token_ids) for c in run.choices)
        return {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": completion,
            "total_tokens": len(prompt_ids) + completion,
        }

    def _extension(self, route: Route, prompt_ids: list[int] | None) -> dict[str, Any]:
        return CloraResponseExtension(
            agent=route.agent,
            adapter_version=route.adapter_version,
            prompt_token_ids=prompt_ids,
            version_attribution=version_attribution(self._engine),
        ).wire()

    async def _record(
        self,
        body: CompletionRequest,
        principal: Principal,
        route: Route,
        prompt_ids: list[int],
        run: GenerationRun,
        completion_id: str,
    ) -> None:
        record = build_record(
            completion_id=completion_id,
            kind="completion",
            route=route,
            principal=principal,
            request=body.model_dump(mode="json", exclude_none=True),
            prompt_token_ids=prompt_ids,
            run=run,
            outputs=[(c, c.text, c.finish_reason or "stop", None) for c in run.choices],
            capabilities=self._engine.capabilities,
        )
        await self._store.record(record)
        generated = sum(len(c.token_ids) for c in run.choices)
        self._metrics.observe_completion(record.agent, "completions", len(prompt_ids), generated)

    def _chunk(self, payload: dict[str, Any], body: CompletionRequest) -> str:
        # Sent as built, not through `Completion`: its `finish_reason` cannot be null, yet
        # OpenAI streams null on every chunk but the last (the SDK parses chunks leniently).
        if include_usage(body) and "usage" not in payload:
            payload["usage"] = None
        return sse_event(payload)

    async def _stream(
        self,
        body: CompletionRequest,
        principal: Principal,
        route: Route,
        prompt_ids: list[int],
        run: GenerationRun,
        completion_id: str,
    ) -> AsyncIterator[str]:
        offsets = {c.index: 0 for c in run.choices}
        first = True
        try:
            async for choice, out in run.events():
                if not out.tokens and not out.text and not out.finished:
                    continue
                choice_json = self._stream_choice(body, choice, out, offsets[choice.index])
                offsets[choice.index] += len(out.text)
                payload = self._payload(body, run, completion_id, [choice_json])
                if first:
                    payload["clora"] = self._extension(route, prompt_ids)
                    first = False
                yield self._chunk(payload, body)
            await self._record(body, principal, route, prompt_ids, run, completion_id)
            if include_usage(body):
                payload = self._payload(body, run, completion_id, [])
                payload["usage"] = self._usage(prompt_ids, run)
                yield self._chunk(payload, body)
            yield DONE
        except CloraError as exc:
            yield sse_event(error_event(exc))
            yield DONE
        except Exception:
            log.exception("completion stream %s failed", completion_id)
            yield sse_event(error_event(EngineError("the stream failed; see the server log")))
            yield DONE
        finally:
            run.abort()

    def _stream_choice(
        self, body: CompletionRequest, choice: ChoiceState, out: RequestOutput, offset: int
    ) -> dict[str, Any]:
        n = len(out.tokens)
        start = len(choice.token_ids) - n
        return self._choice(
            body,
            choice,
            choice.token_ids[start:],
            choice.logprobs[start:],
            choice.top_logprobs[start:],
            out.text,
            final=out.finished,
            text_offset=offset,
        )
