"""A gated MLP at prefill (many rows: reconstruct + cuBLAS), the gate/up -> down hand-off in one pass.

Run apart, the hand-off is three passes over the activations: the gate/up product's output
transform (had128 with svh, over [rows, 2 * inter]), gated_act, then the down projection's input
transform (had128 with suh). In a 4,096-token prefill of the Llama-3.1-8B shape gated_act alone
was 7% of the GPU time, and the two transforms about as much again by their share of the
Hadamard kernel's bytes (csrc/PERF_NOTES.md, session 17). Here one kernel (gated_had128 with the
output scales) reads the gate/up sums once and writes the down projection's transformed input,
with the same bits as the passes it replaces.
"""
from __future__ import annotations

import torch

from engine import ops  # a cycle (ops imports this module first): used at call time only
from engine.ops.groups import is_gate_up


def dense_gated_mlp(x: "torch.Tensor | ops.PendingNorm", g: "ops.EXL3Group", down, act: str, inter_features: int,
                    out_features: int) -> torch.Tensor | None:
    """down(act(gate(x)) * up(x)) for a prefill's rows on the GPU: g is the joined gate/up, `down`
    the down projection's EXL3 tensors, inter_features the gate/up outputs' logical width. None
    where this does not serve (few rows, padded widths, no kernels): the caller runs the plain
    path."""
    n = down.trellis.shape[0] * 16
    in_f = g.trellis.shape[0] * 16
    if (x.shape[:-1].numel() <= ops.FUSED_MAX_ROWS or x.shape[-1] != in_f or not ops.GLUE_KERNELS
            or act not in ops._ACT_IDS or not is_gate_up(g, n) or inter_features != n
            or not g.trellis.is_cuda or not down.trellis.is_cuda
            or not ops._use_cuda(g.suh, g.svh, down.suh, down.svh)):
        return None
    if isinstance(x, ops.PendingNorm):
        x.settle_pre()  # a norm over a norm: the inner one first, the outer in the input pass
    if not isinstance(x, ops.PendingNorm) or not x.fusable(in_f):
        x = ops.as_tensor(x)
        if not ops._use_cuda(x):
            return None
    lead = x.shape[:-1]
    z = ops._dense_group_sums(ops._member_inputs(x, g), g)  # a pending norm: in the members' input pass
    bg, bu = (None, None) if g.bias is None else (g.bias[:n], g.bias[n:])
    xh = ops.extension().gated_had128(z[:, :n], z[:, n:], ops._ACT_IDS[act], down.suh, g.svh[:n], g.svh[n:], bg, bu)
    out_f = down.trellis.shape[1] * 16
    y = ops._dense_product(xh, down, ops._padded_bias(down, out_f)).reshape(*lead, out_f)
    return (y if out_f == out_features else y[..., :out_features]).to(x.dtype)
