"""In-memory LoRA adapter weights and the engine limits they must fit.

`LoRAWeights` is the one in-memory form of an adapter: what the PEFT reader
returns, what the engine copies into its slots and what the trainer publishes.
Keys name a projection by its place in the model, e.g.
`layers.3.self_attn.q_proj`, with `A` of shape [rank, in_features] and `B` of
shape [out_features, rank] exactly as PEFT stores `lora_A` / `lora_B`.

Not here: file formats (see `peft_io`), batching math (see `ops`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

from clora_feedback.errors import AdapterError

ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"^layers\.(\d+)\.(self_attn|mlp)\.(\w+)$")


def module_key(layer: int, name: str) -> str:
    """The canonical key of projection `name` (e.g. "q_proj") in decoder layer `layer`."""
    group = "self_attn" if name in ATTENTION_MODULES else "mlp"
    return f"layers.{layer}.{group}.{name}"


def parse_module_key(key: str) -> tuple[int, str]:
    """Inverse of `module_key`: returns (layer, projection name)."""
    match = _KEY.match(key)
    if match is None:
        raise AdapterError(f"not a projection key: {key!r}")
    return int(match.group(1)), match.group(3)


@dataclass(frozen=True)
class LoRALimits:
    """What an engine can hold; adapters are checked against it before tensors are read.

    Attributes:
        max_rank: largest rank accepted (lower ranks are zero-padded into slots).
        target_modules: projection names that may carry LoRA weights.
        num_layers: decoder layers of the base model.
        shapes: (in_features, out_features) per projection name.
    """

    max_rank: int
    target_modules: tuple[str, ...]
    num_layers: int
    shapes: Mapping[str, tuple[int, int]]


@dataclass
class LoRAWeights:
    """One adapter's weights, on the host, in fp32 unless stated otherwise.

    Attributes:
        rank: LoRA rank r.
        alpha: LoRA alpha; the update is `scaling * B @ A`.
        tensors: projection key -> (A [r, in], B [out, r]).
        use_rslora: scale by alpha / sqrt(r) instead of alpha / r.
    """

    rank: int
    alpha: float
    tensors: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    use_rslora: bool = False

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    @property
    def target_modules(self) -> tuple[str, ...]:
        return tuple(sorted({parse_module_key(k)[1] for k in self.tensors}))

    def num_bytes(self) -> int:
        return sum(
            a.numel() * a.element_size() + b.numel() * b.element_size()
            for a, b in self.tensors.values()
        )

    def clone(self) -> LoRAWeights:
        return LoRAWeights(
            rank=self.rank,
            alpha=self.alpha,
            tensors={
                k: (a.detach().clone(), b.detach().clone()) for k, (a, b) in self.tensors.items()
            },
            use_rslora=self.use_rslora,
        )

    def validate(self, limits: LoRALimits) -> None:
        """Raise `AdapterError` unless every tensor fits the engine (rank, targets, shapes)."""
        check_config(self.rank, self.target_modules, limits)
        for key, (a, b) in self.tensors.items():
            check_shapes(key, tuple(a.shape), tuple(b.shape), self.rank, limits)
            if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
                raise AdapterError(f"{key}: non-finite values")


def check_config(rank: int, target_modules: Iterable[str], limits: LoRALimits) -> None:
    """Reject an adapter's declared shape before any tensor is read."""
    if not 1 <= rank <= limits.max_rank:
        raise AdapterError(
            f"adapter rank {rank} is outside 1..{limits.max_rank} (engine max_lora_rank)"
        )
    unsupported = sorted(set(target_modules) - set(limits.target_modules))
    if unsupported:
        raise AdapterError(
            f"adapter targets {unsupported}, which this engine does not serve "
            f"(lora_target_modules={list(limits.target_modules)})"
        )


def check_shapes(
    key: str, a_shape: tuple[int, ...], b_shape: tuple[int, ...], rank: int, limits: LoRALimits
) -> None:
    """Reject one projection's A and B shapes unless they are `[rank, in]` and `[out, rank]`
    of a layer and projection the engine serves."""
    layer, name = parse_module_key(key)
    if layer >= limits.num_layers:
        raise AdapterError(f"{key}: layer {layer} >= model layers {limits.num_layers}")
    if name not in limits.shapes:
        raise AdapterError(f"{key}: {name} is not a projection this engine serves")
    fan_in, fan_out = limits.shapes[name]
    if a_shape != (rank, fan_in) or b_shape != (fan_out, rank):
        raise AdapterError(
            f"{key}: expected A {(rank, fan_in)} and B {(fan_out, rank)}, "
            f"got {a_shape} and {b_shape}"
        )


def random_lora_weights(
    limits: LoRALimits,
    *,
    rank: int = 8,
    alpha: float = 16.0,
    seed: int = 0,
    std: float = 0.05,
    target_modules: Iterable[str] | None = None,
) -> LoRAWeights:
    """Random adapter with non-zero A and B (so it changes outputs); for tests and benchmarks."""
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for layer in range(limits.num_layers):
        for name in target_modules or limits.target_modules:
            fan_in, fan_out = limits.shapes[name]
            a = torch.randn(rank, fan_in, generator=gen) * std
            b = torch.randn(fan_out, rank, generator=gen) * std
            tensors[module_key(layer, name)] = (a, b)
    return LoRAWeights(rank=rank, alpha=alpha, tensors=tensors)
