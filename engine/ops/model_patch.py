"""Route a loaded model's EXL3 linears through engine.ops instead of their dense weights.

The torch path of `QuantLinear` keeps a reconstructed dense weight; on a GPU with the kernels the
compressed trellis is all that is needed, so the dense copy is dropped (an 8B model shrinks from
16 GB to 4 GB) and forward calls `ops.exl3_linear`. Until engine/models calls this itself, the
benchmarks apply it after `load_model`.
"""
from __future__ import annotations

import types

import torch
from torch import nn

from engine import ops


def _kernel_forward(self, x: torch.Tensor) -> torch.Tensor:
    return ops.exl3_linear(x, self.exl3, self.out_features)


def route_quant_linears(model: nn.Module, drop_dense: bool = True) -> int:
    """Make every module that carries `.exl3` compute with ops.exl3_linear. Returns the count."""
    n = 0
    for mod in model.modules():
        t = getattr(mod, "exl3", None)
        if t is None:
            continue
        if t.bias is not None and t.bias.dtype != torch.float16:
            t.bias = t.bias.half()
        mod.forward = types.MethodType(_kernel_forward, mod)
        if drop_dense and isinstance(getattr(mod, "weight", None), torch.Tensor):
            mod.weight = torch.empty(0, dtype=mod.weight.dtype, device=mod.weight.device)
        n += 1
    if drop_dense and torch.cuda.is_available():
        torch.cuda.empty_cache()
    return n
