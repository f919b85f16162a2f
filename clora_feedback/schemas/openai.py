"""Wire models of the OpenAI-compatible endpoints: requests in, extension fields out.

Requests (`ChatCompletionRequest`, `CompletionRequest`, `LoadLoRAAdapterRequest`,
`UnloadLoRAAdapterRequest`) are pydantic models in strict mode, so a wrong type
is a 400 naming the parameter instead of a silent coercion. Fields follow the
order of the OpenAI API reference. Unknown fields are ignored (as vLLM does) so
that SDKs and frameworks sending newer parameters keep working; parameters we
know but cannot honour (penalties, logit bias, `echo`) are accepted only at
their no-op values and otherwise refused by name. `response_format` follows
OpenAI's shapes (text, json_object, json_schema) and cannot be combined with a
forced tool call.

Responses reuse the `openai` package's own types (`ChatCompletion`,
`ChatCompletionChunk`, `Completion`, `Model`); they allow extra fields, which is
how the gateway adds its extension. Every extension lives under one key,
`clora`, documented by `CloraResponseExtension` (top level) and
`CloraChoiceExtension` (per choice). The official client ignores unknown fields
and exposes them through `model_extra`, e.g. `completion.model_extra["clora"]`.

Not here: turning requests into engine work (see `chat` and `completions`).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, model_validator

from clora_feedback.errors import InvalidRequestError

MAX_N = 16
"""Most choices per request: each choice is one engine sequence."""
MAX_STOP = 16
"""Most stop strings per request (OpenAI allows 4; agent frameworks sometimes send more)."""
MAX_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5
_AGENT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]*$")


class _Wire(BaseModel):
    """Strict types, unknown fields ignored."""

    model_config = ConfigDict(strict=True, extra="ignore")


# ---------------------------------------------------------------- messages


class TextContentPart(_Wire):
    """`{"type": "text", "text": ...}`; the only content part this text-only gateway accepts."""

    type: Literal["text"]
    text: str


def _text_only(value: Any) -> Any:
    """Refuse non-text content parts by name before pydantic tries (and fails) to read them."""
    if isinstance(value, list):
        for part in value:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind is not None and kind != "text":
                raise ValueError(
                    f"content part type {kind!r} is not supported; this gateway serves text only"
                )
    return value


Content = Annotated[str | list[TextContentPart], BeforeValidator(_text_only)]


class SystemMessage(_Wire):
    """A system (or, in newer SDKs, developer) instruction."""

    role: Literal["system", "developer"]
    content: Content
    name: str | None = None


class UserMessage(_Wire):
    role: Literal["user"]
    content: Content
    name: str | None = None


class ToolCallFunction(_Wire):
    name: str
    arguments: str = Field(
        description="JSON-encoded arguments, exactly as the model produced them."
    )


class ToolCall(_Wire):
    """A tool call made by an earlier assistant turn."""

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class AssistantMessage(_Wire):
    role: Literal["assistant"]
    content: Content | None = None
    name: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None


class ToolMessage(_Wire):
    """The result of a tool call, answering `tool_call_id`."""

    role: Literal["tool"]
    content: Content
    tool_call_id: str


ChatMessage = Annotated[
    SystemMessage | UserMessage | AssistantMessage | ToolMessage, Discriminator("role")
]


def content_text(content: Content | None) -> str | None:
    """Flatten a content field (string or list of text parts) to one string."""
    if content is None or isinstance(content, str):
        return content
    return "".join(part.text for part in content)


# ---------------------------------------------------------------- tools


class FunctionDefinition(_Wire):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(
        None, description="JSON Schema of the arguments object."
    )
    strict: bool | None = None


class ChatTool(_Wire):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Wire):
    name: str


class NamedToolChoice(_Wire):
    """`{"type": "function", "function": {"name": ...}}`: force a call of this tool."""

    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class StreamOptions(_Wire):
    include_usage: bool | None = None


class JSONSchemaFormat(_Wire):
    """`response_format.json_schema`: the schema a reply follows.

    The fields of the `openai` package's `ResponseFormatJSONSchema.json_schema`
    (a test keeps them equal), retyped strictly so a wrong type is a 400.

    The embedded engine enforces the subset of JSON Schema that
    `clora_feedback.chat_format.schema` lists, whether or not `strict` is set;
    keywords outside it are accepted and not enforced.
    """

    model_config = ConfigDict(strict=True, extra="ignore", serialize_by_alias=True)

    description: str | None = None
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    schema_: dict[str, Any] | None = Field(
        None, alias="schema", description="JSON Schema of the reply; absent: any JSON object."
    )
    strict: bool | None = None


class ResponseFormat(_Wire):
    """`response_format`, OpenAI's three shapes folded into one model so errors name fields:
    `{"type": "text"}` (no constraint), `{"type": "json_object"}` (one JSON object) and
    `{"type": "json_schema", "json_schema": {...}}` (one object following the schema)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _check_shape(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise InvalidRequestError(
                "response_format of type 'json_schema' needs a 'json_schema' object",
                param="response_format.json_schema",
            )
        return self

    @property
    def constrains(self) -> bool:
        """The reply must be JSON ("json_object" or "json_schema")."""
        return self.type != "text"

    @property
    def reply_schema(self) -> dict[str, Any] | None:
        """The schema the reply follows; None for any JSON object (or for "text")."""
        if self.type != "json_schema" or self.json_schema is None:
            return None
        return self.json_schema.schema_


# ---------------------------------------------------------------- requests


def _check_sampling(request: ChatCompletionRequest | CompletionRequest) -> None:
    """Checks shared by both completion endpoints that pydantic's field rules cannot express."""
    for name in ("frequency_penalty", "presence_penalty"):
        if getattr(request, name):
            raise InvalidRequestError(
                f"{name} is not supported by this engine; omit it or send 0", param=name
            )
    if request.logit_bias:
        raise InvalidRequestError("logit_bias is not supported by this engine", param="logit_bias")
    if request.stream_options is not None and not request.stream:
        raise InvalidRequestError(
            "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
            param="stream_options",
        )
    stops = stop_list(request.stop)
    if len(stops) > MAX_STOP:
        raise InvalidRequestError(f"at most {MAX_STOP} stop sequences are allowed", param="stop")
    if any(s == "" for s in stops):
        raise InvalidRequestError("stop sequences must be non-empty strings", param="stop")


def stop_list(stop: str | list[str] | None) -> tuple[str, ...]:
    """The `stop` parameter as a tuple (it may be one string, a list or absent)."""
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


def include_usage(request: ChatCompletionRequest | CompletionRequest) -> bool:
    """Whether a stream should end with a usage-only chunk (`stream_options.include_usage`)."""
    return bool(request.stream and request.stream_options and request.stream_options.include_usage)


class ChatCompletionRequest(_Wire):
    """`POST /v1/chat/completions`. `model` is an agent name or the base model's name."""

    model: str = Field(min_length=1)
    messages: list[ChatMessage] = Field(min_length=1)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    n: int | None = Field(1, ge=1, le=MAX_N)
    parallel_tool_calls: bool | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    response_format: ResponseFormat | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(1.0, ge=0.0, le=2.0)
    top_p: float | None = Field(1.0, gt=0.0, le=1.0)
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None
    user: str | None = None

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        _check_sampling(self)
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequestError(
                "logprobs must be set to true if top_logprobs is used", param="top_logprobs"
            )
        self._check_tools()
        fmt = self.response_format
        if (
            fmt is not None
            and fmt.constrains
            and self.effective_tool_choice not in ("none", "auto")
        ):
            raise InvalidRequestError(
                f"response_format {fmt.type!r} cannot be combined with a forced "
                "tool_choice: the reply is either the forced call or a JSON object; drop one",
                param="response_format",
            )
        return self

    def _check_tools(self) -> None:
        names = [t.function.name for t in self.tools or ()]
        if len(names) != len(set(names)):
            raise InvalidRequestError("tool names must be unique", param="tools")
        choice = self.tool_choice
        if choice is None or choice == "none" or choice == "auto":
            return
        if not names:
            raise InvalidRequestError(
                "tool_choice requires a non-empty tools list when it is 'required' or names a function",
                param="tool_choice",
            )
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise InvalidRequestError(
                f"tool_choice names function {choice.function.name!r}, which is not in tools",
                param="tool_choice",
            )

    @property
    def max_tokens_param(self) -> tuple[str, int | None]:
        """The effective completion budget and the parameter it came from."""
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens

    @property
    def constrains_reply(self) -> bool:
        """`response_format` asks for JSON, so the reply is constrained content."""
        return self.response_format is not None and self.response_format.constrains

    @property
    def effective_tool_choice(self) -> ToolChoice:
        """OpenAI's default: "auto" when tools are given, "none" otherwise."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"


class CompletionRequest(_Wire):
    """`POST /v1/completions` (legacy text completion) for one prompt.

    `prompt` is a string or a list of token ids; a one-element list of either is
    accepted too. Several prompts in one request are refused: send one request
    per prompt, so each gets its own completion id and trajectory.
    """

    model: str = Field(min_length=1)
    prompt: str | list[int] | list[str] | list[list[int]]
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    echo: bool | None = False
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    max_tokens: int | None = Field(16, ge=1)
    n: int | None = Field(1, ge=1, le=MAX_N)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    suffix: str | None = None
    temperature: float | None = Field(1.0, ge=0.0, le=2.0)
    top_p: float | None = Field(1.0, gt=0.0, le=1.0)
    user: str | None = None

    @model_validator(mode="after")
    def _check_completion(self) -> CompletionRequest:
        _check_sampling(self)
        if self.echo:
            raise InvalidRequestError("echo is not supported", param="echo")
        if self.suffix:
            raise InvalidRequestError("suffix is not supported", param="suffix")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise InvalidRequestError("best_of other than n is not supported", param="best_of")
        prompt = self.prompt
        if (
            isinstance(prompt, list)
            and prompt
            and not isinstance(prompt[0], int)
            and len(prompt) != 1
        ):
            raise InvalidRequestError(
                "one prompt per request: send each prompt of a batch as its own request",
                param="prompt",
            )
        if self.prompt_text is None and not self.prompt_token_ids:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        if self.prompt_text == "":
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        return self

    @property
    def prompt_text(self) -> str | None:
        """The prompt when given as text, else None."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return prompt
        if prompt and isinstance(prompt[0], str):
            return prompt[0]
        return None

    @property
    def prompt_token_ids(self) -> list[int]:
        """The prompt when given as token ids, else an empty list."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt:
            first = prompt[0]
            if isinstance(first, int):
                return [int(t) for t in prompt if isinstance(t, int)]
            if isinstance(first, list):
                return list(first)
        return []


class LoadLoRAAdapterRequest(_Wire):
    """`POST /v1/load_lora_adapter`, vLLM's JSON. `load_inplace` replaces a loaded
    adapter with a new version instead of refusing (vLLM >= 0.10)."""

    lora_name: str | None = None
    lora_path: str | None = None
    load_inplace: bool = False

    @model_validator(mode="after")
    def _check(self) -> LoadLoRAAdapterRequest:
        if not self.lora_name or not self.lora_path:
            raise InvalidRequestError(
                "Both 'lora_name' and 'lora_path' must be provided.", param="lora_name"
            )
        check_agent_name(self.lora_name, param="lora_name")
        return self


class UnloadLoRAAdapterRequest(_Wire):
    """`POST /v1/unload_lora_adapter`, vLLM's JSON (`lora_int_id` is accepted and ignored)."""

    lora_name: str | None = None
    lora_int_id: int | None = None

    @model_validator(mode="after")
    def _check(self) -> UnloadLoRAAdapterRequest:
        if not self.lora_name:
            raise InvalidRequestError(
                "'lora_name' needs to be provided to unload a LoRA adapter.", param="lora_name"
            )
        return self


def check_agent_name(name: str, *, param: str) -> None:
    """Agent names share `AgentConfig.name`'s rules: 1-128 chars, `[A-Za-z0-9._:-]`."""
    if not (1 <= len(name) <= 128) or _AGENT_NAME.match(name) is None:
        raise InvalidRequestError(
            f"invalid agent name {name!r}: use 1-128 characters from A-Z a-z 0-9 . _ : -",
            param=param,
        )


# ---------------------------------------------------------------- extensions


class CloraResponseExtension(BaseModel):
    """The `clora` object at the top level of every completion response and chunk.

    Attributes:
        agent: the agent that served the request; null when the base model did
            (the base model's name was requested, or the agent has no adapter).
        adapter_version: the agent's adapter version when the request was admitted
            (0 = base model). Individual tokens may report a newer version after a
            hot swap; see `CloraChoiceExtension.token_versions`.
        prompt_token_ids: the exact engine token ids of the prompt, including any
            chat template and forced tool-call prefix. Present on non-streamed
            responses and on the first chunk of a stream.
        version_attribution: "request" when the serving engine attributes one
            adapter version per request (its `token_versions` then repeat the
            version the request was admitted under); absent when every token's
            version is exact.
    """

    agent: str | None
    adapter_version: int
    prompt_token_ids: list[int] | None = None
    version_attribution: Literal["request"] | None = None

    def wire(self) -> dict[str, Any]:
        """JSON form: `agent` always present (null for the base model), the optional fields
        only when set."""
        unset = {k for k in ("prompt_token_ids", "version_attribution") if getattr(self, k) is None}
        return self.model_dump(exclude=unset or None)


class CloraChoiceExtension(BaseModel):
    """The `clora` object on every choice (and on every streamed choice delta).

    Attributes:
        token_ids: engine token ids generated for this choice (in a stream: for
            this delta). The ids are the training ground truth; re-tokenising the
            text may give different ids.
        token_versions: the adapter version that produced each token, same length
            as `token_ids`.
    """

    token_ids: list[int]
    token_versions: list[int]
