"""`POST /v1/chat/completions`: messages -> prompt ids -> engine -> OpenAI response or SSE.

Per request, `ChatHandler`:
1. routes `model` to an agent (404 unknown, 403 not this key's);
2. renders messages and tools (`tools.render_messages`), applies the model's
   chat template with the generation prompt, and for a forced `tool_choice`
   ("required" or a named function) appends `forced_call_prefix` and asks the
   engine for a `ToolCallSpec` (the functions' parameter schemas), which the
   engine compiles, so the call's arguments are always JSON that follows the
   declared parameters (stop strings are ignored for forced calls: they could
   cut it); an engine that cannot compile it answers 400, and so does a
   schema it cannot compile (before any engine work); a `response_format` of
   "json_object" or "json_schema" asks for a `JSONSchemaSpec` instead (the
   reply is one JSON object, as content; stop strings ignored likewise, tools
   not parsed); a reply cut by `max_tokens` is returned as cut, with "length";
   with `tool_choice` "auto" the spec is an "on_trigger" `ToolCallSpec`: text is
   free until the model opens a call, which then follows the declared tools'
   schemas (an engine that cannot compile that serves such calls unconstrained,
   and refuses `strict` tools with a 400); `parallel_tool_calls: false` allows
   one call (the prompt says so, the constraint stops after it, the parser keeps
   the first); rendering and tokenising run off the event loop (`offload`);
3. checks the context window and submits n sequences (`GenerationRun`); the
   request travels on as one frozen `ChatTurn`;
4. parses tool calls (`finish_reason` "tool_calls" when there are any; legacy
   `functions` requests get `message.function_call` and "function_call"); a
   call left open at the end (cut by `max_tokens` or a stop string) is closed
   by replaying the text through the calls' grammar, built only then (the
   engine compiles its own copy to constrain the tokens);
5. records the trajectory (the request's `metadata` with it), then answers:
   one JSON body, or SSE chunks (each choice's finish in a chunk of its own,
   after its last delta, as OpenAI sends it) ending with an optional usage
   chunk and `[DONE]` (the trajectory is committed first).

Streaming yields typed `ChoiceChunk`s (`chunks`), which the chat SSE writer
turns into `chat.completion.chunk` JSON and `/v1/responses` into its own
events, so neither re-parses the other's wire format.

Not here: HTTP routing (see `routes`), the wire models (see `schemas.openai`), the
prompt format and its grammar (see `clora_feedback.chat_format`), what every
completion handler shares (see `serving`).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from openai.types.chat import ChatCompletion
from starlette.requests import Request

from clora_feedback.chat_format.calls import (
    CALL_CLOSE,
    CALL_OPEN,
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
    triggered_grammar,
)
from clora_feedback.chat_format.tools import forced_call, forced_call_prefix, render_messages
from clora_feedback.engine.base import Engine
from clora_feedback.engine.types import GuidedDecoding, JSONSchemaSpec, RequestOutput, ToolCallSpec
from clora_feedback.errors import InvalidRequestError
from clora_feedback.gateway.agents import AgentRegistry, Route
from clora_feedback.gateway.auth import Principal
from clora_feedback.gateway.capture import build_record
from clora_feedback.gateway.generation import ChoiceState, GenerationRun, plan_sampling
from clora_feedback.gateway.logprobs import TokenPieces, chat_logprobs
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
    ChatCompletionRequest,
    ChatTool,
    choice_extension,
    include_usage,
    stop_list,
)
from clora_feedback.store.trajectories import AsyncTrajectoryStore


@dataclass(frozen=True)
class ChatPrompt:
    """A chat request turned into engine input.

    Attributes:
        token_ids: the prompt, including the chat template and any forced prefix.
        forced_prefix: text of a forced tool-call opening ("" when none is forced);
            part of the prompt, but parsed together with the generated text.
        parse_tools: tools are offered, so the output is parsed for calls.
        guided: the declarative spec for the engine to compile: the forced call's, the
            calls the model chooses, or the JSON reply's that `response_format` asks for.
        drops_stop: stop strings are ignored (a forced call or a JSON reply: they could
            cut it); calls the model chooses keep them.
        parallel: several calls may be returned; false keeps the first one only
            (`parallel_tool_calls: false`, legacy `functions`).
    """

    token_ids: list[int]
    forced_prefix: str
    parse_tools: bool
    guided: GuidedDecoding | None = None
    drops_stop: bool = False
    parallel: bool = True


@dataclass(frozen=True)
class ChatTurn:
    """One chat request on its way, built once by `open` and read by every step after.

    Attributes:
        completion_id: the response id (= the trajectory id).
        body: the request.
        principal: the caller.
        route: how `body.model` is served.
        prompt: the engine input and how to read its output.
        run: the engine work, n choices.
    """

    completion_id: str
    body: ChatCompletionRequest
    principal: Principal
    route: Route
    prompt: ChatPrompt
    run: GenerationRun


@dataclass(frozen=True)
class ChoiceResult:
    """What one finished choice answers with."""

    content: str | None
    tool_calls: list[dict[str, Any]] | None
    finish_reason: str


@dataclass(frozen=True)
class ChoiceChunk:
    """What one engine chunk of one choice adds to a streamed reply, typed for every writer.

    Attributes:
        index: the choice.
        content: text to append (None: none in this chunk).
        tool_calls: calls completed in this chunk (`{"id", "type", "function"}`), the
            first of them the choice's call number `first_call`.
        first_call: how many calls the choice had streamed before this chunk.
        token_ids: engine token ids of this chunk.
        token_versions: the adapter version of each.
        logprobs: the chunk's `logprobs` JSON when the request asked for them.
        finish_reason: set on a choice's last chunk (which carries nothing else), as
            the client sees it ("function_call" for legacy `functions`).
    """

    index: int
    content: str | None = None
    tool_calls: tuple[dict[str, Any], ...] = ()
    first_call: int = 0
    token_ids: tuple[int, ...] = ()
    token_versions: tuple[int, ...] = ()
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None


def closing_suffix(prompt: ChatPrompt, choice: ChoiceState) -> str:
    """Text that completes a call left open at the end of `choice` ("" when none is).

    A call is left open when `max_tokens` cut the choice, or when a stop string
    cut a call the model chose (`<tool_call>` without its `</tool_call>`; a
    forced call ignores stop strings and ends at its object's `}`). Only then is
    the calls' grammar built: the engine compiled its own copy to constrain the
    tokens, and it stays inside the engine.
    """
    spec = prompt.guided
    if not isinstance(spec, ToolCallSpec):
        return ""
    text = prompt.forced_prefix + choice.text
    cut_by_stop = spec.mode == "on_trigger" and text.rfind(CALL_OPEN) > text.rfind(CALL_CLOSE)
    if choice.finish_reason != "length" and not cut_by_stop:
        return ""
    grammar: Grammar = (
        call_grammar(spec.functions, spec.name)
        if spec.mode == "forced"
        else triggered_grammar(spec.functions, parallel=spec.parallel)
    )
    return completion_suffix(grammar, choice.text)


def _tool_call_json(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


class ChatHandler:
    """Serves chat completions for every agent on one engine."""

    def __init__(
        self, engine: Engine, agents: AgentRegistry, store: AsyncTrajectoryStore, metrics: Metrics
    ):
        self._serving = Serving(engine, agents, store, metrics)

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
        turn = await self.open(body, principal, size=size)
        if body.stream:
            name = f"chat stream {turn.completion_id}"
            return SSEResponse(
                openai_stream(self._sse(turn), name=name, on_exit=turn.run.abort),
                on_close=turn.run.abort,
            )
        return self.response(turn, await self.complete(turn, request))

    async def open(
        self, body: ChatCompletionRequest, principal: Principal, *, size: int | None = None
    ) -> ChatTurn:
        """Route, render and submit one request: its engine run is under way on return.

        Raises:
            CloraError: unknown model (404), a bad request or a constraint the engine
                cannot compile (400), the context window (400), a full queue (429).
        """
        serving = self._serving
        route = serving.route(body, principal)
        # Rendering and tokenising a big prompt takes a while: keep the event loop free.
        prompt = await off_loop(lambda: self._prepare(body), size=size)
        param, max_tokens = body.max_tokens_param
        sampling = plan_sampling(
            prompt_len=len(prompt.token_ids),
            max_model_len=serving.engine.max_model_len,
            max_tokens=max_tokens,
            max_tokens_param=param,
            prompt_param="messages",
            stop=() if prompt.drops_stop else stop_list(body.stop),
            logprobs=bool(body.logprobs),
            top_logprobs=body.top_logprobs or 0,
            controls=body,
        )
        route, completion_id, run = serving.start(
            route,
            id_prefix="chatcmpl",
            prompts=[prompt.token_ids],
            sampling=sampling,
            n=body.n or 1,
            guided=prompt.guided,
        )
        return ChatTurn(completion_id, body, principal, route, prompt, run)

    async def complete(self, turn: ChatTurn, request: Request) -> list[ChoiceResult]:
        """Generate every choice (cancelled if the client leaves), record, return the results."""
        choices = await run_unless_disconnected(request, turn.run.run())
        results = [self._finish_choice(turn.prompt, c) for c in choices]
        await self._record(turn, results)
        return results

    def extension(self, turn: ChatTurn) -> dict[str, Any]:
        """The response's top-level `clora` object."""
        return self._serving.capture.extension(turn.route, turn.prompt.token_ids)

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
        engine = self._serving.engine
        tokenizer = engine.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise InvalidRequestError(
                f"model {engine.model_name!r} has no chat template; use /v1/completions",
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
        engine.capabilities.check(spec)
        return ChatPrompt(ids, prefix, parse, spec, drops_stop=True, parallel=parallel)

    def _chosen_calls(self, ids: list[int], tools: list[ChatTool], parallel: bool) -> ChatPrompt:
        """`tool_choice` "auto": the calls the model opens follow their tools' schemas.

        An engine that cannot constrain calls the model chooses serves them
        unconstrained, unless a tool is `strict`: that promise it cannot keep is a 400.
        """
        functions = {t.function.name: t.function.parameters for t in tools}
        spec = ToolCallSpec(functions=functions, mode="on_trigger", parallel=parallel)
        capabilities = self._serving.engine.capabilities
        if not capabilities.supports(spec):
            if any(t.function.strict for t in tools):
                capabilities.check(spec)  # raises, naming `tools`
            return ChatPrompt(ids, "", True, parallel=parallel)
        return ChatPrompt(ids, "", True, spec, parallel=parallel)

    def _reply_spec(self, body: ChatCompletionRequest) -> JSONSchemaSpec | None:
        """The JSON reply `response_format` (or `guided_json`) asks for, checked against the
        engine; None for text."""
        if not body.constrains_reply:
            return None
        spec = JSONSchemaSpec(body.reply_schema)
        self._serving.engine.capabilities.check(spec)
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

    async def _record(self, turn: ChatTurn, results: list[ChoiceResult]) -> None:
        run = turn.run
        record = build_record(
            completion_id=turn.completion_id,
            kind="chat",
            route=turn.route,
            principal=turn.principal,
            request=turn.body.model_dump(mode="json", exclude_none=True),
            prompt_token_ids=turn.prompt.token_ids,
            run=run,
            outputs=[
                (c, c.text, r.finish_reason, r.tool_calls)
                for c, r in zip(run.choices, results, strict=True)
            ],
            capabilities=self._serving.engine.capabilities,
        )
        await self._serving.capture.commit(record, "chat")

    def response(self, turn: ChatTurn, results: list[ChoiceResult]) -> dict[str, Any]:
        """The `chat.completion` JSON of a finished turn."""
        body = turn.body
        choices = []
        for state, result in zip(turn.run.choices, results, strict=True):
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
                    self._serving.pieces,
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
            "id": turn.completion_id,
            "object": "chat.completion",
            "created": int(turn.run.created_at),
            "model": body.model,
            "choices": choices,
            "usage": turn.run.usage(),
            "clora": self.extension(turn),
        }
        return ChatCompletion.model_validate(payload).model_dump(mode="json", exclude_unset=True)

    # -- streaming ------------------------------------------------------------------

    async def chunks(self, turn: ChatTurn) -> AsyncGenerator[ChoiceChunk, None]:
        """The typed chunks of a streamed turn; the trajectory is committed after the last.

        Raises:
            CloraError: the engine failed or aborted a sequence.
        """
        streamer = _ChoiceStreamer(self._serving.pieces, turn)
        async with aclosing(turn.run.events()) as events:  # closed with us: pumps stop
            async for choice, out in events:
                for chunk in streamer.chunks(choice, out):
                    yield chunk
        await self._record(turn, [streamer.result(c) for c in turn.run.choices])

    async def _sse(self, turn: ChatTurn) -> AsyncGenerator[str, None]:
        """`chat.completion.chunk` events (`openai_stream` adds `[DONE]` and errors)."""
        # With tools the reply may turn out to be calls only, whose content is null:
        # content then starts with its first delta (OpenAI's first chunk is the same).
        opening: dict[str, Any] = {"role": "assistant"}
        if not turn.prompt.parse_tools:
            opening["content"] = ""
        first = [
            {"index": c.index, "delta": dict(opening), "logprobs": None, "finish_reason": None}
            for c in turn.run.choices
        ]
        yield self._event(turn, first, clora=self.extension(turn))
        legacy = turn.body.legacy_functions
        async with aclosing(self.chunks(turn)) as chunks:
            async for chunk in chunks:
                yield self._event(turn, [_chunk_choice(chunk, legacy)])
        if include_usage(turn.body):
            yield self._event(turn, [], usage=turn.run.usage())

    @staticmethod
    def _event(turn: ChatTurn, choices: list[dict[str, Any]], **extra: Any) -> str:
        """One `chat.completion.chunk` (built as OpenAI's `ChatCompletionChunk` reads it)."""
        payload: dict[str, Any] = {
            "id": turn.completion_id,
            "object": "chat.completion.chunk",
            "created": int(turn.run.created_at),
            "model": turn.body.model,
            "choices": choices,
            **extra,
        }
        if include_usage(turn.body) and "usage" not in payload:
            payload["usage"] = None
        return sse_event(payload)


def _chunk_choice(chunk: ChoiceChunk, legacy_functions: bool) -> dict[str, Any]:
    """A chunk as a `chat.completion.chunk` choice."""
    if chunk.finish_reason is not None:
        return {
            "index": chunk.index,
            "delta": {},
            "logprobs": None,
            "finish_reason": chunk.finish_reason,
            "clora": choice_extension([], []),
        }
    delta: dict[str, Any] = {}
    if chunk.content:
        delta["content"] = chunk.content
    if chunk.tool_calls and legacy_functions:
        delta["function_call"] = chunk.tool_calls[0]["function"]
    elif chunk.tool_calls:
        delta["tool_calls"] = [
            {"index": chunk.first_call + k, **call} for k, call in enumerate(chunk.tool_calls)
        ]
    return {
        "index": chunk.index,
        "delta": delta,
        "logprobs": chunk.logprobs,
        "finish_reason": None,
        "clora": choice_extension(chunk.token_ids, chunk.token_versions),
    }


class _ChoiceStreamer:
    """Turns engine chunks into `ChoiceChunk`s (content or tool calls) and remembers what
    each choice streamed, so the trajectory records what the client saw (including the
    tool-call ids it will refer to)."""

    def __init__(self, pieces: TokenPieces, turn: ChatTurn):
        self._pieces = pieces
        self._body = turn.body
        self._prompt = turn.prompt
        self._parsers: dict[int, ToolCallStreamParser] = {}
        self._content: dict[int, list[str]] = {c.index: [] for c in turn.run.choices}
        self._calls: dict[int, list[dict[str, Any]]] = {c.index: [] for c in turn.run.choices}
        if turn.prompt.parse_tools:
            for choice in turn.run.choices:
                parser = ToolCallStreamParser()
                if turn.prompt.forced_prefix:
                    parser.feed(turn.prompt.forced_prefix)  # emits nothing: it only opens a call
                self._parsers[choice.index] = parser

    def chunks(self, choice: ChoiceState, out: RequestOutput) -> list[ChoiceChunk]:
        """The chunks of one engine chunk of `choice`.

        The finish comes in a chunk of its own, after the last content or tool-call
        chunk, as OpenAI sends it: the SDK's stream helpers close a tool call's
        arguments (`tool_calls.function.arguments.done`) only when a later chunk
        finishes the choice.
        """
        parser = self._parsers.get(choice.index)
        if parser is None:
            content = out.text or None
            calls: list[dict[str, Any]] = []
            if content:
                self._content[choice.index].append(content)
        else:
            events = parser.feed(out.text) if out.text else []
            if out.finished:
                tail = closing_suffix(self._prompt, choice)
                events += (parser.feed(tail) if tail else []) + parser.finish()
            content, calls = self._apply_events(choice.index, events)
        first_call = len(self._calls[choice.index]) - len(calls)
        found: list[ChoiceChunk] = []
        if content or calls or out.tokens:
            found.append(self._chunk(choice, out, content, calls, first_call))
        if out.finished:
            found.append(ChoiceChunk(choice.index, finish_reason=self._finish_reason(choice)))
        return found

    def _chunk(
        self,
        choice: ChoiceState,
        out: RequestOutput,
        content: str | None,
        calls: list[dict[str, Any]],
        first_call: int,
    ) -> ChoiceChunk:
        start = len(choice.token_ids) - len(out.tokens)
        logprobs = None
        if self._body.logprobs and out.tokens:
            logprobs = chat_logprobs(
                self._pieces,
                choice.token_ids[start:],
                choice.logprobs[start:],
                choice.top_logprobs[start:],
                self._body.top_logprobs or 0,
            ).model_dump()
        return ChoiceChunk(
            choice.index,
            content=content,
            tool_calls=tuple(calls),
            first_call=first_call,
            token_ids=tuple(choice.token_ids[start:]),
            token_versions=tuple(choice.versions[start:]),
            logprobs=logprobs,
        )

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

    def _apply_events(
        self, index: int, events: list[StreamEvent]
    ) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, calls) that `events` add to choice `index`, remembered for its result."""
        content = "".join(e.text for e in events if isinstance(e, ContentDelta))
        if content:
            self._content[index].append(content)
        calls = [
            _tool_call_json(e.id, e.name, e.arguments)
            for e in events
            if isinstance(e, ToolCallEvent)
        ]
        if not self._prompt.parallel:
            calls = calls[: max(0, 1 - len(self._calls[index]))]  # the first call counts
        self._calls[index].extend(calls)
        return content or None, calls
