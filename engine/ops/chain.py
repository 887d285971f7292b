"""Decode chains: a product's output stage writes the next product's input.

At one token per step every quantized linear's input needs a prep (the norm, the input signs,
the 128-point Hadamard, the int8 passes of the MUL1 integer path). As a kernel of its own that
prep was a kernel boundary on the critical path before each product, about 12% of a decode step
(csrc/PERF_NOTES.md, session 6). In a chain the warp that finishes a 128-column block of one
product's output writes that block's part of the next product's input (csrc/kernels.h, ChainOut),
so the next product follows the first directly. A Llama-style layer has four links, each on or
off by TRELLIS_CHAIN (ops.CHAIN; LINKS below):

    attention -> o_proj    (attn) the decode attention kernel writes each head's
                           128-chunk of o_proj's input as it writes the head's output.
    o_proj  -> gate/up     (normed) rms_norm(o + residual) * w. A block cannot know the row's 1 / rms, so it
                           writes its chunks of (o + residual) * w (the int8 passes are
                           scale-invariant) and its sum of squares; the consumer's output stage
                           applies 1 / rms.
    gate/up -> down        (gated) act(gate) * up, by whichever block of a chunk's pair finishes
                           second (bit for bit the down projection's own prep).
    down    -> next q/k/v  (normed, where gate/up -> down chains too) as o_proj -> gate/up.

Written by the products' own output stages, the product-to-product links were slower than the
prep kernels they replace (the output stage is on the critical path, where a prep kernel overlaps
the product before it under PDL), alone and together; the attention link paid (csrc/PERF_NOTES.md,
sessions 7 and 12). Since session 29 every plain product's output stage is a kernel of its own
(ops.GV_SPLIT_FINISH); at setting 5 (the default since session 30) a chain's products run plain
too and that kernel writes the link in place of the prep kernel: with all four links, 12 kernels
of a Llama layer became 9 and decode ran 1-4% faster (H200), so every link is on by default.

A product whose reader is not launched yet is a Deferred: the reader launches it with the chain
output it needs, and anything else calls value() and gets the plain product.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from engine import ops  # a cycle (ops imports this module first): used at call time only
from engine.ops.groups import is_gate_up
from engine.ops.settings import parse_kinds

# The links a decode step may chain (ops.CHAIN): "attn", the attention kernel writing o_proj's
# input; "gated", gate/up writing the down projection's; "normed", o_proj and down writing the
# input of the grouped product after the next norm.
LINKS = frozenset({"attn", "gated", "normed"})


def parse_setting(value: str) -> frozenset[str]:
    """TRELLIS_CHAIN: 0 (none), 1 (all), or a comma list of LINKS."""
    return parse_kinds("TRELLIS_CHAIN", value, LINKS)


@dataclass
class PreparedInput:
    """A decode product's int8 input (1..4 rows) in prep_frag's layout (one fragment group): xb
    [segments, in/16, 1, 32, 4], the passes' steps and the chunk sums [segments, rows, in/128].
    With `part` (sums of squares of each row's in/128 blocks) the values still lack the norm's
    1 / rms, which the product applies (eps)."""

    xb: torch.Tensor
    scales: torch.Tensor
    csum: torch.Tensor
    part: torch.Tensor | None = None
    eps: float = 0.0

    @staticmethod
    def empty(segments: int, n: int, device: torch.device, normed: bool = False, eps: float = 0.0,
              rows: int = 1) -> "PreparedInput":
        nch = n // 128
        return PreparedInput(
            xb=torch.empty(segments, n // 16, 1, 32, 4, dtype=torch.int32, device=device),
            scales=torch.empty(segments, rows, nch, 2, dtype=torch.float32, device=device),
            csum=torch.empty(segments, rows, nch, dtype=torch.float32, device=device),
            part=torch.empty(rows, nch, dtype=torch.float32, device=device) if normed else None,
            eps=eps,
        )

    @property
    def rows(self) -> int:
        return self.scales.shape[1]

    def tensors(self) -> list[torch.Tensor]:
        return [self.xb, self.scales, self.csum] + ([self.part] if self.part is not None else [])


@dataclass
class ChainOut:
    """What a product's output stage writes for the next product (csrc/kernels.h, ChainOut):
    mode 1 [xb, scales, csum, suh, part, norm_w (, residual, residual_out)], mode 2 [xb, scales,
    csum, suh, pairs] with the activation id."""

    mode: int
    tensors: list[torch.Tensor] = field(default_factory=list)
    act: int = 0

    @staticmethod
    def normed(target: PreparedInput, suh: torch.Tensor, norm_w: torch.Tensor, residual: torch.Tensor | None = None,
               residual_out: torch.Tensor | None = None) -> "ChainOut":
        res = [] if residual is None else [residual.reshape(-1), residual_out.reshape(-1)]
        return ChainOut(1, [target.xb, target.scales, target.csum, suh, target.part, norm_w, *res])

    @staticmethod
    def gated(target: PreparedInput, suh: torch.Tensor, pairs: torch.Tensor, act: int) -> "ChainOut":
        return ChainOut(2, [target.xb, target.scales, target.csum, suh, pairs], act)


@dataclass
class Deferred:
    """An EXL3 product of a decode step (1..4 rows) not launched yet. `x` is its input (a tensor,
    or a PreparedInput some earlier product's output stage writes); `lead` the output's leading
    shape."""

    x: "torch.Tensor | PreparedInput"
    t: object  # EXL3Tensors
    out_features: int
    dtype: torch.dtype
    lead: tuple[int, ...]
    result: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.lead, self.out_features))

    @property
    def padded_out(self) -> int:
        return self.t.trellis.shape[1] * 16

    @property
    def device(self) -> torch.device:
        return self.t.trellis.device

    @property
    def is_cuda(self) -> bool:
        return self.t.trellis.is_cuda

    def launch(self, chain: ChainOut | None = None) -> torch.Tensor:
        """Run the product (its output stage writing `chain` too) and return its output."""
        if self.result is not None:
            raise RuntimeError("a deferred product runs once")
        y = exl3_gemm_chained(self.x, self.t, chain)
        if y.shape[-1] != self.out_features:
            y = y[..., :self.out_features]
        self.result = y.to(self.dtype).reshape(self.shape)
        return self.result

    def value(self) -> torch.Tensor:
        return self.result if self.result is not None else self.launch(None)


# ------------------------------------------------------------------------------------------
# Launching chains (engine.ops re-exports defer_linear, gated_chain, attention_into_chain; its
# exl3_gemm_group calls chain_into_group for a PendingNorm over a Deferred product)


def attention_into_chain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                         scale: float, o, out_features: int, rope: "ops.PendingRope | None" = None,
                         softcap: float | None = None) -> "tuple[torch.Tensor, Deferred] | None":
    """One decode step's attention (ops.decode_attention, with the step's RoPE where `rope`) whose
    kernel also writes o_proj's int8 input, and o_proj on it as a Deferred: no prep kernel for
    o_proj. q [1, H, 1, D]: D = 128, or 256 (Gemma) with ops.ATTN_CHAIN_D256 where the tensor-core
    walk takes it (the extension's decode_attention_chain_serves; ops.ATTN_MMA_D256). None where
    the chain does not serve (the caller runs the plain path)."""
    B, H, T, D = q.shape
    n = H * D
    if not (B == 1 and T == 1 and D in (128, 256) and _takes_prepared(o, n, q.device, "attn")
            and ops.decode_attention_serves(q, k, v, mask)
            and (D == 128 or (ops.ATTN_CHAIN_D256 and ops.extension().decode_attention_chain_serves(k, v)))):
        return None
    target = PreparedInput.empty(1, n, q.device)
    out = ops.decode_attention(q, k, v, mask, scale, (target, o.suh), rope, softcap)
    return out, Deferred(target, o, out_features, q.dtype, (B, T))


def exl3_gemm_chained(x: "torch.Tensor | PreparedInput", t, chain: ChainOut | None) -> torch.Tensor:
    """ops.exl3_gemm of a decode step's 1..4 rows where x may be a PreparedInput (the previous
    product's output stage wrote it) and the output stage may write `chain` for the next product.
    [rows, out_padded]."""
    if not isinstance(x, PreparedInput):
        return ops.exl3_gemm(x.reshape(-1, x.shape[-1]), t, mode="fused", chain=chain)
    return _product_on_prepared(t, ops._padded_bias(t, t.trellis.shape[1] * 16), [], x, chain)


def _product_on_prepared(t, bias: torch.Tensor | None, seg_cols: list[int], x: PreparedInput,
                         chain: ChainOut | None) -> torch.Tensor:
    """The fused product of t (EXL3Tensors, or an EXL3Group with its seg_cols) on a PreparedInput
    of 1..4 rows, its output stage writing `chain` too. [rows, out_padded]."""
    in_f, out_f = t.trellis.shape[0] * 16, t.trellis.shape[1] * 16
    device = t.trellis.device
    stand_in = torch.empty(x.rows, in_f, dtype=torch.float16, device=device)  # gives m; never read
    ws = ops.workspace(device, x.rows * out_f)
    return ops.extension().exl3_gemm(stand_in, t.suh, t.svh, t.trellis, bias, ops.CODEBOOK_IDS[t.codebook], ws, 0, 1,
                                     3, ops.block_counters(device, out_f // 128), seg_cols, None, 0, None, x.eps, None,
                                     None, x.tensors(), *ops._chain_args(chain), [], None, False)


def _chains_on(link: str) -> bool:
    """This link is on and the settings chains need hold: the glue kernels, the version-3 fused
    product."""
    return link in ops.CHAIN and ops.GLUE_KERNELS and ops.MM_VERSION == 3 and ops.FUSED_MAX_ROWS >= 1


def _takes_prepared(t, in_f: int, device: torch.device, link: str) -> bool:
    """Whether a decode product of `t` can read a PreparedInput that `link` writes: the link is
    on, the product is the fused MUL1 integer path of the version-3 kernel, on the GPU."""
    return (_chains_on(link) and ops.INT8_MAX_ROWS >= 1 and t.codebook == "mul1" and t.trellis.is_cuda
            and t.trellis.device == device and t.trellis.shape[0] * 16 == in_f and in_f % 128 == 0
            and ops._use_cuda(t.suh, t.svh))


@functools.lru_cache(maxsize=None)
def _chain_fits(in_f: int, out_f: int, K: int, rows: int, split: int, variant: int) -> bool:
    """Whether a product of this shape and rows can write a chain output (csrc gemv_chain_fits:
    one row where no warp finishes more column blocks than the kernel keeps, 2..4 rows through
    the finish kernel; no debug variant but those that keep the shipped schedule: the decode forms
    8, 21 and 22, and 41). `split`, the split-finish setting the answer for 2..4 rows depends on, and
    `variant`, the configured TRELLIS_GV_VARIANT, key the cache."""
    return bool(ops.extension().chain_fits(in_f, out_f, K, rows))


def _chain_rows(rows: int) -> bool:
    """Whether a decode step of this many rows may chain: one, or up to ops.CHAIN_ROWS (at most
    the integer path's four) where the finish kernel writes the links (split finish 5)."""
    return rows == 1 or (1 < rows <= min(ops.CHAIN_ROWS, ops.INT8_MAX_ROWS, 4)
                         and ops.extension().split_finish_setting() >= 5)


def _writes_chain(t, rows: int = 1) -> bool:
    """Whether a product of t (EXL3Tensors or EXL3Group) on `rows` rows can write a chain output:
    the MUL1 integer path, a shape the kernels can finish with a chain output."""
    in_f, out_f, K = t.trellis.shape[0] * 16, t.trellis.shape[1] * 16, t.trellis.shape[2] // 16
    if not (t.codebook == "mul1" and ops.INT8_MAX_ROWS >= rows and _chain_rows(rows)):
        return False
    # The kernels say which configured variants keep chains (the decode forms do, so that a decode
    # A/B under TRELLIS_GV_VARIANT differs in the products alone; until session 35 any variant
    # turned chains off here, and decode under variants 25 and 26 ran without them).
    return _chain_fits(in_f, out_f, K, rows, ops.extension().split_finish_setting() if rows > 1 else 0,
                       ops._DEFAULT_VARIANT)


def defer_linear(x: torch.Tensor, t, out_features: int) -> "torch.Tensor | Deferred":
    """ops.exl3_linear(x, t, out_features), or, for a decode step's row (or rows: ops.CHAIN_ROWS)
    on the GPU where chains are on, the same product not launched yet (a Deferred): its reader may
    launch it with a chain output. Without chains, its output may stay open sums (ops.open_linear)
    for the reader's prep to finish."""
    in_f = t.trellis.shape[0] * 16
    rows = x.shape[:-1].numel()
    if (_chains_on("normed") and x.shape[-1] == in_f and ops._use_cuda(x, t.suh, t.svh) and t.trellis.is_cuda
            and _writes_chain(t, rows)):
        return Deferred(x, t, out_features, x.dtype, tuple(x.shape[:-1]))
    return ops.open_linear(x, t, out_features)


_pair_counters: dict = {}  # per device: int32 per chunk pair, zero between calls


def gated_chain(x: "torch.Tensor | ops.PendingNorm", g: ops.EXL3Group, down, act: str, out_features: int,
                defer: bool = False) -> "torch.Tensor | Deferred | None":
    """down(act(gate(x)) * up(x)) for a decode step's row (or rows: ops.CHAIN_ROWS), the gate/up
    product's output stage writing the down projection's input. A Deferred down product with
    `defer`. None where the chain does not serve (the caller then runs the plain path)."""
    n = down.trellis.shape[0] * 16
    lead = x.shape[:-1]
    rows = lead.numel()
    if (act not in ops._ACT_IDS or not is_gate_up(g, n)
            or not _takes_prepared(down, n, g.trellis.device, "gated") or not _writes_chain(g, rows)):
        return None
    target = PreparedInput.empty(1, n, g.trellis.device, rows=rows)
    pairs = ops._zeroed(_pair_counters, g.trellis.device, n // 128, 1024, torch.int32)
    ops.exl3_gemm_group(x, g, mode="fused", chain=ChainOut.gated(target, down.suh, pairs, ops._ACT_IDS[act]))
    d = Deferred(target, down, out_features, x.dtype, tuple(lead))
    return d if defer else d.value()


def chain_into_group(p: "ops.PendingNorm", g: ops.EXL3Group, chain: ChainOut | None) -> torch.Tensor | None:
    """The group's product on rms_norm(d + residual) where d = p.x is a Deferred product: d's
    output stage writes the group's input, so no prep runs. None where the chain does not serve."""
    d: Deferred = p.x
    in_f = g.trellis.shape[0] * 16
    res = p.residual
    rows = d.shape[:-1].numel()
    if not (d.padded_out == in_f == d.out_features and p.weight.is_contiguous() and p.weight.numel() == in_f
            and ops._use_cuda(p.weight) and _takes_prepared(g, in_f, d.device, "normed") and _writes_chain(d.t, rows)
            and d.shape.numel() == rows * in_f
            and (res is None or (res.is_contiguous() and res.shape == d.shape and ops._use_cuda(res)))):
        return None
    target = PreparedInput.empty(len(g.members), in_f, d.device, normed=True, eps=p.eps, rows=rows)
    res_out = None if res is None else torch.empty_like(res)
    y = d.launch(ChainOut.normed(target, g.suh, p.weight, res, res_out))
    p.sum = y if res is None else res_out
    return _product_on_prepared(g, g.bias, g.seg_cols, target, chain)
