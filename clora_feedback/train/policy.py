"""The trainer's model seam: what a step needs from the policy being trained.

`PolicyModel` is the Protocol the trainer codes against: the log-probabilities
of scored tokens under a batch of trainable adapters (or under the base model,
the KL reference policy, with `lora=None`), plus the facts the trainer reads
(LoRA limits, device, tokenizer, context length, model name).

`DecoderPolicy` is the torch implementation over `clora_feedback.model`. The
composition root picks how it gets its base weights:

- `DecoderPolicy.shared_with(engine)`: the very tensors an embedded engine
  serves from (no second copy of the model; the base is only read);
- `DecoderPolicy.from_dir(model_dir, ...)`: its own copy, for a trainer beside
  any other engine or in a process of its own.

Compute dtype (`trainer.compute_dtype`): the forward/backward runs in the
dtype of the policy's base weights. When the engine serves in another dtype,
`shared_with` makes the trainer its own cast copy (the one case where sharing
gives way). Whatever the compute dtype, the trainable LoRA masters, their
gradients and the Adam moments stay fp32 (see `state`), and the head and the
log-softmax run in fp32 (see `forward`).

Not here: losses and the optimizer (see `step`), the serving engine.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from clora_feedback.hardware import DTYPES
from clora_feedback.lora.weights import LoRALimits
from clora_feedback.model.base import BaseWeights
from clora_feedback.train.forward import PackedBatch, TrainLoRA, token_logprobs

COMPUTE_DTYPES: dict[str, torch.dtype] = {n: DTYPES[n] for n in ("float32", "bfloat16")}
"""The explicit `trainer.compute_dtype` names (of `clora_feedback.hardware.DTYPES`; `auto`
resolves to one of them, see `hardware.resolve_dtype`)."""


class ModelFacts(Protocol):
    """What the trainer reads about the base model (an engine states the same facts)."""

    @property
    def model_name(self) -> str:
        """The base model's public name (recorded in each version's manifest)."""
        ...

    @property
    def max_model_len(self) -> int:
        """Longest prompt + completion, in tokens."""
        ...

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase: ...

    @property
    def lora_limits(self) -> LoRALimits:
        """What a trained adapter must fit (the serving engine's limits)."""
        ...


class PolicyModel(ModelFacts, Protocol):
    """The differentiable policy a trainer steps (base frozen, LoRA rows per agent)."""

    @property
    def device(self) -> torch.device:
        """Where training state is swapped in and the forward runs."""
        ...

    def token_logprobs(self, batch: PackedBatch, lora: TrainLoRA | None) -> torch.Tensor:
        """[N] fp32 logprobs of `batch.targets[batch.mask]`; `lora=None` is the base model."""
        ...


class SharesBaseWeights(ModelFacts, Protocol):
    """Something in this process that serves from a `BaseWeights` (the embedded engine)."""

    @property
    def base_weights(self) -> BaseWeights: ...


@dataclass(frozen=True, eq=False)  # compared by identity, like the tensors it holds
class DecoderPolicy:
    """`PolicyModel` over a `BaseWeights` (the forward of `clora_feedback.model.decoder`).

    Attributes:
        base: the frozen base tensors (shared or owned; only read).
        tokenizer, lora_limits, model_name, max_model_len: see `ModelFacts`.
    """

    base: BaseWeights
    tokenizer: PreTrainedTokenizerBase
    lora_limits: LoRALimits
    model_name: str
    max_model_len: int
    _head: torch.Tensor | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        # The fp32 vocabulary projection the log-softmax reads, made once (bf16 compute only).
        if self.base.lm_head.dtype != torch.float32:
            object.__setattr__(self, "_head", self.base.lm_head.float())

    @classmethod
    def shared_with(
        cls, source: SharesBaseWeights, *, compute_dtype: torch.dtype | None = None
    ) -> DecoderPolicy:
        """A policy on the very tensors `source` (e.g. the embedded engine) already holds.

        No copy is made when `compute_dtype` is None or the engine's dtype: the
        trainer reads the base weights the engine serves from, and trains
        adapters that fit the engine's limits. Another `compute_dtype` gets a
        cast copy of the base (e.g. bf16 training beside an fp32 engine).
        """
        base = source.base_weights
        if compute_dtype is not None and compute_dtype != base.dtype:
            base = cast_base(base, compute_dtype)
        return cls(
            base,
            source.tokenizer,
            source.lora_limits,
            source.model_name,
            source.max_model_len,
        )

    @classmethod
    def from_dir(
        cls,
        model_dir: Path,
        *,
        max_lora_rank: int,
        target_modules: tuple[str, ...],
        model_name: str | None = None,
        max_model_len: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> DecoderPolicy:
        """A policy on its own copy of the base model loaded from an HF directory."""
        base = BaseWeights.from_dir(model_dir, dtype=dtype, device=device)
        positions = base.config.max_position_embeddings
        return cls(
            base,
            AutoTokenizer.from_pretrained(str(model_dir)),
            base.lora_limits(max_lora_rank, tuple(target_modules)),
            model_name or Path(model_dir).name,
            min(max_model_len, positions) if max_model_len else positions,
        )

    @property
    def device(self) -> torch.device:
        return self.base.device

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype of the base GEMMs and activations (masters and moments are fp32)."""
        return self.base.dtype

    @property
    def head(self) -> torch.Tensor:
        """The fp32 [V, hidden] vocabulary projection the log-softmax reads."""
        return self._head if self._head is not None else self.base.lm_head

    def token_logprobs(self, batch: PackedBatch, lora: TrainLoRA | None) -> torch.Tensor:
        return token_logprobs(self.base, batch, lora, self.head)


def cast_base(base: BaseWeights, dtype: torch.dtype) -> BaseWeights:
    """A copy of `base` with every tensor in `dtype` (the tied head stays tied)."""
    out = copy.copy(base)

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype).contiguous()

    out.dtype = dtype
    out.embed = cast(base.embed)
    out.lm_head = out.embed if base.lm_head is base.embed else cast(base.lm_head)
    out.final_norm = cast(base.final_norm)
    out.layers = [{k: cast(v) for k, v in layer.items()} for layer in base.layers]
    out.cos, out.sin = cast(base.cos), cast(base.sin)
    return out
