"""Global scale search (spec 5.4 step 4): the factor g that makes the regularized weight fit the
codebook best, measured by Viterbi-encoding a sample of tiles at candidate scales.

Effort is a knob: the reference's grid (10 coarse + 5 fine points on ~50-100 tiles) is cheap on a
GPU; on a CPU `fast` uses 6 coarse and 3 fine points on a smaller sample, which finds the same
optimum to within a few percent of g (the error curve is flat near its minimum)."""
from __future__ import annotations

import torch

from engine.formats.exl3 import to_stream_tiles
from engine.quantize.viterbi import encode_tiles


def sample_tiles(w: torch.Tensor, max_tiles: int) -> torch.Tensor:
    """A wrapped diagonal band of width 3 over the tile grid plus the highest- and lowest-energy
    tiles, capped at max_tiles; deterministic."""
    tiles = to_stream_tiles(w)
    ti, tj, _ = tiles.shape
    idx = []
    for i in range(max(ti, tj)):
        for d in range(3):
            idx.append((i % ti) * tj + (i + d) % tj)
    flat = tiles.reshape(-1, 256)
    energy = flat.square().mean(dim=1)
    extra = min(max(8, len(idx) // 16), flat.shape[0] // 2)
    order = torch.argsort(energy)
    idx += order[-extra:].tolist() + order[:extra].tolist()
    idx = list(dict.fromkeys(idx))  # unique, order kept
    if len(idx) > max_tiles:
        step = len(idx) / max_tiles
        idx = [idx[int(i * step)] for i in range(max_tiles)]
    return flat[idx]


def _mse_grid(tiles: torch.Tensor, grid: list[float], K: int, codebook: str) -> list[float]:
    """Error of every candidate scale, all encoded in one batch (one Viterbi call on a GPU)."""
    g = torch.tensor(grid, dtype=tiles.dtype, device=tiles.device).view(-1, 1, 1)
    scaled = (tiles.unsqueeze(0) * g).reshape(-1, 256)
    _, dec = encode_tiles(scaled, K, codebook)
    err = (dec.view(len(grid), -1, 256) / g - tiles.unsqueeze(0)).square().mean(dim=(1, 2))
    return [float(e) for e in err]


def search_scale(w: torch.Tensor, K: int, codebook: str, effort: str = "full") -> float:
    """Best global scale g for regularized w [in, out] (w·g is what gets encoded)."""
    if effort == "full":
        sample = sample_tiles(w, 128)
        coarse_grid = [0.1 + 0.2 * i for i in range(10)]
        coarse_sample = sample[::3]
        fine_step = 0.075
    else:
        sample = sample_tiles(w, 9)
        coarse_grid = [0.4, 0.6, 0.8, 1.0, 1.2]
        coarse_sample = sample[::3]
        fine_step = 0.1
    coarse = _mse_grid(coarse_sample, coarse_grid, K, codebook)
    g0 = coarse_grid[min(range(len(coarse)), key=coarse.__getitem__)]
    offsets = [-2, -1, 0, 1, 2] if effort == "full" else [-1, 0, 1]
    grid = [g0 + o * fine_step for o in offsets]
    grid = [g for g in grid if g > 0.01]
    errs = _mse_grid(sample, grid, K, codebook)
    j = min(range(len(errs)), key=errs.__getitem__)
    g = grid[j]
    if 0 < j < len(grid) - 1:
        e0, e1, e2 = errs[j - 1], errs[j], errs[j + 1]
        denom = e0 - 2 * e1 + e2
        if denom > 0:
            off = 0.5 * (e0 - e2) / denom
            g += max(-0.5, min(0.5, off)) * fine_step
    return max(g, 0.01)
