"""Wire models of the Responses API (`POST /v1/responses`): the request, and its chat form.

`ResponsesRequest` is the subset of OpenAI's `CreateResponse` this text-only
gateway serves, in strict mode like the chat models (a wrong type is a 400
naming the parameter; unknown fields are ignored):

- `input`: a string, or a list of items: messages (roles user, assistant,
  system, developer; content a string or `input_text` / `output_text` /
  `refusal` parts; `type: "message"` may be left out), `function_call` and
  `function_call_output` items, so an agent loop can send its history back;
- `instructions`, `previous_response_id`, `store`, `metadata`;
- `max_output_tokens`, `temperature`, `top_p`;
- function tools in the Responses' flat shape (`{"type": "function", "name",
  "parameters", "strict"}`), `tool_choice`, `parallel_tool_calls`;
- `text.format`: text, `json_object` or `json_schema` (structured output);
- `stream`.

Anything else that changes the answer is refused by name: other tool types
(web_search, file_search, computer, mcp, ...), other input item or content
types (images, files, reasoning, item references), `background`, `conversation`,
`prompt`, `reasoning`, `truncation: "auto"`, `include`, `top_logprobs`,
`context_management`. Hints without an effect here (`service_tier`,
`prompt_cache_key`, `safety_identifier`, `user`, `max_tool_calls`, which only
counts built-in tools) are accepted.

`ResponsesChatRequest` is the chat completion request a Responses request is
served as; it carries the Responses request (without `input`, whose items are
its `messages`) under `responses`, so the stored trajectory is enough to
rebuild the conversation for `previous_response_id` and to answer
`GET /v1/responses/{id}`.

The response body and stream events reuse the `openai` package's types
(`openai.types.responses`).

Not here: turning requests into engine work and events (see
`clora_feedback.gateway.responses`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    model_validator,
)

from clora_feedback.errors import InvalidRequestError
from clora_feedback.schemas.openai import ChatCompletionRequest
from clora_feedback.schemas.strict_schema import check_strict_schema

__all__ = [
    "FunctionCallItem",
    "FunctionCallOutputItem",
    "FunctionTool",
    "FunctionToolChoice",
    "MessageItem",
    "ResponsesChatRequest",
    "ResponsesRequest",
    "TextConfig",
    "TextFormat",
]

_TEXT_PARTS = frozenset({"input_text", "output_text", "refusal"})
_ITEM_TAGS = {
    "message": "Message",
    "function_call": "FunctionCall",
    "function_call_output": "FunctionCallOutput",
}


class _Wire(BaseModel):
    """Strict types, unknown fields ignored (ids, statuses, annotations sent back)."""

    model_config = ConfigDict(strict=True, extra="ignore")


# ---------------------------------------------------------------- input items


class InputText(_Wire):
    """`{"type": "input_text", "text": ...}` (a user, system or developer text)."""

    type: Literal["input_text"]
    text: str


class OutputText(_Wire):
    """`{"type": "output_text", "text": ...}`: an earlier assistant reply sent back."""

    type: Literal["output_text"]
    text: str


class Refusal(_Wire):
    """`{"type": "refusal", "refusal": ...}`: an earlier assistant refusal sent back."""

    type: Literal["refusal"]
    refusal: str


def _text_parts_only(value: Any) -> Any:
    """Refuse non-text parts (images, files, audio) by type before pydantic tries them."""
    if isinstance(value, list):
        for part in value:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind is not None and not isinstance(kind, str):
                raise ValueError(f"content part type must be a string, got {type(kind).__name__}")
            if kind is not None and kind not in _TEXT_PARTS:
                raise ValueError(
                    f"content part type {kind!r} is not supported; this gateway serves text only"
                )
    return value


ContentPart = Annotated[InputText | OutputText | Refusal, Discriminator("type")]
Content = Annotated[str | list[ContentPart], BeforeValidator(_text_parts_only)]


class MessageItem(_Wire):
    """A message in `input` (`EasyInputMessage` or `InputMessage`; `type` may be omitted)."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Content


class FunctionCallItem(_Wire):
    """An earlier function call of the model, sent back (`call_id` is what outputs answer)."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str = Field(description="JSON-encoded arguments, as the model produced them.")


class FunctionCallOutputItem(_Wire):
    """The result of the function call `call_id`."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[InputText]


def _item_tag(value: Any) -> str | None:
    # Tags are capitalised so that error locations skip them like type names
    # (`input[2].call_id`, not `input[2].function_call.call_id`).
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", None)
    return _ITEM_TAGS.get(kind) if isinstance(kind, str) else None


def _known_item(value: Any) -> Any:
    if isinstance(value, dict) and _item_tag(value) is None:
        kind = value.get("type")
        raise ValueError(
            f"input item type {kind!r} is not supported; send messages, function_call and "
            "function_call_output items"
        )
    return value


InputItem = Annotated[
    Annotated[MessageItem, Tag("Message")]
    | Annotated[FunctionCallItem, Tag("FunctionCall")]
    | Annotated[FunctionCallOutputItem, Tag("FunctionCallOutput")],
    Discriminator(_item_tag),
    BeforeValidator(_known_item),
]


def item_text(content: str | list[InputText] | list[ContentPart]) -> str:
    """A content field (string or text parts) as one string, parts joined by newlines."""
    if isinstance(content, str):
        return content
    return "\n".join(p.refusal if isinstance(p, Refusal) else p.text for p in content)


# ---------------------------------------------------------------- tools and text


def _function_tools_only(value: Any) -> Any:
    if isinstance(value, dict) and value.get("type", "function") != "function":
        raise ValueError(
            f"tool type {value.get('type')!r} is not supported; this gateway serves function "
            "tools only"
        )
    return value


class FunctionTool(_Wire):
    """A function tool in the Responses' flat shape."""

    type: Literal["function"] = "function"
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(
        None, description="JSON Schema of the arguments object."
    )
    strict: bool | None = None


class FunctionToolChoice(_Wire):
    """`{"type": "function", "name": ...}`: force a call of this tool."""

    type: Literal["function"]
    name: str


def _function_choice_only(value: Any) -> Any:
    if isinstance(value, dict) and value.get("type") != "function":
        raise ValueError(
            f"tool_choice of type {value.get('type')!r} is not supported; use 'none', 'auto', "
            "'required' or a function"
        )
    return value


ToolChoice = Annotated[
    Literal["none", "auto", "required"] | FunctionToolChoice, BeforeValidator(_function_choice_only)
]


class TextFormat(_Wire):
    """`text.format`: `{"type": "text"}`, `{"type": "json_object"}` or
    `{"type": "json_schema", "name", "schema", "description", "strict"}`."""

    model_config = ConfigDict(strict=True, extra="ignore", serialize_by_alias=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _check_shape(self) -> TextFormat:
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            raise InvalidRequestError(
                "text.format of type 'json_schema' needs a 'name' and a 'schema'",
                param="text.format",
            )
        if self.type == "json_schema" and self.strict:
            check_strict_schema(self.schema_, name=self.name or "", param="text.format")
        return self

    def chat_format(self) -> dict[str, Any]:
        """The chat completions' `response_format` that asks for the same reply."""
        if self.type != "json_schema":
            return {"type": self.type}
        inner: dict[str, Any] = {
            "name": self.name,
            "schema": self.schema_,
            "description": self.description,
        }
        if self.strict is not None:
            inner["strict"] = self.strict
        return {
            "type": "json_schema",
            "json_schema": {k: v for k, v in inner.items() if v is not None},
        }


class TextConfig(_Wire):
    """`text`: the reply's format; `verbosity` only at its default ("medium")."""

    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


# ---------------------------------------------------------------- the request


class ResponsesRequest(_Wire):
    """`POST /v1/responses`. `model` is an agent name or the base model's name."""

    model: str = Field(min_length=1)
    input: list[InputItem] | str  # list first: its errors are the ones to report
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    metadata: dict[str, str] | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = Field(None, min_length=1)
    store: bool | None = None
    stream: bool | None = False
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    text: TextConfig | None = None
    tool_choice: ToolChoice | None = None
    tools: list[Annotated[FunctionTool, BeforeValidator(_function_tools_only)]] | None = None
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    user: str | None = None
    # Accepted without effect: hints for OpenAI's own serving.
    max_tool_calls: int | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    service_tier: Literal["auto", "default"] | None = None
    # Known, refused unless at their no-op values.
    background: bool | None = None
    context_management: Any = None
    conversation: Any = None
    include: list[str] | None = None
    prompt: Any = None
    reasoning: dict[str, Any] | None = None
    top_logprobs: int | None = None
    truncation: Literal["auto", "disabled"] | None = None

    @model_validator(mode="after")
    def _check(self) -> ResponsesRequest:
        self._refuse_unsupported()
        if self.input == "" or self.input == []:
            raise InvalidRequestError("input must not be empty", param="input")
        return self

    def _refuse_unsupported(self) -> None:
        refused: list[tuple[str, bool]] = [
            ("background", bool(self.background)),
            ("context_management", self.context_management is not None),
            ("conversation", self.conversation is not None),
            ("include", bool(self.include)),
            ("prompt", self.prompt is not None),
            (
                "reasoning",
                any(v is not None for v in (self.reasoning or {}).values()),
            ),
            ("top_logprobs", bool(self.top_logprobs)),
            ("truncation", self.truncation == "auto"),
            (
                "text.verbosity",
                self.text is not None and self.text.verbosity not in (None, "medium"),
            ),
        ]
        for param, is_set in refused:
            if is_set:
                raise InvalidRequestError(
                    f"{param} is not supported by this gateway; omit it", param=param
                )

    @property
    def forced_call(self) -> bool:
        """`tool_choice` forces a call ("required" or a named function)."""
        return self.tool_choice not in (None, "none", "auto")

    @property
    def stored(self) -> bool:
        """`store` (OpenAI's default: true): whether `GET` and `previous_response_id` may
        name this response later."""
        return self.store is not False

    def origin(self) -> dict[str, Any]:
        """This request as JSON without `input` (kept with the trajectory)."""
        return self.model_dump(mode="json", exclude={"input"}, exclude_none=True)


class ResponsesChatRequest(ChatCompletionRequest):
    """The chat completion request a Responses request is served as.

    Attributes:
        responses: the Responses request as JSON without `input` (`ResponsesRequest.origin`):
            `messages` hold the whole conversation (a previous response's, then this
            input), preceded by one developer message when `instructions` is set;
            plus `input_offset`, the index in `messages` where this request's input
            begins (for `GET /v1/responses/{id}/input_items`).
    """

    responses: dict[str, Any]
