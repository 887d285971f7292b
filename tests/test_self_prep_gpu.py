"""Decode products that prep their own input (m = 1, MUL1 integer path; csrc/exl3_gemv.cuh, SP)
against the reference and against the prep-kernel path they replace (pytest -m gpu).

The prep-skip probe tells the two apart: with it on, prep_frag launches nothing, so a product
that still matches the reference took its input from its own prep."""
from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from engine import ops  # noqa: E402
from engine.formats import exl3 as fmt  # noqa: E402
from tests import gpu_layers  # noqa: E402
from tests.gpu_layers import rel_rms, workspaces_zero  # noqa: E402

DEV = torch.device("cuda")


def rand_layer(n_in, n_out, K, seed, bias=False):
    return gpu_layers.rand_layer(n_in, n_out, K, "mul1", seed, bias)


@contextmanager
def prep_kernels(*, skipped: bool = False, self_prep: bool = True):
    ext = ops.extension()
    ext.set_prep_skip(skipped)
    ext.set_self_prep(self_prep)
    try:
        yield
    finally:
        ext.set_prep_skip(False)
        ext.set_self_prep(ops.SELF_PREP)


# one k row per unit (small), two (4096x28672 at K <= 5), K past the two-row limit, odd widths
@pytest.mark.parametrize("n_in,n_out,K", [(4096, 4096, 4), (14336, 4096, 4), (4096, 28672, 4), (4096, 28672, 2),
                                          (4096, 28672, 5), (4096, 28672, 6), (2048, 1024, 6), (1024, 2048, 8),
                                          (1152, 640, 3),
                                          (128, 128, 1)])
def test_self_prepped_product_matches_reference_and_prep_path(n_in, n_out, K):
    t = rand_layer(n_in, n_out, K, seed=n_in + n_out + K, bias=True)
    x = torch.randn(1, n_in, device=DEV).half()
    x[0, 7] = 40.0  # one large value: per-chunk int8 steps differ a lot
    want = fmt.exl3_matmul_reference(x.float(), t)
    with prep_kernels(skipped=True):
        own = ops.exl3_gemm(x, t, mode="fused", int8=True)
    with prep_kernels(self_prep=False):
        sep = ops.exl3_gemm(x, t, mode="fused", int8=True)
    assert rel_rms(own, want) < 2e-3
    assert rel_rms(own, sep) < 1e-3
    assert workspaces_zero()


@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh", "gelu"])
def test_self_prepped_gated_input(act):
    """The down projection: act(gate) * up computed by the product's own prep, gate and up as
    views of one grouped output."""
    n_in, n_out = 2816, 1024
    t = rand_layer(n_in, n_out, 4, seed=71)
    gu = torch.randn(1, 2 * n_in, device=DEV).half() * 2
    gate, up = gu[:, :n_in], gu[:, n_in:]
    want = fmt.exl3_matmul_reference(ops.gated_act(gate, up, act).float(), t)
    with prep_kernels(skipped=True):
        own = ops.exl3_gemm(gate, t, up=up, act=act, mode="fused", int8=True)
    assert rel_rms(own, want) < 2e-3


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("n_in,outs", [(512, (384, 128, 128)), (4096, (4096, 1024, 1024)), (4096, (14336, 14336))])
def test_self_prepped_grouped_product_with_norm(n_in, outs, with_residual):
    """q/k/v and gate/up: rms_norm(x + residual) * w in the product's own prep, each member with
    its own input signs (warp ranges cross members), and x + residual written bit for bit."""
    members = [rand_layer(n_in, n, 4, seed=900 + n_in + i) for i, n in enumerate(outs)]
    g = ops.join_linears(members)
    w = (torch.rand(n_in, device=DEV) + 0.5).half()
    x = torch.randn(1, 1, n_in, device=DEV).half()
    r = torch.randn(1, 1, n_in, device=DEV).half() if with_residual else None
    h, s = ops.add_rms_norm(x, r, w, 1e-5) if with_residual else (ops.rms_norm(x, w, 1e-5), x)
    with prep_kernels(skipped=True):
        p = ops.PendingNorm(x, w, 1e-5, r)
        got = ops.exl3_gemm_group(p, g, mode="fused", int8=True)
        assert torch.equal(ops.as_sum(p), s)
    for t, y in zip(members, got):
        assert rel_rms(y, fmt.exl3_matmul_reference(h.float(), t)) < 2e-3, t.out_features
    with prep_kernels(self_prep=False):
        sep = ops.exl3_gemm_group(ops.PendingNorm(x, w, 1e-5, r), g, mode="fused", int8=True)
    for a, b in zip(got, sep):
        assert rel_rms(a, b) < 1e-3


def test_rows_past_one_keep_the_prep_kernel():
    """Self prep is for m = 1 only: with the prep kernels skipped, a two-row product reads
    stale activations, so it must differ from the reference (the probe works), while one row
    still matches."""
    t = rand_layer(1024, 512, 4, seed=5)
    x = torch.randn(2, 1024, device=DEV).half()
    with prep_kernels(self_prep=False):
        ops.exl3_gemm(torch.zeros_like(x), t, mode="fused", int8=True)  # leaves zero activations behind
    with prep_kernels(skipped=True):
        two = ops.exl3_gemm(x, t, mode="fused", int8=True)
        one = ops.exl3_gemm(x[:1], t, mode="fused", int8=True)
    assert rel_rms(one, fmt.exl3_matmul_reference(x[:1].float(), t)) < 2e-3
    want = fmt.exl3_matmul_reference(x.float(), t)
    err = float((two.float() - want).norm() / want.norm())  # NaN (garbage read) counts as far too
    assert not err < 0.1
