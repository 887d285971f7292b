"""Attention-side ops of a decode step and of prefill: RoPE (with the step's KV-cache write), the
one-query decode attention (which can take that RoPE and write, and the per-head q/k norms, along
with it: PendingRope) and Gemma 2's capped attention probabilities. Kept apart from the products
because none of it touches the trellis; their settings (ATTN_*, CAPPED_SOFTMAX, GLUE_KERNELS) stay
in engine.ops, read at call time, so that a test or benchmark that sets ops.X changes these too.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engine import ops  # a cycle (ops imports this module first): used at call time only
from engine.ops.chain import PreparedInput

_attn_counters: dict = {}  # completion counters of decode_attention's splits, per device


@dataclass
class PendingRope:
    """One decode token's RoPE and KV-cache write, left to the attention kernel: q [B, H, 1, D]
    unrotated (a view of the projection), keys / values the cache's span [B, Hkv, S, D] that the
    token's slot `position` (long [1] on the device) is in, k_new / v_new [B, 1, Hkv, D] the
    token's projections, cos / sin [1, D]. `head_norms` (Qwen3, Gemma 3): the q and k norms
    (models.layers.RMSNorm) that come before the RoPE, left to the kernel too; q and k_new are
    then their inputs. `window`: the layer's sliding window, whose slots are then all the kernel
    walks (ops.ATTN_WINDOW; the mask must hide the others). Whoever holds one must run
    decode_attention with it, or apply() it, before anything reads q or the cache."""

    q: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    k_new: torch.Tensor
    v_new: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    position: torch.Tensor
    head_norms: "tuple[torch.nn.Module, torch.nn.Module] | None" = None
    window: int | None = None  # the layer's sliding window: the token sees slots position - window < j

    def serves(self, mask: torch.Tensor | None) -> bool:
        """Whether the attention kernel takes this token's RoPE and cache write along with the
        attention (the RoPE kernel's layouts and the attention kernel's)."""
        if self.window and mask is None:  # the window walk leaves the slots past the token to the mask
            return False
        return (ops.ATTN_ROPE and decode_attention_serves(self.q, self.keys, self.values, mask)
                and rope_kernel_serves(self.cos, self.sin, self.q.transpose(1, 2), self.k_new, self.v_new)
                and self.k_new.stride() == self.v_new.stride() and self.k_new.data_ptr() % 16 == 0
                and self.v_new.data_ptr() % 16 == 0 and self.position.is_cuda and self.position.numel() == 1
                and self._norms_serve())

    def _norms_serve(self) -> bool:
        if self.head_norms is None:
            return True
        qn, kn = self.head_norms
        if not ops.ATTN_HEAD_NORMS:
            return False
        D = self.q.shape[-1]
        # the kernel's head-normed variant is built for Qwen3's and Gemma 3's head dims, uncapped
        return D in (128, 256) and qn.eps == kn.eps and all(
            w.is_cuda and w.dtype == torch.float16 and w.is_contiguous() and w.numel() == D and w.device == self.q.device
            for w in (qn.kernel_weight, kn.kernel_weight))

    def tensors(self) -> list[torch.Tensor]:
        norms = [] if self.head_norms is None else [n.kernel_weight for n in self.head_norms]
        return [self.k_new, self.v_new, self.cos.reshape(-1), self.sin.reshape(-1), self.position, *norms]

    def norm_eps(self) -> float:
        return 0.0 if self.head_norms is None else float(self.head_norms[0].eps)

    def apply(self) -> torch.Tensor:
        """The head norms, RoPE and the cache write on their own (their kernels, or PyTorch ops):
        the rotated q [B, H, 1, D], for an attention that does none of them."""
        q, k = self.q.transpose(1, 2), self.k_new
        if self.head_norms is not None:
            q, k = self.head_norms[0](q), self.head_norms[1](k)
        q, _ = rope_qk_store(q, k, self.v_new, self.cos, self.sin, self.keys, self.values, self.position)
        return q.transpose(1, 2)


def decode_attention_serves(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Shapes and layouts the decode-attention kernel takes (everything else stays on SDPA)."""
    if not (ops.ATTN_KERNEL and q.dim() == 4 and k.dim() == 4 and q.shape[2] == 1 and ops._use_cuda(q, k, v, mask)):
        return False
    B, H, _, D = q.shape
    if D not in (64, 128, 256) or k.shape != v.shape or k.stride() != v.stride() or k.shape[0] != B:
        return False
    if k.shape[3] != D or H % k.shape[1] or q.stride(3) != 1 or k.stride(3) != 1:
        return False
    dl = D // 32
    for t in (q, k):
        if t.data_ptr() % (2 * dl) or t.stride(0) % dl or t.stride(1) % dl or (t.shape[2] > 1 and t.stride(2) % dl):
            return False
    if v.data_ptr() % (2 * dl):
        return False
    if mask is not None:
        if mask.dim() != 2 or mask.shape[0] not in (1, B) or mask.shape[1] != k.shape[2] or mask.stride(1) != 1:
            return False
    return True


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                     scale: float, chain: "tuple[PreparedInput, torch.Tensor] | None" = None,
                     rope: PendingRope | None = None, softcap: float | None = None) -> torch.Tensor | None:
    """softmax(scale q.k + mask) v for one query per sequence: q [B, H, 1, D], k, v [B, Hkv, S, D]
    (grouped heads read in place), mask additive [1 or B, S] or None. With `rope` (whose q, keys
    and values these are, rope.serves(mask) checked) the kernel first rotates q and writes the
    token's k and v into the cache. `softcap` (Gemma 2): each score s becomes
    softcap * tanh(s / softcap) before the mask. None when the kernel does not take these tensors;
    the caller then runs its own path (models/layers.attention)."""
    if softcap is not None and not (softcap > 0 and math.isfinite(softcap)):
        raise ValueError(f"decode_attention: softcap must be a positive finite number, not {softcap}")
    if rope is not None:
        if not (q is rope.q and k is rope.keys and v is rope.values and rope.serves(mask)):
            raise ValueError("decode_attention: a pending RoPE goes with its own q, keys and values, in a layout the kernel takes")
    elif not decode_attention_serves(q, k, v, mask):
        return None
    # One completion counter per block row of the kernel (batch x kv head x group of up to 4
    # query heads): B x H is always enough.
    counters = ops._zeroed(_attn_counters, q.device, q.shape[0] * q.shape[1], 1024, torch.int32)
    nxt = [] if chain is None else [chain[0].xb, chain[0].scales, chain[0].csum, chain[1]]
    window = rope.window if rope is not None and ops.ATTN_WINDOW and rope.window else 0
    return ops.extension().decode_attention(q, k, v, mask, float(scale), float(softcap or 0.0), counters, nxt,
                                            [] if rope is None else rope.tensors(),
                                            0.0 if rope is None else rope.norm_eps(), int(window))


def rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotary embedding on q [B, T, Hq, D] and k [B, T, Hk, D] (the layout the projections
    produce), cos/sin [T, D]. On the GPU one kernel rotates both in place (they are fresh
    projection outputs), rounding like the PyTorch ops, which otherwise cost ten launches."""
    if rope_kernel_serves(cos, sin, q, k):
        ops.extension().rope_qk(q, k, cos, sin, None, None, None, None)
        return q, k
    c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)

    def rot(t):
        h = t.shape[-1] // 2
        return torch.cat((-t[..., h:], t[..., :h]), dim=-1)

    return q * c + rot(q) * s, k * c + rot(k) * s


def rope_kernel_serves(cos: torch.Tensor, sin: torch.Tensor, *heads: torch.Tensor) -> bool:
    """Whether the RoPE kernel takes these: fp16 CUDA, each of `heads` (q, k, v) [B, T, H, D] with
    its heads contiguous, cos/sin contiguous [T, D]."""
    T, D = heads[0].shape[1], heads[0].shape[-1]
    return (ops.GLUE_KERNELS and ops._use_cuda(cos, sin, *heads)
            and all(t.dim() == 4 and t.stride(-1) == 1 and t.stride(-2) == D for t in heads)
            and cos.shape == (T, D) and cos.is_contiguous() and sin.is_contiguous())


def rope_qk_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, position: torch.Tensor):
    """rope_qk, then this step's k (rotated) and v [B, T, Hk, D] stored in the caches
    [B, Hk, slots, D] at slots position .. position + T - 1 (`position`: a long [1] on the device,
    so a CUDA graph can replay it). On the GPU one kernel does all of it, instead of three."""
    if (rope_kernel_serves(cos, sin, q, k, v) and ops._use_cuda(k_cache, v_cache) and k_cache.stride(-1) == 1
            and k_cache.stride() == v_cache.stride() and position.is_cuda):
        ops.extension().rope_qk(q, k, cos, sin, v, k_cache, v_cache, position)
        return q, k
    q, k = rope_qk(q, k, cos, sin)
    slots = position + torch.arange(k.shape[1], device=position.device)
    k_cache.index_copy_(2, slots, k.transpose(1, 2))
    v_cache.index_copy_(2, slots, v.transpose(1, 2))
    return q, k


def capped_softmax_(scores: torch.Tensor, softcap: float, mask: torch.Tensor | None, q0: int) -> bool:
    """Gemma 2's attention probabilities in place where the kernel takes them: scores [..., t, S]
    (scale / softcap times q.k) become softmax(mask(softcap * tanh(scores))), rounded as
    capped_attention's passes round them; mask bool [T or 1, S] (the chunk's queries are rows q0 ..
    q0 + t - 1) or None. False (scores untouched) where it does not serve: the caller runs the
    passes."""
    if not (ops.CAPPED_SOFTMAX and ops._use_cuda(scores) and scores.dim() >= 2 and scores.is_contiguous()
            and scores.numel() > 0):
        return False
    S, t = scores.shape[-1], scores.shape[-2]
    if mask is not None and not (mask.dtype == torch.bool and mask.dim() == 2 and mask.shape[-1] == S and mask.is_cuda
                                 and (mask.shape[0] == 1 or q0 + t <= mask.shape[0]) and mask.stride(-1) == 1):
        return False
    ext = ops.extension()
    with torch.cuda.device(scores.device):  # the row limit is the scores' device's
        if S > ext.capped_softmax_max_len():
            return False
    ext.capped_softmax_(scores, float(softcap), mask, int(q0))
    return True
