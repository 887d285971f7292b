"""Soft-capped attention (Gemma 2) off the decode kernel: capped_attention takes its queries in
chunks that bound the scores it holds, and gives the plain formula's result whatever the chunking;
one_query_attention caps a decode step's scores the same way."""
from __future__ import annotations

import pytest
import torch

from engine.cache.masks import causal_mask
from engine.models.layers import attention, capped_attention, one_query_attention


def _reference(q, k, v, mask, scale, softcap):
    """The formula in float64, with K and V repeated per query head."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(groups, dim=1), v.double().repeat_interleave(groups, dim=1)
    scores = torch.matmul(q.double(), k.transpose(2, 3)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.double()
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def _case(B, H, Hkv, T, S, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=g) * 2  # scores well past the cap, so it matters
    k = torch.randn(B, Hkv, S, D, generator=g) * 2
    v = torch.randn(B, Hkv, S, D, generator=g)
    return q, k, v


@pytest.mark.parametrize("B,H,Hkv", [(1, 4, 4), (2, 6, 2), (1, 8, 1)])
@pytest.mark.parametrize("mask_kind", ["causal", "window", "additive", "none_square"])
def test_capped_attention_chunks_give_the_formula(B, H, Hkv, mask_kind):
    T, S, scale, cap = 11, 17, 0.3, 5.0  # 6 cached keys before the 11 queries
    q, k, v = _case(B, H, Hkv, T, S)
    if mask_kind == "causal":
        mask = causal_mask(S - T, T, None, "cpu")
    elif mask_kind == "window":
        mask = causal_mask(S - T, T, 4, "cpu")
    elif mask_kind == "additive":
        mask = torch.where(causal_mask(S - T, T, 7, "cpu"), 0.0, float("-inf"))
    else:  # T == S, mask None: plain causal
        q, k, v = _case(B, H, Hkv, S, S)
        mask = None
    want = _reference(q, k, v, causal_mask(0, S, None, "cpu") if mask is None else mask, scale, cap)
    per_query = B * H * k.shape[2] * 2 * q.element_size()
    for rows in (1, 3, 4, 1000):  # chunks of 1, 3 and 4 queries (the last one short), and one chunk
        got = capped_attention(q, k, v, mask, scale, cap, scores_bytes=rows * per_query)
        assert got.shape == q.shape
        assert (got.double() - want).abs().max().item() < 1e-5, rows


def test_capped_attention_holds_at_most_its_budget(monkeypatch):
    """The scores it materializes stay within scores_bytes: a long prompt never holds [heads, T, S]."""
    B, H, Hkv, T = 1, 8, 2, 64
    q, k, v = _case(B, H, Hkv, T, T)
    budget = 10 * B * H * T * 2 * q.element_size()  # ten queries' worth
    seen = []
    real_softmax = torch.softmax
    monkeypatch.setattr(torch, "softmax", lambda x, dim: (seen.append(x.numel()), real_softmax(x, dim))[1])
    got = capped_attention(q, k, v, None, 0.25, 3.0, scores_bytes=budget)
    assert len(seen) == 7 and max(seen) == B * H * 10 * T  # 64 queries in chunks of 10
    want = _reference(q, k, v, causal_mask(0, T, None, "cpu"), 0.25, 3.0)
    assert (got.double() - want).abs().max().item() < 1e-5


def test_attention_with_a_softcap_on_the_cpu():
    """attention() routes capped prefills to capped_attention and capped decode steps to
    one_query_attention; both give the formula, and the cap changes the result."""
    q, k, v = _case(2, 6, 3, 5, 9)
    mask = causal_mask(4, 5, None, "cpu")
    got = attention(q, k, v, mask, 0.4, softcap=4.0)
    assert (got.double() - _reference(q, k, v, mask, 0.4, 4.0)).abs().max().item() < 1e-5
    one = q[:, :, -1:]
    window = causal_mask(8, 1, 3, "cpu")  # [1, 9]: the step's last 3 keys
    step = attention(one, k, v, window, 0.4, softcap=4.0)
    assert (step.double() - _reference(one, k, v, window, 0.4, 4.0)).abs().max().item() < 1e-5
    assert torch.equal(step, one_query_attention(one, k, v, window, 0.4, 4.0))
    assert (step - attention(one, k, v, window, 0.4)).abs().max().item() > 1e-2  # the cap is applied



def test_one_pass_capped_softmax_arithmetic_gives_the_passes():
    """The arithmetic of csrc/capped_softmax.cu, modelled here in torch (the GPU test runs the
    kernel itself): tanh as 1 - 2 / (1 + 2^(2x log2 e)) on x clamped to +-10 is within 2e-7 of
    tanh, and changes its fp16 rounding on about 1e-4 of inputs spread over [-12, 12] (more, up to
    a few percent, of the small scores real models have, where fp16's steps are finer: each such
    change is one fp16 step); with the kernel's roundings (fp16 after tanh and after the cap's
    product, -inf where masked, an exp2 softmax in fp32) the probabilities are capped_attention's
    four passes' to 1e-5 but for one in 1,000 at most, which an fp16 step of either may move (at
    most 2e-3)."""
    log2e = 1.4426950408889634

    def one_pass(scores, cap, allowed):
        x = scores.float().clamp(-10, 10)
        t = (1 - 2 / (1 + torch.exp2(2 * log2e * x))).half().float()
        v = (t * cap).half().float()
        if allowed is not None:
            v = v.masked_fill(~allowed, float("-inf"))
        e = torch.exp2((v - v.amax(-1, keepdim=True)) * log2e)
        return (e / e.sum(-1, keepdim=True)).half()

    x = torch.linspace(-12, 12, 200001)
    fast = 1 - 2 / (1 + torch.exp2(2 * log2e * x.clamp(-10, 10)))
    assert (fast.double() - torch.tanh(x.double())).abs().max().item() < 2e-7
    assert (fast.half() != torch.tanh(x).half()).float().mean().item() < 2e-4
    g = torch.Generator().manual_seed(3)
    for S in (1, 37, 1025):
        T = min(S, 40)
        q0 = T // 3
        scores = (torch.randn(2, 3, T - q0, S, generator=g) * 1.5).half()
        for mask in (causal_mask(S - T, T, None, "cpu"), causal_mask(S - T, T, 5, "cpu"), None):
            allowed = None if mask is None else mask[q0:T]
            want = scores.clone().float().tanh().half()
            want = (want.float() * 30.0).half().float()
            if allowed is not None:
                want = want.masked_fill(~allowed, float("-inf"))
            want = torch.softmax(want, -1).half()
            diff = (one_pass(scores, 30.0, allowed).float() - want.float()).abs()
            assert diff.max().item() < 2e-3 and (diff > 1e-5).float().mean().item() < 1e-3, S
