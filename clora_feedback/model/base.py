"""The frozen base decoder tensors, loaded once from an HF safetensors directory.

`BaseWeights` is what the serving engine and the trainer share: q/k/v and
gate/up already fused into one weight each (the order of `GROUPS`), the norms,
the embedding and the vocabulary projection, and the RoPE tables. Nothing here
is ever written after loading, so one instance can back a serving engine and
a trainer at the same time (no second copy of the model).

Not here: adapter slots and the serving fast path (`clora_feedback.engine.decoder`),
the forward itself (`decoder`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file

from clora_feedback.errors import InvalidRequestError
from clora_feedback.lora.weights import LoRALimits
from clora_feedback.model.config import ModelConfig

GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("qkv", ("q_proj", "k_proj", "v_proj")),
    ("o", ("o_proj",)),
    ("gate_up", ("gate_proj", "up_proj")),
    ("down", ("down_proj",)),
)
"""Fused projection groups: (group, member projections in output order)."""


def read_safetensors_dir(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every `*.safetensors` file in `model_dir`, on the host."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise InvalidRequestError(f"no *.safetensors weights in {model_dir}")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(load_file(str(f), device="cpu"))
    return weights


class BaseWeights:
    """The base decoder's tensors in the fused layout (read-only after construction).

    Attributes:
        config: the architecture.
        dtype, device: of every tensor below (RoPE tables included).
        embed: [V, hidden] token embeddings.
        lm_head: [V, hidden] vocabulary projection (the same tensor as `embed` when tied).
        final_norm: [hidden] weight of the last RMSNorm.
        layers: per decoder layer: `in_norm`, `post_norm` [hidden]; `qkv`
            [(H+2K)*D, hidden]; `o` [hidden, H*D]; `gate_up` [2I, hidden];
            `down` [hidden, I]; and `qkv_bias` [(H+2K)*D] when the model has one.
        cos, sin: [max_position_embeddings, D] RoPE tables.
    """

    def __init__(
        self,
        config: ModelConfig,
        tensors: dict[str, torch.Tensor],
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        """Take the HF-named `tensors` (consumed: entries are popped as they are moved)."""
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)

        def take(name: str) -> torch.Tensor:
            return tensors.pop(name).to(device=self.device, dtype=dtype).contiguous()

        self.embed = take("model.embed_tokens.weight")
        self.lm_head = (
            self.embed
            if config.tie_word_embeddings or "lm_head.weight" not in tensors
            else take("lm_head.weight")
        )
        self.final_norm = take("model.norm.weight")
        self.layers = [self._take_layer(take, i) for i in range(config.num_layers)]
        self.cos, self.sin = rope_tables(config, dtype, self.device)

    def _take_layer(self, take: Callable[[str], torch.Tensor], i: int) -> dict[str, torch.Tensor]:
        p = f"model.layers.{i}."
        attn = ("q_proj", "k_proj", "v_proj")
        layer = {
            "in_norm": take(p + "input_layernorm.weight"),
            "post_norm": take(p + "post_attention_layernorm.weight"),
            "qkv": torch.cat([take(p + f"self_attn.{n}.weight") for n in attn]),
            "o": take(p + "self_attn.o_proj.weight"),
            "gate_up": torch.cat([take(p + f"mlp.{n}.weight") for n in ("gate_proj", "up_proj")]),
            "down": take(p + "mlp.down_proj.weight"),
        }
        if self.config.attention_bias:
            layer["qkv_bias"] = torch.cat([take(p + f"self_attn.{n}.bias") for n in attn])
        return layer

    @classmethod
    def from_dir(
        cls,
        model_dir: Path,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> BaseWeights:
        """Load an HF Llama/Qwen2 directory (`config.json` + `*.safetensors`)."""
        config = ModelConfig.from_dir(model_dir)
        return cls(config, read_safetensors_dir(model_dir), dtype=dtype, device=device)

    def bias(self, layer: int, group: str) -> torch.Tensor | None:
        """The bias of fused projection `group` in `layer` (only q/k/v may have one)."""
        return self.layers[layer].get(f"{group}_bias")

    def lora_limits(self, max_rank: int, target_modules: tuple[str, ...]) -> LoRALimits:
        """The limits an adapter for this model must fit, given a rank cap and targets."""
        shapes = self.config.projection_shapes()
        return LoRALimits(max_rank, tuple(target_modules), self.config.num_layers, shapes)

    def tensors(self) -> Iterator[torch.Tensor]:
        """Every distinct weight tensor once (the tied `lm_head` is not counted twice)."""
        yield self.embed
        if self.lm_head is not self.embed:
            yield self.lm_head
        yield self.final_norm
        for layer in self.layers:
            yield from layer.values()


def rope_tables(
    config: ModelConfig, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_position_embeddings, D] of the default (unscaled) rotary embedding."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(device=device, dtype=dtype), emb.sin().to(device=device, dtype=dtype)
