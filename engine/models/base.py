"""What every model family provides to the generator, whatever its internals."""
from __future__ import annotations

import torch
from torch import nn

from engine.cache.contiguous import KVCache
from engine.cache.masks import attention_mask
from engine.cache.static import MIN_SPAN, StaticKVCache
from engine.io.hf_config import ModelConfig


class CausalLM(nn.Module):
    """`forward(input_ids [B, T], cache=None) -> logits fp32 [B, T, config.vocab_size]`.

    With a cache, the T new tokens sit at positions cache.length .. cache.length+T-1, their keys
    and values are appended, and cache.length grows by T. Subclasses have `layers`, each with a
    `self_attn.window`.

    A one-token forward with a StaticKVCache never reads a device value on the host (positions,
    masks and cache writes all stay on the device), so it can be captured in a CUDA graph:
    engine.generate.graph_decode does that, and new model code must keep it that way.
    """

    config: ModelConfig

    def __init__(self, config: ModelConfig, device: torch.device, dtype: torch.dtype):
        super().__init__()
        self.config = config
        self.device = device
        self.dtype = dtype

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        c = self.config
        return KVCache(c.num_layers, batch, c.num_kv_heads, c.head_dim, max_len, self.dtype, self.device)

    def new_static_cache(self, batch: int, max_len: int, min_span: int = MIN_SPAN) -> StaticKVCache:
        """A cache whose one-token forwards can be captured in a CUDA graph (see engine.cache.static)."""
        c = self.config
        return StaticKVCache(c.num_layers, batch, c.num_kv_heads, c.head_dim, max_len, self.dtype, self.device,
                             min_span)

    def rope(self, rotary, positions: torch.Tensor, cache: KVCache | None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of `rotary` at `positions` in the model's dtype; a one-token step over a
        StaticKVCache reads them from the cache's table (one kernel instead of six per step)."""
        if isinstance(cache, StaticKVCache) and positions.numel() == 1:
            return cache.rope_rows(rotary, self.dtype)
        return rotary(positions, self.dtype)

    def _attention_inputs(self, input_ids: torch.Tensor, cache: KVCache | None):
        """(positions [T] of the new tokens, {window: mask} for each window size the layers use).

        With a cache, both come from it (it knows where the tokens go and which of its keys they
        may see) after checking it has room for all of them."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, tokens], got shape {list(input_ids.shape)}")
        B, T = input_ids.shape
        windows = {layer.self_attn.window for layer in self.layers}
        if cache is None:
            return (torch.arange(T, device=self.device),
                    {w: attention_mask(0, T, w, self.device) for w in windows})
        cache.check_room(T, B)
        return cache.positions(T), {w: cache.mask(T, w) for w in windows}
