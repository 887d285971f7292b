"""Weight regularization before trellis coding (spec 5.4): random signs, 128-point Hadamards on
both sides and per-channel scales, so the target looks like i.i.d. Gaussian noise of the
codebook's RMS. All of it folds into the stored suh/svh vectors (W = diag(suh)·Hk·Ŵ·Hn·diag(svh))."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.formats.exl3 import CODEBOOK_SCALE, hadamard128


def random_signs(n: int, seed: int, device: str | torch.device = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 2, (n,), generator=g) * 2 - 1).to(device=device, dtype=torch.float32)


@dataclass
class RegularizedWeight:
    w: torch.Tensor   # fp32 [in, out], regularized domain (before the global scale)
    su: torch.Tensor  # fp32 [in]: signs × input scales (global scale not yet folded in)
    sv: torch.Tensor  # fp32 [out]: signs × output scales; exactly 0 for all-zero columns
    all_zero: bool


def regularize(w: torch.Tensor, in_signs: torch.Tensor, out_signs: torch.Tensor,
               out_scales: bool = True) -> RegularizedWeight:
    """w: fp32 [in, out], padded to multiples of 128 (zero rows/columns for the padding)."""
    w = w.float()
    col_rms = w.square().mean(dim=0).sqrt()
    zero_cols = col_rms == 0
    all_zero = bool(zero_cols.all())
    if out_scales and not all_zero:
        c = col_rms / col_rms.mean()
        c = torch.where(zero_cols, torch.full_like(c, 0.1), c)
        sv = out_signs * c + 1e-10
    else:
        sv = out_signs.clone()
    w = hadamard128(w / sv, dim=1)
    row_rms = w.square().mean(dim=1).sqrt()
    row_rms = torch.where(row_rms == 0, torch.full_like(row_rms, 0.1), row_rms)
    su = in_signs * row_rms / -CODEBOOK_SCALE + 1e-10
    w = hadamard128(w / su[:, None], dim=0)
    sv = torch.where(zero_cols, torch.zeros_like(sv), sv)
    return RegularizedWeight(w, su, sv, all_zero)


def rotate_hessian(H: torch.Tensor, su: torch.Tensor) -> torch.Tensor:
    """H' = Hk·diag(su)·H·diag(su)·Hk: the input Hessian seen by the regularized weight.

    Upstream rotates with the signs only; including the su magnitudes makes the LDLQ feedback
    weight each channel by how much it really contributes to the output error."""
    s = su / su.abs().mean()
    Hs = H * s[:, None] * s[None, :]
    return hadamard128(hadamard128(Hs, dim=0), dim=1)
