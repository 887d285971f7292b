"""The product kernel with block-shared activations (csrc/exl3_gemv_sa.cuh) against the torch
reference and against the per-warp version-3 kernel, which it replaces for 17..32 rows of large
layers, and the deferred finish of many-row products (pytest -m gpu)."""
from __future__ import annotations

import itertools

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from engine import ops  # noqa: E402
from engine.formats import exl3 as fmt  # noqa: E402
from tests.gpu_layers import (DEV, SA_A12, SA_IN_FINISH, SA_WGMMA, capture, kernels_run,  # noqa: E402
                               rand_layer, rel_rms, sa_cfgs, template_args, workspaces_zero)

# debug variants: force the block-shared kernel on (shipped configuration) or off; its benchmark
# configurations (one k row per unit, four tiles per unit, both; MUL1's affine step per weight pair;
# four k rows per unit; K = 4's states with the previous word masked once, lane_states_k4's A12;
# that with MUL1's byte sums by MMAs, mul1_f16_by_mma; no MMAs for empty row groups, kSaSkipEmpty)
SHARED, PER_WARP = 30, 31
BENCH_CONFIGS = (32, 33, 34, 35, 37, 39, 40, 45)
# the block-shared kernel with two tiles per unit (shipped at 25..32 rows of layers under 4096 x
# 18432 weights, K <= 4; every build has it, for every K and codebook)
TWO_TILES = 44


@pytest.mark.parametrize("K,cb", list(itertools.product(range(1, 9), ["3inst", "mcg", "mul1"])))
def test_shared_kernel_matches_reference_for_every_row_group(K, cb):
    """Rows 1..32 (one, two and four fragment groups) with a bias, on a shape with several k
    slices and uneven block ranges: the reference's product, and the per-warp kernel's up to
    fp32 summation order; the benchmark configurations too (K = 4 MUL1 builds them, the others
    run the shipped one)."""
    t = rand_layer(1536, 640, K, cb, seed=500 + K, bias=True)
    ref_w = fmt.reconstruct(t.trellis, cb)
    for rows in (1, 7, 8, 9, 17, 32):
        x = torch.randn(rows, 1536, device=DEV).half()
        want = fmt.exl3_matmul_reference(x.float(), t, ref_w)
        with ops.debug_variant(SHARED):
            y = ops.exl3_gemm(x, t, mode="fused", int8=False, version=3)
        with ops.debug_variant(PER_WARP):
            y_old = ops.exl3_gemm(x, t, mode="fused", int8=False, version=3)
        for variant in BENCH_CONFIGS:
            with ops.debug_variant(variant):
                y_cfg = ops.exl3_gemm(x, t, mode="fused", int8=False, version=3)
            assert rel_rms(y_cfg, want) < 2e-3, (rows, variant)
        with ops.debug_variant(TWO_TILES):
            y_two = ops.exl3_gemm(x, t, mode="fused", int8=False, version=3)
        assert rel_rms(y_two, want) < 2e-3, (rows, rel_rms(y_two, want))
        assert rel_rms(y_two, y_old) < 1e-3, rows
        assert y.shape == (rows, 640)
        assert rel_rms(y, want) < 2e-3, (rows, rel_rms(y, want))
        assert rel_rms(y, y_old) < 1e-3, rows
    assert workspaces_zero()


def test_default_dispatch_takes_shared_kernel_where_it_measured_faster():
    """The default rule (setting 3, session 39) launches the block-shared kernel for 17..32 rows of
    layers of at least 4096 x 14336 weights and 9..16 rows of layers of at least 4096 x 28672;
    elsewhere the per-warp one. Both give the reference's product."""
    assert ops.GV_SHARED == 3
    large = rand_layer(4096, 28672, 4, "mul1", seed=31, bias=True)
    big = rand_layer(4096, 14336, 4, "mul1", seed=7)
    small = rand_layer(4096, 4096, 4, "mul1", seed=8)
    cases = ((large, 9, True), (large, 16, True), (large, 8, False), (large, 17, True), (big, 32, True),
             (big, 17, True), (big, 16, False), (big, 8, False), (small, 32, False), (small, 8, False))
    for t, rows, shared in cases:
        x = torch.randn(rows, t.trellis.shape[0] * 16, device=DEV).half()
        names = kernels_run(lambda: ops.exl3_gemm(x, t, mode="fused", int8=False, version=3))
        assert any("gemv_sa" in n for n in names) == shared, (rows, t.trellis.shape, names)
        assert any("gemv_sa" not in n for n in names) != shared, (rows, names)
        y = ops.exl3_gemm(x, t, mode="fused", int8=False, version=3)
        assert rel_rms(y, fmt.exl3_matmul_reference(x.float(), t)) < 2e-3, (rows, t.trellis.shape)
    assert workspaces_zero()


def _sa_cfg(names: set[str]) -> int:
    """The CFG template argument of the one block-shared kernel in a set of kernel names."""
    (cfg,) = sa_cfgs(names)
    return cfg


def test_default_dispatch_takes_two_tiles_per_unit_for_25_rows_and_up_below_4096x18432():
    """The block-shared kernel takes two tiles per unit (CFG 512, kSaTwoTiles) at 25..32 rows of
    layers of fewer than 4096 x 18432 weights, four at 17..24 rows, at and above that size, and
    everywhere with the setting at 0; with it at 2 (a benchmark mode) two everywhere; all give the
    reference's product."""
    ext = ops.extension()
    cases = ((4096, 14336, 32, True), (14336, 4096, 25, True), (14336, 4096, 24, False), (8192, 10240, 32, False))
    for n_in, n_out, rows, two in cases:
        t = rand_layer(n_in, n_out, 4, "mul1", seed=n_in + 3 * n_out)
        x = torch.randn(rows, n_in, device=DEV).half()
        want = fmt.exl3_matmul_reference(x.float(), t)
        try:
            for setting in (1, 0, 2):
                ext.set_gemv_sa_tiles(setting)
                names = kernels_run(lambda: ops.exl3_gemm(x, t, mode="fused", int8=False, version=3))
                want_cfg = 512 if setting == 2 or (two and setting == 1) else 0
                # (the wgmma bit, and with it K = 4 MUL1's A12, ride along on Hopper:
                # tests/test_gemv_wgmma_gpu.py)
                riders = SA_WGMMA | SA_A12
                assert _sa_cfg(names) & ~riders == want_cfg, (n_in, n_out, rows, setting, names)
                y = ops.exl3_gemm(x, t, mode="fused", int8=False, version=3)
                assert rel_rms(y, want) < 2e-3, (n_in, n_out, rows, setting, rel_rms(y, want))
        finally:
            ext.set_gemv_sa_tiles(1)
    assert workspaces_zero()


@pytest.mark.parametrize("n_in,n_out", [(128, 128), (4096, 256), (384, 4096), (14336, 512), (8192, 2048)])
def test_shared_kernel_odd_and_lopsided_shapes(n_in, n_out):
    """One k row group only, a 14,336-wide input (k slices of uneven row counts), few columns
    (many slices, few blocks each), more columns than inputs."""
    t = rand_layer(n_in, n_out, 3, "mcg", seed=n_in + n_out)
    for rows in (9, 32):
        x = torch.randn(rows, n_in, device=DEV).half()
        x[:, 5] = 25.0
        with ops.debug_variant(SHARED):
            y = ops.exl3_gemm(x, t, mode="fused", int8=False, version=3)
        assert rel_rms(y, fmt.exl3_matmul_reference(x.float(), t)) < 2e-3, rows
    assert workspaces_zero()


@pytest.mark.parametrize("K,cb", [(2, "mul1"), (4, "3inst"), (5, "mcg"), (8, "mul1")])
def test_shared_kernel_grouped_members(K, cb):
    """A grouped product (q/k/v-like members of unequal widths): each block reads one member's
    activations, so every member matches its own reference product, at every row group and for
    grids with few and many units per warp."""
    outs = (384, 128, 256)
    members = [rand_layer(1024, n, K, cb, seed=700 + 10 * K + i, bias=(i == 2)) for i, n in enumerate(outs)]
    wants_w = [fmt.reconstruct(t.trellis, cb) for t in members]
    g = ops.join_linears(members)
    try:
        for min_units, rows in itertools.product((8, 2), (5, 16, 32)):
            ops.extension().set_gemv_min_units(min_units)
            x = torch.randn(rows, 1024, device=DEV).half()
            with ops.debug_variant(SHARED):
                got = ops.exl3_gemm_group(x, g, int8=False)
            for t, w, y in zip(members, wants_w, got):
                assert rel_rms(y, fmt.exl3_matmul_reference(x.float(), t, w)) < 2e-3, (min_units, rows, t.out_features)
    finally:
        ops.extension().set_gemv_min_units(8)
    assert workspaces_zero()


def test_shared_kernel_in_a_captured_graph():
    """A captured 32-row product replays on new input (the grid and slice layout are fixed at
    capture; the workspace and counters are left zeroed for the next replay)."""
    t = rand_layer(4096, 1536, 4, "mul1", seed=3)
    x = torch.randn(32, 4096, device=DEV).half()
    graph, y = capture(lambda: ops.exl3_gemm(x, t))
    for seed in range(2):
        x.copy_(torch.randn(32, 4096, device=DEV, generator=torch.Generator(device=DEV).manual_seed(seed)).half())
        graph.replay()
        torch.cuda.synchronize()
        assert rel_rms(y, fmt.exl3_matmul_reference(x.float(), t)) < 2e-3


@pytest.mark.parametrize("variant", [SHARED, PER_WARP])
def test_deferred_finish_matches_row_by_row(variant):
    """Many-row products finish their 128-column blocks after the main loop, 8 workspace rows per
    round trip; a warp with more than four such blocks finishes the rest at once, row by row
    (one 8-warp block over 8192 columns of a 128-wide input: eight blocks per warp). Both orders
    give the reference's product and leave the workspace zeroed. (Many-row products leave their
    transform to a kernel of its own by default, gemv_split_finish; here their warps do it.)"""
    ext = ops.extension()
    for n_in, n_out, min_units in ((1024, 1536, 8), (128, 8192, 512)):
        t = rand_layer(n_in, n_out, 4, "3inst", seed=n_out, bias=True)
        for rows in (2, 17, 32):
            x = torch.randn(rows, n_in, device=DEV).half()
            want = fmt.exl3_matmul_reference(x.float(), t)
            got = []
            try:
                ext.set_gemv_split_finish(0)
                ext.set_gemv_min_units(min_units)
                for finish_rows in (8, 1):
                    ext.set_gemv_finish_rows(finish_rows)
                    with ops.debug_variant(variant):
                        got.append(ops.exl3_gemm(x, t, mode="fused", int8=False, version=3))
            finally:
                ext.set_gemv_finish_rows(8)
                ext.set_gemv_min_units(8)
                ext.set_gemv_split_finish(ops.GV_SPLIT_FINISH)
            for y in got:
                assert rel_rms(y, want) < 2e-3, (n_in, n_out, rows)
            # the same sums, added by atomics in whatever order the warps reach them
            assert rel_rms(got[0], got[1]) < 1e-3
    assert workspaces_zero()


def _finish_kernel_against_warps(rows: int, split_mode: int, warp_mode: int, n_out: int = 4096,
                                 shared: bool = False, int8: bool = False):
    """A product of 4096 inputs with a bias under split-finish setting split_mode, where the
    finish kernel runs, and under warp_mode, where it does not: each against the reference, each
    leaving the workspace zero, the two the same up to the order of their atomics, and the
    block-shared kernel (shared) or the per-warp one serving both; int8: the integer path's
    products (1..4 rows). Returns the layer."""
    ext = ops.extension()
    t = rand_layer(4096, n_out, 4, "mul1", seed=rows, bias=True)
    x = torch.randn(rows, 4096, device=DEV).half()
    want = fmt.exl3_matmul_reference(x.float(), t)
    got = {}
    try:
        for mode in (split_mode, warp_mode):
            ext.set_gemv_split_finish(mode)
            names = kernels_run(lambda: ops.exl3_gemm(x, t, mode="fused", int8=int8, version=3), "")
            assert any("gemv_sa" in n for n in names) == shared, names
            assert any("gv_finish_kernel" in n for n in names) == (mode == split_mode), (mode, names)
            got[mode] = ops.exl3_gemm(x, t, mode="fused", int8=int8, version=3)
            assert workspaces_zero()
    finally:
        ext.set_gemv_split_finish(ops.GV_SPLIT_FINISH)
    for mode in (split_mode, warp_mode):
        assert rel_rms(got[mode], want) < 2e-3, (mode, rel_rms(got[mode], want))
    assert rel_rms(got[split_mode], got[warp_mode]) < 1e-3
    return t


@pytest.mark.parametrize("rows", [17, 24, 32])
def test_split_finish_matches_the_finish_in_the_warps(rows):
    """The block-shared product's output transform as a kernel of its own (setting 1 and up)
    against the one its finishing warps do (0), on a shape the default dispatch gives this
    kernel; in a captured graph replayed with new inputs it gives what the eager call gives."""
    t = _finish_kernel_against_warps(rows, 1, 0, n_out=14336, shared=True)
    xs = [torch.randn(rows, 4096, device=DEV).half() for _ in range(2)]
    static_x = xs[0].clone()
    graph, out = capture(lambda: ops.exl3_gemm(static_x, t, mode="fused", int8=False, version=3))
    for xi in xs:
        static_x.copy_(xi)
        graph.replay()
        torch.cuda.synchronize()
        assert rel_rms(out, ops.exl3_gemm(xi, t, mode="fused", int8=False, version=3)) < 1e-3
    assert workspaces_zero()


@pytest.mark.parametrize("rows", [9, 17, 32])
def test_shared_kernel_mul1_row_sums_over_slices(rows):
    """MUL1 on the block-shared kernel decodes to 1024 + t and adds k_bias times the row sums of
    each k slice once per column group: inputs of mean 1 with unit input scales make that term
    ~30x the product, on a shape of several slices (8192 inputs) and several blocks per slice;
    the per-pair affine decode (variant 35), the byte sums by MMAs (variant 40), two tiles per unit
    (variant 44) and the per-warp kernel agree with it."""
    t = rand_layer(8192, 2048, 4, "mul1", seed=rows)
    t = fmt.EXL3Tensors(t.trellis, torch.ones_like(t.suh), t.svh, "mul1", None)
    x = (1.0 + 0.1 * torch.randn(rows, 8192, device=DEV)).half()
    want = fmt.exl3_matmul_reference(x.float(), t)
    got = {}
    for variant in (SHARED, 35, 40, TWO_TILES, PER_WARP):
        with ops.debug_variant(variant):
            got[variant] = ops.exl3_gemm(x, t, mode="fused", int8=False, version=3)
        assert rel_rms(got[variant], want) < 2e-3, (variant, rel_rms(got[variant], want))
    assert rel_rms(got[SHARED], got[35]) < 1e-3
    assert rel_rms(got[SHARED], got[40]) < 1e-3
    assert rel_rms(got[SHARED], got[TWO_TILES]) < 1e-3
    assert workspaces_zero()


@pytest.mark.parametrize("rule", [0, 1])
def test_grid_rules_keep_the_product(rule):
    """The grid rule (set_gemv_sa_grid: 1 fewest k slices, 0 the one before session 28) changes how
    the k rows are cut into slices, so how many partial sums per output reach the workspace, not
    the product: against the reference and the other rule, on a 4096-input shape where the two
    cut differently, with MUL1's per-slice row sums in play."""
    t = rand_layer(4096, 14336, 4, "mul1", seed=rule)
    x = torch.randn(32, 4096, device=DEV).half()
    want = fmt.exl3_matmul_reference(x.float(), t)
    ext = ops.extension()
    got = []
    try:
        for r in (rule, 1 - rule):
            ext.set_gemv_sa_grid(r)
            names = kernels_run(lambda: ops.exl3_gemm(x, t, mode="fused", int8=False, version=3))
            assert any("gemv_sa" in n for n in names), names
            got.append(ops.exl3_gemm(x, t, mode="fused", int8=False, version=3))
    finally:
        ext.set_gemv_sa_grid(1)
    assert rel_rms(got[0], want) < 2e-3, rel_rms(got[0], want)
    assert rel_rms(got[0], got[1]) < 1e-3
    assert workspaces_zero()


def test_grid_never_asks_for_a_second_wave():
    """The block-shared grid fits at once (two blocks per SM): one block more ran in a second wave,
    30% slower at 4096x28672 (session 28). Over the K values and the layer shapes the default
    dispatch gives this kernel; with the fewest k slices shared memory allows there (the old rule
    cut 4096x14336 into 10)."""
    ext = ops.extension()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    shapes = [(4096, 14336), (4096, 28672), (14336, 4096), (8192, 28672), (28672, 8192), (5120, 13824), (3584, 18944)]
    for K in range(1, 9):
        for n_in, n_out in shapes:
            for rows in (17, 32):
                blocks, slices, slice_rows = ext.gemv_sa_plan(K, rows, n_in, n_out, sms)
                assert 0 < blocks <= 2 * sms, (K, n_in, n_out, blocks)
                assert slices * slice_rows >= n_in // 16 and slice_rows <= 64, (K, n_in, slices, slice_rows)
                assert blocks >= 1.8 * sms, (K, n_in, n_out, blocks)  # and not many idle
    assert ext.gemv_sa_plan(4, 32, 4096, 14336, sms)[1] == 4
    if sms == 132:  # the H100 / H200 count the old rule's 10 slices were worked out for (four tiles a unit)
        ext.set_gemv_sa_grid(0)
        ext.set_gemv_sa_tiles(0)
        try:
            assert ext.gemv_sa_plan(4, 32, 4096, 14336, sms)[1] == 10
        finally:
            ext.set_gemv_sa_grid(1)
            ext.set_gemv_sa_tiles(1)


@pytest.mark.parametrize("rows", [9, 16, 17, 32])
def test_split_finish_of_the_per_warp_kernel(rows):
    """Setting 2 (and up) gives the per-warp kernel's 9..32-row products (here a small
    layer, which the block-shared kernel does not take) the finish kernel too; 0 none."""
    _finish_kernel_against_warps(rows, 2, 0)


@pytest.mark.parametrize("rows", [2, 5, 8])
def test_split_finish_of_one_row_group(rows):
    """Setting 3 gives the per-warp kernel's fp16-path products of one group of rows (1..8; 5..8
    take that path by default) the finish kernel too; 2 leaves them to their warps."""
    _finish_kernel_against_warps(rows, 3, 2)


@pytest.mark.parametrize("rows", [1, 3, 4])
def test_split_finish_of_the_integer_path(rows):
    """Setting 4 (and up; 5 the default) gives the integer path's products (1..4 rows) the finish
    kernel too; 3 leaves them to their warps."""
    _finish_kernel_against_warps(rows, 4, 3, int8=True)


IN_FINISH_PER_WARP, IN_FINISH_SHARED = 47, 46


@pytest.mark.parametrize("rows", [1, 8, 16, 32])
def test_output_stage_in_the_warps_only_where_a_product_runs_unsplit(rows):
    """Split products (the default) run kernels built without their warps' output stage; unsplit
    ones (split-finish setting 0, which needs a debug build) take the forms that have it: the
    per-warp kernel's debug-variant-47 instantiation, the block-shared kernel's kSaInFinish
    (CFG 2048) one. Since session 42 that holds for the per-warp kernel's two-group form (9..16
    rows) too, which until then kept the stage and served both. Debug variants 47 and 46 (those
    forms run split: the baselines of the change) give the shipped product; every form gives the
    reference's."""
    ext = ops.extension()
    t = rand_layer(4096, 14336, 4, "mul1", seed=900 + rows, bias=True)  # block-shared at 17..32 rows
    x = torch.randn(rows, 4096, device=DEV).half()
    want = fmt.exl3_matmul_reference(x.float(), t)
    run = lambda: ops.exl3_gemm(x, t, mode="fused", version=3)  # noqa: E731
    shared = rows > 16

    def forms(names):
        per_warp = [a[4] for a in template_args(names, "exl3_gemv_kernel")]
        sa = sa_cfgs(names)
        assert len(per_warp) + len(sa) == 1, names
        return per_warp, sa

    names = kernels_run(run, "")
    per_warp, sa = forms(names)
    assert (len(sa) == 1) == shared
    assert per_warp in ([], ["0"]) and all(not c & SA_IN_FINISH for c in sa), names
    assert any("gv_finish_kernel" in n for n in names)
    y = run()
    assert rel_rms(y, want) < 2e-3
    try:
        ext.set_gemv_split_finish(0)
        names = kernels_run(run, "")
        per_warp, sa = forms(names)
        assert per_warp in ([], [str(IN_FINISH_PER_WARP)]) and all(c & SA_IN_FINISH for c in sa), names
        assert not any("gv_finish_kernel" in n for n in names)
        y_warps = run()
    finally:
        ext.set_gemv_split_finish(ops.GV_SPLIT_FINISH)
    assert rel_rms(y_warps, want) < 2e-3
    assert rel_rms(y_warps, y) < 1e-3
    with ops.debug_variant(IN_FINISH_SHARED if shared else IN_FINISH_PER_WARP):
        names = kernels_run(run, "")
        y_fat = run()
    per_warp, sa = forms(names)
    assert per_warp in ([], [str(IN_FINISH_PER_WARP)]) and all(c & SA_IN_FINISH for c in sa), names
    assert any("gv_finish_kernel" in n for n in names)
    assert rel_rms(y_fat, y) < 1e-3
    assert workspaces_zero()


def test_shared_setting_1_leaves_two_row_groups_to_the_per_warp_kernel():
    """Setting 1 (TRELLIS_GV_SHARED=1, the rule before session 39 and its benchmark baseline) keeps
    9..16 rows of the largest layers on the per-warp kernel, 17..32 rows on the block-shared one;
    the products match the reference either way."""
    ext = ops.extension()
    large = rand_layer(4096, 28672, 4, "mul1", seed=33, bias=True)
    try:
        ext.set_gemv_shared_acts(1)
        for rows, shared in ((9, False), (16, False), (17, True)):
            x = torch.randn(rows, 4096, device=DEV).half()
            names = kernels_run(lambda: ops.exl3_gemm(x, large, mode="fused", int8=False, version=3))
            assert any("gemv_sa" in n for n in names) == shared, (rows, names)
            y = ops.exl3_gemm(x, large, mode="fused", int8=False, version=3)
            assert rel_rms(y, fmt.exl3_matmul_reference(x.float(), large)) < 2e-3, rows
    finally:
        ext.set_gemv_shared_acts(ops.GV_SHARED)
    assert workspaces_zero()
