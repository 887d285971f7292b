"""The token pick's GPU side (csrc/token_pick.cu): greedy decoding's argmax and the sampler's top-k
and draw, each a small kernel where torch takes several launches on a 128k-entry row. TOPK_KERNEL
stays in engine.ops with the other settings, read at call time.
"""
from __future__ import annotations

import torch

from engine import ops  # a cycle (ops imports this module first): used at call time only


def argmax(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, -1): one kernel on CUDA (greedy decoding's pick, once a token from 128k
    logits, where torch's reduce takes two launches and ~30 us)."""
    if (x.is_cuda and x.dim() >= 1 and x.dtype in (torch.float32, torch.float16) and x.numel() > 0
            and x.shape[-1] < 2**31 and x.numel() // x.shape[-1] < 65536 and ops._kernels_ready()):
        rows = x.reshape(-1, x.shape[-1])
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        scratch = ops._zeroed(_argmax_scratch, x.device, 2 * rows.shape[0], 128, torch.int64)
        return ops.extension().argmax_rows(rows, scratch).reshape(x.shape[:-1])
    return torch.argmax(x, dim=-1)


_argmax_scratch: dict = {}


def topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk(x, k) of a 1-d vector: (values, indices), largest first. On a GPU with the
    kernels, for fp32 and k <= 64 (the kernel's limits: topk_small_serves), two small launches;
    ties then go to the lower index (torch.topk leaves their order open) and NaN counts as the
    largest value, as in torch.topk."""
    if (ops.TOPK_KERNEL and x.is_cuda and x.dim() == 1 and x.dtype == torch.float32 and ops._kernels_ready()
            and ops.extension().topk_small_serves(x.numel(), k)):
        vals, ids = ops.extension().topk_small(x.contiguous(), k)
        return vals, ids
    return torch.topk(x, k)


def sample_top_available(logits: torch.Tensor) -> bool:
    """Whether sample_top can serve a draw from these logits (fp32 on a GPU with the kernels)."""
    return logits.is_cuda and logits.dtype == torch.float32 and ops._kernels_ready()


def sample_top(vals: torch.Tensor, ids: torch.Tensor, top: torch.Tensor, z: torch.Tensor | None,
               top_p: float, min_p: float, u: torch.Tensor) -> torch.Tensor:
    """engine.generate.sampling.choose's steps after top-k, as one kernel (its caller checks
    sample_top_available, so everything here is fp32 and fresh from topk): int64 [3] (token, widen, bad)."""
    return ops.extension().sample_top(vals, ids, top, z, float(top_p), float(min_p), u)
