"""The simplest KV cache: one preallocated [batch, kv_heads, max_len, head_dim] pair per layer.

All rows of a batch share one length (no padding, no paging); the paged cache for continuous
batching comes later and keeps the same contract. One forward of T new tokens asks the cache,
in this order: `positions(T)` and `mask(T, window)` (where the tokens go and which keys they
see), `update` per layer (store and return the keys to attend), then `advance(T)`.
"""
from __future__ import annotations

import torch

from engine.cache.masks import attention_mask
from engine.errors import TrellisError


class CacheFull(TrellisError):
    """More tokens than the cache was allocated for."""


class KVCache:
    def __init__(self, num_layers: int, batch: int, num_kv_heads: int, head_dim: int, max_len: int,
                 dtype: torch.dtype, device: torch.device | str):
        if batch < 1 or max_len < 1:
            raise TrellisError(f"a KV cache needs batch >= 1 and max_len >= 1 (got {batch}, {max_len})")
        shape = (batch, num_kv_heads, max_len, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.batch = batch
        self.max_len = max_len
        self.device = torch.device(device)
        self.length = 0  # tokens already stored (and attended to by the next forward)

    def check_room(self, new_tokens: int, batch: int) -> None:
        if batch != self.batch:
            raise TrellisError(f"input batch {batch} does not match the cache's batch {self.batch}")
        if self.length + new_tokens > self.max_len:
            raise CacheFull(f"context full: {self.length} + {new_tokens} tokens exceed the cache size {self.max_len}")

    def positions(self, new_tokens: int) -> torch.Tensor:
        """Positions [T] of the next T tokens (the rope angles)."""
        return torch.arange(self.length, self.length + new_tokens, device=self.device)

    def mask(self, new_tokens: int, window: int | None) -> torch.Tensor | None:
        """The attention mask for the next T tokens over the keys `update` will return."""
        return attention_mask(self.length, new_tokens, window, self.device)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this step's k, v [B, Hkv, T, D] after the first `length` positions; return all of them."""
        end = self.length + k.shape[2]
        self.keys[layer][:, :, self.length:end] = k
        self.values[layer][:, :, self.length:end] = v
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def advance(self, new_tokens: int) -> None:
        """Called once per forward, after every layer has stored its part."""
        self.length += new_tokens

    def reset(self) -> None:
        self.length = 0

    def truncate(self, length: int) -> None:
        """Forget everything after `length` tokens (e.g. to re-run from a shared prefix)."""
        if not 0 <= length <= self.length:
            raise TrellisError(f"cannot truncate a cache of {self.length} tokens to {length}")
        self.length = length

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)
