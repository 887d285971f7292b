"""Quantize the linears of one module to EXL3 tensors (spec 5.3-5.8), end to end:
pad → regularize → global scale search → rotated Hessian → block LDL → LDLQ + Viterbi → pack.

All linears of a module are encoded together (their tile requests are merged per K), so narrow
layers do not leave the device idle. Every random choice is seeded from (seed, tensor key), so a
conversion is reproducible bit for bit on the same machine and device."""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import torch

from engine.formats.exl3 import MARKER_VALUES, EXL3Tensors, pack_symbols, pad_to_128
from engine.quantize.ldlq import block_ldl, ldlq_job, run_jobs
from engine.quantize.regularize import random_signs, regularize, rotate_hessian
from engine.quantize.scale_search import search_scale


@dataclass
class LinearSpec:
    """One linear to quantize. `weight` is in HF orientation [out, in], unpadded."""

    key: str
    weight: torch.Tensor
    K: int
    qmap: str                      # linears with the same qmap share input activations / Hessian
    bias: torch.Tensor | None = None


@dataclass
class QuantizedLinear:
    key: str
    K: int
    codebook: str
    trellis: torch.Tensor          # int16 [in/16, out/16, 16K]
    suh: torch.Tensor              # fp16 [in]
    svh: torch.Tensor              # fp16 [out]
    bias: torch.Tensor | None      # fp16 [out] (padded)
    in_features: int               # unpadded
    out_features: int
    proxy_err: float               # tr(EᵀH'E)/tr(WᵀH'W), or relative MSE without a Hessian
    scale: float
    flags: str = ""
    extra: dict = field(default_factory=dict)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Stored tensors in the reference writer's order: suh, svh, bias, marker, trellis."""
        out = {f"{self.key}.suh": self.suh, f"{self.key}.svh": self.svh}
        if self.bias is not None:
            out[f"{self.key}.bias"] = self.bias
        if self.codebook in MARKER_VALUES:
            out[f"{self.key}.{self.codebook}"] = torch.tensor(MARKER_VALUES[self.codebook], dtype=torch.int32)
        out[f"{self.key}.trellis"] = self.trellis
        return out

    def exl3(self) -> EXL3Tensors:
        return EXL3Tensors(self.trellis, self.suh, self.svh, self.codebook, self.bias, self.key)

    def dense_weight(self, device: str | torch.device = "cpu") -> torch.Tensor:
        """What a decoder will compute: HF orientation [out, in], unpadded, fp32."""
        w = self.exl3().to(device).dense_weight(torch.float32)
        return w[: self.in_features, : self.out_features].T.contiguous()


def _seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) & 0x7FFFFFFF


@torch.no_grad()
def quantize_linears(specs: list[LinearSpec], hessians: dict[str, torch.Tensor | None], codebook: str = "mul1",
                     seed: int = 0, effort: str = "full", device: str | torch.device = "cpu",
                     out_scales: bool = True) -> list[QuantizedLinear]:
    """Quantize every spec; `hessians[spec.qmap]` is the damped input Hessian (padded) or None."""
    prepared = []
    for spec in specs:
        n_out, n_in = spec.weight.shape
        p_in, p_out = pad_to_128(n_in), pad_to_128(n_out)
        w = torch.zeros(p_in, p_out, dtype=torch.float32, device=device)
        w[:n_in, :n_out] = spec.weight.to(device=device, dtype=torch.float32).T
        in_signs = random_signs(p_in, _seed(seed, spec.qmap), device)
        out_signs = random_signs(p_out, _seed(seed, spec.key), device)
        reg = regularize(w, in_signs, out_signs, out_scales=out_scales)
        g = 1.0 if reg.all_zero else search_scale(reg.w, spec.K, codebook, effort)
        target = reg.w * g
        su = reg.su / g
        H = hessians.get(spec.qmap)
        Hr = L = None
        if H is not None:
            Hr = rotate_hessian(H.to(device), reg.su)
            L = block_ldl(Hr)
        prepared.append((spec, n_in, n_out, target, su, reg.sv, g, Hr, L))
    jobs = [ldlq_job(p[3], p[8], p[0].K) for p in prepared]
    results = run_jobs(jobs, [codebook] * len(jobs))
    out = []
    for (spec, n_in, n_out, target, su, sv, g, Hr, L), res in zip(prepared, results):
        err = target - res.w_hat
        if Hr is not None:
            num = float((err * (Hr @ err)).sum())
            den = float((target * (Hr @ target)).sum())
        else:
            num, den = float(err.square().sum()), float(target.square().sum())
        proxy = num / den if den > 0 else 0.0
        trellis = pack_symbols(res.states, spec.K).cpu()
        bias = None
        if spec.bias is not None:
            bias = torch.zeros(target.shape[1], dtype=torch.float16)
            bias[:n_out] = spec.bias.to(torch.float16).cpu()
        out.append(QuantizedLinear(
            key=spec.key, K=spec.K, codebook=codebook, trellis=trellis,
            suh=su.to(torch.float16).cpu(), svh=sv.to(torch.float16).cpu(), bias=bias,
            in_features=n_in, out_features=n_out, proxy_err=proxy, scale=g,
            flags=("o" if out_scales else "") + ("" if Hr is not None else "f"),
        ))
    return out
