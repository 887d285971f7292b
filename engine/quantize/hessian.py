"""Hessian proxies H = E[xᵀx] of a linear layer's inputs (spec 5.2-5.3).

Linears fed by the same activations (q/k/v; gate/up) share one accumulator. Rows of X that
contain inf/NaN are dropped and counted, as they would poison the whole matrix."""
from __future__ import annotations

import torch

SIGMA_REG = 0.025  # damping, as a fraction of the mean diagonal


class HessianAccumulator:
    """Accumulates XᵀX in fp32 over calibration activations, padded to `n` input channels."""

    def __init__(self, n: int, device: str | torch.device = "cpu"):
        self.n = n
        self.H = torch.zeros(n, n, dtype=torch.float32, device=device)
        self.count = 0
        self.dropped = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).to(self.H.device, torch.float32)
        finite = torch.isfinite(x).all(dim=1)
        if not bool(finite.all()):
            self.dropped += int((~finite).sum())
            x = x[finite]
        if x.shape[1] < self.n:
            x = torch.nn.functional.pad(x, (0, self.n - x.shape[1]))
        self.H.addmm_(x.T, x)
        self.count += x.shape[0]

    def finalize(self, sigma_reg: float = SIGMA_REG) -> torch.Tensor | None:
        """Mean XᵀX plus damping; None when nothing usable was captured (uncalibrated fallback)."""
        if self.count == 0:
            return None
        H = self.H / self.count
        d = float(H.diagonal().mean())
        if not (d == d) or d < 1e-20 or d == float("inf"):
            return None
        H.diagonal().add_(sigma_reg * d)
        return H
