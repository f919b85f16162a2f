"""The `Engine` Protocol: the seam between serving backends and everything else.

The embedded torch engine (`clora_feedback.engine.embedded`) is the reference
implementation; the vLLM engine (`clora_feedback.engine.vllm`) implements the
same surface over vLLM's OpenAI server. Callers
(the gateway, the trainer, benchmarks) depend only on this Protocol.

Not here: HTTP, tokenisation of chat messages, persistence.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Protocol

from clora_feedback.engine.types import (
    EngineCapabilities,
    EngineStats,
    GenerationRequest,
    RequestOutput,
)
from clora_feedback.store.versions import AdapterRef

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from clora_feedback.lora.weights import LoRALimits


class RequestStream(Protocol):
    """Async iterator over the chunks of one request; ends after the finished chunk."""

    request_id: str

    def __aiter__(self) -> AsyncIterator[RequestOutput]: ...

    def abort(self) -> None:
        """Stop generating; the batch row is freed before the next decode step."""
        ...


class Engine(Protocol):
    """A warm base model serving many agents, each through its own LoRA adapter."""

    @property
    def model_name(self) -> str: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase: ...

    @property
    def lora_limits(self) -> LoRALimits:
        """What adapters must fit (rank, targets, shapes); checked before tensors are read."""
        ...

    @property
    def capabilities(self) -> EngineCapabilities:
        """What this engine promises (version attribution, logprob mode, constraint kinds);
        the gateway and trajectory capture follow it."""
        ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def add_request(self, request: GenerationRequest) -> RequestStream:
        """Queue a request. Raises `OverloadedError` at once when the queue is full,
        `ContextLengthError` when prompt + max_tokens exceed the context,
        `NotFoundError` when `request.agent` has no adapter and is not None, and
        `InvalidRequestError` when `request.guided` is a kind this engine does not
        compile (see `capabilities`) or a schema it cannot satisfy."""
        ...

    def add_requests(self, requests: Sequence[GenerationRequest]) -> Sequence[RequestStream]:
        """Queue several requests for the same step (the choices of one completion request):
        each is checked as `add_request` checks it, and all are queued or none is."""
        ...

    async def load_adapter(self, ref: AdapterRef) -> None:
        """Serve `ref` as its agent's adapter (installing it, or replacing the one served).

        Validates first (against `lora_limits`, from `ref.weights` when the engine
        takes tensors in memory, else from `ref.path`): a bad adapter raises
        `AdapterError` (or `StoreError` for unreadable files) and serving is
        untouched. Once it returns, tokens from the next decode step on report
        `ref.version`; requests in flight move to it when the engine attributes
        versions per token (`capabilities.per_token_versions`).
        """
        ...

    async def unload_adapter(self, agent: str) -> None:
        """Stop serving `agent`'s adapter (a no-op when it has none); later requests for
        it fail with `NotFoundError` unless the caller routes them with `agent=None`.
        Requests already accepted for it (queued or running) still complete, on its
        weights (or on a new version if the name is loaded again while they wait): an
        unload fails none of them."""
        ...

    def adapter_version(self, agent: str) -> int | None:
        """The version of `agent`'s adapter that new requests get, or None if it has none."""
        ...

    def prefetch(self, agent: str) -> None:
        """Start bringing `agent`'s adapter to where a request needs it, without waiting:
        the gateway calls it as soon as a request is routed, so a cold agent's read runs
        while the prompt is rendered and tokenised. A hint: unknown agents and failed
        reads are reported by `add_request`, not here."""
        ...

    def replica_of(self, agent: str) -> str | None:
        """Where `agent` is served: "embedded" for the in-process engine; for vLLM the URL of
        its home replica (the first of its rendezvous order that is up, where its requests
        go first), None before `start` or while no replica is up."""
        ...

    def stats(self) -> EngineStats: ...
