"""The architecture facts of a base decoder, read once from its HF `config.json`.

Not here: tensors (see `base`), the forward (see `decoder`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from clora_feedback.errors import InvalidRequestError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")


@dataclass(frozen=True)
class ModelConfig:
    """The architecture facts the engine and the trainer need, read from an HF `config.json`."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_dir(cls, model_dir: Path) -> ModelConfig:
        raw = json.loads((Path(model_dir) / "config.json").read_text())
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise InvalidRequestError(
                f"model_type {model_type!r} is not supported ({SUPPORTED_MODEL_TYPES})"
            )
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
            raise InvalidRequestError(f"rope scaling {rope!r} is not supported")
        heads = raw["num_attention_heads"]
        eos = raw.get("eos_token_id")
        return cls(
            model_type=model_type,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", raw.get("rope_theta", 10000.0)),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            attention_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
            eos_token_ids=tuple(eos if isinstance(eos, list) else [eos] if eos is not None else []),
        )

    def projection_shapes(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of every projection."""
        h, i = self.hidden_size, self.intermediate_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }
