"""The `Engine` Protocol: the seam between serving backends and everything else.

The embedded torch engine (`clora_feedback.engine.embedded`) is the reference
implementation; a vLLM-backed engine would implement the same surface. Callers
(the gateway, the trainer, benchmarks) depend only on this Protocol.

Not here: HTTP, tokenisation of chat messages, persistence.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Protocol

from clora_feedback.engine.types import EngineStats, GenerationRequest, RequestOutput

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from clora_feedback.lora.weights import LoRALimits, LoRAWeights


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

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def add_request(self, request: GenerationRequest) -> RequestStream:
        """Queue a request. Raises `OverloadedError` at once when the queue is full,
        `ContextLengthError` when prompt + max_tokens exceed the context, and
        `NotFoundError` when `request.agent` has no adapter and is not None."""
        ...

    def set_adapter(self, agent: str, version: int, weights: LoRAWeights) -> None:
        """Install (or replace in place) an agent's adapter. Applied between decode
        steps; tokens produced afterwards report `version`. Validates first: a bad
        adapter raises `AdapterError` and leaves serving untouched."""
        ...

    def remove_adapter(self, agent: str) -> None:
        """Drop an agent's adapter; later requests for it are served by the base model
        only if the caller routes them with `agent=None`."""
        ...

    def adapter_version(self, agent: str) -> int | None:
        """The live version of an agent's adapter, or None if it has none."""
        ...

    def stats(self) -> EngineStats: ...
