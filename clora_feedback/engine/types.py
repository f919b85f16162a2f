"""Value types shared by every engine and by its callers (the gateway, the trainer).

A request goes in as `GenerationRequest`; the engine streams `RequestOutput`
chunks back, each carrying the `TokenEvent`s produced in one decode step. Every
token knows the adapter version that produced it, so a trajectory can be
replayed against exactly the policy that generated it.

This module holds plain data only: no torch, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol

if TYPE_CHECKING:
    from clora_feedback.lora.weights import LoRAWeights

FinishReason = Literal["stop", "length", "abort"]

BASE_VERSION = 0
"""Adapter version reported for tokens generated with no adapter (the base model)."""


@dataclass(frozen=True)
class AdapterRef:
    """An immutable adapter version, as an engine is asked to serve it.

    Attributes:
        agent: the public agent name.
        version: the registry's version number (>= 1; never reused for the agent).
        path: the version's PEFT directory (`adapter_config.json` +
            `adapter_model.safetensors`); every engine can load from it.
        weights: the same tensors already in memory, an optional fast path for an
            engine that lives in this process (`EngineCapabilities.in_memory_adapters`);
            other engines ignore it.
    """

    agent: str
    version: int
    path: Path | None
    weights: LoRAWeights | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class EngineCapabilities:
    """What an engine promises, so the gateway and trajectory capture can follow it honestly.

    Attributes:
        per_token_versions: every `TokenEvent.adapter_version` is the version that produced
            that token (an update can land mid-request); false: one version per request,
            the one it was admitted under.
        logprobs: "processed" = behaviour logprobs of the distribution actually sampled
            from (after temperature/top-p); "raw" = log-softmax of the raw logits.
        in_memory_adapters: `AdapterRef.weights` is used when given (no disk read).
        constraints: kinds of declarative constraint the engine compiles ("json_schema",
            "tool_call").
    """

    per_token_versions: bool
    logprobs: Literal["processed", "raw"]
    in_memory_adapters: bool
    constraints: frozenset[str] = frozenset()


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one sequence.

    Attributes:
        max_tokens: most tokens to generate (>= 1).
        temperature: 0 means greedy; otherwise logits are divided by it.
        top_p: nucleus mass kept before sampling, in (0, 1].
        seed: per-request RNG seed; the same seed and prompt give the same output.
        stop: strings that end generation; the matched string is not returned.
        stop_token_ids: token ids that end generation (the tokenizer's EOS is added by the engine).
        logprobs: return each sampled token's logprob in `TokenEvent.top_logprobs` too.
        top_logprobs: how many alternatives to report per position (0..20).
        ignore_eos: keep generating past EOS (benchmarks only).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    ignore_eos: bool = False


class TokenConstraint(Protocol):
    """What an engine compiles a `GuidedDecoding` spec into: which tokens a sequence may take next.

    The embedded engine draws candidates in order of sampled preference and takes
    the first one the constraint `allows`; it then calls `advance`. When `is_done`
    turns true the sequence finishes with reason "stop". Engine-internal: callers
    hand engines the declarative spec, never a constraint object.
    """

    def allows(self, token_id: int) -> bool: ...

    def advance(self, token_id: int) -> None: ...

    def is_done(self) -> bool: ...


JSONSchema = Mapping[str, Any]
"""A JSON Schema document (a decoded JSON object)."""


@dataclass(frozen=True)
class ToolCallSpec:
    """Declarative constraint: the completion finishes one forced tool call.

    The prompt already ends with the call's opening in the chat format
    (`clora_feedback.chat_format.tools.forced_call_prefix`); what the model
    generates is then, with `name` set, that function's arguments object and the
    call's closing `}`; with `name` None, one of `functions`' names, `", "arguments": `,
    that function's arguments object and `}`. The arguments follow the function's
    parameter schema (the subset `clora_feedback.chat_format.schema` enforces).

    Attributes:
        functions: function name -> its `parameters` JSON Schema (None: any JSON object).
        name: the function the call must use; None lets the model pick one of `functions`.
    """

    functions: Mapping[str, JSONSchema | None]
    name: str | None = None
    kind: ClassVar[str] = "tool_call"


@dataclass(frozen=True)
class JSONSchemaSpec:
    """Declarative constraint: the completion is exactly one JSON object following `schema`.

    Attributes:
        schema: the JSON Schema the object follows (None: any JSON object).
    """

    schema: JSONSchema | None = None
    kind: ClassVar[str] = "json_schema"


GuidedDecoding = ToolCallSpec | JSONSchemaSpec
"""The declarative constraints a request may carry; `EngineCapabilities.constraints`
lists the `kind`s an engine compiles."""


@dataclass
class GenerationRequest:
    """One sequence to generate.

    Attributes:
        request_id: unique id chosen by the caller; used to abort.
        agent: agent whose adapter serves this request; None serves the base model.
        prompt_token_ids: the full prompt as engine token ids.
        sampling: sampling parameters.
        guided: optional declarative constraint (a forced tool call or a JSON schema),
            compiled by the engine; its `kind` must be in `EngineCapabilities.constraints`.
    """

    request_id: str
    agent: str | None
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    guided: GuidedDecoding | None = None


@dataclass(frozen=True)
class TokenEvent:
    """One generated token.

    Attributes:
        token_id: engine token id.
        logprob: behaviour logprob of this token, in the engine's declared mode
            (`EngineCapabilities.logprobs`): "raw" = log-softmax of the raw logits,
            before temperature/top_p; "processed" = of the distribution sampled from.
        adapter_version: version of the agent's adapter that produced the token
            (`BASE_VERSION` when no adapter was active); with
            `EngineCapabilities.per_token_versions` false, the request's admitted version.
        top_logprobs: (token_id, logprob) alternatives, most likely first; empty
            unless requested.
    """

    token_id: int
    logprob: float
    adapter_version: int
    top_logprobs: tuple[tuple[int, float], ...] = ()


@dataclass
class RequestOutput:
    """What one decode step produced for one request.

    Attributes:
        request_id: the request this belongs to.
        tokens: tokens generated in this step (usually one).
        text: detokenised text newly made final by this step (stop strings held back).
        finished: true on the last chunk of a request.
        finish_reason: why it finished, on the last chunk only.
        prompt_tokens: length of the prompt (repeated on every chunk).
    """

    request_id: str
    tokens: list[TokenEvent]
    text: str
    finished: bool = False
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for /health and /metrics."""

    running: int
    waiting: int
    max_num_seqs: int
    max_waiting: int
    steps: int
    generated_tokens: int
    adapters: dict[str, int]
