"""Several EXL3 linears that read the same input, stored so one kernel launch computes them all.

At batch 1 a Llama layer's q, k and v products (and gate and up) are small, and each paid a prep
launch and a product launch with a fixed cost larger than its weights' streaming time
(csrc/PERF_NOTES.md). Concatenating their trellises along the columns makes them one product
whose column segments keep their own input signs (suh) and output scales (svh, bias).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.formats.exl3 import EXL3Tensors


@dataclass
class EXL3Group:
    """The members' tensors joined: trellis [in/16, sum(out)/16, 16K], suh [members, in], svh
    and bias over all columns. `members` keep their own EXL3Tensors, with trellis, svh and bias
    now views into the joined ones, so nothing is stored twice."""

    members: list[EXL3Tensors]
    trellis: torch.Tensor
    suh: torch.Tensor
    svh: torch.Tensor
    bias: torch.Tensor | None
    codebook: str
    seg_cols: list[int]  # first column of members 1.. in the joined output

    @property
    def bounds(self) -> list[tuple[int, int]]:
        starts = [0, *self.seg_cols]
        ends = [*self.seg_cols, self.trellis.shape[1] * 16]
        return list(zip(starts, ends))


MAX_MEMBERS = 4  # the kernel's segment table


def is_gate_up(g: EXL3Group, n: int) -> bool:
    """Whether g is a gated MLP's gate and up, each n (padded) columns wide: the down projection
    that reads act(gate) * up then takes n inputs."""
    return len(g.members) == 2 and g.seg_cols == [n] and g.trellis.shape[1] * 16 == 2 * n


def can_group(members: list[EXL3Tensors]) -> bool:
    """One launch needs one K, one codebook, one input width, at most four members."""
    if not 2 <= len(members) <= MAX_MEMBERS:
        return False
    first = members[0]
    return all(m.K == first.K and m.codebook == first.codebook and m.in_features == first.in_features
               and m.trellis.device == first.trellis.device for m in members)


def join(members: list[EXL3Tensors]) -> EXL3Group:
    """Concatenate the members (which must pass can_group) and point them at the joined copy."""
    if not can_group(members):
        raise ValueError("these EXL3 linears cannot share one product (K, codebook, input width or device differ)")
    trellis = torch.cat([m.trellis for m in members], dim=1).contiguous()
    suh = torch.stack([m.suh.half() for m in members]).contiguous()
    svh = torch.cat([m.svh.half() for m in members]).contiguous()
    bias = None
    if any(m.bias is not None for m in members):
        # a bias may be stored unpadded (shorter than the padded out): zero-extend each
        parts = [F.pad(m.bias.half(), (0, m.out_features - m.bias.numel())) if m.bias is not None
                 else torch.zeros(m.out_features, dtype=torch.float16, device=m.svh.device) for m in members]
        bias = torch.cat(parts).contiguous()
    seg_cols, col = [], 0
    for m in members[:-1]:
        col += m.out_features
        seg_cols.append(col)
    group = EXL3Group(list(members), trellis, suh, svh, bias, members[0].codebook, seg_cols)
    for m, (a, b) in zip(members, group.bounds):
        m.trellis = trellis[:, a // 16:b // 16]
        m.svh = svh[a:b]
        if m.bias is not None:
            m.bias = bias[a:b]
    return group
