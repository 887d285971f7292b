"""Switch a loaded model's EXL3 linears to the compressed path (engine.ops on the trellis).

`load_model` already does this on a GPU where the kernels build; this is for the cases where
that choice is made afterwards: tests comparing the ops path with the dense one on any device,
and benchmarks.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.models.layers import QuantLinear, fuse_projections


def route_quant_linears(model: nn.Module, drop_dense: bool = True, group: bool | None = None) -> int:
    """Make every QuantLinear compute with ops.exl3_linear (and, with `group`, q/k/v and gate/up
    on the GPU as one grouped product each; None: as load_model does, TRELLIS_GROUP). Returns how
    many QuantLinears there are."""
    if group is None:
        from engine.models import GROUPED_PRODUCTS as group
    n = 0
    for mod in model.modules():
        if isinstance(mod, QuantLinear):
            mod.use_compressed(drop_dense)
            n += 1
    if group:
        fuse_projections(model)
    if drop_dense and torch.cuda.is_available():
        torch.cuda.empty_cache()
    return n
