"""Value types shared by every engine and by its callers (the gateway, the trainer).

A request goes in as `GenerationRequest`; the engine streams `RequestOutput`
chunks back, each carrying the `TokenEvent`s produced in one decode step. Every
token knows the adapter version that produced it, so a trajectory can be
replayed against exactly the policy that generated it.

This module holds plain data (and the range checks of `SamplingParams`) only: no
torch, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol

from clora_feedback.errors import InvalidRequestError

if TYPE_CHECKING:
    pass

FinishReason = Literal["stop", "length", "abort"]

BASE_VERSION = 0
"""Adapter version reported for tokens generated with no adapter (the base model)."""


@dataclass(frozen=True)
class EngineCapabilities:
    """What an engine promises, so the gateway and trajectory capture can follow it honestly.

    Attributes:
        per_token_versions: every `TokenEvent.adapter_version` is the version that produced
            that token (an update can land mid-request); false: one version per request,
            the one it was admitted under.
        logprobs: "processed" = behaviour logprobs of the distribution actually sampled
            from (after penalties, logit_bias, min_tokens, temperature, top-k and top-p);
            "raw" = log-softmax of the raw logits, before any of them.
        in_memory_adapters: `AdapterRef.weights` is used when given (no disk read).
        constraints: kinds of declarative constraint the engine compiles ("json_schema",
            "tool_call", "tool_call_trigger").
    """

    per_token_versions: bool
    logprobs: Literal["processed", "raw"]
    in_memory_adapters: bool
    constraints: frozenset[str] = frozenset()

    def supports(self, guided: GuidedDecoding) -> bool:
        """Whether the engine compiles this kind of spec."""
        return guided.kind in self.constraints

    def check(self, guided: GuidedDecoding | None) -> None:
        """Raise `InvalidRequestError` (400, naming the parameter that asked for `guided`)
        when the engine does not compile this kind of spec; None passes."""
        if guided is None or self.supports(guided):
            return
        param = "response_format"
        if isinstance(guided, ToolCallSpec):
            param = "tool_choice" if guided.mode == "forced" else "tools"
        raise InvalidRequestError(
            f"this engine cannot enforce a {guided.kind!r} constraint "
            f"(it supports: {', '.join(sorted(self.constraints)) or 'none'})",
            param=param,
        )


SEED_BITS = 64
"""Seeds are 64-bit patterns: an engine seed is in [0, 2**64)."""


def choice_seed(seed: int, index: int) -> int:
    """The engine seed of choice `index` of a request seeded with `seed`.

    `seed` may be any integer a client sends within [-2**63, 2**64) (a signed or
    an unsigned 64-bit value); it is read as its 64-bit two's-complement pattern
    and choice i gets `(seed + i) mod 2**64`. So n seeded choices differ yet
    repeat, the sum never overflows (2**64 - 1 with n=2 gives 2**64 - 1 and 0),
    and -1 and 2**64 - 1 name the same seed.
    """
    return (seed + index) % (1 << SEED_BITS)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one sequence.

    The controls apply in vLLM's order: penalties and `logit_bias` are added to the
    raw logits, `min_tokens` masks the stop tokens, then temperature, `top_k` and
    `top_p` shape the distribution that is sampled (or argmax-ed when greedy).

    Attributes:
        max_tokens: most tokens to generate (>= 1).
        temperature: 0 means greedy; otherwise logits are divided by it.
        top_p: nucleus mass kept before sampling, in (0, 1].
        seed: per-request RNG seed in [0, 2**64) (see `choice_seed`); the same seed and
            prompt give the same output, whatever else shares the batch.
        stop: strings that end generation; the matched string is not returned.
        stop_token_ids: token ids that end generation (the tokenizer's EOS is added by the engine).
        logprobs: return each sampled token's logprob in `TokenEvent.top_logprobs` too.
        top_logprobs: how many alternatives to report per position (0..20).
        ignore_eos: keep generating past EOS (vLLM's extension; benchmarks use it).
        top_k: keep only the k highest logits before sampling; 0 = off.
        min_tokens: EOS and the stop token ids cannot be sampled before this many
            tokens were generated (stop strings still apply).
        presence_penalty: subtracted once from the logit of every token that already
            appears in this sequence's generated tokens (not the prompt), in [-2, 2].
        frequency_penalty: subtracted from a token's logit once per time it appears in
            the generated tokens so far, in [-2, 2].
        logit_bias: (token id, bias) pairs added to the logits before sampling; a bias
            of -100 bans a token in practice, +100 forces it.
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
    top_k: int = 0
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    @property
    def penalized(self) -> bool:
        """Presence or frequency penalty is set (the sampler then counts generated tokens)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def check(self, vocab_size: int) -> None:
        """Refuse what no engine can sample, naming the parameter (engines call this on admission).

        Raises:
            InvalidRequestError: a value outside its range, or a `logit_bias` token id
                outside [0, vocab_size).
        """
        if self.seed is not None and not 0 <= self.seed < 1 << SEED_BITS:
            raise InvalidRequestError("seed must be in [0, 2**64) at the engine", param="seed")
        if self.top_k < 0:
            raise InvalidRequestError("top_k must be 0 (off) or at least 1", param="top_k")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}]", param="min_tokens"
            )
        bad = sorted(t for t, _ in self.logit_bias if not 0 <= t < vocab_size)
        if bad:
            raise InvalidRequestError(
                f"logit_bias names token ids outside this model's vocabulary [0, {vocab_size}): "
                f"{bad[:5]}",
                param="logit_bias",
            )


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
    """Declarative constraint on tool calls: a forced call, or the calls the model chooses.

    `mode` "forced": the prompt already ends with the call's opening in the chat
    format (`clora_feedback.chat_format.tools.forced_call_prefix`); what the model
    generates is then, with `name` set, that function's arguments object and the
    call's closing `}`; with `name` None, one of `functions`' names, `", "arguments": `,
    that function's arguments object and `}`.

    `mode` "on_trigger" (`tool_choice` "auto"): the text is free until the model
    opens a call (`<tool_call>`); the call is then constrained the same way (a
    name among `functions`, its arguments) through `</tool_call>`, and the text
    is free again; with `parallel` false the completion ends with the first call.

    Either way the arguments follow the function's parameter schema (the subset
    `clora_feedback.chat_format.schema` enforces). The two modes are different
    `kind`s, so an engine that compiles only forced calls refuses the other.

    Attributes:
        functions: function name -> its `parameters` JSON Schema (None: any JSON object).
        name: the function the call must use ("forced" only); None lets the model pick.
        mode: "forced" or "on_trigger".
        parallel: "on_trigger": several calls may follow one another.
    """

    functions: Mapping[str, JSONSchema | None]
    name: str | None = None
    mode: Literal["forced", "on_trigger"] = "forced"
    parallel: bool = True

    @property
    def kind(self) -> str:
        """The constraint kind: "tool_call" (forced) or "tool_call_trigger" (model's choice)."""
        return "tool_call" if self.mode == "forced" else "tool_call_trigger"


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
        background: the service's own evaluation traffic (the release gate, the no-op
            probe), not a client's: an engine may admit it only into rows that no client
            request is waiting for (the embedded engine does, keeping one row advancing;
            vLLM serves it like any request).
    """

    request_id: str
    agent: str | None
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    guided: GuidedDecoding | None = None
    background: bool = False


@dataclass(frozen=True)
class TokenEvent:
    """One generated token.

    Attributes:
        token_id: engine token id.
        logprob: behaviour logprob of this token, in the engine's declared mode
            (`EngineCapabilities.logprobs`): "raw" = log-softmax of the raw logits,
            before every sampling control; "processed" = of the distribution sampled from.
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
class PrefixCacheStats:
    """Counters of an engine's prefix cache (KV blocks reused across requests).

    Attributes:
        block_tokens: tokens per cached block.
        hits: blocks reused instead of prefilled.
        misses: full prompt blocks looked up and not found (prefilled instead).
        evictions: blocks dropped to stay within `capacity_bytes`.
        blocks: blocks held now.
        bytes: memory the held blocks take.
        capacity_bytes: the bound on `bytes`.
    """

    block_tokens: int
    hits: int
    misses: int
    evictions: int
    blocks: int
    bytes: int
    capacity_bytes: int


@dataclass(frozen=True)
class HostCacheStats:
    """The embedded engine's host copies of adapters (`engine.host_adapter_cache_mb`).

    Attributes:
        bytes: memory the held copies take.
        capacity_bytes: their budget (0: unbounded).
        reads: versions read from their directories for agents whose copy was not held.
        drops: copies dropped to stay within the budget.
    """

    bytes: int
    capacity_bytes: int
    reads: int
    drops: int


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for /health and /metrics.

    `prefix_cache` is None for an engine without one (or with it turned off);
    `host_cache` for an engine that keeps no host copies of adapters (vLLM).
    """

    running: int
    waiting: int
    max_num_seqs: int
    max_waiting: int
    steps: int
    generated_tokens: int
    adapters: dict[str, int]
    prefix_cache: PrefixCacheStats | None = None
    host_cache: HostCacheStats | None = None
