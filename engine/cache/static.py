"""A KV cache whose one-token decode step has static shapes, so the step can be a CUDA graph.

KVCache slices its buffers to the stored length, a host integer that changes every token; a
CUDA graph replays fixed shapes and fixed host values. So for a one-token forward this cache:

- keeps the write position on the device (`position`, long [1]): `update` writes there with
  index_copy_ and `advance` adds to it, so a replayed graph moves itself on by one token;
- attends over a fixed `span` of slots (a power of two >= min_span, capped at max_len), with a
  mask computed on the device that hides the slots after the position (and, for sliding-window
  layers, the slots that fell out of the window).

The span only changes when the sequence crosses a power of two, so a long decode replays a
handful of graphs (engine.generate.graph_decode keys them by span), and past min_span no step
reads more than twice the keys it needs, however large max_len is.

Multi-token forwards (prefill) are never captured: they take KVCache's exact-length path, which
keeps SDPA's causal kernels. `length` (host) and `position` (device) always hold the same count;
whoever replays a graph adds to `length` itself, since the graph only moves `position`.
"""
from __future__ import annotations

import torch

from engine import ops
from engine.cache.contiguous import KVCache

MIN_SPAN = 256
ROPE_TABLE_CHUNK = 8192  # positions per step when a cache builds its RoPE table


class StaticKVCache(KVCache):
    def __init__(self, num_layers: int, batch: int, num_kv_heads: int, head_dim: int, max_len: int,
                 dtype: torch.dtype, device: torch.device | str, min_span: int = MIN_SPAN):
        super().__init__(num_layers, batch, num_kv_heads, head_dim, max_len, dtype, device)
        self.min_span = min_span
        self.position = torch.zeros(1, dtype=torch.long, device=self.device)
        self.slots = torch.arange(max_len, device=self.device)  # slot i holds the token at position i
        # The one-token mask's two values (mask(): one where() picks between them).
        self._attend = torch.zeros((), dtype=dtype, device=self.device)
        self._hide = torch.full((), float("-inf"), dtype=dtype, device=self.device)
        self._rope_tables: dict = {}

    def span(self, new_tokens: int = 1) -> int:
        """How many slots the next forward attends over: the stored ones exactly for a prefill,
        the smallest power-of-two bucket that holds them for a one-token step."""
        end = self.length + new_tokens
        if new_tokens > 1:
            return end
        span = self.min_span
        while span < end:
            span *= 2
        return min(span, self.max_len)

    def positions(self, new_tokens: int) -> torch.Tensor:
        """For one token the live counter itself, not a copy (a kernel less per step): it moves
        on at advance(), so read it before."""
        if new_tokens > 1:
            return super().positions(new_tokens)
        return self.position

    def mask(self, new_tokens: int, window: int | None) -> torch.Tensor | None:
        """For one token: [1, span] of the slots at positions p-window < k <= p; bool (True =
        may attend), or on the GPU additive (0 / -inf in the cache dtype): SDPA turns a bool mask
        into that itself, in three kernels per layer, where this is three per token."""
        if new_tokens > 1:
            return super().mask(new_tokens, window)
        keys = self.slots[:self.span(1)]
        allowed = keys <= self.position
        if window is not None:
            allowed &= keys > self.position - window
        if self.device.type == "cuda":
            return torch.where(allowed, self._attend, self._hide)[None, :]
        return allowed[None, :]

    def rope_rows(self, rotary, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """rotary(positions, dtype) for a one-token step: cos, sin [1, D] at `position`, one row of
        a table this cache makes once per rotary (its slots' rows, computed by rotary itself, so
        the same bits) instead of six elementwise kernels every step. The table lives with the
        cache, as long as the graphs that read it."""
        table = self._rope_tables.get(id(rotary))
        if table is None or table.dtype != dtype:
            self._rope_tables.pop(id(rotary), None)
            table = None
            for start in range(0, self.max_len, ROPE_TABLE_CHUNK):  # chunks: the fp32 angles stay small
                cos, sin = rotary(self.slots[start:start + ROPE_TABLE_CHUNK], dtype)
                if table is None:  # [max_len, 2, D]
                    table = torch.empty(self.max_len, 2, cos.shape[-1], dtype=dtype, device=self.device)
                table[start:start + cos.shape[0], 0] = cos
                table[start:start + cos.shape[0], 1] = sin
            self._rope_tables[id(rotary)] = table
        rows = table.index_select(0, self.position)
        return rows[:, 0], rows[:, 1]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store one token's k, v [B, Hkv, 1, D] at `position`; return the first `span` slots
        (the mask hides the ones not yet written or out of the window)."""
        if k.shape[2] > 1:
            return super().update(layer, k, v)
        self.keys[layer].index_copy_(2, self.position, k)
        self.values[layer].index_copy_(2, self.position, v)
        span = self.span(1)
        return self.keys[layer][:, :, :span], self.values[layer][:, :, :span]

    def pending_rope(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, head_norms=None, window: int | None = None) -> "ops.PendingRope":
        """One token's RoPE and cache write (after the q and k `head_norms`, where a model has
        them), not run yet: the decode attention kernel does them itself where it can (one to
        three kernels less per layer); elsewhere apply() runs them. q, k, v come as the
        projections give them, [B, 1, heads, D]. `window`: the layer's sliding window (mask()
        hides the slots outside it), which the kernel may walk alone."""
        span = self.span(1)
        return ops.PendingRope(q.transpose(1, 2), self.keys[layer][:, :, :span], self.values[layer][:, :, :span],
                               k, v, cos, sin, self.position, head_norms, window)

    def advance(self, new_tokens: int) -> None:
        super().advance(new_tokens)
        self.position.add_(new_tokens)

    def reset(self) -> None:
        super().reset()
        self.position.zero_()

    def truncate(self, length: int) -> None:
        super().truncate(length)
        self.position.fill_(length)
