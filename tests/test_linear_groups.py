"""Grouped EXL3 products (q/k/v, gate/up as one launch): the joining and the model wiring, on the
reference path (the kernel itself is checked against it in tests/test_ops_gpu.py)."""
from __future__ import annotations

import pytest
import torch

from engine import ops
from engine.formats import exl3 as fmt


def rand_layer(n_in, n_out, K, cb, seed, bias_len=None):
    g = torch.Generator().manual_seed(seed)
    trellis = torch.randint(-32768, 32768, (n_in // 16, n_out // 16, 16 * K), generator=g, dtype=torch.int32).short()
    suh = (torch.randn(n_in, generator=g) * 0.5).half()
    svh = (torch.randn(n_out, generator=g) * 0.5).half()
    b = torch.randn(bias_len, generator=g).half() if bias_len else None
    return fmt.EXL3Tensors(trellis, suh, svh, cb, b)


def test_join_keeps_every_members_product():
    members = [rand_layer(256, 256, 3, "mcg", 1), rand_layer(256, 128, 3, "mcg", 2, bias_len=100),
               rand_layer(256, 128, 3, "mcg", 3)]
    x = torch.randn(5, 256)
    want = [fmt.exl3_matmul_reference(x, t) for t in members]
    g = ops.join_linears(members)
    assert g.seg_cols == [256, 384] and g.bounds == [(0, 256), (256, 384), (384, 512)]
    assert g.trellis.shape == (16, 32, 48) and g.suh.shape == (3, 256)
    # the unpadded bias of member 1 is zero-extended in place; the others contribute zeros
    assert torch.equal(g.bias[256:356], members[1].bias[:100]) and not g.bias[356:384].any()
    assert not g.bias[:256].any() and not g.bias[384:].any()
    # members now view the joined copy: no weight is stored twice
    assert members[0].trellis.data_ptr() == g.trellis.data_ptr()
    got = ops.exl3_gemm_group(x, g)
    for y, w in zip(got, want):
        assert torch.allclose(y, w, rtol=1e-4, atol=1e-4)
    trimmed = ops.exl3_linear_group(x, g, [256, 100, 128])
    assert [t.shape[-1] for t in trimmed] == [256, 100, 128]
    assert torch.allclose(trimmed[1], want[1][:, :100], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("change", ["K", "codebook", "in", "one", "five"])
def test_cannot_group_mismatched_members(change):
    a = rand_layer(256, 128, 4, "3inst", 1)
    b = {
        "K": rand_layer(256, 128, 3, "3inst", 2),
        "codebook": rand_layer(256, 128, 4, "mul1", 2),
        "in": rand_layer(384, 128, 4, "3inst", 2),
    }.get(change)
    members = {"one": [a], "five": [a] * 5}.get(change, [a, b])
    assert not ops.can_group(members)
    with pytest.raises(ValueError, match="cannot share one product"):
        ops.join_linears(members)


def test_fused_projections_keep_model_logits(tmp_path):
    from bench.synth import SHAPES, write_synth_model
    from engine.models import load_model
    from engine.models.layers import fuse_projections, split_projections
    from engine.ops.model_patch import route_quant_linears

    d = write_synth_model(tmp_path / "tiny", SHAPES["tiny"], 3.0, head_bits=4, codebook="3inst")
    model = load_model(d)
    ids = torch.tensor([[1, 5, 9, 200, 3]])
    with torch.inference_mode():
        route_quant_linears(model)  # CPU: nothing is grouped (groups are for the GPU kernels)
        assert all(m.qkv is None for m in model.modules() if hasattr(m, "qkv"))
        want = model(ids)
        assert fuse_projections(model, device_type=None) == 2 * SHAPES["tiny"].layers
        assert fuse_projections(model, device_type=None) == 2 * SHAPES["tiny"].layers  # idempotent
        got = model(ids)
        assert split_projections(model) == 2 * SHAPES["tiny"].layers
        after = model(ids)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4)
    assert torch.allclose(after, want, rtol=1e-4, atol=1e-4)


def test_is_gate_up_takes_two_members_of_the_down_projections_width():
    from engine.ops.groups import is_gate_up

    pair = ops.join_linears([rand_layer(256, 384, 2, "mcg", 1), rand_layer(256, 384, 2, "mcg", 2)])
    assert is_gate_up(pair, 384) and not is_gate_up(pair, 256)
    uneven = ops.join_linears([rand_layer(256, 384, 2, "mcg", 3), rand_layer(256, 256, 2, "mcg", 4)])
    assert not is_gate_up(uneven, 384) and not is_gate_up(uneven, 320)
    three = ops.join_linears([rand_layer(256, 128, 2, "mcg", 5 + i) for i in range(3)])
    assert not is_gate_up(three, 128)


def test_gated_input_falls_back_to_act_then_product_off_the_gpu():
    """exl3_gemm(gate, up=...) is exl3_gemm(gated_act(gate, up)) wherever the fused prep does not
    run (the reference path here); a padded `in` is zero-extended after the activation."""
    t = rand_layer(256, 128, 4, "mul1", 7)
    gate, up = torch.randn(3, 250), torch.randn(3, 250)
    for act in ("silu", "gelu"):
        want = fmt.exl3_matmul_reference(ops.gated_act(gate, up, act), t)
        got = ops.exl3_gemm(gate, t, up=up, act=act)
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    # and the activation really is applied: a different one gives a different product
    assert not torch.allclose(ops.exl3_gemm(gate, t, up=up, act="silu"), ops.exl3_gemm(gate, t, up=up, act="gelu"))


def test_masks_apply_the_same_as_bool_or_additive():
    from engine.models.layers import apply_mask, attention
    allowed = torch.tensor([[True, True, False, True, False]])
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
    s = torch.randn(2, 3, 1, 5)
    assert torch.equal(apply_mask(s, allowed), apply_mask(s, additive))
    q, k, v = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    assert torch.allclose(attention(q, k, v, allowed, 0.3), attention(q, k, v, additive, 0.3), atol=1e-6)
    assert torch.allclose(attention(q, k, v, allowed, 0.3, softcap=5.0), attention(q, k, v, additive, 0.3, softcap=5.0), atol=1e-6)


def test_pending_norm_off_the_gpu_is_the_norm_and_the_sum():
    """RMSNorm.pending computes at once off the GPU (and for Gemma's unit offset); value() and
    as_sum give the norm of x + residual and the sum, as add_forward does."""
    from engine.models.layers import RMSNorm
    norm = RMSNorm(torch.rand(64) + 0.5, 1e-6)
    x, r = torch.randn(2, 3, 64), torch.randn(2, 3, 64)
    p = norm.pending(x, r)
    want_h, want_s = norm.add_forward(x, r)
    assert p.normed is not None and torch.equal(ops.as_tensor(p), want_h) and torch.equal(ops.as_sum(p), want_s)
    q = norm.pending(x)
    assert torch.equal(ops.as_tensor(q), norm(x)) and ops.as_sum(q) is x
    # a PendingNorm built by hand computes on demand, once
    lazy = ops.PendingNorm(x, norm.weight, 1e-6, r)
    assert lazy.normed is None and lazy.shape == x.shape and lazy.dtype == x.dtype
    assert torch.allclose(lazy.value(), want_h) and torch.allclose(ops.as_sum(lazy), want_s)
    assert lazy.value() is lazy.normed
    unit = RMSNorm(torch.zeros(64), 1e-6, unit_offset=True).pending(x, r)
    assert torch.allclose(ops.as_tensor(unit), RMSNorm(torch.zeros(64), 1e-6, unit_offset=True)(x + r))


def test_norm_over_a_pending_norm():
    """A Gemma block's post-norm and the norm after it (RMSNorm.pending of a pending norm): off the
    GPU the inner one is computed at once (in Gemma's fp32 form), so the outer is the norm of its
    output plus the residual. A norm over a norm built by hand (PendingNorm.pre_weight, as the GPU
    fold makes it) computes the inner norm on demand, and settle_pre leaves the outer pending as a
    plain norm of the inner one's output; no prep takes it off the GPU."""
    from engine.models.layers import RMSNorm
    post = RMSNorm(torch.randn(128) * 0.3, 1e-6, unit_offset=True)
    pre = RMSNorm(torch.randn(128) * 0.3, 1e-5, unit_offset=True)
    x, r = torch.randn(2, 3, 128) * 5, torch.randn(2, 3, 128)
    inner = post.pending(x)
    p = pre.pending(inner, r)
    assert p.pre_weight is None and p.normed is not None
    want_h, want_s = pre.add_forward(post(x), r)
    assert torch.equal(ops.as_tensor(p), want_h) and torch.equal(ops.as_sum(p), want_s)

    w, pw = torch.rand(128) + 0.5, torch.rand(128) + 0.5
    lazy = ops.PendingNorm(x, w, 1e-5, r, pre_weight=pw, pre_eps=1e-6)
    want_h, want_s = ops.add_rms_norm(ops.rms_norm(x, pw, 1e-6), r, w, 1e-5)
    assert not lazy.fusable(128) and not lazy.fusable(128, pre_ok=True)
    assert torch.equal(lazy.value(), want_h) and torch.equal(ops.as_sum(lazy), want_s)
    assert lazy.pre_weight is None
    settled = ops.PendingNorm(x, w, 1e-5, r, pre_weight=pw, pre_eps=1e-6)
    settled.settle_pre()
    assert settled.pre_weight is None and settled.normed is None
    assert torch.equal(settled.x, ops.rms_norm(x, pw, 1e-6)) and torch.equal(settled.value(), want_h)
    # the grouped product's reference path (no GPU) takes the settled input
    members = [rand_layer(128, 128, 4, "mul1", 3), rand_layer(128, 256, 4, "mul1", 4)]
    want = [fmt.exl3_matmul_reference(want_h, t) for t in members]
    got = ops.exl3_gemm_group(ops.PendingNorm(x, w, 1e-5, r, pre_weight=pw, pre_eps=1e-6), ops.join_linears(members))
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-4) for a, b in zip(got, want))
