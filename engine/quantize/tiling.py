"""Cutting a matrix into 16×16 tiles in trellis stream order, and putting decoded tiles back.

The encoder sees each tile as 256 values in stream order (spec section 3.4); the stored trellis
stays in that order, so only the targets and the decoded values need permuting."""
from __future__ import annotations

import torch

from engine.formats.exl3 import STREAM_TO_TILE, TILE


def to_stream_tiles(w: torch.Tensor) -> torch.Tensor:
    """[rows, cols] (multiples of 16) -> [rows/16, cols/16, 256] in stream order."""
    r, c = w.shape
    tiles = w.reshape(r // TILE, TILE, c // TILE, TILE).permute(0, 2, 1, 3).reshape(r // TILE, c // TILE, TILE * TILE)
    return tiles[..., STREAM_TO_TILE.to(w.device)]


def from_stream_tiles(t: torch.Tensor) -> torch.Tensor:
    """Inverse of to_stream_tiles: [ti, tj, 256] -> [ti*16, tj*16]."""
    ti, tj, _ = t.shape
    flat = torch.empty_like(t)
    flat[..., STREAM_TO_TILE.to(t.device)] = t
    return flat.reshape(ti, tj, TILE, TILE).permute(0, 2, 1, 3).reshape(ti * TILE, tj * TILE)
