"""The embedded engine's prefix cache: keys/values of token blocks kept across requests.

A sequence's tokens are cut into blocks of `block_tokens`; block i is named by
a chain digest, blake2b(digest of block i-1, identity, tokens of block i), so
one name stands for the whole prefix up to the block's end. `identity` is what
the KV cache row was computed with: the slot's (agent, version, content tag)
(see `slots.SlotIdentity`). LoRA applies to the k/v projections, so the same
tokens under another adapter, another version, or a reload of the same version
with other weights, have other keys and values: they never share a name, and a
publish can never serve blocks computed by the version before it.

Blocks are copies, not shared pages: `load` copies a hit prefix into a
sequence's row of the `KVCache` (positions 0.., so RoPE is already right) and
the engine prefills only the rest; `store` copies finished blocks out of a row.
Memory is bounded by `capacity_bytes`, least recently used blocks evicted
first; a hit touches its chain leaf first, so a shared prefix (a system prompt)
outlives the conversations that extend it.

Not here: when to look up or store (see `embedded`), the KV layout (see `model.KVCache`),
which weights sit in which slot (see `slots`).
"""

from __future__ import annotations

import array
import hashlib
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from clora_feedback.engine.decoder import KVCache
from clora_feedback.engine.slots import SlotIdentity
from clora_feedback.engine.types import PrefixCacheStats

BLOCK_TOKENS = 16
"""Tokens per cached block."""


@dataclass(eq=False)
class _Block:
    """Keys and values of one block for every layer: k, v [L, kv_heads, block_tokens, D]."""

    k: torch.Tensor
    v: torch.Tensor


@dataclass(eq=False)
class PrefixChain:
    """One sequence's block names, grown as its tokens are known.

    Attributes:
        identity: what the sequence's cache row is computed with.
        digests: chain digest of each full block named so far.
        stored: leading blocks known to be in the cache (found or stored).
        valid: false once the row's weights changed under it (a flip mid-request):
            its later blocks mix versions and are never stored.
    """

    identity: SlotIdentity
    digests: list[bytes] = field(default_factory=list)
    stored: int = 0
    valid: bool = True

    def extend(self, tokens: Sequence[int], blocks: int, block_tokens: int) -> None:
        """Name the first `blocks` full blocks of `tokens` (those not named yet)."""
        tag = repr(self.identity).encode()
        for i in range(len(self.digests), blocks):
            chunk = tokens[i * block_tokens : (i + 1) * block_tokens]
            h = hashlib.blake2b(self.digests[-1] if self.digests else b"", digest_size=16)
            h.update(tag)
            h.update(array.array("q", chunk).tobytes())
            self.digests.append(h.digest())


class PrefixCache:
    """Blocks of keys/values by chain digest, LRU within a byte bound.

    The engine's step thread calls `start`, `load` and `store`; `stats` and `clear`
    may come from any thread (one lock guards the blocks and the counters).

    Args:
        cache: the engine's KV cache (its layout and dtype are the blocks').
        capacity_bytes: most bytes the blocks may take.
        block_tokens: tokens per block.
    """

    def __init__(
        self, cache: KVCache, capacity_bytes: int, block_tokens: int = BLOCK_TOKENS
    ) -> None:
        layers, _, kv_heads, _, head_dim = cache.k.shape
        self.block_tokens = block_tokens
        self.block_bytes = 2 * layers * kv_heads * block_tokens * head_dim * cache.k.element_size()
        self.capacity_bytes = capacity_bytes
        self._blocks: OrderedDict[bytes, _Block] = OrderedDict()
        self._lock = threading.Lock()
        self._hits = 0
        self._misses = 0
        self._evictions = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._blocks)

    def start(self, tokens: Sequence[int], identity: SlotIdentity) -> tuple[PrefixChain, int]:
        """Begin a sequence: find its longest cached block-aligned prefix.

        At least one token is left to prefill (the forward over it gives the
        first token's logits), so at most (len(tokens) - 1) // block_tokens blocks hit.

        Returns:
            the sequence's chain and how many leading blocks are cached (for `load`).
        """
        chain = PrefixChain(identity)
        full = (len(tokens) - 1) // self.block_tokens
        chain.extend(tokens, full, self.block_tokens)
        with self._lock:
            found = 0
            while found < full and chain.digests[found] in self._blocks:
                found += 1
            for digest in reversed(chain.digests[:found]):  # leaf first: ancestors stay fresher
                self._blocks.move_to_end(digest)
            chain.stored = found
            self._hits += found
            self._misses += full - found
        return chain, found

    def load(self, chain: PrefixChain, blocks: int, cache: KVCache, row: int) -> int:
        """Copy the chain's first `blocks` blocks into `row` of `cache`; returns tokens loaded.

        Blocks dropped since `start` (a `clear` from another thread) shorten the load.
        """
        with self._lock:
            found = []
            for digest in chain.digests[:blocks]:
                block = self._blocks.get(digest)
                if block is None:
                    break
                found.append(block)
        if not found:
            return 0
        end = len(found) * self.block_tokens
        cache.k[:, row, :, :end] = torch.cat([b.k for b in found], dim=2)
        cache.v[:, row, :, :end] = torch.cat([b.v for b in found], dim=2)
        return end

    def store(
        self, chain: PrefixChain, tokens: Sequence[int], upto: int, cache: KVCache, row: int
    ) -> None:
        """Keep the full blocks of `tokens[:upto]` whose keys/values `row` holds.

        Args:
            chain: the sequence's chain (extended here as far as `upto` allows).
            tokens: the sequence's tokens so far (prompt, then generated).
            upto: positions 0..upto-1 of `row` hold this sequence's keys/values.
            cache: the engine's KV cache.
            row: the sequence's row.
        """
        blocks = upto // self.block_tokens
        if not chain.valid or blocks <= chain.stored or self.block_bytes > self.capacity_bytes:
            return
        chain.extend(tokens, blocks, self.block_tokens)
        b, dense = self.block_tokens, torch.contiguous_format
        with self._lock:
            for i in range(chain.stored, blocks):
                digest = chain.digests[i]
                if digest not in self._blocks:
                    self._make_room()
                    self._blocks[digest] = _Block(
                        cache.k[:, row, :, i * b : (i + 1) * b].clone(memory_format=dense),
                        cache.v[:, row, :, i * b : (i + 1) * b].clone(memory_format=dense),
                    )
            for digest in reversed(chain.digests[:blocks]):
                if digest in self._blocks:
                    self._blocks.move_to_end(digest)
        chain.stored = blocks

    def _make_room(self) -> None:
        """Evict least recently used blocks until one more fits (caller holds the lock)."""
        while (len(self._blocks) + 1) * self.block_bytes > self.capacity_bytes:
            self._blocks.popitem(last=False)
            self._evictions += 1

    def clear(self) -> None:
        """Drop every block (counters are kept)."""
        with self._lock:
            self._blocks.clear()

    def stats(self) -> PrefixCacheStats:
        with self._lock:
            blocks = len(self._blocks)
            return PrefixCacheStats(
                block_tokens=self.block_tokens,
                hits=self._hits,
                misses=self._misses,
                evictions=self._evictions,
                blocks=blocks,
                bytes=blocks * self.block_bytes,
                capacity_bytes=self.capacity_bytes,
            )
