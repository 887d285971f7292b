"""Block LDL decomposition and LDLQ feedback quantization (spec 5.3 step 5 and 5.5).

With H' = L·D·Lᵀ (L block-unit-lower, 16×16 blocks), choosing each 16-row block of Ŵ, last block
first, to approximate W_b + Σ_{r>b} L[r,b]ᵀ (W_r − Ŵ_r) minimizes tr(EᵀH'E) greedily.

`ldlq_job` is a generator: it yields (K, tiles) for each row block and receives (states,
decoded) back, so a driver (`run_jobs`) can merge the tile requests of many linears into one
large Viterbi call — that is what keeps a GPU (or every CPU core) busy on narrow layers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Generator

import torch

from engine.quantize.hessian import SIGMA_REG
from engine.formats.exl3 import from_stream_tiles, to_stream_tiles
from engine.quantize.viterbi import encode_tiles

BLOCK = 16


def block_ldl(H: torch.Tensor, block: int = BLOCK, retries: int = 10) -> torch.Tensor:
    """Strictly block-lower L̃ with H = (L̃ + I)·D·(L̃ + I)ᵀ; damps H further if not positive definite."""
    H = H.double()
    n = H.shape[0]
    d = float(H.diagonal().mean())
    for attempt in range(retries + 1):
        L, info = torch.linalg.cholesky_ex(H)
        if int(info) == 0:
            break
        H = H + 2 * SIGMA_REG * d * torch.eye(n, dtype=H.dtype, device=H.device)
    else:
        raise ValueError("Hessian is not positive definite even after damping")
    nb = n // block
    Lb = L.reshape(nb, block, nb, block)
    diag = torch.stack([Lb[i, :, i, :] for i in range(nb)])  # [nb, 16, 16]
    inv = torch.linalg.inv(diag)
    # right-multiply every block column j by inv(L_jj)
    Lt = torch.einsum("aibj,bjk->aibk", Lb, inv)
    for i in range(nb):
        Lt[i, :, i, :] = 0
    return Lt.reshape(n, n).float()


@dataclass
class TileResult:
    states: torch.Tensor   # int32 [in/16, out/16, 256], stream order
    w_hat: torch.Tensor    # fp32 [in, out], decoded, regularized domain


TileRequest = tuple[int, torch.Tensor]  # (K, tiles [n, 256])


def ldlq_job(w: torch.Tensor, L: torch.Tensor | None, K: int) -> Generator[TileRequest, tuple, TileResult]:
    """Quantize regularized w [in, out] with LDLQ feedback (L None: independent tiles)."""
    n_in, n_out = w.shape
    nb, nt = n_in // BLOCK, n_out // BLOCK
    states = torch.empty(nb, nt, 256, dtype=torch.int32, device=w.device)
    w_hat = torch.zeros_like(w)
    if L is None:
        st, dec = yield (K, to_stream_tiles(w).reshape(-1, 256))
        states = st.reshape(nb, nt, 256)
        w_hat = from_stream_tiles(dec.reshape(nb, nt, 256))
        return TileResult(states, w_hat)
    err = torch.zeros_like(w)  # W − Ŵ for finished rows, 0 elsewhere
    for b in range(nb - 1, -1, -1):
        r0, r1 = b * BLOCK, (b + 1) * BLOCK
        target = w[r0:r1]
        if r1 < n_in:
            target = target + L[r1:, r0:r1].T @ err[r1:]
        st, dec = yield (K, to_stream_tiles(target).reshape(nt, 256))
        states[b] = st.reshape(nt, 256)
        w_hat[r0:r1] = from_stream_tiles(dec.reshape(1, nt, 256))
        err[r0:r1] = w[r0:r1] - w_hat[r0:r1]
    return TileResult(states, w_hat)


def run_jobs(jobs: list[Generator], codebooks: list[str], **encode_kw) -> list[TileResult]:
    """Drive several ldlq_job generators, merging their tile requests per (K, codebook)."""
    results: list[TileResult | None] = [None] * len(jobs)
    pending: dict[int, TileRequest] = {}
    for i, job in enumerate(jobs):
        pending[i] = next(job)
    while pending:
        groups: dict[tuple[int, str], list[int]] = {}
        for i, (K, _) in pending.items():
            groups.setdefault((K, codebooks[i]), []).append(i)
        replies: dict[int, tuple] = {}
        for (K, cb), idx in groups.items():
            tiles = torch.cat([pending[i][1] for i in idx])
            st, dec = encode_tiles(tiles, K, cb, **encode_kw)
            a = 0
            for i in idx:
                n = pending[i][1].shape[0]
                replies[i] = (st[a:a + n], dec[a:a + n])
                a += n
        pending = {}
        for i, reply in replies.items():
            try:
                pending[i] = jobs[i].send(reply)
            except StopIteration as stop:
                results[i] = stop.value
    return results  # type: ignore[return-value]
