"""What every model family provides to the generator, whatever its internals."""
from __future__ import annotations

import torch
from torch import nn

from engine.cache.contiguous import KVCache
from engine.io.hf_config import ModelConfig


class CausalLM(nn.Module):
    """`forward(input_ids [B, T], cache=None) -> logits fp32 [B, T, config.vocab_size]`.

    With a cache, the T new tokens sit at positions cache.length .. cache.length+T-1, their keys
    and values are appended, and cache.length grows by T.
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

    def _start(self, input_ids: torch.Tensor, cache: KVCache | None) -> int:
        """Position of the first new token (checks that the cache has room for all of them)."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, tokens], got shape {list(input_ids.shape)}")
        if cache is None:
            return 0
        cache.check_room(input_ids.shape[1], input_ids.shape[0])
        return cache.length
