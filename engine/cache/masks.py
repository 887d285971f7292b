"""Which cached keys a query may attend to, as the bool masks `engine.models.layers.attention` takes.

These live beside the caches because the answer depends on how a cache lays its keys out; the
model only asks its cache (`KVCache.mask`) for the mask that fits the keys `update` returns.
"""
from __future__ import annotations

import torch


def causal_mask(start: int, length: int, window: int | None, device: torch.device | str) -> torch.Tensor:
    """bool [length, start+length]: query at position p sees keys at p-window < k <= p."""
    q_pos = torch.arange(start, start + length, device=device)[:, None]
    k_pos = torch.arange(start + length, device=device)[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    return allowed


def attention_mask(start: int, length: int, window: int | None, device: torch.device | str) -> torch.Tensor | None:
    """The mask `attention` needs, or None when plain causal attention is the same thing."""
    if window is None or start + length <= window:
        return None
    return causal_mask(start, length, window, device)
