"""A Llama/Qwen2-architecture decoder with per-row multi-LoRA and a slotted KV cache.

Written for serving: q/k/v and gate/up projections are fused into one matmul
each, every target projection owns preallocated adapter slot buffers (see
`clora_feedback.lora.ops`), and the KV cache is a fixed array of rows so
sequences join and leave the batch without reallocation.

Two entry points: `prefill` (one sequence, many tokens, fills its cache row)
and `decode` (many sequences, one token each, every row with its own adapter).

Not here: scheduling, sampling, tokenisation (see `embedded`, `sampling`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from clora_feedback.errors import AdapterError, InvalidRequestError
from clora_feedback.lora.ops import LoRABatch, lora_delta
from clora_feedback.lora.weights import LoRALimits, LoRAWeights, module_key

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")
# Fused projection groups: (group, members in output order).
GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("qkv", ("q_proj", "k_proj", "v_proj")),
    ("o", ("o_proj",)),
    ("gate_up", ("gate_proj", "up_proj")),
    ("down", ("down_proj",)),
)


@dataclass(frozen=True)
class ModelConfig:
    """The architecture facts the engine needs, read from an HF `config.json`."""

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


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LoRASlots:
    """Adapter slot buffers for one fused projection group of one layer.

    `a` is [S, R_g, in] and `b` is [S, out_g, R_g], where R_g stacks one
    `max_rank` block per member projection and `b` is block-diagonal, so a
    fused q/k/v (or gate/up) update is a single matmul pair.
    """

    def __init__(
        self,
        members: list[tuple[str, int]],
        fan_in: int,
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.members = members  # (projection name, out_features), output order
        self.max_rank = max_rank
        total_out = sum(out for _, out in members)
        self.a = torch.zeros(num_slots, max_rank * len(members), fan_in, dtype=dtype, device=device)
        self.b = torch.zeros(
            num_slots, total_out, max_rank * len(members), dtype=dtype, device=device
        )

    def write(
        self, slot: int, pieces: dict[str, tuple[torch.Tensor, torch.Tensor]], scaling: float
    ) -> None:
        """Copy one adapter's matrices into `slot` (missing members stay zero)."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        out_offset = 0
        for m, (name, out) in enumerate(self.members):
            if name in pieces:
                a, b = pieces[name]
                r = a.shape[0]
                lo = m * self.max_rank
                self.a[slot, lo : lo + r].copy_(a)
                self.b[slot, out_offset : out_offset + out, lo : lo + r].copy_(b * scaling)
            out_offset += out

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()


class KVCache:
    """Keys and values for `rows` sequences of up to `max_len` tokens: [L, rows, kv_heads, max_len, head_dim]."""

    def __init__(
        self, config: ModelConfig, rows: int, max_len: int, dtype: torch.dtype, device: torch.device
    ):
        shape = (config.num_layers, rows, config.num_kv_heads, max_len, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len


class LoRAModel:
    """The decoder: base weights (inference only) plus per-layer adapter slots."""

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        *,
        max_loras: int,
        max_lora_rank: int,
        target_modules: tuple[str, ...],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype
        self.num_slots = max_loras + 1
        self.max_lora_rank = max_lora_rank
        self.target_modules = tuple(t for t in target_modules)
        shapes = config.projection_shapes()
        self.limits = LoRALimits(max_lora_rank, self.target_modules, config.num_layers, shapes)

        def take(name: str) -> torch.Tensor:
            return weights.pop(name).to(device=self.device, dtype=dtype).contiguous()

        self.embed = take("model.embed_tokens.weight")
        self.lm_head = (
            self.embed
            if config.tie_word_embeddings or "lm_head.weight" not in weights
            else take("lm_head.weight")
        )
        self.final_norm = take("model.norm.weight")
        self.layers: list[dict[str, torch.Tensor]] = []
        self.slots: list[dict[str, LoRASlots]] = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            layer = {
                "in_norm": take(p + "input_layernorm.weight"),
                "post_norm": take(p + "post_attention_layernorm.weight"),
                "qkv": torch.cat(
                    [take(p + f"self_attn.{n}.weight") for n in ("q_proj", "k_proj", "v_proj")]
                ),
                "o": take(p + "self_attn.o_proj.weight"),
                "gate_up": torch.cat(
                    [take(p + f"mlp.{n}.weight") for n in ("gate_proj", "up_proj")]
                ),
                "down": take(p + "mlp.down_proj.weight"),
            }
            if config.attention_bias:
                layer["qkv_bias"] = torch.cat(
                    [take(p + f"self_attn.{n}.bias") for n in ("q_proj", "k_proj", "v_proj")]
                )
            self.layers.append(layer)
            group_slots = {}
            for group, members in GROUPS:
                chosen = [(m, shapes[m][1]) for m in members if m in self.target_modules]
                if chosen:
                    fan_in = shapes[members[0]][0]
                    group_slots[group] = LoRASlots(
                        chosen, fan_in, self.num_slots, max_lora_rank, dtype, self.device
                    )
            self.slots.append(group_slots)
        inv_freq = 1.0 / (
            config.rope_theta
            ** (torch.arange(0, config.head_dim, 2, dtype=torch.float32) / config.head_dim)
        )
        positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(device=self.device, dtype=dtype)
        self.sin = emb.sin().to(device=self.device, dtype=dtype)

    @classmethod
    def from_dir(
        cls,
        model_dir: Path,
        *,
        max_loras: int,
        max_lora_rank: int,
        target_modules: tuple[str, ...],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> LoRAModel:
        config = ModelConfig.from_dir(model_dir)
        weights: dict[str, torch.Tensor] = {}
        files = sorted(Path(model_dir).glob("*.safetensors"))
        if not files:
            raise InvalidRequestError(f"no *.safetensors weights in {model_dir}")
        for f in files:
            weights.update(load_file(str(f), device="cpu"))
        return cls(
            config,
            weights,
            max_loras=max_loras,
            max_lora_rank=max_lora_rank,
            target_modules=target_modules,
            dtype=dtype,
            device=device,
        )

    # -- adapters -----------------------------------------------------------------

    def write_slot(self, slot: int, weights: LoRAWeights) -> None:
        """Copy an adapter into `slot` (1..max_loras). Caller validated it."""
        if not 1 <= slot < self.num_slots:
            raise AdapterError(f"slot {slot} out of range")
        if weights.rank > self.max_lora_rank:
            raise AdapterError(f"rank {weights.rank} > max_lora_rank {self.max_lora_rank}")
        with torch.no_grad():
            for i, group_slots in enumerate(self.slots):
                for slots in group_slots.values():
                    pieces = {}
                    for name, _ in slots.members:
                        pair = weights.tensors.get(module_key(i, name))
                        if pair is not None:
                            pieces[name] = (
                                pair[0].to(self.device, self.dtype),
                                pair[1].to(self.device, self.dtype),
                            )
                    slots.write(slot, pieces, weights.scaling)

    def clear_slot(self, slot: int) -> None:
        for group_slots in self.slots:
            for slots in group_slots.values():
                slots.clear(slot)

    # -- forward --------------------------------------------------------------------

    def _proj(self, x: torch.Tensor, layer: int, group: str, lora: LoRABatch) -> torch.Tensor:
        w = self.layers[layer][group]
        y = x @ w.t()
        if group == "qkv" and "qkv_bias" in self.layers[layer]:
            y = y + self.layers[layer]["qkv_bias"]
        slots = self.slots[layer].get(group)
        if slots is not None:
            delta = lora_delta(x, slots.a, slots.b, lora)
            if delta is not None:
                if len(slots.members) == len(dict(GROUPS)[group]):
                    y = y + delta
                else:  # only some members targeted: scatter their outputs into place
                    y = y + self._expand(delta, group, slots)
        return y

    def _expand(self, delta: torch.Tensor, group: str, slots: LoRASlots) -> torch.Tensor:
        shapes = self.config.projection_shapes()
        parts, offset = [], 0
        chosen = dict(slots.members)
        for name in dict(GROUPS)[group]:
            out = shapes[name][1]
            if name in chosen:
                parts.append(delta[..., offset : offset + out])
                offset += out
            else:
                parts.append(delta.new_zeros(*delta.shape[:-1], out))
        return torch.cat(parts, dim=-1)

    def _mlp(self, x: torch.Tensor, i: int, lora: LoRABatch) -> torch.Tensor:
        gate, up = self._proj(x, i, "gate_up", lora).chunk(2, dim=-1)
        return self._proj(F.silu(gate) * up, i, "down", lora)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return x * cos + _rotate_half(x) * sin

    def _split_qkv(
        self, qkv: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """qkv [B, T, (H+2K)*D], positions [B, T] -> q [B,H,T,D], k/v [B,K,T,D] with RoPE applied."""
        c = self.config
        b, t, _ = qkv.shape
        q, k, v = qkv.split(
            [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim], -1
        )
        q = q.view(b, t, c.num_heads, c.head_dim).transpose(1, 2)
        k = k.view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2)
        v = v.view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2)
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        return self._rope(q, cos, sin), self._rope(k, cos, sin), v

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return (_rms_norm(h, self.final_norm, self.config.rms_norm_eps) @ self.lm_head.t()).float()

    @torch.inference_mode()
    def prefill(
        self, token_ids: torch.Tensor, cache: KVCache, row: int, slot: int, start: int = 0
    ) -> torch.Tensor:
        """Run a prompt chunk for one sequence and store its keys/values.

        Args:
            token_ids: [T] prompt tokens occupying positions start..start+T-1.
            cache: the KV cache; row `row` is written at those positions.
            row: cache row owned by the sequence.
            slot: adapter slot (0 = base model).
            start: position of the first token (earlier positions already cached).

        Returns:
            [V] fp32 logits for the token after the chunk.
        """
        c = self.config
        t = token_ids.shape[0]
        lora = LoRABatch.from_slots([slot], self.device)
        positions = torch.arange(start, start + t, device=self.device).unsqueeze(0)
        h = self.embed[token_ids].unsqueeze(0)  # [1, T, hidden]
        for i, layer in enumerate(self.layers):
            x = _rms_norm(h, layer["in_norm"], c.rms_norm_eps)
            q, k, v = self._split_qkv(self._proj(x, i, "qkv", lora), positions)
            cache.k[i, row, :, start : start + t] = k[0]
            cache.v[i, row, :, start : start + t] = v[0]
            if start == 0:
                attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            else:
                keys = cache.k[i, row : row + 1, :, : start + t]
                values = cache.v[i, row : row + 1, :, : start + t]
                mask = torch.ones(t, start + t, dtype=torch.bool, device=self.device).tril(start)
                attn = F.scaled_dot_product_attention(
                    q, keys, values, attn_mask=mask, enable_gqa=True
                )
            h = h + self._proj(attn.transpose(1, 2).reshape(1, t, -1), i, "o", lora)
            h = h + self._mlp(_rms_norm(h, layer["post_norm"], c.rms_norm_eps), i, lora)
        return self._logits(h[0, -1])

    @torch.inference_mode()
    def decode(
        self,
        token_ids: torch.Tensor,
        rows: list[int],
        positions: torch.Tensor,
        lora: LoRABatch,
        cache: KVCache,
    ) -> torch.Tensor:
        """One decode step for a batch of sequences.

        Args:
            token_ids: [B] the last sampled token of each sequence.
            rows: B cache rows (ascending); a contiguous run is read as a view.
            positions: [B] position of each new token.
            lora: the adapter slot of each row.
            cache: KV cache.

        Returns:
            [B, V] fp32 logits.
        """
        c = self.config
        b = token_ids.shape[0]
        span = int(positions.max().item()) + 1
        contiguous = rows == list(range(rows[0], rows[0] + b))
        row_index = torch.tensor(rows, device=self.device)
        # mask[b, j]: may row b attend to cached position j
        mask = (torch.arange(span, device=self.device).unsqueeze(0) <= positions.unsqueeze(1)).view(
            b, 1, 1, span
        )
        h = self.embed[token_ids].unsqueeze(1)  # [B, 1, hidden]
        pos2 = positions.unsqueeze(1)
        for i, layer in enumerate(self.layers):
            x = _rms_norm(h, layer["in_norm"], c.rms_norm_eps)
            q, k, v = self._split_qkv(self._proj(x, i, "qkv", lora), pos2)
            cache.k[i, row_index, :, positions] = k[:, :, 0]
            cache.v[i, row_index, :, positions] = v[:, :, 0]
            if contiguous:
                keys = cache.k[i, rows[0] : rows[0] + b, :, :span]
                values = cache.v[i, rows[0] : rows[0] + b, :, :span]
            else:
                keys = cache.k[i].index_select(0, row_index)[:, :, :span]
                values = cache.v[i].index_select(0, row_index)[:, :, :span]
            attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
            h = h + self._proj(attn.transpose(1, 2).reshape(b, 1, -1), i, "o", lora)
            h = h + self._mlp(_rms_norm(h, layer["post_norm"], c.rms_norm_eps), i, lora)
        return self._logits(h[:, 0])
