"""The differentiable Llama/Qwen2 forward over `BaseWeights`, with a per-row LoRA update.

Written for clarity and autograd, not for decode speed: plain `F.linear` on
the fused base weights, RoPE by `rotate_half`, attention by
`F.scaled_dot_product_attention` over whole sequences. The pieces are public
so a caller can compose them differently (the trainer's shared-prefix pass
runs a prefix stream and a per-row stream through the same layer functions).
LoRA enters through one seam, `LoRAUpdate.delta`: the trainer supplies its
trainable per-agent matrices, a test may supply the engine's slot buffers,
and `None` means the base model (the reference policy, adapter disabled).

Shapes: B rows, T positions, H query heads, K key/value heads, D head size.

Not here: KV caches, adapter slots and the decode fast path (see
`clora_feedback.engine.decoder`), losses (see `clora_feedback.train`).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from clora_feedback.model.base import BaseWeights


class LoRAUpdate(Protocol):
    """Where a forward pass gets each projection's LoRA update from."""

    def delta(self, layer: int, group: str, x: torch.Tensor) -> torch.Tensor | None:
        """The update of fused projection `group` (see `GROUPS`) of decoder layer `layer`.

        Args:
            layer: decoder layer index.
            group: "qkv", "o", "gate_up" or "down".
            x: [B, T, in] the projection's input.

        Returns:
            [B, T, out_group] to add to the base projection, or None when no row has one.
        """
        ...


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as HF Llama computes it: normalise in fp32, cast back, then scale."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[..., D] -> [..., D]: (-x2, x1) for the halves x1, x2 of the last dimension."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of x [..., D] with tables broadcastable to it."""
    return x * cos + rotate_half(x) * sin


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """The sin table [P, D] with its first half negated, for `rope_signed`."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)


def rope_signed(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """`apply_rope` with a pre-signed sin (`signed_sin`): rotate_half(x) * sin is
    roll(x, D/2) * sin_signed, one roll instead of two slices, a negation and a cat
    (forward and backward), with the same values."""
    return torch.addcmul(x * cos, torch.roll(x, x.shape[-1] // 2, -1), sin_signed)


def project(
    base: BaseWeights, x: torch.Tensor, layer: int, group: str, lora: LoRAUpdate | None
) -> torch.Tensor:
    """x [B, T, in] -> [B, T, out]: the fused base projection plus each row's LoRA update."""
    y = F.linear(x, base.layers[layer][group], base.bias(layer, group))
    delta = lora.delta(layer, group, x) if lora is not None else None
    return y if delta is None else y + delta


def split_qkv(
    base: BaseWeights, qkv: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [B, T, (H+2K)*D], positions [B, T] -> q [B, H, T, D], k, v [B, K, T, D], RoPE applied."""
    c = base.config
    b, t, _ = qkv.shape
    kv = c.num_kv_heads * c.head_dim
    q, k, v = qkv.split([c.num_heads * c.head_dim, kv, kv], -1)
    q = q.view(b, t, c.num_heads, c.head_dim).transpose(1, 2)
    k = k.view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2)
    v = v.view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2)
    cos, sin = base.cos[positions].unsqueeze(1), base.sin[positions].unsqueeze(1)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def attention_inputs(
    base: BaseWeights,
    layer: int,
    h: torch.Tensor,
    positions: torch.Tensor,
    lora: LoRAUpdate | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Residual stream h [B, T, hidden] -> q, k, v of `layer` (pre-norm, projection, RoPE)."""
    x = rms_norm(h, base.layers[layer]["in_norm"], base.config.rms_norm_eps)
    return split_qkv(base, project(base, x, layer, "qkv", lora), positions)


def attention_output(
    base: BaseWeights, layer: int, h: torch.Tensor, attn: torch.Tensor, lora: LoRAUpdate | None
) -> torch.Tensor:
    """h [B, T, hidden] plus the output projection of attn [B, H, T, D]."""
    b, _, t, _ = attn.shape
    return h + project(base, attn.transpose(1, 2).reshape(b, t, -1), layer, "o", lora)


def mlp_block(
    base: BaseWeights, layer: int, h: torch.Tensor, lora: LoRAUpdate | None
) -> torch.Tensor:
    """h [B, T, hidden] plus the SwiGLU MLP of its post-attention norm."""
    x = rms_norm(h, base.layers[layer]["post_norm"], base.config.rms_norm_eps)
    gate, up = project(base, x, layer, "gate_up", lora).chunk(2, dim=-1)
    return h + project(base, F.silu(gate) * up, layer, "down", lora)


def final_norm(base: BaseWeights, h: torch.Tensor) -> torch.Tensor:
    """The last RMSNorm, h [..., hidden] -> [..., hidden] (what the vocabulary projection reads)."""
    return rms_norm(h, base.final_norm, base.config.rms_norm_eps)


def forward_hidden(
    base: BaseWeights, input_ids: torch.Tensor, lora: LoRAUpdate | None = None
) -> torch.Tensor:
    """The plain causal forward: input_ids [B, T] (right-padded) -> final hidden [B, T, hidden].

    The reference the fast paths are checked against; right padding is never
    seen by a real token, since attention is causal.
    """
    b, t = input_ids.shape
    positions = torch.arange(t, device=input_ids.device).unsqueeze(0).expand(b, t)
    h = base.embed[input_ids]
    for i in range(base.config.num_layers):
        q, k, v = attention_inputs(base, i, h, positions, lora)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        h = mlp_block(base, i, attention_output(base, i, h, attn, lora), lora)
    return final_norm(base, h)


def gather_logprobs(
    hidden: torch.Tensor, lm_head: torch.Tensor, targets: torch.Tensor, chunk: int = 512
) -> torch.Tensor:
    """log_softmax(hidden @ lm_head.T)[targets] for hidden [N, hidden], targets [N] -> [N] fp32.

    In chunks of `chunk` rows, to bound the [N, V] logits memory.
    """
    out = []
    # split, not slices: its backward is one cat, not a zero-filled [N, hidden] per chunk
    for part, wanted in zip(hidden.split(chunk), targets.split(chunk), strict=True):
        lp = torch.log_softmax((part @ lm_head.t()).float(), dim=-1)
        out.append(lp.gather(1, wanted.unsqueeze(1)).squeeze(1))
    return torch.cat(out) if out else hidden.new_zeros(0)
