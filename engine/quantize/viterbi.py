"""Tail-biting Viterbi encoder for EXL3 trellis tiles (spec section 5.6), in plain torch ops.

A tile is 256 target values in stream order. The trellis state after step p is 16 bits; its low
16-K bits (the "edge") carry over to the next step, which appends K new symbol bits. We keep one
best path cost per edge and per tile, and step through the 256 positions; every step is a few
whole-tensor ops over [tiles, 65536 states], so the same code is vectorized on a CPU and runs at
GPU speed on a CUDA device.

Layout trick: state s = k·N + e (k = top K bits, e = edge, N = 2^(16-K)). Its predecessor edge
is s >> K = k·2^(16-2K) + (e >> K), so the previous costs [B, N] viewed as [B, 2^K, N/2^K, 1] and
broadcast over the low K bits of e line up with the states viewed as [B, 2^K, N]: no gather.

Tail-biting (the stream is a cycle): pass A runs over the rotated order (128..255, 0..127) with a
free start and reads off the edge that enters step 0 on its best path; pass B runs 0..255 with
the start forced to that edge and ends on it, so the emitted states are always a consistent
cycle. Unlike upstream (which reads the second-to-last step's costs in pass A), we take the true
final argmin. Costs are fp32 (upstream uses fp16); the squared target term is constant over the
states of a step and is dropped.
"""
from __future__ import annotations

import functools

import torch

from engine.formats.exl3 import codebook_lut

STEPS = 256
_INF = float("inf")


@functools.lru_cache(maxsize=16)
def _lut_terms(codebook: str, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    lut = codebook_lut(codebook, device).float()
    return lut, lut * lut


def _max_batch(K: int, device: torch.device) -> int:
    """Tiles per Viterbi batch: back-pointers are 256·2^(16-K) bytes per tile."""
    budget = (1 << 31) if device.type == "cuda" else (1 << 27)
    per_tile = STEPS * (1 << (16 - K)) + 6 * 65536 * 4
    cap = 4096 if device.type == "cuda" else 32
    return max(1, min(cap, budget // per_tile))


def _forward(targets: torch.Tensor, K: int, lut: torch.Tensor, lut2: torch.Tensor,
             start_edge: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Viterbi over targets [B, T]; returns final costs [B, N] and back-pointers [T, B, N] (k)."""
    B, T = targets.shape
    N = 1 << (16 - K)
    nk = 1 << K
    dev = targets.device
    back = torch.empty(T, B, N, dtype=torch.uint8, device=dev)
    lut_k = lut.view(1, nk, N)
    lut2_k = lut2.view(1, nk, N)
    if start_edge is None:
        cost = torch.zeros(B, N, device=dev)
    else:
        cost = torch.full((B, N), _INF, device=dev)
        cost.scatter_(1, start_edge.view(B, 1), 0.0)
    w2 = (-2.0 * targets).view(B, T, 1, 1)
    for p in range(T):
        # err(s) up to a constant: lut² - 2·w·lut, as [B, 2^K, N]
        step = torch.addcmul(lut2_k, w2[:, p], lut_k)
        # + cost of predecessor edge (k·N/2^K + e>>K), broadcast over the low K bits of e
        step = step.view(B, nk, N // nk, nk).add_(cost.view(B, nk, N // nk, 1))
        cost, arg = step.view(B, nk, N).min(dim=1)
        back[p] = arg.to(torch.uint8)
    return cost, back


def _traceback(back: torch.Tensor, end_edge: torch.Tensor, K: int) -> torch.Tensor:
    """Follow back-pointers from end_edge [B] at the last step; returns states [B, T]."""
    T, B, _ = back.shape
    N = 1 << (16 - K)
    states = torch.empty(B, T, dtype=torch.int64, device=back.device)
    e = end_edge.to(torch.int64)
    rows = torch.arange(B, device=back.device)
    for p in range(T - 1, -1, -1):
        k = back[p, rows, e].to(torch.int64)
        s = k * N + e
        states[:, p] = s
        e = s >> K
    return states


def _encode_batch(targets: torch.Tensor, K: int, codebook: str) -> torch.Tensor:
    lut, lut2 = _lut_terms(codebook, str(targets.device))
    half = STEPS // 2
    rotated = torch.cat([targets[:, half:], targets[:, :half]], dim=1)
    cost, back = _forward(rotated, K, lut, lut2, None)
    path = _traceback(back, cost.argmin(dim=1), K)
    del back
    # rotated position half-1 is original step 255; its edge enters step 0
    e_star = path[:, half - 1] & ((1 << (16 - K)) - 1)
    cost, back = _forward(targets, K, lut, lut2, e_star)
    return _traceback(back, e_star, K)


@torch.no_grad()
def encode_tiles(targets: torch.Tensor, K: int, codebook: str = "mul1",
                 batch: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize tiles [..., 256] (stream order) to trellis states.

    Returns (states int32 [..., 256], decoded fp32 [..., 256]); `decoded` is exactly what
    `reconstruct` yields from the packed states (the codebook value of each state)."""
    if not 1 <= K <= 8:
        raise ValueError(f"K must be 1..8, got {K}")
    shape = targets.shape
    flat = targets.reshape(-1, STEPS).float()
    # match the decoder's input precision: the target is what an fp16 pipeline would see
    flat = flat.half().float()
    n = flat.shape[0]
    batch = batch or _max_batch(K, flat.device)
    states = torch.empty(n, STEPS, dtype=torch.int32, device=flat.device)
    for a in range(0, n, batch):
        states[a:a + batch] = _encode_batch(flat[a:a + batch], K, codebook).to(torch.int32)
    lut, _ = _lut_terms(codebook, str(flat.device))
    decoded = lut[states.long()]
    return states.reshape(shape), decoded.reshape(shape)
