"""`POST /v1/chat/completions`: messages -> prompt ids -> engine -> OpenAI response or SSE.

Per request, `ChatHandler`:
1. routes `model` to an agent (404 unknown, 403 not this key's);
2. renders messages and tools (`tools.render_messages`), applies the model's
   chat template with the generation prompt, and for a forced `tool_choice`
   ("required" or a named function) appends `forced_call_prefix` and asks the
   engine for a `ToolCallSpec` (the functions' parameter schemas), which the
   engine compiles, so the call's arguments are always JSON that follows the
   declared parameters (stop strings are ignored for forced calls: they could
   cut it); an engine that cannot compile it answers 400; a `response_format`
   of "json_object" or "json_schema" asks for a `JSONSchemaSpec` instead (the
   reply is one JSON object, as content; stop strings ignored likewise, tools
   not parsed); a reply cut by `max_tokens` is returned as cut, with "length";
   with `tool_choice` "auto" the spec is an "on_trigger" `ToolCallSpec`: text is
   free until the model opens a call, which then follows the declared tools'
   schemas (an engine that cannot compile that serves such calls unconstrained,
   and refuses `strict` tools with a 400); `parallel_tool_calls: false` allows
   one call (the prompt says so, the constraint stops after it, the parser keeps
   the first); rendering and tokenising run off the event loop (`offload`);
3. checks the context window and submits n sequences (`GenerationRun`);
4. parses tool calls (`finish_reason` "tool_calls" when there are any; legacy
   `functions` requests get `message.function_call` and "function_call");
5. records the trajectory (the request's `metadata` with it), then answers:
   one JSON body, or SSE chunks (each choice's finish in a chunk of its own,
   after its last delta, as OpenAI sends it) ending with an optional usage
   chunk and `[DONE]` (the trajectory is committed first).

Not here: HTTP routing (see `routes`), the wire models (see `schemas.openai`), the
prompt format and its grammar (see `clora_feedback.chat_format`).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from openai.types.chat import ChatCompletion, ChatCompletionChunk
from starlette.requests import Request

from clora_feedback.chat_format.calls import (
    ContentDelta,
    StreamEvent,
    ToolCallEvent,
    ToolCallStreamParser,
    parse_tool_calls,
)
from clora_feedback.chat_format.constraint import (
    Grammar,
    call_grammar,
    completion_suffix,
    object_grammar,
    triggered_grammar,
)
from clora_feedback.chat_format.tools import forced_call, forced_call_prefix, render_messages
from clora_feedback.engine.base import Engine
from clora_feedback.engine.guided import check_supported
from clora_feedback.engine.types import GuidedDecoding, JSONSchemaSpec, RequestOutput, ToolCallSpec
from clora_feedback.errors import CloraError, EngineError, InvalidRequestError
from clora_feedback.gateway.agents import AgentRegistry, Route, sticky_key
from clora_feedback.gateway.auth import Principal
from clora_feedback.gateway.capture import build_record, version_attribution
from clora_feedback.gateway.errors import error_event
from clora_feedback.gateway.generation import ChoiceState, GenerationRun, plan_sampling
from clora_feedback.gateway.logprobs import TokenPieces, chat_logprobs
from clora_feedback.gateway.metrics import Metrics
from clora_feedback.gateway.offload import off_loop
from clora_feedback.gateway.sse import DONE, SSEResponse, run_unless_disconnected, sse_event
from clora_feedback.schemas.openai import (
    ChatCompletionRequest,
    ChatTool,
    CloraResponseExtension,
    choice_extension,
    include_usage,
    stop_list,
)
from clora_feedback.store.trajectories import AsyncTrajectoryStore

log = logging.getLogger(__name__)


@dataclass
class ChatPrompt:
    """A chat request turned into engine input.

    Attributes:
        token_ids: the prompt, including the chat template and any forced prefix.
        forced_prefix: text of a forced tool-call opening ("" when none is forced);
            part of the prompt, but parsed together with the generated text.
        parse_tools: tools are offered, so the output is parsed for calls.
        guided: the declarative spec for the engine to compile: the forced call's, or
            the JSON reply's that `response_format` asks for.
        grammar: the calls' grammar (forced, or chosen by the model), to close a call
            that `max_tokens` cut short (None for a JSON reply: returned as generated).
        drops_stop: stop strings are ignored (a forced call or a JSON reply: they could
            cut it); calls the model chooses keep them.
        parallel: several calls may be returned; false keeps the first one only
            (`parallel_tool_calls: false`, legacy `functions`).
    """

    token_ids: list[int]
    forced_prefix: str
    parse_tools: bool
    guided: GuidedDecoding | None = None
    grammar: Grammar | None = None
    drops_stop: bool = False
    parallel: bool = True


@dataclass
class ChoiceResult:
    """What one finished choice answers with."""

    content: str | None
    tool_calls: list[dict[str, Any]] | None
    finish_reason: str


def closing_suffix(prompt: ChatPrompt, choice: ChoiceState) -> str:
    """Text that completes a forced call cut short by `max_tokens` ("" when it completed).

    The generated text is replayed through the call's grammar here: the engine's
    compiled constraint stays inside the engine.
    """
    if prompt.grammar is None:
        return ""
    return completion_suffix(prompt.grammar, choice.text)


def _tool_call_json(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


class ChatHandler:
    """Serves chat completions for every agent on one engine."""

    def __init__(
        self, engine: Engine, agents: AgentRegistry, store: AsyncTrajectoryStore, metrics: Metrics
    ):
        self._engine = engine
        self._agents = agents
        self._store = store
        self._metrics = metrics
        self._pieces = TokenPieces(engine.tokenizer)

    async def create(
        self,
        body: ChatCompletionRequest,
        principal: Principal,
        request: Request,
        *,
        size: int | None = None,
    ) -> Any:
        """Answer one request: a JSON-able dict, or an `SSEResponse` when streaming.

        `size`: the bytes the prompt is rendered from, when known (the HTTP body of a chat
        request); a small one is rendered on the event loop (`off_loop`).
        """
        route = self._agents.resolve(body.model, sticky=sticky_key(body, uuid.uuid4().hex))
        principal.check_model(body.model, route.agent)
        # Rendering and tokenising a big prompt takes a while: keep the event loop free.
        prompt = await off_loop(lambda: self._prepare(body), size=size)
        param, max_tokens = body.max_tokens_param
        sampling = plan_sampling(
            prompt_len=len(prompt.token_ids),
            max_model_len=self._engine.max_model_len,
            max_tokens=max_tokens,
            max_tokens_param=param,
            prompt_param="messages",
            temperature=body.temperature,
            top_p=body.top_p,
            seed=body.seed,
            stop=() if prompt.drops_stop else stop_list(body.stop),
            logprobs=bool(body.logprobs),
            top_logprobs=body.top_logprobs or 0,
            controls=body,
        )
        completion_id = f"chatcmpl-{uuid.uuid4().hex}"
        run = GenerationRun(
            self._engine,
            completion_id=completion_id,
            agent=route.engine_agent,
            prompt_token_ids=prompt.token_ids,
            sampling=sampling,
            n=body.n or 1,
            guided=prompt.guided,
        )
        if body.stream:
            return SSEResponse(
                self._stream(body, principal, route, prompt, run, completion_id), on_close=run.abort
            )
        choices = await run_unless_disconnected(request, run.run())
        results = [self._finish_choice(prompt, c) for c in choices]
        await self._record(body, principal, route, prompt, run, completion_id, results)
        return self._response(body, route, prompt, run, completion_id, results)

    # -- prompt ---------------------------------------------------------------------

    def _prepare(self, body: ChatCompletionRequest) -> ChatPrompt:
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        choice = body.tool_choice
        choice_wire: str | dict[str, Any] | None = (
            choice.model_dump() if choice is not None and not isinstance(choice, str) else choice
        )
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        parallel = body.parallel_tool_calls is not False
        rendered = render_messages(messages, tools, choice_wire, parallel_calls=parallel)
        tokenizer = self._engine.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise InvalidRequestError(
                f"model {self._engine.model_name!r} has no chat template; use /v1/completions",
                param="messages",
            )
        text = tokenizer.apply_chat_template(rendered, tokenize=False, add_generation_prompt=True)
        prefix = forced_call_prefix(choice_wire, tools)
        ids = list(tokenizer.encode(str(text) + prefix, add_special_tokens=False))
        parse = bool(tools) and body.effective_tool_choice != "none" and not body.constrains_reply
        forced = forced_call(choice_wire, tools)
        if forced is None:
            if parse and body.tools:
                return self._chosen_calls(ids, body.tools, parallel)
            reply = self._reply_spec(body)
            return ChatPrompt(ids, prefix, parse, reply, drops_stop=reply is not None)
        name, functions = forced
        spec = ToolCallSpec(functions=functions, name=name)
        check_supported(spec, self._engine.capabilities)
        # Compiled here too (cheap, no tokens): a bad schema is a 400 before any engine work.
        grammar = call_grammar(functions, name)
        return ChatPrompt(ids, prefix, parse, spec, grammar, drops_stop=True, parallel=parallel)

    def _chosen_calls(self, ids: list[int], tools: list[ChatTool], parallel: bool) -> ChatPrompt:
        """`tool_choice` "auto": the calls the model opens follow their tools' schemas.

        An engine that cannot constrain calls the model chooses serves them
        unconstrained, unless a tool is `strict`: that promise it cannot keep is a 400.
        """
        functions = {t.function.name: t.function.parameters for t in tools}
        spec = ToolCallSpec(functions=functions, mode="on_trigger", parallel=parallel)
        if spec.kind not in self._engine.capabilities.constraints:
            strict = [t.function.name for t in tools if t.function.strict]
            if strict:
                check_supported(spec, self._engine.capabilities)  # raises, naming `tools`
            return ChatPrompt(ids, "", True, parallel=parallel)
        grammar = triggered_grammar(functions, parallel=parallel)  # a bad schema: 400 now
        return ChatPrompt(ids, "", True, spec, grammar, parallel=parallel)

    def _reply_spec(self, body: ChatCompletionRequest) -> JSONSchemaSpec | None:
        """The JSON reply `response_format` (or `guided_json`) asks for, checked against the
        engine; None for text."""
        if not body.constrains_reply:
            return None
        spec = JSONSchemaSpec(body.reply_schema)
        check_supported(spec, self._engine.capabilities)
        object_grammar(spec.schema)  # a bad schema is a 400 before any engine work
        return spec

    # -- results --------------------------------------------------------------------

    def _finish_choice(self, prompt: ChatPrompt, choice: ChoiceState) -> ChoiceResult:
        reason = choice.finish_reason or "stop"
        if not prompt.parse_tools:
            return ChoiceResult(choice.text, None, reason)
        text = prompt.forced_prefix + choice.text + closing_suffix(prompt, choice)
        content, calls = parse_tool_calls(text)
        if not calls:
            return ChoiceResult(content or "", None, reason)
        if not prompt.parallel:
            calls = calls[:1]  # engines that cannot stop after one call: the first one counts
        return ChoiceResult(
            content, [_tool_call_json(c.id, c.name, c.arguments) for c in calls], "tool_calls"
        )

    async def _record(
        self,
        body: ChatCompletionRequest,
        principal: Principal,
        route: Route,
        prompt: ChatPrompt,
        run: GenerationRun,
        completion_id: str,
        results: list[ChoiceResult],
    ) -> None:
        record = build_record(
            completion_id=completion_id,
            kind="chat",
            route=route,
            principal=principal,
            request=body.model_dump(mode="json", exclude_none=True),
            prompt_token_ids=prompt.token_ids,
            run=run,
            outputs=[
                (c, c.text, r.finish_reason, r.tool_calls)
                for c, r in zip(run.choices, results, strict=True)
            ],
            capabilities=self._engine.capabilities,
        )
        await self._store.record(record)
        generated = sum(len(c.token_ids) for c in run.choices)
        self._metrics.observe_completion(record.agent, "chat", len(prompt.token_ids), generated)

    def _usage(self, prompt: ChatPrompt, run: GenerationRun) -> dict[str, int]:
        completion = sum(len(c.token_ids) for c in run.choices)
        prompt_tokens = len(prompt.token_ids)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
        }

    def _extension(self, route: Route, prompt: ChatPrompt | None) -> dict[str, Any]:
        return CloraResponseExtension(
            agent=route.agent,
            adapter_version=route.adapter_version,
            prompt_token_ids=prompt.token_ids if prompt is not None else None,
            version_attribution=version_attribution(self._engine),
        ).wire()

    def _response(
        self,
        body: ChatCompletionRequest,
        route: Route,
        prompt: ChatPrompt,
        run: GenerationRun,
        completion_id: str,
        results: list[ChoiceResult],
    ) -> dict[str, Any]:
        choices = []
        for state, result in zip(run.choices, results, strict=True):
            message: dict[str, Any] = {
                "role": "assistant",
                "content": result.content,
                "refusal": None,
            }
            finish_reason = result.finish_reason
            if result.tool_calls and body.legacy_functions:
                message["function_call"] = result.tool_calls[0]["function"]
                finish_reason = "function_call"
            elif result.tool_calls:
                message["tool_calls"] = result.tool_calls
            logprobs = None
            if body.logprobs:
                logprobs = chat_logprobs(
                    self._pieces,
                    state.token_ids,
                    state.logprobs,
                    state.top_logprobs,
                    body.top_logprobs or 0,
                ).model_dump()
            choices.append(
                {
                    "index": state.index,
                    "message": message,
                    "logprobs": logprobs,
                    "finish_reason": finish_reason,
                    "clora": choice_extension(state.token_ids, state.versions),
                }
            )
        payload = {
            "id": completion_id,
            "object": "chat.completion",
            "created": int(run.created_at),
            "model": body.model,
            "choices": choices,
            "usage": self._usage(prompt, run),
            "clora": self._extension(route, prompt),
        }
        return ChatCompletion.model_validate(payload).model_dump(mode="json", exclude_unset=True)

    # -- streaming ------------------------------------------------------------------

    def _chunk(
        self,
        body: ChatCompletionRequest,
        run: GenerationRun,
        completion_id: str,
        choices: list[dict[str, Any]],
        **extra: Any,
    ) -> str:
        payload: dict[str, Any] = {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": int(run.created_at),
            "model": body.model,
            "choices": choices,
            **extra,
        }
        if include_usage(body) and "usage" not in payload:
            payload["usage"] = None
        chunk = ChatCompletionChunk.model_validate(payload)
        return sse_event(chunk.model_dump(mode="json", exclude_unset=True))

    async def _stream(
        self,
        body: ChatCompletionRequest,
        principal: Principal,
        route: Route,
        prompt: ChatPrompt,
        run: GenerationRun,
        completion_id: str,
    ) -> AsyncIterator[str]:
        try:
            # With tools the reply may turn out to be calls only, whose content is null:
            # content then starts with its first delta (OpenAI's first chunk is the same).
            opening: dict[str, Any] = {"role": "assistant"}
            if not prompt.parse_tools:
                opening["content"] = ""
            first = [
                {
                    "index": c.index,
                    "delta": dict(opening),
                    "logprobs": None,
                    "finish_reason": None,
                }
                for c in run.choices
            ]
            yield self._chunk(body, run, completion_id, first, clora=self._extension(route, prompt))
            streamer = _ChoiceStreamer(self._pieces, body, prompt, run)
            async for choice, out in run.events():
                for delta in streamer.deltas(choice, out):
                    yield self._chunk(body, run, completion_id, [delta])
            results = [streamer.result(c) for c in run.choices]
            await self._record(body, principal, route, prompt, run, completion_id, results)
            if include_usage(body):
                yield self._chunk(body, run, completion_id, [], usage=self._usage(prompt, run))
            yield DONE
        except CloraError as exc:
            yield sse_event(error_event(exc))
            yield DONE
        except Exception:
            log.exception("chat stream %s failed", completion_id)
            yield sse_event(error_event(EngineError("the stream failed; see the server log")))
            yield DONE
        finally:
            run.abort()


class _ChoiceStreamer:
    """Turns engine chunks into OpenAI chunk choices (content or tool-call deltas) and
    remembers what each choice streamed, so the trajectory records what the client saw
    (including the tool-call ids it will refer to)."""

    def __init__(
        self,
        pieces: TokenPieces,
        body: ChatCompletionRequest,
        prompt: ChatPrompt,
        run: GenerationRun,
    ):
        self._pieces = pieces
        self._body = body
        self._prompt = prompt
        self._parsers: dict[int, ToolCallStreamParser] = {}
        self._content: dict[int, list[str]] = {c.index: [] for c in run.choices}
        self._calls: dict[int, list[dict[str, Any]]] = {c.index: [] for c in run.choices}
        if prompt.parse_tools:
            for choice in run.choices:
                parser = ToolCallStreamParser()
                if prompt.forced_prefix:
                    parser.feed(prompt.forced_prefix)  # emits nothing: it can only open a call
                self._parsers[choice.index] = parser

    def deltas(self, choice: ChoiceState, out: RequestOutput) -> list[dict[str, Any]]:
        """Chunk choices for one engine chunk of `choice`.

        The finish comes in a chunk of its own with an empty delta, after the last
        content or tool-call delta, as OpenAI sends it: the SDK's stream helpers
        close a tool call's arguments (`tool_calls.function.arguments.done`) only
        when a later chunk finishes the choice.
        """
        delta: dict[str, Any] = {}
        parser = self._parsers.get(choice.index)
        if parser is None:
            if out.text:
                delta["content"] = out.text
                self._content[choice.index].append(out.text)
        else:
            events = parser.feed(out.text) if out.text else []
            if out.finished:
                tail = closing_suffix(self._prompt, choice)
                events += (parser.feed(tail) if tail else []) + parser.finish()
            self._apply_events(choice.index, events, delta)
        entries: list[dict[str, Any]] = []
        if delta or out.tokens:
            entries.append(self._entry(choice, out, delta))
        if out.finished:
            finish = {
                "index": choice.index,
                "delta": {},
                "logprobs": None,
                "finish_reason": self._finish_reason(choice),
                "clora": choice_extension([], []),
            }
            entries.append(finish)
        return entries

    def _entry(
        self, choice: ChoiceState, out: RequestOutput, delta: dict[str, Any]
    ) -> dict[str, Any]:
        start = len(choice.token_ids) - len(out.tokens)
        entry: dict[str, Any] = {
            "index": choice.index,
            "delta": delta,
            "logprobs": None,
            "finish_reason": None,
            "clora": choice_extension(choice.token_ids[start:], choice.versions[start:]),
        }
        if self._body.logprobs and out.tokens:
            entry["logprobs"] = chat_logprobs(
                self._pieces,
                choice.token_ids[start:],
                choice.logprobs[start:],
                choice.top_logprobs[start:],
                self._body.top_logprobs or 0,
            ).model_dump()
        return entry

    def _finish_reason(self, choice: ChoiceState) -> str:
        reason = self.result(choice).finish_reason
        legacy = reason == "tool_calls" and self._body.legacy_functions
        return "function_call" if legacy else reason

    def result(self, choice: ChoiceState) -> ChoiceResult:
        """What the client received for `choice` (valid once it finished)."""
        content = "".join(self._content[choice.index])
        calls = self._calls[choice.index]
        if calls:
            return ChoiceResult(content or None, calls, "tool_calls")
        return ChoiceResult(content, None, choice.finish_reason or "stop")

    def _apply_events(self, index: int, events: list[StreamEvent], delta: dict[str, Any]) -> None:
        content = "".join(e.text for e in events if isinstance(e, ContentDelta))
        if content:
            delta["content"] = content
            self._content[index].append(content)
        calls = [
            _tool_call_json(e.id, e.name, e.arguments)
            for e in events
            if isinstance(e, ToolCallEvent)
        ]
        first = len(self._calls[index])
        if not self._prompt.parallel:
            calls = calls[: max(0, 1 - first)]  # as `_finish_choice`: the first call counts
        if calls and self._body.legacy_functions:
            self._calls[index].extend(calls)
            delta["function_call"] = calls[0]["function"]
        elif calls:
            self._calls[index].extend(calls)
            delta["tool_calls"] = [{"index": first + k, **call} for k, call in enumerate(calls)]
