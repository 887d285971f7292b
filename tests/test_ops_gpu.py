"""CUDA kernels against the torch reference (run on the GPU machine: pytest -m gpu)."""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from engine import ops  # noqa: E402
from engine.ops import token_pick  # noqa: E402
from engine.formats import exl3 as fmt  # noqa: E402
from tests.gpu_layers import (capture, kernel_names, kernels_run, rand_layer, rel_rms, template_args,  # noqa: E402
                               workspaces_zero)

CODEBOOKS = ["3inst", "mcg", "mul1"]
DEV = torch.device("cuda")


@pytest.fixture(scope="module", autouse=True)
def ext():
    return ops.extension()  # builds once; a build failure fails every test with its message


@pytest.mark.parametrize("K,cb", list(itertools.product(range(1, 9), CODEBOOKS)))
def test_reconstruct_bit_exact(K, cb):
    t = rand_layer(256, 384, K, cb, seed=K * 7 + len(cb))
    got = ops.exl3_reconstruct(t.trellis, cb)
    want = fmt.reconstruct(t.trellis.cpu(), cb).to(DEV)
    assert got.shape == want.shape and got.dtype == torch.float16
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("K,cb", list(itertools.product(range(1, 9), CODEBOOKS)))
def test_fused_product_all_rows(K, cb):
    t = rand_layer(512, 384, K, cb, seed=100 + K)
    ref_w = fmt.reconstruct(t.trellis, cb)
    for rows in (1, 2, 8, 17, 32, 200):
        x = torch.randn(rows, 512, device=DEV).half()
        want = fmt.exl3_matmul_reference(x.float(), t, ref_w)
        for mode in ("fused", "auto") if rows > 32 else ("fused",):
            for int8, version in itertools.product((True, False) if cb == "mul1" and rows <= 8 else (None,), (2, 3)):
                y = ops.exl3_gemm(x, t, mode=mode, int8=int8, version=version)
                assert y.shape == (rows, 384) and y.dtype == torch.float16
                err = rel_rms(y, want)
                assert err < 2e-3, (rows, mode, int8, version, err)


@pytest.mark.parametrize("n_in,n_out,rows", [(128, 128, 1), (1152, 640, 5), (384, 1280, 33), (4096, 256, 3)])
def test_odd_shapes_bias_and_splits(n_in, n_out, rows):
    for cb in CODEBOOKS:
        t = rand_layer(n_in, n_out, 4, cb, seed=n_in + n_out, bias=True)
        x = torch.randn(2, rows, n_in, device=DEV).half()
        want = fmt.exl3_matmul_reference(x.float(), t)
        for ksplit, version in ((0, 2), (1, 2), (3, 2), (0, 3)):
            y = ops.exl3_gemm(x, t, mode="fused", ksplit=ksplit, version=version)
            assert y.shape == (2, rows, n_out)
            assert rel_rms(y, want) < 2e-3, (cb, ksplit, version)
        assert rel_rms(ops.exl3_gemm(x, t, mode="dense"), want) < 2e-3


def test_non_contiguous_input_and_repeat_calls_keep_workspace_clean():
    t = rand_layer(512, 256, 3, "mul1", seed=5)
    big = torch.randn(8, 1024, device=DEV).half()
    x = big[:, 256:768]  # row stride 1024
    want = fmt.exl3_matmul_reference(x.float(), t)
    first = ops.exl3_gemm(x, t)
    second = ops.exl3_gemm(x, t)
    assert rel_rms(first, want) < 2e-3 and rel_rms(second, want) < 2e-3
    assert workspaces_zero()


@pytest.mark.parametrize("cb", CODEBOOKS)
def test_large_layer_matches_reference(cb):
    t = rand_layer(4096, 14336, 4, cb, seed=9)
    for rows in (1, 8, 32):
        x = torch.randn(rows, 4096, device=DEV).half()
        x[:, 7] = 40.0  # an outlier channel: the int8 path's per-block steps must cope
        assert rel_rms(ops.exl3_gemm(x, t), fmt.exl3_matmul_reference(x.float(), t)) < 2e-3


@pytest.mark.parametrize("n_in,n_out", [(1024, 1536), (4096, 14336)])
def test_mul1_fp16_path_applies_the_affine_step_per_output(n_in, n_out):
    """The fp16 path with one group of 8 rows decodes MUL1 to 1024 + t and applies k_inv and
    k_bias once per output, with each row's sum of the rotated input from one MMA per k row
    (csrc/exl3_gemv.cuh, gv_mul1_row_sum). Unit input scales and inputs of mean 1 put a large
    value at the head of every 128-chunk after the rotation, so the k_bias term is ~30x the
    product: a missing or misplaced row sum cannot hide. 4096x14336 takes two k rows per unit,
    and at 17 and 32 rows the block-shared kernel, whose row sums come from its slice's copy of
    the activations (csrc/exl3_gemv_sa.cuh)."""
    t = rand_layer(n_in, n_out, 4, "mul1", seed=n_out)
    t = fmt.EXL3Tensors(t.trellis, torch.ones_like(t.suh), t.svh, "mul1", None)
    ref_w = fmt.reconstruct(t.trellis, "mul1")
    for rows in (1, 3, 5, 8, 12, 17, 32):
        x = (1.0 + 0.1 * torch.randn(rows, n_in, device=DEV)).half()
        y = ops.exl3_gemm(x, t, mode="fused", int8=False, version=3)
        err = rel_rms(y, fmt.exl3_matmul_reference(x.float(), t, ref_w))
        assert err < 2e-3, (rows, err)


@pytest.mark.parametrize("variant", range(10, 20))
def test_occupancy_configurations_match_reference(variant):
    """Each gv_tune configuration (benchmark knob today, a default tomorrow) computes the same
    product: tiles per unit, ring depth and blocks per SM change only the schedule."""
    t = rand_layer(1024, 1536, 4, "mul1", seed=17, bias=True)
    ref_w = fmt.reconstruct(t.trellis, "mul1")
    with ops.debug_variant(variant):
        for rows, int8 in ((1, True), (1, False), (5, True), (8, False), (17, False), (32, False)):
            x = torch.randn(rows, 1024, device=DEV).half()
            y = ops.exl3_gemm(x, t, mode="fused", int8=int8, version=3)
            err = rel_rms(y, fmt.exl3_matmul_reference(x.float(), t, ref_w))
            assert err < 2e-3, (variant, rows, int8, err)
    assert workspaces_zero()


def groups_and_cfgs(run) -> set[tuple[int, int]]:
    """(NG, CFG) of each per-warp product kernel run() launches (exl3_gemv_kernel<K, CB, PATH, NG,
    VAR, CFG, ...>), from the profiler's names."""
    names = kernels_run(run, "exl3_gemv_kernel")
    return {(int(a[3]), int(a[5])) for a in template_args(names, "exl3_gemv_kernel")}


@pytest.mark.parametrize("n_in,n_out", [(1024, 1536), (4096, 14336)])
def test_integer_path_four_row_units_at_two_groups_match_reference(n_in, n_out):
    """Debug variant 51 (CFG 13): the integer path's 5..8 rows in units of four k rows of 4 tiles
    (shipped: one k row). It gives the reference's product and the shipped kernel's up to fp32
    summation order, with a bias; at 1..4 rows (one group) the variant runs the shipped kernel.
    Which kernel ran is read from the profiler's names (exl3_gemv_kernel<K, CB, PATH, NG, VAR,
    CFG, ...>), so a dispatch that fell through to the shipped kernel would fail here."""
    t = rand_layer(n_in, n_out, 4, "mul1", seed=61, bias=True)
    ref_w = fmt.reconstruct(t.trellis, "mul1")
    for rows in (2, 5, 7, 8):
        x = torch.randn(rows, n_in, device=DEV).half()
        x[:, 3] = 12.0
        run = lambda: ops.exl3_gemm(x, t, mode="fused", int8=True, version=3)  # noqa: E731
        y0, shipped = run(), groups_and_cfgs(run)
        with ops.debug_variant(51):
            y, ran = run(), groups_and_cfgs(run)
        assert ran == ({(2, 13)} if rows > 4 else shipped), (rows, ran, shipped)
        ref = fmt.exl3_matmul_reference(x.float(), t, ref_w)
        assert rel_rms(y, ref) < 2e-3, (rows, rel_rms(y, ref))
        assert rel_rms(y, y0) < 1e-3, rows
    assert workspaces_zero()


@pytest.mark.parametrize("n_in,n_out", [(1024, 1536), (4096, 28672)])
def test_decode_split_between_alu_and_fma_pipes_gives_the_same_product(n_in, n_out):
    """The K = 4 MUL1 integer path takes the product s * M of one state per window as W * M -
    (hi * M) << 16 instead of masking the low state first (lane_products_k4): the same integers.
    So it and debug variant 7 (the previous extraction) give the reference's product and each
    other's up to fp32 summation order, at 1..4 rows. 4096x28672 takes four k rows per unit (CFG
    10), 1024x1536 one."""
    t = rand_layer(n_in, n_out, 4, "mul1", seed=41, bias=True)
    ref_w = fmt.reconstruct(t.trellis, "mul1")
    for rows in (1, 2, 4):
        x = torch.randn(rows, n_in, device=DEV).half()
        y0 = ops.exl3_gemm(x, t, mode="fused", int8=True, version=3)
        with ops.debug_variant(7):
            y = ops.exl3_gemm(x, t, mode="fused", int8=True, version=3)
        ref = fmt.exl3_matmul_reference(x.float(), t, ref_w)
        assert rel_rms(y0, ref) < 2e-3 and rel_rms(y, ref) < 2e-3, rows
        assert rel_rms(y, y0) < 1e-3, rows
    assert workspaces_zero()


@pytest.mark.parametrize("n_in,n_out", [(1024, 1536), (4096, 28672)])
@pytest.mark.parametrize("cb", ["mul1", "3inst", "mcg"])
def test_decode_forms_give_the_same_product(n_in, n_out, cb):
    """K = 4's decode forms give the same states and byte sums, so the same products: the shipped
    integer path (A12, the previous word's 12 low bits masked once, and the tiles' words by
    ldmatrix and a shuffle: kLdsm); variant 8 (A12 with shared loads; on the fp16 path, which
    takes A12 since session 51, the shipped kernels); 64 (the fp16 path's two masks, its form
    before session 51); 22 (session 31's integer-path decode: two masks, shared loads); 21 (MUL1,
    fp16 path: the byte sums by two MMAs a tile instead of an IDP4A a weight, mul1_f16_by_mma). In
    the shipped configurations (the compact ring, one and four k rows per unit, the split
    finish): against the reference and the shipped decode (up to fp32 summation order: split-k
    atomics), the integer path at 1..8 rows (MUL1), the fp16 one at 1..32 (per-warp kernel;
    variants 39 and 40 are the block-shared one's). Variant 41 adds MUL1's constant term in the
    integer products' tails, where the shipped split finish adds it in the finish kernel (GvC0)."""
    t = rand_layer(n_in, n_out, 4, cb, seed=53, bias=True)
    ref_w = fmt.reconstruct(t.trellis, cb)
    cases = [(r, False, v) for r in (1, 5, 8, 12, 32) for v in (8, 64)]
    if cb == "mul1":
        cases += [(r, True, v) for r in (1, 2, 4, 8) for v in (8, 22, 41)]
        cases += [(r, False, 21) for r in (1, 5, 8, 12, 32)]
    for rows, int8, variant in cases:
        x = torch.randn(rows, n_in, device=DEV).half()
        y0 = ops.exl3_gemm(x, t, mode="fused", int8=int8, version=3)
        with ops.debug_variant(variant):
            y = ops.exl3_gemm(x, t, mode="fused", int8=int8, version=3)
        ref = fmt.exl3_matmul_reference(x.float(), t, ref_w)
        assert rel_rms(y, ref) < 2e-3, (rows, int8, variant, rel_rms(y, ref))
        assert rel_rms(y, y0) < 1e-3, (rows, int8, variant)
    assert workspaces_zero()


def extension_setting(name, setter, default):
    """A fixture that hands a test one of the extension's launch settings and puts the default
    back after it, pass or fail, so no later test runs under a changed setting."""
    @pytest.fixture(name=name)
    def fixture():
        set_value = getattr(ops.extension(), setter)
        yield set_value
        set_value(getattr(ops, default))
    return fixture


grid_fill = extension_setting("grid_fill", "set_gemv_grid_fill", "GV_GRID_FILL")  # gemv_grid_fill
block_cap = extension_setting("block_cap", "set_gemv_block_cap", "GV_BLOCK_CAP")  # two blocks per SM
four_rows = extension_setting("four_rows", "set_gemv_four_row_units", "FOUR_ROW_UNITS")


def assert_same_product_under(set_value, values, t, cb, n_in, row_paths):
    """Each (rows, int8) product of layer t under every value of one launch setting: against the
    reference (relative RMS < 2e-3) and the first value's product up to fp32 summation order
    (< 1e-3); and the workspaces are left zero."""
    ref_w = fmt.reconstruct(t.trellis, cb)
    for rows, int8 in row_paths:
        x = torch.randn(rows, n_in, device=DEV).half()
        ref = fmt.exl3_matmul_reference(x.float(), t, ref_w)
        ys = []
        for v in values:
            set_value(v)
            ys.append(ops.exl3_gemm(x, t, mode="fused", int8=int8, version=3))
            assert rel_rms(ys[-1], ref) < 2e-3, (rows, int8, v, rel_rms(ys[-1], ref))
        for v, y in zip(values[1:], ys[1:]):
            assert rel_rms(y, ys[0]) < 1e-3, (rows, int8, v)
    assert workspaces_zero()


@pytest.mark.parametrize("n_in,n_out", [(4096, 6144), (14336, 4096), (1024, 1536)])
def test_grid_fill_settings_give_the_same_product(n_in, n_out, grid_fill):
    """The three grid fills (the min-units cap's grid; every resident block where that leaves more
    blocks than SMs; every resident block always) split the same product over different warps: on
    132 SMs these shapes' one-row grids are 192, 224 and 12 blocks under the cap; fill 1 changes
    the first two, fill 2 all three. Against the reference and each other (up to fp32 summation
    order), integer path at 1 and 4 rows, fp16 path at 8."""
    t = rand_layer(n_in, n_out, 4, "mul1", seed=59, bias=True)
    assert_same_product_under(grid_fill, (0, 1, 2), t, "mul1", n_in, ((1, True), (4, True), (8, False)))


@pytest.mark.parametrize("n_in,n_out,cb", [(4096, 4096, "mul1"), (4096, 14336, "3inst"), (4096, 14336, "mul1")])
def test_block_cap_gives_the_same_product(n_in, n_out, cb, block_cap):
    """The padded launch (the default since session 42) runs the same kernels on more shared
    memory: the products the cap can change (the compact ring of a small layer, CFG 9 at 3INST's
    80 registers, the two-group kernel at 9..16 rows, and the block-shared launch at 32, which it
    pads too) against the reference and the unpadded launch, up to fp32 summation order; and the
    workspaces are left zero."""
    t = rand_layer(n_in, n_out, 4, cb, seed=61)
    row_paths = [(rows, cb == "mul1" and rows <= 4) for rows in (1, 6, 12, 16, 32)]
    assert_same_product_under(block_cap, (0, 1), t, cb, n_in, row_paths)


@pytest.mark.parametrize("K,cb", [(2, "mul1"), (4, "mul1"), (5, "mul1"), (6, "mul1"), (4, "3inst"), (3, "mcg"), (6, "3inst")])
def test_two_row_units_of_large_layers_match_reference(K, cb, four_rows):
    """Layers large enough for two k rows per unit (4096x28672: 28,672 row pairs of 128 columns
    against 6 per resident warp) give the reference's product on both arithmetic paths, and the
    same as the one-row configuration (debug variant 10) up to fp32 summation order (four k rows
    per unit off: they would take the integer path's 1..4 rows here)."""
    four_rows(0)
    t = rand_layer(4096, 28672, K, cb, seed=31 + K)
    for rows, int8 in ((1, True), (1, False), (3, True), (8, False)):
        if int8 and cb != "mul1":
            continue
        x = torch.randn(rows, 4096, device=DEV).half()
        x[:, 11] = 30.0
        y = ops.exl3_gemm(x, t, mode="fused", int8=int8, version=3)
        assert rel_rms(y, fmt.exl3_matmul_reference(x.float(), t)) < 2e-3, (rows, int8)
        with ops.debug_variant(10):
            y1 = ops.exl3_gemm(x, t, mode="fused", int8=int8, version=3)
        assert rel_rms(y, y1) < 1e-3, (rows, int8)


@pytest.mark.parametrize("K", [1, 2, 3, 4])
def test_four_row_units_match_reference(K, four_rows):
    """With four k rows per unit switched on (TRELLIS_GV_FOUR_ROW_UNITS; 4096x28672 has 14,336 k-row
    quads of 128 columns, ~7 per resident warp) the integer path takes CFG 10 and gives the
    reference's product at 1..4 rows, and the two-row configuration's up to fp32 summation order;
    so does the fp16 path at 5..8 rows. Off (0), neither takes it."""
    t = rand_layer(4096, 28672, K, "mul1", seed=41 + K)

    def cfg10_ran(x, int8):
        names = kernels_run(lambda: ops.exl3_gemm(x, t, mode="fused", int8=int8, version=3), "exl3_gemv_kernel")
        return any(", 10, false, false>" in n for n in names)

    x, x8 = torch.randn(1, 4096, device=DEV).half(), torch.randn(8, 4096, device=DEV).half()
    four_rows(0)
    assert not cfg10_ran(x, True) and not cfg10_ran(x8, False)
    four_rows(1)
    assert cfg10_ran(x, True) and cfg10_ran(x8, False)
    for rows, int8 in ((1, True), (3, True), (4, True), (5, False), (8, False)):
        x = torch.randn(rows, 4096, device=DEV).half()
        x[:, 11] = 30.0
        y = ops.exl3_gemm(x, t, mode="fused", int8=int8, version=3)
        assert rel_rms(y, fmt.exl3_matmul_reference(x.float(), t)) < 2e-3, rows
        four_rows(0)
        y2 = ops.exl3_gemm(x, t, mode="fused", int8=int8, version=3)
        four_rows(1)
        assert rel_rms(y, y2) < 1e-3, rows
    assert workspaces_zero()


@pytest.mark.parametrize("K,cb", [(2, "mcg"), (3, "3inst"), (4, "3inst")])
def test_four_row_units_of_other_codebooks(K, cb, four_rows):
    """3INST and MCG products always take the fp16 path; on a layer large enough they take four k
    rows per unit at every row count of one group (1..8) and match the reference."""
    t = rand_layer(4096, 28672, K, cb, seed=51 + K)
    four_rows(1)
    for rows in (1, 2, 7):
        x = torch.randn(rows, 4096, device=DEV).half()
        names = kernels_run(lambda: ops.exl3_gemm(x, t, mode="fused", version=3), "exl3_gemv_kernel")
        assert any(", 10, false, false>" in n for n in names), (rows, names)
        y = ops.exl3_gemm(x, t, mode="fused", version=3)
        assert rel_rms(y, fmt.exl3_matmul_reference(x.float(), t)) < 2e-3, rows
    assert workspaces_zero()


def test_default_dispatch_takes_int8_path_up_to_four_rows():
    """MUL1 products of 1..4 rows take the integer path by default (one launch covers 4 rows at the
    cost of one), 5..8 rows the fp16 path; other codebooks never take it. Checked by the kernel's
    PATH template argument (GV_I8 = 0) in the launched kernel's name."""
    import re

    def paths(t, rows):
        x = torch.randn(rows, 1024, device=DEV).half()
        names = kernels_run(lambda: ops.exl3_gemm(x, t, mode="fused"), "exl3_gemv_kernel")
        return {int(re.search(r"exl3_gemv_kernel<\d+, \d+, (\d+)", n).group(1)) for n in names}

    mul1, inst3 = rand_layer(1024, 2048, 4, "mul1", seed=3), rand_layer(1024, 2048, 4, "3inst", seed=4)
    for rows in range(1, 9):
        assert paths(mul1, rows) == ({0} if rows <= 4 else {1}), rows
    assert paths(inst3, 2) == {1}


def test_int8_path_with_zero_and_tiny_rows():
    t = rand_layer(512, 256, 4, "mul1", seed=11)
    x = torch.randn(3, 512, device=DEV).half()
    x[1] = 0
    x[2] *= 1e-3
    y = ops.exl3_gemm(x, t, int8=True)
    want = fmt.exl3_matmul_reference(x.float(), t)
    assert torch.isfinite(y).all() and float(y[1].abs().max()) == 0.0
    assert rel_rms(y[0], want[0]) < 2e-3 and rel_rms(y[2], want[2]) < 2e-3


def test_hadamard_kernel_matches_reference():
    x = torch.randn(7, 3, 384, device=DEV).half()
    got = ops.hadamard128(x)
    want = fmt.hadamard128(x.float())
    assert got.dtype == torch.float16 and rel_rms(got, want) < 1e-3
    # It is its own inverse (orthonormal, symmetric).
    assert rel_rms(ops.hadamard128(got), x.float()) < 2e-3


@pytest.mark.parametrize("rows,n", [(1, 128), (3, 384), (37, 4096), (4096, 640), (8200, 4096)])
def test_hadamard_kernels_tiles_warps_and_scales(rows, n):
    """The Hadamard kernels against the torch steps they stand for: fp16 with pre, post and bias
    in 64-row tiles (the default: resident blocks looping over tiles, several each at 8,200 x 4,096;
    row counts that end inside a tile), the same bits from a block per tile and from the warp
    kernel (several tasks per warp, counts that end inside a warp), and fp32 input (a product's
    workspace), which the warp kernel takes."""
    x = torch.randn(rows, n, device=DEV).half()
    pre, post, bias = (torch.randn(n, device=DEV).half() for _ in range(3))
    ext = ops.extension()
    got = ext.had128(x, pre, post, bias)
    xh = fmt.hadamard128((x * pre).float()).half()
    assert rel_rms(got, xh * post + bias) < 1e-3
    try:  # the tiles looping or one per block, and a warp per 128-block: the same butterflies, the same bits
        ext.set_had_pipeline(False)
        assert torch.equal(ext.had128(x, pre, post, bias), got)
        ext.set_had_tiles(False)
        assert torch.equal(ext.had128(x, pre, post, bias), got)
    finally:
        ext.set_had_tiles(ops.HAD_TILES)
        ext.set_had_pipeline(ops.HAD_PIPELINE)
    z = torch.randn(rows, n, device=DEV)
    want = fmt.hadamard128(z).half() * post
    assert rel_rms(ext.had128(z, None, post, None), want) < 1e-3


@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh", "gelu"])
def test_gated_had128_is_gated_act_then_had128(act):
    """The prefill's down-projection input in one pass (act(gate) * up, times suh, Hadamard) gives
    the bits of gated_act and then had128, for gate and up as column views of one output; also
    in the open form (gate/up's own output transform first), with a block per tile instead of
    resident blocks looping over tiles (several each at 2,100 x 2,048), and where rows start
    misaligned for the tile kernel (the warp kernel takes them)."""
    ext = ops.extension()
    a = ops._ACT_IDS[act]
    for rows, n in ((1, 128), (5, 384), (300, 1024), (2100, 2048)):
        gu = torch.randn(rows, 2 * n, device=DEV).half() * 3
        gate, up = gu[:, :n], gu[:, n:]
        suh = torch.randn(n, device=DEV).half()
        want = ext.had128(ops.gated_act(gate, up, act), suh, None, None)
        got = ext.gated_had128(gate, up, a, suh)
        assert torch.equal(got, want), (rows, n)
        # open: gate and up still to be transformed (svh, bias), as the prefill's MLP passes them
        svh_g, svh_u, b_g, b_u = (torch.randn(n, device=DEV).half() for _ in range(4))
        fin_g, fin_u = ext.had128(gate.contiguous(), None, svh_g, b_g), ext.had128(up.contiguous(), None, svh_u, b_u)
        want_open = ext.had128(ops.gated_act(fin_g, fin_u, act), suh, None, None)
        got_open = ext.gated_had128(gate, up, a, suh, svh_g, svh_u, b_g, b_u)
        assert torch.equal(got_open, want_open), (rows, n)
        try:
            ext.set_had_pipeline(False)
            assert torch.equal(ext.gated_had128(gate, up, a, suh), got), (rows, n)
            assert torch.equal(ext.gated_had128(gate, up, a, suh, svh_g, svh_u, b_g, b_u), got_open), (rows, n)
        finally:
            ext.set_had_pipeline(ops.HAD_PIPELINE)
        # rows that start 8 but not 16 bytes aligned take the warp kernel: the same bits
        wide = torch.zeros(rows, 2 * n + 8, device=DEV).half()
        wide[:, 4:4 + 2 * n] = gu
        assert torch.equal(ext.gated_had128(wide[:, 4:4 + n], wide[:, 4 + n:4 + 2 * n], a, suh), want), (rows, n)


def test_rms_norm_and_fused_residual():
    x = torch.randn(5, 4096, device=DEV).half()
    r = torch.randn(5, 4096, device=DEV).half()
    w = (torch.rand(4096, device=DEV) + 0.5).half()
    h = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)
    want = w * h.half()
    assert rel_rms(ops.rms_norm(x, w, 1e-5), want) < 1e-3
    y, s = ops.add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(s, x + r)
    hs = s.float() * torch.rsqrt(s.float().pow(2).mean(-1, keepdim=True) + 1e-5)
    assert rel_rms(y, w * hs.half()) < 1e-3


@pytest.mark.parametrize("D,pad", [(64, 64), (64, 2), (6, 1)])
def test_rope_kernel_rounds_like_the_torch_ops(D, pad):
    """The fused kernel (in place, q and k in one launch) against the same formula in fp16 torch
    ops on the GPU, for a q that is a strided slice of a wider projection output (pad columns
    after it). Two pairs per thread where rows and heads start 4-byte aligned (D = 64); one where
    they do not (D = 6 and one padding column: an odd token stride)."""
    wide = torch.randn(2, 3, 6 * D + pad, device=DEV).half()
    tail = wide[..., 6 * D:].clone()
    q = wide[..., :6 * D].unflatten(-1, (6, D))
    k = torch.randn(2, 3, 2, D, device=DEV).half()
    ang = torch.randn(3, D, device=DEV)
    cos, sin = ang.cos().half(), ang.sin().half()

    def torch_rope(x):
        c, s = cos[:, None], sin[:, None]
        return x * c + torch.cat((-x[..., D // 2:], x[..., :D // 2]), dim=-1) * s

    want_q, want_k = torch_rope(q), torch_rope(k)
    got_q, got_k = ops.rope_qk(q, k.clone(), cos, sin)
    assert got_q.data_ptr() == wide.data_ptr() and torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert torch.equal(wide[..., 6 * D:], tail)  # the padding columns are not touched


@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh", "gelu"])
def test_gated_act(act):
    g = torch.randn(3, 1000, device=DEV).half() * 3
    u = torch.randn(3, 1000, device=DEV).half()
    fn = {"silu": F.silu, "gelu_pytorch_tanh": lambda v: F.gelu(v, approximate="tanh"), "gelu": F.gelu}[act]
    want = fn(g.float()) * u.float()
    assert rel_rms(ops.gated_act(g, u, act), want) < 2e-3


def test_cuda_graph_capture_of_product():
    t = rand_layer(1024, 512, 4, "mul1", seed=3)
    x = torch.randn(1, 1024, device=DEV).half()
    g, y = capture(lambda: ops.exl3_gemm(x, t))
    x.copy_(torch.randn(1, 1024, device=DEV).half())
    g.replay()
    torch.cuda.synchronize()
    assert rel_rms(y, fmt.exl3_matmul_reference(x.float(), t)) < 2e-3


@pytest.mark.parametrize("K,cb", [(1, "mul1"), (2, "3inst"), (3, "mcg"), (4, "mul1"), (4, "3inst"), (5, "mcg"), (6, "mul1"), (8, "3inst")])
def test_grouped_product_matches_members(K, cb):
    """q/k/v-like members of unequal widths in one launch: each output as its own reference
    product, for the fused rows and the reconstruct-then-cuBLAS prefill path; with a bias on
    one member only, and warp ranges that cross member boundaries (small layers, many warps)."""
    outs = (384, 128, 256)
    members = [rand_layer(512, n, K, cb, seed=300 + 10 * K + i, bias=(i == 1)) for i, n in enumerate(outs)]
    wants_w = [fmt.reconstruct(t.trellis, cb) for t in members]
    g = ops.join_linears(members)
    assert g.seg_cols == [384, 512]
    # 8 units per warp keeps warp ranges inside column groups here; 5 and 3 make them cross
    for min_units, rows in itertools.chain(((8, r) for r in (1, 2, 8, 17, 32, 200)), ((5, 1), (3, 1), (3, 8), (5, 32))):
        ops.extension().set_gemv_min_units(min_units)
        x = torch.randn(rows, 512, device=DEV).half()
        got = ops.exl3_gemm_group(x, g)
        for t, w, y in zip(members, wants_w, got):
            want = fmt.exl3_matmul_reference(x.float(), t, w)
            assert y.shape == want.shape
            assert rel_rms(y, want) < 2e-3, (rows, t.out_features)
        # every member alone (a contiguous copy of its view of the joined trellis) agrees too
        if rows == 1 and min_units == 8:
            solo = [ops.exl3_gemm(x, fmt.EXL3Tensors(t.trellis.contiguous(), t.suh, t.svh.contiguous(), cb,
                                                      None if t.bias is None else t.bias.contiguous()))
                    for t in members]
            for y, z in zip(got, solo):
                assert rel_rms(y, z) < 2e-3
    # the MUL1 integer path: each member's own int8 steps and row sums in the one launch
    if cb == "mul1":
        for min_units, rows in ((8, 1), (8, 4), (8, 8), (3, 1), (5, 6)):
            ops.extension().set_gemv_min_units(min_units)
            x = torch.randn(rows, 512, device=DEV).half()
            got = ops.exl3_gemm_group(x, g, int8=True)
            for t, w, y in zip(members, wants_w, got):
                assert rel_rms(y, fmt.exl3_matmul_reference(x.float(), t, w)) < 2e-3, ("int8", rows, t.out_features)
    ops.extension().set_gemv_min_units(8)
    # the workspace and counters are left zeroed: a second call is as right as the first (the
    # cross-warp sums are atomic adds, so the two may differ in the last bit, not more)
    x = torch.randn(3, 512, device=DEV).half()
    first = [y.clone() for y in ops.exl3_gemm_group(x, g)]
    for a, b in zip(first, ops.exl3_gemm_group(x, g)):
        assert rel_rms(b, a) < 1e-3
    assert workspaces_zero()


def test_grouped_projections_keep_model_logits(tmp_path):
    from bench.synth import SHAPES, write_synth_model
    from engine.models import load_model
    from engine.models.layers import split_projections

    d = write_synth_model(tmp_path / "tiny", SHAPES["tiny"], 4.0, head_bits=6, codebook="3inst", device="cuda")
    model = load_model(d, device="cuda")
    ids = torch.tensor([[1, 5, 9, 200, 3, 7, 11]], device=DEV)
    with torch.inference_mode():
        grouped = model(ids).float()
        grouped_step = model(ids[:, :1]).float()
        assert split_projections(model) == 2 * SHAPES["tiny"].layers
        alone = model(ids).float()
        alone_step = model(ids[:, :1]).float()
    assert rel_rms(grouped, alone) < 2e-3 and rel_rms(grouped_step, alone_step) < 2e-3


def test_whole_model_logits_gpu_match_cpu(ref_fixtures):
    import json

    from engine.models import load_model
    from engine.ops.model_patch import route_quant_linears

    manifest = json.loads((ref_fixtures / "manifest.json").read_text())
    dirs = [p for p in sorted((ref_fixtures / "exl3").iterdir()) if (p / "config.json").exists()]
    assert dirs, f"no EXL3 models under {ref_fixtures / 'exl3'}"
    ids = torch.tensor([manifest["token_ids"][0][:24]])
    for d in dirs:
        cpu = load_model(d, device="cpu")
        want = cpu(ids)
        del cpu
        gpu = load_model(d, device="cuda")
        assert route_quant_linears(gpu) > 0
        got = gpu(ids.to(DEV)).float().cpu()
        assert rel_rms(got, want) < 3e-2, d.name
        agree = (got.argmax(-1) == want.argmax(-1)).float().mean()
        assert agree >= 0.8, (d.name, float(agree))


def test_rope_store_matches_rope_then_cache_write():
    """One decode step's RoPE + KV-cache write in one kernel: the same bits as the RoPE kernel
    followed by index_copy_ into the cache, at the slot the device-side position names."""
    B, H, Hk, D, slots = 2, 8, 2, 64, 32
    g = torch.Generator(device=DEV).manual_seed(5)
    qkv = torch.randn(B, 1, (H + 2 * Hk) * D, generator=g, device=DEV).half()
    cos = torch.randn(1, D, generator=g, device=DEV).half()
    sin = torch.randn(1, D, generator=g, device=DEV).half()
    position = torch.tensor([7], device=DEV)

    def split(t):  # strided views, as the grouped q/k/v product hands them over
        q, k, v = t.split([H * D, Hk * D, Hk * D], dim=-1)
        return q.view(B, 1, H, D), k.view(B, 1, Hk, D), v.view(B, 1, Hk, D)

    caches = [torch.randn(B, Hk, slots, D, generator=g, device=DEV).half() for _ in range(2)]
    want_caches = [c.clone() for c in caches]
    q, k, v = split(qkv.clone())
    wq, wk = ops.rope_qk(*split(qkv.clone())[:2], cos, sin)
    want_caches[0].index_copy_(2, position, wk.transpose(1, 2))
    want_caches[1].index_copy_(2, position, split(qkv)[2].transpose(1, 2))
    gq, gk = ops.rope_qk_store(q, k, v, cos, sin, caches[0], caches[1], position)
    assert torch.equal(gq, wq) and torch.equal(gk, wk)
    assert torch.equal(caches[0], want_caches[0]) and torch.equal(caches[1], want_caches[1])
    # a position past the last slot writes nothing (no out-of-bounds store)
    before = [c.clone() for c in caches]
    ops.rope_qk_store(*split(qkv.clone()), cos, sin, caches[0], caches[1], torch.tensor([slots], device=DEV))
    assert torch.equal(caches[0], before[0]) and torch.equal(caches[1], before[1])


@pytest.mark.parametrize("D,H,Hk,B,mma256,cap,norms", [
    (D, H, Hk, B, mma256, cap, norms)
    for D, H, Hk, B, mma256 in [(128, 32, 8, 1, False), (64, 9, 3, 2, False), (256, 8, 8, 1, False),
                                (256, 16, 8, 1, True), (128, 28, 4, 2, False)]
    for cap, norms in [(None, False), (2.0, False), (None, True)]
    if not (norms and D == 64)])  # the q/k norms' variant: head dims 128 and 256 (Qwen3, Gemma 3)
@pytest.mark.parametrize("span,pos", [(256, 0), (256, 200), (4096, 37), (4096, 4095), (17, 16)])
def test_attention_with_pending_rope_is_rope_then_attention(D, H, Hk, B, mma256, span, pos, cap, norms, monkeypatch,
                                                           request):
    """The decode attention kernel doing the step's RoPE and cache write itself (PendingRope): the
    same cache bits and the same output bits as the RoPE-and-store kernel followed by the plain
    attention kernel, whichever split holds the token's slot (one split or many), with grouped
    heads split into blocks of 4 (several blocks write the same kv head's slot), with Gemma 2's
    soft cap, and with Qwen3's per-head q/k norms before the RoPE (against the norm kernel)."""
    from engine.models.layers import RMSNorm

    g = torch.Generator(device=DEV).manual_seed(D + H + span + pos)
    monkeypatch.setattr(ops, "ATTN_HEAD_NORMS", True)
    ops.extension().set_attn_mma_d256(mma256)  # head dim 256 on the tensor-core walk: its early fetch and patch
    request.addfinalizer(lambda: ops.extension().set_attn_mma_d256(ops.ATTN_MMA_D256))
    head_norms = None
    if norms:  # weights around 1, different for q and k, and an eps that matters at this scale
        head_norms = tuple(RMSNorm((1 + 0.3 * torch.randn(D, generator=g, device=DEV)).half(), 1e-2) for _ in range(2))
    qkv = torch.randn(B, 1, (H + 2 * Hk) * D, generator=g, device=DEV).half()
    cos = torch.randn(1, D, generator=g, device=DEV).half()
    sin = torch.randn(1, D, generator=g, device=DEV).half()
    position = torch.tensor([pos], device=DEV)
    mask = torch.zeros(1, span, device=DEV, dtype=torch.float16)
    mask[:, pos + 1:] = float("-inf")

    def split(t):  # strided views, as the grouped q/k/v product hands them over
        q, k, v = t.split([H * D, Hk * D, Hk * D], dim=-1)
        return q.view(B, 1, H, D), k.view(B, 1, Hk, D), v.view(B, 1, Hk, D)

    caches = [torch.randn(B, Hk, span + 8, D, generator=g, device=DEV).half() for _ in range(2)]
    want_caches = [c.clone() for c in caches]
    q, k, v = split(qkv.clone())
    rope = ops.PendingRope(q.transpose(1, 2), caches[0][:, :, :span], caches[1][:, :, :span], k, v, cos, sin, position,
                           head_norms)
    assert rope.serves(mask)
    got = ops.decode_attention(rope.q, rope.keys, rope.values, mask, D ** -0.5, rope=rope, softcap=cap)
    wq, wk, wv = split(qkv.clone())
    if norms:
        wq, wk = ops.rms_norm(wq, head_norms[0].weight, 1e-2), ops.rms_norm(wk, head_norms[1].weight, 1e-2)
        assert not torch.equal(wq, split(qkv)[0])
    ops.rope_qk_store(wq, wk, wv, cos, sin, want_caches[0], want_caches[1], position)
    want = ops.decode_attention(wq.transpose(1, 2), want_caches[0][:, :, :span], want_caches[1][:, :, :span], mask,
                                D ** -0.5, softcap=cap)
    assert torch.equal(caches[0], want_caches[0]) and torch.equal(caches[1], want_caches[1])
    assert torch.equal(got, want)
    assert torch.equal(q, split(qkv)[0])  # q itself is left as it was
    with pytest.raises(ValueError, match="pending RoPE"):  # a rope goes with its own q and cache
        ops.decode_attention(wq.transpose(1, 2), rope.keys, rope.values, mask, D ** -0.5, rope=rope)
    # apply(): the same without the attention kernel
    caches2 = [c.clone() for c in want_caches]
    caches2[0][:, :, pos] = 0
    q2, k2, v2 = split(qkv.clone())
    r2 = ops.PendingRope(q2.transpose(1, 2), caches2[0][:, :, :span], caches2[1][:, :, :span], k2, v2, cos, sin, position,
                         head_norms)
    assert torch.equal(r2.apply(), wq.transpose(1, 2)) and torch.equal(caches2[0], want_caches[0])


@pytest.mark.parametrize("D,H,Hk,mma256,cap", [(128, 32, 8, False, None), (256, 16, 8, False, 2.0),
                                               (256, 16, 8, True, None), (64, 9, 3, False, None)])
@pytest.mark.parametrize("span,pos,window", [(4096, 37, 1024), (4096, 4000, 1024), (8192, 5000, 4096),
                                             (256, 200, 64), (256, 63, 64), (512, 300, 512), (2048, 2047, 1)])
def test_windowed_step_walks_only_its_window(D, H, Hk, mma256, cap, span, pos, window, monkeypatch, request):
    """A sliding-window layer's decode step with ops.ATTN_WINDOW: the kernel's splits cover only
    the window's slots (pos - window, pos] of the span, found from the device position, so a long
    span past the window costs no more than the window. Against the same step walking the whole
    span behind the window's mask: the same cache bits (the token's slot written by the split that
    holds it) and the output to fp16 rounding (the splits add in another order). With NaN in every
    slot outside the window the output is the same to the bit: they are not read. Windows not yet
    filled (pos < window - 1), filled, equal to the span, and one slot; the tensor-core and the
    scalar walks, soft-capped too."""
    g = torch.Generator(device=DEV).manual_seed(D + span + pos + window)
    ops.extension().set_attn_mma_d256(mma256)
    request.addfinalizer(lambda: ops.extension().set_attn_mma_d256(ops.ATTN_MMA_D256))
    qkv = torch.randn(1, 1, (H + 2 * Hk) * D, generator=g, device=DEV).half()
    cos = torch.randn(1, D, generator=g, device=DEV).half()
    sin = torch.randn(1, D, generator=g, device=DEV).half()
    position = torch.tensor([pos], device=DEV)
    slots = torch.arange(span, device=DEV)
    allowed = (slots <= pos) & (slots > pos - window)
    mask = torch.where(allowed, 0.0, float("-inf")).half()[None, :]
    base = [torch.randn(1, Hk, span, D, generator=g, device=DEV).half() for _ in range(2)]

    def step(caches):  # the step's RoPE, cache write and attention over these caches (written in place)
        q, k, v = qkv.clone().split([H * D, Hk * D, Hk * D], dim=-1)
        rope = ops.PendingRope(q.view(1, 1, H, D).transpose(1, 2), caches[0], caches[1], k.view(1, 1, Hk, D),
                               v.view(1, 1, Hk, D), cos, sin, position, None, window)
        assert rope.serves(mask)
        return ops.decode_attention(rope.q, rope.keys, rope.values, mask, D ** -0.5, rope=rope, softcap=cap)

    outs, caches = {}, {}
    for on in (True, False):
        monkeypatch.setattr(ops, "ATTN_WINDOW", on)
        caches[on] = [t.clone() for t in base]
        outs[on] = step(caches[on])
    assert torch.equal(caches[True][0], caches[False][0]) and torch.equal(caches[True][1], caches[False][1])
    assert rel_rms(outs[True], outs[False]) < 1e-3
    lo = max(0, pos - window + 1)
    outside = torch.ones(span, dtype=torch.bool, device=DEV)
    outside[lo:min(span, lo + window)] = False
    monkeypatch.setattr(ops, "ATTN_WINDOW", True)
    poisoned = [t.clone() for t in base]
    for t in poisoned:
        t[:, :, outside] = float("nan")
    assert torch.equal(step(poisoned), outs[True])


def test_pending_rope_declines_what_the_kernel_cannot_take(monkeypatch):
    D, H, Hk, span = 128, 8, 2, 64
    qkv = torch.randn(1, 1, (H + 2 * Hk) * D, device=DEV).half()
    q, k, v = qkv.split([H * D, Hk * D, Hk * D], dim=-1)
    q, k, v = q.view(1, 1, H, D), k.view(1, 1, Hk, D), v.view(1, 1, Hk, D)
    cache = torch.zeros(2, 1, Hk, span, D, device=DEV).half()
    cos, sin = torch.ones(1, D, device=DEV).half(), torch.zeros(1, D, device=DEV).half()
    pos = torch.tensor([3], device=DEV)
    rope = ops.PendingRope(q.transpose(1, 2), cache[0], cache[1], k, v, cos, sin, pos)
    assert rope.serves(None)
    assert not ops.PendingRope(q.transpose(1, 2), cache[0], cache[1], k, v, cos.float(), sin, pos).serves(None)
    assert not ops.PendingRope(q.transpose(1, 2), cache[0], cache[1], k, v, torch.ones(2, D, device=DEV).half(),
                               sin, pos).serves(None)
    # head norms the kernel cannot take: fp32 weights, the wrong length, two different eps
    from engine.models.layers import RMSNorm

    def norms(wq, wk, eps_k=1e-6):
        return ops.PendingRope(q.transpose(1, 2), cache[0], cache[1], k, v, cos, sin, pos,
                               (RMSNorm(wq, 1e-6), RMSNorm(wk, eps_k)))

    w = torch.ones(D, device=DEV).half()
    monkeypatch.setattr(ops, "ATTN_HEAD_NORMS", True)
    assert norms(w, w).serves(None)
    assert not norms(w.float(), w).serves(None)
    assert not norms(w, torch.ones(D // 2, device=DEV).half()).serves(None)
    assert not norms(w, w, eps_k=1e-5).serves(None)
    # head dim 64 (no Qwen3 or Gemma 3 has it): the kernel's head-normed variant is not built
    q64, k64, v64 = (torch.randn(1, 1, n, 64, device=DEV).half() for n in (H, Hk, Hk))
    c64 = torch.zeros(2, 1, Hk, span, 64, device=DEV).half()
    cs64 = (torch.ones(1, 64, device=DEV).half(), torch.zeros(1, 64, device=DEV).half())
    w64 = RMSNorm(torch.ones(64, device=DEV).half(), 1e-6)
    assert ops.PendingRope(q64.transpose(1, 2), c64[0], c64[1], k64, v64, *cs64, pos).serves(None)
    assert not ops.PendingRope(q64.transpose(1, 2), c64[0], c64[1], k64, v64, *cs64, pos, (w64, w64)).serves(None)
    monkeypatch.setattr(ops, "ATTN_HEAD_NORMS", False)  # the setting off: the norms' own kernels
    assert not norms(w, w).serves(None) and rope.serves(None)
    monkeypatch.setattr(ops, "ATTN_ROPE", False)
    assert not rope.serves(None)


@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh", "gelu"])
def test_gated_input_product_matches_act_then_product(act):
    """The down projection's prep computing act(gate) * up itself: the same bits go into the
    product as from gated_act (so the outputs agree to the atomics' last-bit order), for gate and
    up as views of one grouped output, the int8 path, and row counts past one fused chunk."""
    n_in, n_out = 1024, 512
    t = rand_layer(n_in, n_out, 4, "mul1", seed=41, bias=True)
    for rows, int8 in ((1, False), (8, False), (17, False), (1, True), (3, True), (8, True), (200, False)):
        gu = torch.randn(rows, 2 * n_in, device=DEV).half() * 2
        gate, up = gu[:, :n_in], gu[:, n_in:]
        a = ops.gated_act(gate, up, act)
        want = fmt.exl3_matmul_reference(a.float(), t)
        sep = ops.exl3_gemm(a, t, int8=int8, mode="fused")
        fused = ops.exl3_gemm(gate, t, up=up, act=act, int8=int8, mode="fused")
        assert fused.shape == (rows, n_out)
        assert rel_rms(fused, sep) < 1e-3, (rows, int8)
        assert rel_rms(fused, want) < 2e-3, (rows, int8)
    # prefill (reconstruct + cuBLAS): the input transform takes act(gate) * up itself, same bits
    gu = torch.randn(100, 2 * n_in, device=DEV).half() * 2
    gate, up = gu[:, :n_in], gu[:, n_in:]
    a = ops.gated_act(gate, up, act)
    dense = ops.exl3_gemm(gate, t, up=up, act=act, mode="dense")
    assert torch.equal(dense, ops.exl3_gemm(a, t, mode="dense"))
    assert rel_rms(dense, fmt.exl3_matmul_reference(a.float(), t)) < 2e-3


@pytest.mark.parametrize("act,bias", [("silu", False), ("gelu_pytorch_tanh", True)])
def test_dense_gated_mlp_is_the_plain_prefill_path(act, bias):
    """A prefill's gated MLP with the gate/up -> down hand-off in one kernel (dense_mlp.py): the
    bits of the grouped gate/up product, its output transform, gated_act and the down projection
    run apart; and the reference's MLP within fp16 rounding. Few rows are declined (the fused
    per-row products serve those)."""
    n_in, inter, n_out = 512, 384, 640
    gate, up = (rand_layer(n_in, inter, 4, "mul1", seed=60 + i, bias=bias) for i in range(2))
    down = rand_layer(inter, n_out, 3, "mul1", seed=62, bias=bias)
    x = torch.randn(200, n_in, device=DEV).half()
    want_g, want_u = (fmt.exl3_matmul_reference(x.float(), t) for t in (gate, up))
    g = ops.join_linears([gate, up])
    got = ops.dense_gated_mlp(x, g, down, act, inter, n_out)
    gy, uy = ops.exl3_linear_group(x, g, [inter, inter])
    assert torch.equal(got, ops.exl3_linear(gy, down, n_out, up=uy, act=act))
    a = ops.gated_act(want_g.half(), want_u.half(), act)
    assert rel_rms(got, fmt.exl3_matmul_reference(a.float(), down)) < 5e-3
    assert ops.dense_gated_mlp(x[:8], g, down, act, inter, n_out) is None
    assert ops.dense_gated_mlp(x, g, down, act, inter - 1, n_out) is None


def test_static_cache_gpu_mask_is_additive_and_same_attention():
    from engine.cache.static import StaticKVCache
    from engine.models.layers import attention
    cache = StaticKVCache(1, 1, 2, 64, 300, torch.float16, DEV, min_span=16)
    cache.length = 9
    cache.position.fill_(9)
    for window in (None, 4):
        m = cache.mask(1, window)
        assert m.dtype == torch.float16 and m.shape == (1, 16)
        keys = torch.arange(16, device=DEV)
        allowed = (keys <= 9) & ((keys > 9 - window) if window else True)
        assert torch.equal(m[0] == 0, allowed) and bool(torch.isneginf(m[0][~allowed]).all())
        q = torch.randn(1, 4, 1, 64, device=DEV).half()
        k, v = torch.randn(2, 1, 2, 16, 64, device=DEV).half()
        got = attention(q, k, v, m, 0.125)
        want = attention(q, k, v, allowed[None, :], 0.125)
        assert rel_rms(got, want) < 1e-3


@pytest.mark.parametrize("with_residual", [False, True])
def test_pending_norm_computed_in_the_grouped_prep(with_residual):
    """q/k/v reading rms_norm(x + residual) * w straight from the prep: the same products as
    from the norm kernel's output (up to the order of the row's sum of squares), and x + residual
    written bit for bit, for the fp16 and int8 paths and more rows than one fused pass."""
    members = [rand_layer(512, n, 4, "mul1", seed=500 + i) for i, n in enumerate((384, 128, 128))]
    g = ops.join_linears(members)
    w = (torch.rand(512, device=DEV) + 0.5).half()
    for rows, int8 in ((1, False), (1, True), (3, True), (5, True), (40, False), (70, False)):
        x = torch.randn(1, rows, 512, device=DEV).half()
        r = torch.randn(1, rows, 512, device=DEV).half() if with_residual else None
        p = ops.PendingNorm(x, w, 1e-5, r)
        got = ops.exl3_gemm_group(p, g, mode="fused", int8=int8)
        h, s = ops.add_rms_norm(x, r, w, 1e-5) if with_residual else (ops.rms_norm(x, w, 1e-5), x)
        want = ops.exl3_gemm_group(h, g, mode="fused", int8=int8)
        assert p.normed is None and torch.equal(ops.as_sum(p), s), rows
        for a, b in zip(got, want):
            assert rel_rms(a, b) < 1e-3, (rows, int8)


def test_norm_over_a_norm_computed_in_the_grouped_prep(monkeypatch):
    """A Gemma block's post-norm, residual add and next pre-norm (PendingNorm.pre_weight) in one
    decode prep (ops.PREP_DOUBLE_NORM): the double-normed prep kernel runs and no rms_norm kernel
    does; the products equal those from the two norm kernels' output up to the order of the rows'
    sums of squares, and the residual stream is theirs to an fp16 rounding; for the fp16 and int8
    paths, rows in one block and across blocks, and more rows than one fused pass; a hidden size
    of 512 and one of 2304, whose last 1,024-wide pass over a row is partial. With the setting off
    the inner norm runs as its kernel and the outer one in the prep, as before."""
    for hidden in (512, 2304):
        _norm_over_a_norm_case(hidden, monkeypatch)


def _norm_over_a_norm_case(hidden: int, monkeypatch):
    members = [rand_layer(hidden, m, 4, "mul1", seed=520 + i) for i, m in enumerate((384, 128, 128))]
    g = ops.join_linears(members)
    w = (torch.rand(hidden, device=DEV) + 0.5).half()
    pw = (torch.rand(hidden, device=DEV) + 0.5).half()
    for rows, int8 in ((1, False), (1, True), (3, True), (5, True), (40, False)):
        x = torch.randn(1, rows, hidden, device=DEV).half() * 4
        r = torch.randn(1, rows, hidden, device=DEV).half()
        h, s = ops.add_rms_norm(ops.rms_norm(x, pw, 1e-6), r, w, 1e-5)
        want = ops.exl3_gemm_group(h, g, mode="fused", int8=int8)
        for on in (True, False):
            monkeypatch.setattr(ops, "PREP_DOUBLE_NORM", on)
            p = ops.PendingNorm(x, w, 1e-5, r, pre_weight=pw, pre_eps=1e-6)
            names = kernel_names(lambda: ops.exl3_gemm_group(p, g, mode="fused", int8=int8))
            passes = -(-rows // 32)  # the binding's fused passes of at most 32 rows, a prep each
            assert sum("prep_frag_kernel<false, true>" in n for n in names) == (passes if on else 0), (rows, names)
            assert sum("rms_norm_kernel" in n for n in names) == (0 if on else 1), (rows, names)
            p = ops.PendingNorm(x, w, 1e-5, r, pre_weight=pw, pre_eps=1e-6)
            got = ops.exl3_gemm_group(p, g, mode="fused", int8=int8)
            assert p.normed is None and torch.allclose(ops.as_sum(p), s, rtol=2e-3, atol=4e-3), (rows, on)
            for a, b in zip(got, want):
                assert rel_rms(a, b) < 1e-3, (rows, int8, on)


@pytest.mark.parametrize("with_residual", [False, True])
def test_norm_had128_is_rms_norm_then_had128_per_member(with_residual):
    """A grouped product's prefill inputs in one pass (norm_had128): for every member's pre-scale,
    the bits of rms_norm (or add_rms_norm, whose sum it also writes) and then had128, in 64-row
    tiles (row counts that end inside a tile), and through its fallback where the tile kernels are
    off or x does not start 16-byte aligned."""
    ext = ops.extension()
    for rows, n, members in ((1, 128, 1), (63, 512, 3), (130, 4096, 2), (65, 1024, 4), (4100, 4096, 3)):
        x = torch.randn(rows, n, device=DEV).half() * 3
        r = torch.randn(rows, n, device=DEV).half() if with_residual else None
        w = (torch.rand(n, device=DEV) + 0.5).half()
        pre = torch.randn(members, n, device=DEV).half()
        normed, s = ops.add_rms_norm(x, r, w, 1e-5) if with_residual else (ops.rms_norm(x, w, 1e-5), None)
        want = torch.stack([ext.had128(normed, pre[i], None, None) for i in range(members)])
        got = ext.norm_had128(x, w, 1e-5, r, pre)
        assert len(got) == (2 if with_residual else 1) and torch.equal(got[0], want), (rows, n)
        if with_residual:
            assert torch.equal(got[1], s)
        try:
            ext.set_had_tiles(False)
            assert torch.equal(ext.norm_had128(x, w, 1e-5, r, pre)[0], want), (rows, n)
        finally:
            ext.set_had_tiles(ops.HAD_TILES)
        shifted = torch.empty(rows * n + 4, device=DEV).half()[4:].view(rows, n)  # 8, not 16, bytes aligned
        shifted.copy_(x)
        assert torch.equal(ext.norm_had128(shifted, w, 1e-5, r, pre)[0], want), (rows, n)


@pytest.mark.parametrize("with_residual", [False, True])
def test_prefill_group_takes_the_norm_in_its_input_pass(with_residual, monkeypatch):
    """At prefill a grouped product (q/k/v) and the gated MLP (gate/up -> down) reading a pending
    norm compute it in their members' input pass (norm_had128's kernel runs; with
    TRELLIS_NORM_HAD=0 it does not): the same bits as from the norm kernel's output either way, and
    x + residual recorded bit for bit."""
    members = [rand_layer(512, n, 4, "mul1", seed=700 + i) for i, n in enumerate((384, 128, 128))]
    g = ops.join_linears(members)
    gate, up = (rand_layer(512, 384, 4, "mul1", seed=710 + i) for i in range(2))
    gu = ops.join_linears([gate, up])
    down = rand_layer(384, 512, 3, "mul1", seed=712)
    w = (torch.rand(512, device=DEV) + 0.5).half()
    x = torch.randn(1, 200, 512, device=DEV).half()
    r = torch.randn(1, 200, 512, device=DEV).half() if with_residual else None
    h, s = ops.add_rms_norm(x, r, w, 1e-5) if with_residual else (ops.rms_norm(x, w, 1e-5), x)
    want = ops.exl3_gemm_group(h, g)
    want_mlp = ops.dense_gated_mlp(h, gu, down, "silu", 384, 512)
    for norm_had in (True, False):
        monkeypatch.setattr(ops, "NORM_HAD", norm_had)
        ran = kernels_run(lambda: ops.exl3_gemm_group(ops.PendingNorm(x, w, 1e-5, r), g), "norm_had128")
        assert bool(ran) == norm_had, ran
        p = ops.PendingNorm(x, w, 1e-5, r)
        got = ops.exl3_gemm_group(p, g)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), norm_had
        assert torch.equal(ops.as_sum(p), s), norm_had
        p = ops.PendingNorm(x, w, 1e-5, r)
        assert torch.equal(ops.dense_gated_mlp(p, gu, down, "silu", 384, 512), want_mlp), norm_had
        assert torch.equal(ops.as_sum(p), s), norm_had


@pytest.mark.parametrize("D,H,Hkv", [(128, 32, 8), (64, 9, 3), (128, 28, 4), (256, 8, 8), (64, 14, 2), (128, 5, 5)])
@pytest.mark.parametrize("S", [1, 37, 256, 4100])
def test_decode_attention_matches_reference(D, H, Hkv, S):
    """One-token attention against the fp32 reference: grouped heads (1 to 7 per kv head, so head
    groups of 4 with a partial last one), strided cache slices, a mask that hides the tail and
    one that also hides a window's head, and one split or many."""
    from engine.models.layers import one_query_attention

    g = torch.Generator(device=DEV).manual_seed(S * 7 + D + H)
    B, slots = 2, S + 24
    cache_k = torch.randn(B, Hkv, slots, D, generator=g, device=DEV).half()
    cache_v = torch.randn(B, Hkv, slots, D, generator=g, device=DEV).half()
    k, v = cache_k[:, :, :S], cache_v[:, :, :S]
    q = torch.randn(B, 1, H, D, generator=g, device=DEV).half().transpose(1, 2)  # [B, H, 1, D], strided
    scale = D ** -0.5
    pos = max(0, (2 * S) // 3)
    tail = torch.zeros(1, S, device=DEV, dtype=torch.float16)
    tail[:, pos + 1:] = float("-inf")
    window = tail.clone()
    window[:, : max(0, pos - 40)] = float("-inf")
    per_row = torch.zeros(B, S, device=DEV, dtype=torch.float16)
    per_row[1, S // 2 + 1:] = float("-inf")
    for mask in (None, tail, window, per_row):
        for _ in range(2):  # the second call finds the counters the first left behind
            got = ops.decode_attention(q, k, v, mask, scale)
            assert got is not None and got.shape == (B, H, 1, D) and got.dtype == torch.float16
            ref_mask = None if mask is None else mask.float()[:, None, None, :]  # [B or 1, 1, 1, S]
            want = one_query_attention(q.float(), k.float(), v.float(), ref_mask, scale)
            assert rel_rms(got, want) < 2e-3, (mask is None, rel_rms(got, want))
    assert ops.decode_attention(q.float(), k, v, None, scale) is None  # not fp16: the caller's SDPA path


def _masked_attention_case(S: int, seed: int, H: int, Hkv: int, D: int, B: int):
    """q [B, H, 1, D], strided k and v [B, Hkv, S, D] (views of S + 5 slots), a window that masks
    the first half of the slots (whole splits masked) and a mask per sequence that hides the last
    sequence's final two thirds."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    k = torch.randn(B, Hkv, S + 5, D, generator=g, device=DEV).half()[:, :, :S]
    v = torch.randn(B, Hkv, S + 5, D, generator=g, device=DEV).half()[:, :, :S]
    q = torch.randn(B, H, 1, D, generator=g, device=DEV).half()
    window = torch.zeros(1, S, device=DEV, dtype=torch.float16)
    window[:, : S // 2] = float("-inf")
    per_row = torch.zeros(B, S, device=DEV, dtype=torch.float16)
    per_row[-1, S // 3 + 1:] = float("-inf")
    return q, k, v, window, per_row


@pytest.mark.parametrize("mask_kind", ["causal", "window", "one_row", "none"])
@pytest.mark.parametrize("S", [1, 37, 4097])
def test_capped_softmax_is_the_four_passes(mask_kind, S, monkeypatch):
    """Gemma 2's prefill probabilities in one kernel (ops.CAPPED_SOFTMAX) against capped_attention's
    tanh, cap, mask and softmax passes on the same fp16 scores: rows of 1 to 4,097 keys, a chunk
    whose queries start past the first (q0), causal and windowed masks with a row per query, one
    mask row for all, none. The kernel's tanh lands on the other side of an fp16 rounding of the
    passes' now and then (about 1e-4 of scores: tests/test_attention.py), which moves that score
    by a step of the cap's fp16 product: so every probability within 1e-2, all but 0.1% within
    2e-3, and rows that sum to 1."""
    from engine.cache.masks import causal_mask
    from engine.models.layers import apply_mask_

    monkeypatch.setattr(ops, "CAPPED_SOFTMAX", True)
    T = min(S, 40)
    q0 = T // 3
    g = torch.Generator(device=DEV).manual_seed(S)
    scores = (torch.randn(2, 3, 2, T - q0, S, generator=g, device=DEV) * 1.5).half()  # around the cap
    one_row = torch.rand(1, S, generator=g, device=DEV) > 0.3
    one_row[0, 0] = True
    mask = {"causal": causal_mask(S - T, T, None, DEV), "window": causal_mask(S - T, T, 5, DEV),
            "one_row": one_row, "none": None}[mask_kind]
    want = scores.clone().tanh_().mul_(30.0)
    if mask is not None:
        apply_mask_(want, mask[q0:T] if mask.shape[0] == T else mask)
    want = torch.softmax(want, dim=-1).float()
    got = scores.clone()
    names = kernel_names(lambda: ops.capped_softmax_(got, 30.0, mask, q0))
    assert [n for n in names if "capped_softmax_kernel" in n], names
    got = scores.clone()
    assert ops.capped_softmax_(got, 30.0, mask, q0)
    diff = (got.float() - want).abs()
    assert diff.max().item() < 1e-2 and (diff > 2e-3).float().mean().item() < 1e-3
    assert (got.float().sum(-1) - 1).abs().max().item() < 1e-2
    monkeypatch.setattr(ops, "CAPPED_SOFTMAX", False)
    assert not ops.capped_softmax_(scores.clone(), 30.0, mask, q0)


def test_capped_attention_on_the_kernel_is_the_passes(monkeypatch):
    """A Gemma-2-like prefill (16 query heads of 256 over 8, 300 queries in chunks of 64 over 300
    keys, causal and windowed) through capped_attention with the one-pass kernel and without: the
    outputs within 2e-3 relative RMS."""
    from engine.cache.masks import causal_mask
    from engine.models.layers import capped_attention

    g = torch.Generator(device=DEV).manual_seed(7)
    q = torch.randn(1, 16, 300, 256, generator=g, device=DEV).half()
    k = torch.randn(1, 8, 300, 256, generator=g, device=DEV).half()
    v = torch.randn(1, 8, 300, 256, generator=g, device=DEV).half()
    budget = 64 * 16 * 300 * 2 * 2  # 64 queries' scores and probabilities a chunk
    for mask in (None, causal_mask(0, 300, 64, DEV)):
        outs = {}
        for on in (True, False):
            monkeypatch.setattr(ops, "CAPPED_SOFTMAX", on)
            names = kernel_names(lambda: capped_attention(q, k, v, mask, 256 ** -0.5, 50.0, scores_bytes=budget))
            assert any("capped_softmax_kernel" in n for n in names) == on, names  # not the passes twice
            outs[on] = capped_attention(q, k, v, mask, 256 ** -0.5, 50.0, scores_bytes=budget)
        assert rel_rms(outs[True], outs[False]) < 2e-3


@pytest.mark.parametrize("D,H,Hkv,B", [(128, 32, 16, 1), (256, 16, 8, 1), (64, 9, 3, 2), (256, 8, 4, 2)])
@pytest.mark.parametrize("S", [1, 37, 256, 4100])
def test_decode_attention_soft_caps_its_scores(D, H, Hkv, B, S):
    """Gemma 2's soft cap (scores -> softcap * tanh(scores / softcap) before the mask) in the
    kernel against the fp32 reference: the tensor-core and the scalar walks (head dim 256's 8-key
    tensor-core walk turned on here), with and without masks, one split and many. A cap of 1.5
    squashes most scores here, so a kernel that skipped it would be far off."""
    from engine.models.layers import one_query_attention

    q, k, v, window, per_row = _masked_attention_case(S, S + D + H + 1, H, Hkv, D, B)
    scale, cap = 0.25, 1.5
    ext = ops.extension()
    ext.set_attn_mma_d256(True)
    try:
        for mma_slots, mask in itertools.product((1, 0), (None, window, per_row)):
            ext.set_attn_mma_slots(mma_slots)
            got = ops.decode_attention(q, k, v, mask, scale, softcap=cap)
            ref_mask = None if mask is None else mask.float()[:, None, None, :]
            want = one_query_attention(q.float(), k.float(), v.float(), ref_mask, scale, cap)
            assert rel_rms(got, want) < 2e-3, (mma_slots, mask is None, rel_rms(got, want))
            if S > 1:
                plain = one_query_attention(q.float(), k.float(), v.float(), ref_mask, scale)
                assert rel_rms(plain, want) > 2e-2  # the cap matters in this case
    finally:
        ext.set_attn_mma_slots(ops.ATTN_MMA_SLOTS)
        ext.set_attn_mma_d256(ops.ATTN_MMA_D256)
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="softcap"):
            ops.decode_attention(q, k, v, None, scale, softcap=bad)


def _split_attention_case(S: int, seed: int, H: int = 32, Hkv: int = 8, D: int = 128, B: int = 1):
    """B sequences of H heads over Hkv kv heads (by default one of 32 over 8, D = 128) at S slots,
    and a window that masks the cache's first half (so whole splits see only masked keys): q, k,
    v, window."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    k = torch.randn(B, Hkv, S, D, generator=g, device=DEV).half()
    v = torch.randn(B, Hkv, S, D, generator=g, device=DEV).half()
    q = torch.randn(B, H, 1, D, generator=g, device=DEV).half()
    window = torch.zeros(1, S, device=DEV, dtype=torch.float16)
    window[:, : S // 2] = float("-inf")
    return q, k, v, window


def _attention_reference(q, k, v, mask):
    from engine.models.layers import one_query_attention

    D = q.shape[-1]
    return one_query_attention(q.float(), k.float(), v.float(),
                               None if mask is None else mask.float()[:, None, None, :], D ** -0.5)


@pytest.mark.parametrize("S", [700, 4100, 9000])
def test_decode_attention_merges_its_splits_in_one_pass_as_in_two(S):
    """Several splits (scalar walk, 8 kv heads: 700 slots 3, 4100 17, 9000 33; tensor-core walk:
    6, 16, 16; one or more batches of 8 partials) merge in one pass with a running max; the
    previous merge (the max first, then the sums) gives the same output up to fp32 rounding, with
    splits whose keys are all masked among them (the window hides the head of the cache)."""
    q, k, v, window = _split_attention_case(S, seed=S)
    scale = q.shape[-1] ** -0.5
    ext = ops.extension()
    try:
        for mma_slots, mask in itertools.product((0, 1), (None, window)):
            ext.set_attn_mma_slots(mma_slots)
            ext.set_attn_merge_online(True)
            one = ops.decode_attention(q, k, v, mask, scale)
            ext.set_attn_merge_online(False)
            two = ops.decode_attention(q, k, v, mask, scale)
            want = _attention_reference(q, k, v, mask)
            assert rel_rms(one, want) < 2e-3 and rel_rms(two, want) < 2e-3, mma_slots
            assert rel_rms(one, two) < 1e-3, mma_slots
    finally:
        ext.set_attn_merge_online(ops.ATTN_MERGE_ONLINE)
        ext.set_attn_mma_slots(ops.ATTN_MMA_SLOTS)


@pytest.mark.parametrize("S", [256, 1000, 1280, 2100, 4100])
def test_decode_attention_one_load_splits_match_reference(S):
    """The scalar walk's splits of one 16-key load per warp (set_attn_one_load_splits: never, the
    shipped limit, always up to the cap) give the reference's attention, with and without a window
    that leaves whole splits masked. (Head dim 128 takes the tensor-core walk by default; the
    scalar one is switched on here.)"""
    q, k, v, window = _split_attention_case(S, seed=S + 3)
    scale = q.shape[-1] ** -0.5
    ext = ops.extension()
    ext.set_attn_mma_slots(0)
    try:
        for limit in (0, 10, 64):
            ext.set_attn_one_load_splits(limit)
            for mask in (None, window):
                got = ops.decode_attention(q, k, v, mask, scale)
                assert rel_rms(got, _attention_reference(q, k, v, mask)) < 2e-3, limit
    finally:
        ext.set_attn_one_load_splits(ops.ATTN_ONE_LOAD_SPLITS)
        ext.set_attn_mma_slots(ops.ATTN_MMA_SLOTS)


@pytest.mark.parametrize("D,H,Hkv,B", [(128, 32, 8, 1), (64, 9, 3, 2), (128, 28, 4, 2), (128, 8, 8, 1), (64, 14, 2, 1),
                                       (256, 16, 8, 1), (256, 8, 4, 2), (256, 7, 1, 1)])
@pytest.mark.parametrize("S", [1, 9, 16, 17, 256, 1300, 9000, 33000])
def test_decode_attention_tensor_core_walk_matches_scalar(D, H, Hkv, B, S):
    """Decode attention walking its keys on the tensor cores (set_attn_mma_slots(1), the default;
    head dim 256 with set_attn_mma_d256, its 8-key form) gives the reference's attention and the
    scalar walk's up to rounding (its probabilities enter the MMA as fp16): one split (spans up to
    256, 128 at head dim 256, unless set_attn_mma_one_split(0)) or many, steps past a warp's last
    key (rows that read nothing), head groups of 1 to 7 heads (a partial block of 4), a window that
    leaves whole splits masked, a per-sequence mask, and rows that are not 16-byte aligned (then it
    declines: the scalar walk's result exactly; head dim 256 rows are never 8 bytes off, the
    binding wants 16-byte rows there)."""
    q, k, v, window, per_row = _masked_attention_case(S, S + D + H, H, Hkv, D, B)
    g = torch.Generator(device=DEV).manual_seed(S + D + H + 7)  # for the misaligned rows below
    scale = D ** -0.5
    ext = ops.extension()
    ext.set_attn_mma_d256(True)
    try:
        for one_split, mask in itertools.product((ops.ATTN_MMA_ONE_SPLIT, 0), (None, window, per_row)):
            ext.set_attn_mma_one_split(one_split)  # 0: spans up to 256 slots in several splits too
            ext.set_attn_mma_slots(1)
            mma = ops.decode_attention(q, k, v, mask, scale)
            ext.set_attn_mma_slots(0)
            scalar = ops.decode_attention(q, k, v, mask, scale)
            want = _attention_reference(q, k, v, mask)
            assert rel_rms(mma, want) < 2e-3 and rel_rms(scalar, want) < 2e-3, (one_split, mask is None)
            assert rel_rms(mma, scalar) < 1e-3, (one_split, mask is None)
        ext.set_attn_mma_slots(1)
        walk = kernels_run(lambda: ops.decode_attention(q, k, v, None, scale), "decode_attention_kernel")
        assert walk and all(f"<{D // 32}, 0, true, " in n for n in walk), walk  # the tensor-core walk ran
        if D == 256:
            return
        # Rows 8 bytes off a 16-byte boundary (the binding wants D / 32 halves): the scalar walk.
        base = torch.randn(B * Hkv * (S + 1) * D + 8, generator=g, device=DEV).half()
        odd = base[4:4 + B * Hkv * S * D].view(B, Hkv, S, D)
        ext.set_attn_mma_slots(1)
        a = ops.decode_attention(q, odd, odd, None, scale)
        ext.set_attn_mma_slots(0)
        assert a is not None and torch.equal(a, ops.decode_attention(q, odd, odd, None, scale))
    finally:
        ext.set_attn_mma_slots(ops.ATTN_MMA_SLOTS)
        ext.set_attn_mma_one_split(ops.ATTN_MMA_ONE_SPLIT)
        ext.set_attn_mma_d256(ops.ATTN_MMA_D256)


@pytest.mark.parametrize("D,H,Hkv,B", [(128, 32, 8, 1), (64, 9, 3, 2), (256, 16, 8, 1)])
def test_decode_attention_two_stage_ring_matches_three(D, H, Hkv, B):
    """The tensor-core walk with a two-stage ring (what a GPU with less shared memory per block,
    such as the A100, gets; set_attn_mma_stages(2)) gives the three-stage walk's attention up to
    fp32 rounding and the reference's, and the launched kernel is the two-stage one."""
    ext = ops.extension()
    ext.set_attn_mma_d256(True)
    try:
        for S in (9, 256, 1300, 9000):
            q, k, v, window = _split_attention_case(S, seed=S + D, H=H, Hkv=Hkv, D=D, B=B)
            scale = D ** -0.5
            for mask in (None, window):
                ext.set_attn_mma_stages(3)
                three = ops.decode_attention(q, k, v, mask, scale)
                ext.set_attn_mma_stages(2)
                names = kernels_run(lambda: ops.decode_attention(q, k, v, mask, scale), "decode_attention_kernel")
                assert names and all("true, 2, " in n for n in names), names  # <DL, MODE, MMA, NS, WIN>
                two = ops.decode_attention(q, k, v, mask, scale)
                assert rel_rms(two, _attention_reference(q, k, v, mask)) < 2e-3, S
                assert rel_rms(two, three) < 1e-3, S
    finally:
        ext.set_attn_mma_stages(0)
        ext.set_attn_mma_d256(ops.ATTN_MMA_D256)


def test_argmax_kernel_is_torch_argmax():
    """ops.argmax (one kernel) picks what torch.argmax picks: the first of equal maxima, NaN above
    everything, -inf rows index 0; fp32 and fp16, strided rows, sizes that fill no block evenly."""
    g = torch.Generator(device=DEV).manual_seed(5)
    cases = [torch.randn(3, 128256, device=DEV, generator=g),
             torch.randn(2, 1, 1000, device=DEV, generator=g).half()[:, -1],
             torch.randn(4, 12345, device=DEV, generator=g)[:, 7:],
             torch.randn(1, 1, device=DEV, generator=g),
             torch.randn(70, 8191, device=DEV, generator=g)]
    ties = torch.zeros(3, 5000, device=DEV)
    ties[1, [900, 5, 4000]] = 2.0
    ties[2, [17, 4999]] = float("nan")
    ties[2, 3] = float("inf")
    cases.append(ties)
    cases.append(torch.full((2, 3000), float("-inf"), device=DEV))
    for x in cases:
        got = ops.argmax(x)
        assert got.dtype == torch.long and got.shape == x.shape[:-1]
        assert torch.equal(got, torch.argmax(x, dim=-1)), x.shape
    assert ops.argmax(torch.randn(50, device=DEV)).shape == ()
    assert all(int(b.abs().sum()) == 0 for b in token_pick._argmax_scratch.values())  # left zero for the next call
