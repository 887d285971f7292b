"""Tail-biting Viterbi encoder for EXL3 trellis tiles (spec section 5.6), in plain torch ops.

A tile is 256 target values in stream order. The trellis state after step p is 16 bits; its low
16-K bits (the "edge") carry over to the next step, which appends K new symbol bits. We keep one
best path cost per edge and per tile, and step through the 256 positions; every step is a few
whole-tensor ops over [tiles, 65536 states], so the same code is vectorized on a CPU and runs at
GPU speed on a CUDA device.

Back-pointers (uint8, the top K bits of the best state entering each edge) make the traceback
a handful of tiny ops per step, which matters on a GPU where each op is a kernel launch.

Layout trick: state s = k·N + e (k = top K bits, e = edge, N = 2^(16-K)). Its predecessor edge
is s >> K = k·2^(16-2K) + (e >> K), so the previous costs [B, N] viewed as [B, 2^K, N/2^K, 1] and
broadcast over the low K bits of e line up with the states viewed as [B, 2^K, N]: no gather.

Tail-biting (the stream is a cycle): pass A runs with a free start over the last `warmup`
steps and `lookahead` steps past the wrap, and reads off the edge that enters step 0 on its best
path; pass B runs 0..255 with the start forced to that edge and ends on it, so the emitted states
are always a consistent cycle. Unlike upstream (which reads the second-to-last step's costs in
pass A), we take the true final argmin, and pass A covers 128 + 64 steps instead of 256 (shorter
passes, e.g. 64 + 32, cost about 1% more MSE at K = 1..2 in our measurements). Costs are fp32
(upstream uses fp16); the squared target term is constant over the states of a step and is
dropped.

On a CUDA device `encode_tiles` uses the fused kernel csrc/exl3_viterbi.cu when the extension is
available (one launch for the whole batch instead of thousands of whole-tensor ops); it makes the
same arithmetic and tie choices, so it returns the same states. TRELLIS_NO_CUDA_VITERBI=1 forces
the torch path, which stays the fallback and the kernel's test oracle.
"""
from __future__ import annotations

import functools
import os

import torch

from engine.formats.exl3 import codebook_lut
from engine.quantize import viterbi_native

STEPS = 256
_INF = float("inf")


@functools.lru_cache(maxsize=16)
def _lut_half(codebook: str, device: str) -> torch.Tensor:
    return codebook_lut(codebook, device).contiguous()


def _cuda_kernel_ok(device: torch.device, warmup: int, lookahead: int) -> bool:
    if os.environ.get("TRELLIS_NO_CUDA_VITERBI") == "1":
        return False
    if not (1 <= warmup <= STEPS and 0 <= lookahead <= STEPS):
        return False
    from engine import ops  # deferred: the CPU converter never needs the extension machinery

    return ops.kernels_available(device)


@functools.lru_cache(maxsize=16)
def _lut_terms(codebook: str, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    lut = codebook_lut(codebook, device).float()
    return lut, lut * lut


def _max_batch(K: int, device: torch.device) -> int:
    """Tiles per Viterbi batch: back-pointers take 256·2^(16-K) bytes per tile and the step
    array 65536 floats; on a CPU small batches also keep the step arrays in cache."""
    per_tile = STEPS * (1 << (16 - K)) + 3 * 65536 * 4
    if device.type == "cuda":
        return max(1, min(4096, (1 << 34) // per_tile))
    return max(1, min(8, (1 << 26) // per_tile))


def _forward(targets: torch.Tensor, K: int, lut: torch.Tensor, lut2: torch.Tensor,
             start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Viterbi over targets [B, T] from start costs [B, N]. Returns the final costs [B, N] and
    back-pointers [T, B, N] (uint8: the top K bits k of the best state entering each edge)."""
    B, T = targets.shape
    N = 1 << (16 - K)
    nk = 1 << K
    M = N // nk
    dev = targets.device
    back = torch.empty(T, B, N, dtype=torch.uint8, device=dev)
    step = torch.empty(B, nk, N, device=dev)
    cost = torch.empty(B, N, device=dev)
    arg = torch.empty(B, N, dtype=torch.int64, device=dev)
    lut_k, lut2_k = lut.view(1, nk, N), lut2.view(1, nk, N)
    w2 = (-2.0 * targets).view(B, T, 1, 1)
    prev = start
    for p in range(T):
        torch.addcmul(lut2_k, w2[:, p], lut_k, out=step)  # err(s) less the constant w²
        step.view(B, nk, M, nk).add_(prev.view(B, nk, M, 1))  # + cost of predecessor edge
        torch.min(step, dim=1, out=(cost, arg))
        back[p].copy_(arg)
        prev = cost
    return cost, back


def _traceback(back: torch.Tensor, end_edge: torch.Tensor, K: int, stop: int = 0) -> torch.Tensor:
    """Follow back-pointers from end_edge [B] after the last step down to step `stop`;
    returns states [B, T] (entries before `stop` are left 0)."""
    T, B, N = back.shape
    states = torch.zeros(B, T, dtype=torch.int64, device=back.device)
    e = end_edge.to(torch.int64).view(B, 1)
    for p in range(T - 1, stop - 1, -1):
        s = back[p].gather(1, e).to(torch.int64).mul_(N).add_(e)  # state = k·N + e
        states[:, p] = s.view(B)
        e = s >> K
    return states


def _encode_batch(targets: torch.Tensor, K: int, codebook: str, warmup: int, lookahead: int) -> torch.Tensor:
    lut, lut2 = _lut_terms(codebook, str(targets.device))
    B = targets.shape[0]
    N = 1 << (16 - K)
    # pass A: free start at step 256-warmup, run through 255 and `lookahead` steps past the wrap
    rotated = torch.cat([targets[:, STEPS - warmup:], targets[:, :lookahead]], dim=1)
    free = torch.zeros(B, N, device=targets.device)
    cost, back = _forward(rotated, K, lut, lut2, free)
    path = _traceback(back, cost.argmin(dim=1), K, stop=warmup - 1)
    del back
    e_star = path[:, warmup - 1] & (N - 1)  # edge after original step 255 = edge entering step 0
    # pass B: start forced to e_star, end on e_star: a closed cycle
    start = torch.full((B, N), _INF, device=targets.device)
    start.scatter_(1, e_star.view(B, 1), 0.0)
    _, back = _forward(targets, K, lut, lut2, start)
    return _traceback(back, e_star, K)


class _GraphedEncoder:
    """CUDA-graph replay of `_encode_batch` (opt-in: TRELLIS_CUDA_GRAPHS=1).

    One call launches ~4000 tiny kernels; on narrow layers launch overhead, not arithmetic,
    sets the speed. A graph per (batch bucket, K, codebook) replays them all at once. Batches
    are padded with zero tiles up to a bucket so only a few graphs are ever captured."""

    def __init__(self):
        self.graphs: dict[tuple, tuple] = {}

    @staticmethod
    def bucket(n: int) -> int:
        b = 16
        while b < n:
            b *= 2
        return b

    def __call__(self, targets: torch.Tensor, K: int, codebook: str, warmup: int, lookahead: int) -> torch.Tensor:
        n = targets.shape[0]
        B = self.bucket(n)
        key = (B, K, codebook, warmup, lookahead, targets.device)
        if key not in self.graphs:
            static_in = torch.zeros(B, STEPS, device=targets.device)
            side = torch.cuda.Stream(targets.device)
            side.wait_stream(torch.cuda.current_stream(targets.device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    _encode_batch(static_in, K, codebook, warmup, lookahead)
            torch.cuda.current_stream(targets.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_out = _encode_batch(static_in, K, codebook, warmup, lookahead)
            self.graphs[key] = (graph, static_in, static_out)
        graph, static_in, static_out = self.graphs[key]
        static_in.zero_()
        static_in[:n].copy_(targets)
        graph.replay()
        return static_out[:n].clone()


_graphed = _GraphedEncoder()


def _use_graphs(device: torch.device) -> bool:
    return device.type == "cuda" and os.environ.get("TRELLIS_CUDA_GRAPHS") == "1"


@torch.no_grad()
def encode_tiles(targets: torch.Tensor, K: int, codebook: str = "mul1",
                 batch: int | None = None, warmup: int = 128, lookahead: int = 64,
                 native: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize tiles [..., 256] (stream order) to trellis states.

    On a CPU the fused C encoder (viterbi_native) is used when it builds, on a GPU the fused CUDA
    kernel (csrc/exl3_viterbi.cu) when the extension is available; `native=False` forces the torch
    path (the reference both are tested against).

    Returns (states int32 [..., 256], decoded fp32 [..., 256]); `decoded` is exactly what
    `reconstruct` yields from the packed states (the codebook value of each state)."""
    if not 1 <= K <= 8:
        raise ValueError(f"K must be 1..8, got {K}")
    shape = targets.shape
    flat = targets.reshape(-1, STEPS).float()
    # match the decoder's input precision: the target is what an fp16 pipeline would see
    flat = flat.half().float()
    n = flat.shape[0]
    if native and flat.device.type == "cpu" and viterbi_native.available():
        lut, _ = _lut_terms(codebook, "cpu")
        states = viterbi_native.encode(flat, K, lut, warmup, lookahead)
    elif native and flat.is_cuda and _cuda_kernel_ok(flat.device, warmup, lookahead):
        from engine import ops

        lut_h = _lut_half(codebook, str(flat.device))
        states = ops.extension().viterbi_encode(flat.contiguous(), K, lut_h, warmup, lookahead)
    else:
        batch = batch or _max_batch(K, flat.device)
        states = torch.empty(n, STEPS, dtype=torch.int32, device=flat.device)
        encode = _graphed if _use_graphs(flat.device) else _encode_batch
        for a in range(0, n, batch):
            states[a:a + batch] = encode(flat[a:a + batch], K, codebook, warmup, lookahead).to(torch.int32)
    lut, _ = _lut_terms(codebook, str(flat.device))
    decoded = lut[states.long()]
    return states.reshape(shape), decoded.reshape(shape)
