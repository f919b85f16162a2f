"""Wire models of the OpenAI-compatible endpoints: requests in, extension fields out.

Requests (`ChatCompletionRequest`, `CompletionRequest`, `LoadLoRAAdapterRequest`,
`UnloadLoRAAdapterRequest`) are pydantic models in strict mode, so a wrong type
is a 400 naming the parameter instead of a silent coercion. Fields follow the
order of the OpenAI API reference. Unknown fields are ignored (as vLLM does) so
that SDKs and frameworks sending newer parameters keep working; parameters we
know but cannot honour (`echo`, `suffix`) are accepted only at their no-op
values and otherwise refused by name. Sampling controls: OpenAI's penalties and
`logit_bias`, and vLLM's extensions `top_k`, `min_tokens` and `ignore_eos`
(grouped at the end of each request model). `response_format` follows
OpenAI's shapes (text, json_object, json_schema) and cannot be combined with a
forced tool call; vLLM's `guided_json` is the same as a json_schema format.
`metadata` follows OpenAI's limits (16 pairs, keys <= 64, values <= 512
characters) and is stored with the trajectory. Legacy `functions` /
`function_call` are mapped onto `tools` / `tool_choice` (one call at most, and
the reply carries `function_call`); `store` is accepted either way (the gateway
records every completion: that is what it is for); `service_tier` only as
"auto" or "default"; `prompt_cache_key` and `safety_identifier` are hints
without effect here; `prediction`, `reasoning_effort`, `verbosity`, `audio`,
`web_search_options` and any `modalities` but text are refused by name
(`unsupported_parameter`), as OpenAI answers for a model without them: nothing
documented that changes the answer is accepted and ignored.

Responses reuse the `openai` package's own types (`ChatCompletion`,
`ChatCompletionChunk`, `Completion`, `Model`); they allow extra fields, which is
how the gateway adds its extension. Every extension lives under one key,
`clora`, documented by `CloraResponseExtension` (top level) and
`CloraChoiceExtension` (per choice). The official client ignores unknown fields
and exposes them through `model_extra`, e.g. `completion.model_extra["clora"]`.

Not here: turning requests into engine work (see `chat` and `completions`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, model_validator

from clora_feedback.errors import InvalidRequestError
from clora_feedback.schemas.strict_schema import check_strict_schema

MAX_N = 16
"""Most choices per request: each choice is one engine sequence."""
MAX_STOP = 16
"""Most stop strings per request (OpenAI allows 4; agent frameworks sometimes send more)."""
MAX_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5
MAX_PROMPTS = 64
"""Most prompts in one text-completion request (each is n engine sequences)."""
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
    keywords outside it are accepted and not enforced. With `strict: true` every
    object must be closed (`additionalProperties: false`), as OpenAI requires: a
    400 naming `response_format` otherwise (`schemas.strict_schema`).
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
        spec = self.json_schema
        if self.type == "json_schema" and spec is not None and spec.strict:
            check_strict_schema(spec.schema_, name=spec.name, param="response_format")
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


SEED_MIN = -(2**63)
SEED_MAX = 2**64 - 1
"""`seed` takes a signed or an unsigned 64-bit value (see `engine.types.choice_seed`)."""
MAX_LOGIT_BIAS = 300
"""Most `logit_bias` entries (OpenAI's limit)."""
_TOKEN_ID_KEY = re.compile(r"^(0|[1-9][0-9]{0,9})$")


def _check_logit_bias(bias: dict[str, float] | None) -> None:
    """OpenAI's rules: token ids (decimal strings) -> a bias in [-100, 100], at most 300.
    Ids beyond the model's vocabulary are refused by the engine (`SamplingParams.check`)."""
    if not bias:
        return
    if len(bias) > MAX_LOGIT_BIAS:
        raise InvalidRequestError(
            f"logit_bias may have at most {MAX_LOGIT_BIAS} entries, got {len(bias)}",
            param="logit_bias",
        )
    for key, value in bias.items():
        if _TOKEN_ID_KEY.match(key) is None:
            raise InvalidRequestError(
                f"logit_bias keys must be token ids written as decimal integers, got {key[:40]!r}",
                param="logit_bias",
            )
        if not -100.0 <= value <= 100.0:
            raise InvalidRequestError(
                f"logit_bias values must be in [-100, 100], got {value} for token {key}",
                param="logit_bias",
            )


def logit_bias_pairs(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """`logit_bias` as (token id, bias) pairs in token order (checked by the request model)."""
    return tuple(sorted((int(k), float(v)) for k, v in (bias or {}).items()))


def _check_sampling(request: ChatCompletionRequest | CompletionRequest) -> None:
    """Checks shared by both completion endpoints that pydantic's field rules cannot express."""
    _check_logit_bias(request.logit_bias)
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


MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512


def _check_metadata(metadata: dict[str, str] | None) -> None:
    """OpenAI's rules for `metadata`: at most 16 pairs, keys <= 64 and values <= 512 chars."""
    if metadata is None:
        return
    if len(metadata) > MAX_METADATA_PAIRS:
        raise InvalidRequestError(
            f"metadata may have at most {MAX_METADATA_PAIRS} pairs, got {len(metadata)}",
            param="metadata",
        )
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY:
            raise InvalidRequestError(
                f"metadata keys may be at most {MAX_METADATA_KEY} characters, got {key[:80]!r}",
                param="metadata",
            )
        if len(value) > MAX_METADATA_VALUE:
            raise InvalidRequestError(
                f"metadata values may be at most {MAX_METADATA_VALUE} characters "
                f"(key {key!r} has {len(value)})",
                param=f"metadata.{key}",
            )


def _guided_schema(guided: dict[str, Any] | str) -> dict[str, Any]:
    """vLLM's `guided_json` (a schema, or a string of one) as a schema."""
    if isinstance(guided, dict):
        return guided
    try:
        schema = json.loads(guided)
    except ValueError:
        schema = None
    if not isinstance(schema, dict):
        raise InvalidRequestError(
            "guided_json must be a JSON Schema object (or a string holding one)",
            param="guided_json",
        )
    return schema


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
    metadata: dict[str, str] | None = Field(
        None,
        description="Up to 16 string pairs stored with the trajectory; "
        "`conversation_id` is what feedback may name.",
    )
    n: int | None = Field(1, ge=1, le=MAX_N)
    parallel_tool_calls: bool | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    response_format: ResponseFormat | None = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(1.0, ge=0.0, le=2.0)
    top_p: float | None = Field(1.0, gt=0.0, le=1.0)
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None
    user: str | None = None
    # Legacy and accepted-only fields (see `_check_accepted`), and vLLM's `guided_json`.
    functions: list[FunctionDefinition] | None = Field(
        None, description="Deprecated: mapped to `tools`, one call at most."
    )
    function_call: Literal["none", "auto"] | NamedFunction | None = Field(
        None, description="Deprecated: mapped to `tool_choice`."
    )
    prediction: dict[str, Any] | None = Field(None, description="Not supported: refused.")
    service_tier: str | None = Field(None, description='"auto" or "default"; others refused.')
    store: bool | None = Field(
        None, description="Accepted either way: the gateway records every completion."
    )
    modalities: list[str] | None = Field(None, description='Only ["text"]; audio is refused.')
    audio: dict[str, Any] | None = Field(None, description="Audio output: refused.")
    reasoning_effort: str | None = Field(
        None, description="Not a reasoning model: any value is refused."
    )
    verbosity: str | None = Field(None, description="Not supported by this model: refused.")
    web_search_options: dict[str, Any] | None = Field(
        None, description="No built-in web search: refused."
    )
    prompt_cache_key: str | None = Field(
        None, description="Accepted without effect: a hint for OpenAI's own prompt cache."
    )
    safety_identifier: str | None = Field(
        None, description="Accepted without effect: an end-user id for OpenAI's abuse checks."
    )
    guided_json: dict[str, Any] | str | None = Field(
        None, description="vLLM's extension: the same as a json_schema response_format."
    )
    # vLLM's sampling extensions (the OpenAI SDK sends them through `extra_body`).
    top_k: int | None = Field(
        None, ge=-1, description="Keep only the k most likely tokens; 0 or -1: off (vLLM)."
    )
    min_tokens: int | None = Field(
        None, ge=0, description="EOS and stop token ids are blocked until this many tokens (vLLM)."
    )
    ignore_eos: bool | None = Field(
        None, description="Keep generating past EOS, up to max_tokens (vLLM)."
    )

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        _check_sampling(self)
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequestError(
                "logprobs must be set to true if top_logprobs is used", param="top_logprobs"
            )
        _check_metadata(self.metadata)
        self._check_accepted()
        self._map_functions()
        self._check_tools()
        self._check_reply_format()
        return self

    def _check_accepted(self) -> None:
        """Fields OpenAI documents that this gateway accepts only at some values: what it
        cannot honour is refused by name, as OpenAI refuses it for a model without it."""
        if self.prediction is not None:
            raise InvalidRequestError(
                "prediction (predicted outputs) is not supported; omit it", param="prediction"
            )
        if self.service_tier not in (None, "auto", "default"):
            raise InvalidRequestError(
                f"service_tier {self.service_tier!r} is not offered; send 'auto' or 'default'",
                param="service_tier",
            )
        unsupported = {
            "reasoning_effort": self.reasoning_effort is not None,
            "modalities": any(m != "text" for m in self.modalities or ()),
            "audio": self.audio is not None,
            "verbosity": self.verbosity is not None,
            "web_search_options": self.web_search_options is not None,
        }
        for param, is_set in unsupported.items():
            if is_set:
                raise InvalidRequestError(
                    f"Unsupported parameter: '{param}' is not supported with this model "
                    "(it serves text only, without reasoning or built-in tools); omit it.",
                    param=param,
                    code="unsupported_parameter",
                )

    def _map_functions(self) -> None:
        """Legacy `functions` / `function_call` become `tools` / `tool_choice` (one call at most:
        the legacy reply has room for one `function_call`)."""
        if self.functions is None:
            if self.function_call is not None:
                raise InvalidRequestError("function_call requires functions", param="function_call")
            return
        if self.tools is not None or self.tool_choice is not None:
            raise InvalidRequestError(
                "send either functions/function_call (deprecated) or tools/tool_choice, not both",
                param="functions",
            )
        if not self.functions:
            raise InvalidRequestError("functions must not be empty", param="functions")
        self.tools = [ChatTool(type="function", function=f) for f in self.functions]
        call = self.function_call
        if isinstance(call, NamedFunction):
            self.tool_choice = NamedToolChoice(type="function", function=call)
        else:
            self.tool_choice = call
        self.parallel_tool_calls = False

    def _check_reply_format(self) -> None:
        fmt = self.response_format
        param = "response_format"
        if self.guided_json is not None:
            if fmt is not None and fmt.constrains:
                raise InvalidRequestError(
                    "send either guided_json or a JSON response_format, not both",
                    param="guided_json",
                )
            _guided_schema(self.guided_json)  # a string must hold a JSON object
            param = "guided_json"
        if self.constrains_reply and self.effective_tool_choice not in ("none", "auto"):
            kind = fmt.type if fmt is not None and fmt.constrains else "guided_json"
            raise InvalidRequestError(
                f"{kind!r} cannot be combined with a forced tool_choice: "
                "the reply is either the forced call or a JSON object; drop one",
                param=param,
            )

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
        """`response_format` (or `guided_json`) asks for JSON: the reply is constrained content."""
        if self.guided_json is not None:
            return True
        return self.response_format is not None and self.response_format.constrains

    @property
    def reply_schema(self) -> dict[str, Any] | None:
        """The schema a JSON reply follows (None: any object, or not a JSON reply)."""
        if self.guided_json is not None:
            return _guided_schema(self.guided_json)
        fmt = self.response_format
        return fmt.reply_schema if fmt is not None else None

    @property
    def reply_param(self) -> str:
        """The parameter that asked for a JSON reply, for errors about its schema."""
        return "guided_json" if self.guided_json is not None else "response_format"

    @property
    def legacy_functions(self) -> bool:
        """The request used `functions`: the reply carries `function_call`, not `tool_calls`."""
        return self.functions is not None

    @property
    def effective_tool_choice(self) -> ToolChoice:
        """OpenAI's default: "auto" when tools are given, "none" otherwise."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"


class CompletionRequest(_Wire):
    """`POST /v1/completions` (legacy text completion) for one prompt or several.

    `prompt` is a string, a list of token ids, or a list of either (at most
    `MAX_PROMPTS`), as OpenAI and vLLM accept it (LangChain's `OpenAI(...).batch`
    sends a list): the choices are indexed prompt by prompt, `n` each, and every
    prompt is recorded as its own trajectory (`capture.prompt_completion_id`).
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
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    suffix: str | None = None
    temperature: float | None = Field(1.0, ge=0.0, le=2.0)
    top_p: float | None = Field(1.0, gt=0.0, le=1.0)
    user: str | None = None
    # vLLM's sampling extensions (the OpenAI SDK sends them through `extra_body`).
    top_k: int | None = Field(
        None, ge=-1, description="Keep only the k most likely tokens; 0 or -1: off (vLLM)."
    )
    min_tokens: int | None = Field(
        None, ge=0, description="EOS and stop token ids are blocked until this many tokens (vLLM)."
    )
    ignore_eos: bool | None = Field(
        None, description="Keep generating past EOS, up to max_tokens (vLLM)."
    )

    @model_validator(mode="after")
    def _check_completion(self) -> CompletionRequest:
        _check_sampling(self)
        if self.echo:
            raise InvalidRequestError("echo is not supported", param="echo")
        if self.suffix:
            raise InvalidRequestError("suffix is not supported", param="suffix")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise InvalidRequestError("best_of other than n is not supported", param="best_of")
        prompts = self.prompts
        if not prompts:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        if len(prompts) > MAX_PROMPTS:
            raise InvalidRequestError(
                f"at most {MAX_PROMPTS} prompts per request, got {len(prompts)}", param="prompt"
            )
        for i, one in enumerate(prompts):
            if len(one) == 0:
                where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
                raise InvalidRequestError(f"{where} must not be empty", param=where)
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts, each a text or a list of token ids (one for a plain prompt)."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if prompt and isinstance(prompt[0], int):
            return [[t for t in prompt if isinstance(t, int)]]
        return [p for p in prompt if isinstance(p, str | list)]


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
    completion_id: str | None = None
    """The trajectory that records this choice, when it is not the response's `id`: a
    text completion of several prompts records one per prompt (`{id}-p{index}`), which
    feedback names. Absent otherwise."""


def choice_extension(
    token_ids: Sequence[int], token_versions: Sequence[int], completion_id: str | None = None
) -> dict[str, Any]:
    """`CloraChoiceExtension(...).model_dump(exclude_none=True)` for the engine's int lists, as
    a plain dict: it is built for every choice of every streamed chunk."""
    extension: dict[str, Any] = {
        "token_ids": list(token_ids),
        "token_versions": list(token_versions),
    }
    if completion_id is not None:
        extension["completion_id"] = completion_id
    return extension
