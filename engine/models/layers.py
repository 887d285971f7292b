"""Building blocks shared by the model families: norms, linears, attention, activations.

Linears are small modules with one `forward` so that a compiled EXL3 kernel can later replace
`QuantLinear.forward` without the model code noticing.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine import ops
# attention_mask is re-exported: the converter's layer runner and the benches import it from here
from engine.cache.masks import attention_mask, causal_mask  # noqa: F401
from engine.errors import ConfigError
from engine.formats.exl3 import EXL3Tensors


class RMSNorm(nn.Module):
    """RMS norm computed in fp32.

    `unit_offset` is Gemma's convention: the stored weight w is applied as (1 + w), and the
    product is taken before casting back; Llama-style casts first, then multiplies by w. On the
    GPU a Gemma norm runs the same kernels as a Llama one with (1 + w) as their weight: one
    kernel, or none where a grouped product's prep computes it, instead of eight PyTorch ops
    (session 20: 2.8 of a synthetic Gemma-2-9B token's 7.4 ms went to those). The kernels' order
    (cast, then multiply, with 1 + w itself rounded: three roundings where Gemma has one) moves a
    Gemma output by about an ulp of its dtype (at most ~1.5).
    """

    def __init__(self, weight: torch.Tensor, eps: float, unit_offset: bool = False):
        super().__init__()
        self.register_buffer("weight", weight)
        if unit_offset:
            self.register_buffer("offset_weight", (1.0 + weight.float()).to(weight.dtype), persistent=False)
        self.eps = eps
        self.unit_offset = unit_offset

    @property
    def kernel_weight(self) -> torch.Tensor:
        """The weight of the Llama-style norm this one is: w, or Gemma's 1 + w."""
        return self.offset_weight if self.unit_offset else self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.unit_offset or x.is_cuda:
            return ops.rms_norm(x, self.kernel_weight, self.eps)  # one kernel on the GPU instead of eight
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual add rides in the norm's kernel."""
        x = ops.as_tensor(x)  # a deferred product (engine/ops/chain.py) runs now
        if not self.unit_offset or x.is_cuda:
            return ops.add_rms_norm(x, residual, self.kernel_weight, self.eps)
        s = x + residual
        return self(s), s

    def pending(self, x: "torch.Tensor | ops.PendingNorm", residual: torch.Tensor | None = None) -> ops.PendingNorm:
        """norm(x (+ residual)) as a PendingNorm: on the GPU the grouped product that reads it
        computes it in its prep; elsewhere it is computed now. x may itself be a pending plain
        norm (a Gemma block's post-norm): on the GPU the two become one PendingNorm whose reader's
        prep may compute both (PendingNorm.pre_weight), saving the inner norm's launch."""
        if isinstance(x, ops.PendingNorm):
            if x.normed is None and x.residual is None and x.pre_weight is None and residual is not None:
                inner = ops.as_tensor(x.x)  # a deferred product (o_proj after its attention chain) runs now
                if inner.is_cuda:
                    return ops.PendingNorm(inner, self.kernel_weight, self.eps, residual, pre_weight=x.weight,
                                           pre_eps=x.eps)
                x.x = inner
            x = ops.as_tensor(x)
        p = ops.PendingNorm(x, self.kernel_weight, self.eps, residual)
        if not x.is_cuda:
            if residual is None:
                p.normed, p.sum = self(x), x
            else:
                p.normed, p.sum = self.add_forward(x, residual)
        return p


class DenseLinear(nn.Module):
    """y = x·Wᵀ + b with an HF-layout weight [out, in]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.register_buffer("weight", weight)
        self.register_buffer("bias", bias)
        self.out_features, self.in_features = weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class QuantLinear(DenseLinear):
    """An EXL3 linear, computed one of two ways.

    Dense (the torch path): the original-basis weight W = diag(suh)·H·Ŵ·H·diag(svh) is
    reconstructed once at load and used as a plain matmul. EXL3 pads `in` and `out` to multiples
    of 128; the padded rows of W only ever meet zero-extended inputs and the padded columns are
    trimmed from the output, so slicing W to the logical [in, out] is exactly the same computation.

    Compressed: every call goes through `engine.ops.exl3_linear` on the trellis itself (the CUDA
    kernels, or their torch reference off the GPU). Chosen at load when the kernels serve the
    device, so no dense copy is ever built (4x less memory at 4 bpw).
    """

    def __init__(self, exl3: EXL3Tensors, in_features: int, out_features: int, dtype: torch.dtype):
        bias = None
        if exl3.bias is not None:
            bias = exl3.bias[:out_features].to(dtype)
            if bias.numel() < out_features:  # a bias stored unpadded and shorter than out: zero-extend
                bias = F.pad(bias, (0, out_features - bias.numel()))
        compressed = exl3.trellis.is_cuda and ops.kernels_available(exl3.trellis.device)
        if compressed:
            w = torch.empty(out_features, 0, dtype=dtype, device=exl3.trellis.device)
        else:
            w = exl3.dense_weight(torch.float32)[:in_features, :out_features].t().contiguous().to(dtype)
        super().__init__(w, bias)
        self.in_features = in_features
        self.exl3 = exl3
        self.bits = exl3.K
        self.compressed = False
        if compressed:
            self.use_compressed()

    def use_compressed(self, drop_dense: bool = True) -> None:
        """Switch to computing from the trellis through engine.ops, dropping the dense copy."""
        self.compressed = True
        if self.exl3.bias is not None:
            self.exl3.bias = self.exl3.bias.half()
        if drop_dense and self.weight.numel():
            self.weight = torch.empty(self.out_features, 0, dtype=self.weight.dtype, device=self.weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.compressed:
            return ops.exl3_linear(x, self.exl3, self.out_features)
        return F.linear(x, self.weight, self.bias)

    def deferred(self, x: torch.Tensor) -> "torch.Tensor | ops.Deferred":
        """self(x), or for one row on the GPU that product not launched yet, so that the product
        reading it can have its output stage write that product's input (engine/ops/chain.py)."""
        if self.compressed:
            return ops.defer_linear(x, self.exl3, self.out_features)
        return self(x)

    def gated_forward(self, gate: "torch.Tensor | ops.OpenSums", up: "torch.Tensor | ops.OpenSums", act: str,
                      open_out: bool = False) -> "torch.Tensor | ops.OpenSums":
        """self(gated_act(gate, up, act)); compressed on the GPU, the activation is computed by
        the product's input prep instead of a launch of its own. gate and up may be open sums;
        open_out: the output may stay open (ops.OpenSums) for a product that reads it."""
        if self.compressed:
            if open_out:
                return ops.open_linear(gate, self.exl3, self.out_features, up=up, act=act)
            return ops.exl3_linear(gate, self.exl3, self.out_features, up=up, act=act)
        return self(ops.gated_act(ops.as_tensor(gate), ops.as_tensor(up), act))


class QuantLinearGroup:
    """QuantLinears that read the same input (q/k/v, gate/up) computed by one grouped product.

    A plain object, not a module: the members stay registered where the model put them (their
    EXL3 tensors become views into the joined copy), so state and module trees do not change.
    """

    def __init__(self, members: list[QuantLinear]):
        self.group = ops.join_linears([m.exl3 for m in members])
        self.out_features = [m.out_features for m in members]

    @staticmethod
    def build(members: list[nn.Module], device_type: str | None = "cuda") -> "QuantLinearGroup | None":
        """The group, or None where one launch cannot serve them (dense linears, different K,
        codebook or input width, not on `device_type`; None: any device)."""
        if not all(isinstance(m, QuantLinear) and m.compressed for m in members):
            return None
        if device_type is not None and any(m.exl3.trellis.device.type != device_type for m in members):
            return None
        if not ops.can_group([m.exl3 for m in members]):
            return None
        return QuantLinearGroup(members)

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        return ops.exl3_linear_group(x, self.group, self.out_features)

    def open(self, x: "torch.Tensor | ops.PendingNorm") -> "list[torch.Tensor] | list[ops.OpenSums]":
        """self(x), the outputs possibly left open (ops.OpenSums) for a product that reads them."""
        return ops.open_linear_group(x, self.group, self.out_features)

    def split(self) -> None:
        """Give every member its own contiguous tensors again (one launch each afterwards)."""
        for t in self.group.members:
            t.trellis, t.svh = t.trellis.contiguous(), t.svh.contiguous()
            if t.bias is not None:
                t.bias = t.bias.contiguous()


def fuse_projections(model: nn.Module, device_type: str | None = "cuda") -> int:
    """Group each attention's q/k/v and each gated MLP's gate/up into one product where they are
    compressed EXL3 linears on `device_type` (None: any device, for tests). Returns how many
    groups were made."""
    n = 0
    for mod in model.modules():
        fuse = getattr(mod, "fuse_projections", None)
        if fuse is not None and fuse(device_type):
            n += 1
    return n


def split_projections(model: nn.Module) -> int:
    """Undo fuse_projections (benchmarks time the model both ways in one run). Returns how many
    groups were split."""
    n = 0
    for mod in model.modules():
        for name, value in list(vars(mod).items()):
            if isinstance(value, QuantLinearGroup):
                value.split()
                setattr(mod, name, None)
                n += 1
    return n


def _sdpa_supports_gqa() -> bool:
    """torch >= 2.5 attends grouped KV heads without copying them (`enable_gqa`)."""
    try:
        x = torch.zeros(1, 2, 1, 8)
        F.scaled_dot_product_attention(x, x[:, :1], x[:, :1], enable_gqa=True)
        return True
    except TypeError:
        return False


SDPA_GQA = _sdpa_supports_gqa()


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
              scale: float, softcap: float | None = None, rope: "ops.PendingRope | None" = None) -> torch.Tensor:
    """Scaled dot-product attention with grouped KV heads.

    q [B, H, T, D]; k, v [B, Hkv, S, D] with the T queries at the last T of the S positions.
    `mask` is a bool [T, S] (True = may attend), an additive float one, or None for plain causal
    attention.
    Soft-capping (Gemma 2) squashes the scores before softmax: the decode kernel does it; SDPA
    cannot, so other calls run capped_attention. `rope`: the step's RoPE and cache write, which
    the decode kernel does along (q is then unrotated; ops.PendingRope).
    """
    groups = q.shape[1] // k.shape[1]
    T, S = q.shape[2], k.shape[2]
    if rope is not None and not (T == 1 and q.is_cuda):
        q, rope = rope.apply(), None  # left to a kernel that is not going to run
    if mask is None and T > 1 and T != S:
        mask = causal_mask(S - T, T, None, q.device)

    if T == 1 and q.device.type == "cpu":
        return one_query_attention(q, k, v, mask, scale, softcap)
    if T == 1 and q.is_cuda:
        out = ops.decode_attention(q, k, v, mask, scale, rope=rope, softcap=softcap)  # None: not a layout it takes
        if out is not None:
            return out
    if softcap is not None:
        return capped_attention(q, k, v, mask, scale, softcap)

    kwargs = {"scale": scale}
    if groups > 1 and SDPA_GQA:
        kwargs["enable_gqa"] = True
    elif groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    if mask is not None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kwargs)
    # T == 1 sees every cached position; T == S is the plain causal square
    return F.scaled_dot_product_attention(q, k, v, is_causal=T > 1, **kwargs)


# What capped_attention's scores may take at once. Whole, Gemma-2-9B's 16 heads over an 8,192-token
# prompt would hold 16 x 8,192^2 scores per layer twice over (scores, probabilities): 4 GB in fp16.
CAPPED_SCORES_BYTES = 256 << 20


def capped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                     scale: float, softcap: float, scores_bytes: int = CAPPED_SCORES_BYTES) -> torch.Tensor:
    """Attention with Gemma 2's soft cap by hand: softmax(softcap * tanh(scale q.k / softcap) +
    mask) v, in chunks of queries whose scores and probabilities fit `scores_bytes`. Grouped heads
    are folded into the query axis (as in one_query_attention), so K and V are read in place, never
    copied per head. The scores stay in q's dtype and are transformed in place (softmax accumulates
    in fp32 for 16-bit inputs): on the GPU each pass over them is memory traffic, and fp32 copies
    made a 4,096-token Gemma-2-9B prefill 0.7x as fast (session 20, call 5). With
    ops.CAPPED_SOFTMAX one kernel does a chunk's tanh, cap, mask and softmax in one read and one
    write of its scores, where a bool mask of one row per query (or one row for all) is given.
    Shapes and mask as `attention`'s (None: causal)."""
    B, H, T, D = q.shape
    kv_heads, S = k.shape[1], k.shape[2]
    groups = H // kv_heads
    if mask is None:
        mask = causal_mask(S - T, T, None, q.device)
    if mask.dim() == 4:  # [B or 1, H or 1, T, S] -> the folded layout
        mask = mask.unsqueeze(2) if mask.shape[1] == 1 else mask.reshape(mask.shape[0], kv_heads, groups, T, S)
    qg = (q * (scale / softcap)).reshape(B, kv_heads, groups, T, D)  # the scores come out over the cap
    keys_t = k.transpose(2, 3).unsqueeze(2)  # [B, Hkv, 1, D, S]
    values = v.unsqueeze(2)  # [B, Hkv, 1, S, D]
    out = q.new_empty(B, kv_heads, groups, T, D)
    rows = max(1, scores_bytes // (B * H * S * 2 * q.element_size()))
    for t0 in range(0, T, rows):
        t1 = min(T, t0 + rows)
        scores = torch.matmul(qg[:, :, :, t0:t1], keys_t)  # [B, Hkv, groups, t, S]
        if ops.capped_softmax_(scores, softcap, mask, t0):  # a 2-d bool mask, where the kernel serves
            probs = scores  # the four passes below in one kernel (ops.CAPPED_SOFTMAX)
        else:
            scores.tanh_().mul_(softcap)
            apply_mask_(scores, mask[..., t0:t1, :] if mask.shape[-2] == T else mask)
            probs = torch.softmax(scores, dim=-1)
        out[:, :, :, t0:t1] = torch.matmul(probs, values)
    return out.reshape(B, H, T, D)


def apply_mask(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Scores with a mask applied as SDPA applies it: bool (True = may attend) or additive."""
    return apply_mask_(scores.clone(), mask)


def apply_mask_(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """apply_mask in place, for scores that are the caller's own scratch (returned)."""
    if mask.dtype == torch.bool:
        return scores.masked_fill_(~mask, float("-inf"))
    return scores.add_(mask)


def one_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                        scale: float, softcap: float | None = None) -> torch.Tensor:
    """One decode query per row on the CPU, where SDPA's kernels cost ~20x more than two small
    matmuls. Grouped heads are folded into the query axis so K/V are never copied. `mask` is None
    or [1, S] (a sliding window, or the static cache's not-yet-written slots); `softcap` is Gemma
    2's (scores -> softcap * tanh(scores / softcap) before the mask)."""
    B, H, _, D = q.shape
    kv_heads = k.shape[1]
    qg = q.reshape(B, kv_heads, H // kv_heads, D)
    scores = torch.matmul(qg, k.transpose(2, 3)).float() * scale  # [B, Hkv, groups, S]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        apply_mask_(scores, mask)  # scores: this call's own tensor
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    return torch.matmul(probs, v).reshape(B, H, 1, D)


def check_activation(name: str) -> str:
    """The gated activations engine.ops computes (SiLU, GELU tanh or erf); others fail at load."""
    if name not in ops.GATED_ACTIVATIONS:
        raise ConfigError(f"unsupported activation '{name}' (supported: {', '.join(ops.GATED_ACTIVATIONS)})")
    return name


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU for Llama/Qwen/Mistral, GeGLU for Gemma."""

    def __init__(self, gate_proj: nn.Module, up_proj: nn.Module, down_proj: nn.Module, act: str):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj
        self.act_name = check_activation(act)
        self.gate_up: QuantLinearGroup | None = None
        # Set by a layer whose next reader launches deferred products (engine/ops/chain.py): the
        # output may then be an ops.Deferred (chains) or ops.OpenSums (open sums).
        self.defer_output = False

    def fuse_projections(self, device_type: str | None) -> bool:
        if self.gate_up is None:
            self.gate_up = QuantLinearGroup.build([self.gate_proj, self.up_proj], device_type)
        return self.gate_up is not None

    def forward(self, x: "torch.Tensor | ops.PendingNorm") -> "torch.Tensor | ops.Deferred":
        if self.gate_up is not None and isinstance(self.down_proj, QuantLinear) and self.down_proj.compressed:
            # one row on the GPU: gate/up's output stage writes the down projection's input
            out = ops.gated_chain(x, self.gate_up.group, self.down_proj.exl3, self.act_name,
                                  self.down_proj.out_features, defer=self.defer_output)
            if out is not None:
                return out
            # a prefill: the gate/up sums go to the down projection's input in one pass
            out = ops.dense_gated_mlp(x, self.gate_up.group, self.down_proj.exl3, self.act_name,
                                      self.gate_proj.out_features, self.down_proj.out_features)
            if out is not None:
                return out
        if self.gate_up is not None:
            # gate/up's outputs may stay open sums where the down projection's prep reads them
            compressed_down = isinstance(self.down_proj, QuantLinear) and self.down_proj.compressed
            gate, up = self.gate_up.open(x) if compressed_down else self.gate_up(x)
        else:
            x = ops.as_tensor(x)
            gate, up = self.gate_proj(x), self.up_proj(x)
        if isinstance(self.down_proj, QuantLinear):
            return self.down_proj.gated_forward(gate, up, self.act_name, open_out=self.defer_output)
        return self.down_proj(ops.gated_act(gate, up, self.act_name))
