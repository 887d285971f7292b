"""The block-shared product's warpgroup-MMA form (csrc/exl3_gemv_sa.cuh, kSaWgmma; sm_90a code,
csrc/wgmma.cuh) against the torch reference and against its synchronous-MMA form (pytest -m gpu).
On a device of compute capability 9.0 it serves 17..32 rows at K <= 4 by default; elsewhere the
setting changes nothing, which the tests check too."""
from __future__ import annotations

import itertools

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from engine import ops  # noqa: E402
from engine.formats import exl3 as fmt  # noqa: E402
from engine.ops import build  # noqa: E402
from tests.gpu_layers import (DEV, SA_A12, SA_PRODUCTS, SA_TC_SUM, SA_ROTATE, SA_STAMP, SA_STEAL, SA_TWIN,  # noqa: E402
                               SA_TWO_TILES, SA_WGMMA, SA_WIDE, kernels_run, rand_layer, rel_rms, sa_cfgs,
                               workspaces_zero)

# a 9.0 device and a build with sm_90a code (CUDA 12 or newer: engine/ops/build.py)
HOPPER = torch.cuda.get_device_capability() == (9, 0) and build._cuda_major() >= 12


def _sa_cfgs(fn) -> list[int]:
    """The block-shared kernels' CFGs among the kernels fn() launches."""
    return sa_cfgs(kernels_run(fn))


def _both_forms(run):
    """run() with the setting on (the default) and off: (result on, CFGs on, result off, CFGs off)."""
    ext = ops.extension()
    assert ops.GV_WGMMA == 1
    y_on, cfg_on = run(), _sa_cfgs(run)
    try:
        ext.set_gemv_wgmma(0)
        y_off, cfg_off = run(), _sa_cfgs(run)
    finally:
        ext.set_gemv_wgmma(ops.GV_WGMMA)
    return y_on, cfg_on, y_off, cfg_off


@pytest.mark.parametrize("K,cb", list(itertools.product(range(1, 5), ["3inst", "mcg", "mul1"])))
def test_wgmma_form_matches_reference(K, cb):
    """Every K <= 4 and codebook, four row groups with two tiles a unit (25..32 rows) and four
    (17..24), a bias, and a shape with several k slices: on Hopper the wgmma form runs and gives
    the reference's product, and the synchronous form's up to fp32 summation order; off it (or on
    another GPU) the synchronous form runs. K = 4 MUL1's wgmma form at four tiles a unit masks the
    states' A once (kSaA12, shipped since session 45); the synchronous form at four row groups
    keeps CFG 0."""
    ext = ops.extension()
    t = rand_layer(2048, 1536, K, cb, seed=40 + K, bias=True)
    w = fmt.reconstruct(t.trellis, cb)
    try:
        ext.set_gemv_shared_acts(2)  # the block-shared kernel for every shape (the rule's sizes are big)
        for rows in (17, 24, 25, 32):
            x = torch.randn(rows, 2048, device=DEV).half()
            x[:, 7] = 20.0
            y_on, cfg_on, y_off, cfg_off = _both_forms(lambda: ops.exl3_gemm(x, t, mode="fused", int8=False, version=3))
            assert len(cfg_on) == 1 and bool(cfg_on[0] & SA_WGMMA) == HOPPER, (rows, cfg_on)
            assert cfg_on[0] & SA_TWO_TILES == (SA_TWO_TILES if rows > 24 else 0), (rows, cfg_on)
            a12 = HOPPER and K == 4 and cb == "mul1" and rows <= 24
            assert bool(cfg_on[0] & SA_A12) == a12, (rows, cfg_on)
            assert cfg_off == [cfg_on[0] & ~(SA_WGMMA | SA_A12)], (rows, cfg_on, cfg_off)
            want = fmt.exl3_matmul_reference(x.float(), t, w)
            assert rel_rms(y_on, want) < 2e-3, (rows, rel_rms(y_on, want))
            assert rel_rms(y_on, y_off) < 1e-3, rows
    finally:
        ext.set_gemv_shared_acts(ops.GV_SHARED)
    assert workspaces_zero()


@pytest.mark.parametrize("variant,decode", [(48, SA_TC_SUM), (49, SA_A12), (50, SA_PRODUCTS)])
def test_wgmma_form_with_other_decodes(variant, decode):
    """Debug variants 48-50 (A/B forms): the wgmma form with MUL1's byte sums by MMAs (48), with
    the states' A masked once (49), or on the integer path's products (50) runs on Hopper
    (elsewhere the synchronous form with that decode) and gives the reference's product, and the
    shipped decode's (variant 30: the synchronous form, CFG 0) up to fp32 summation order."""
    t = rand_layer(2048, 1536, 4, "mul1", seed=variant, bias=True)
    w = fmt.reconstruct(t.trellis, "mul1")
    for rows in (17, 24, 32):
        x = torch.randn(rows, 2048, device=DEV).half()
        run = lambda: ops.exl3_gemm(x, t, mode="fused", int8=False, version=3)  # noqa: E731
        with ops.debug_variant(variant):
            assert _sa_cfgs(run) == [decode | (SA_WGMMA if HOPPER else 0)], rows
            y = run()
        with ops.debug_variant(30):  # the block-shared kernel, CFG 0 (synchronous MMAs, shipped decode)
            y_shipped = run()
        assert rel_rms(y, fmt.exl3_matmul_reference(x.float(), t, w)) < 2e-3, rows
        assert rel_rms(y, y_shipped) < 1e-3, rows
    assert workspaces_zero()


@pytest.mark.parametrize("n_in,n_out", [(2048, 1536), (14336, 4096), (128, 2048)])
def test_slice_by_parts_keeps_mul1_row_sums(n_in, n_out):
    """Every block-shared form copies its activation slice in parts, each on an mbarrier that a
    warp waits for only when its k rows need it, in the layout the prep wrote for that form
    (wgmma's on Hopper for the wgmma forms), and takes MUL1's constant term from the prep's chunk
    sums (session 48). One large column makes a missing, doubled or misplaced row sum show. The
    shipped forms at one, two and four row groups (5, 12, 17, 24 and 32 rows: synchronous,
    synchronous with A12, wgmma at four and two tiles a unit on Hopper), with rows past m in the
    last group, several k slices of uneven length (14,336 inputs) and one chunk of 128 inputs:
    the reference's product, and the per-warp kernel's (no slice) up to fp32 summation order."""
    ext = ops.extension()
    t = rand_layer(n_in, n_out, 4, "mul1", seed=56, bias=True)
    w = fmt.reconstruct(t.trellis, "mul1")
    try:
        for rows in (5, 12, 17, 24, 32):
            x = torch.randn(rows, n_in, device=DEV).half()
            x[:, 5] = 16.0
            run = lambda: ops.exl3_gemm(x, t, mode="fused", int8=False, version=3)  # noqa: E731
            ext.set_gemv_shared_acts(2)  # the block-shared kernel at every row count and size
            (cfg,) = _sa_cfgs(run)
            assert bool(cfg & SA_A12) == (rows in (12, 17, 24) if HOPPER else rows == 12), (rows, cfg)
            y = run()
            ext.set_gemv_shared_acts(0)  # the per-warp kernel
            assert _sa_cfgs(run) == [], rows
            y_per_warp = run()
            assert rel_rms(y, fmt.exl3_matmul_reference(x.float(), t, w)) < 2e-3, rows
            assert rel_rms(y, y_per_warp) < 1e-3, rows
    finally:
        ext.set_gemv_shared_acts(ops.GV_SHARED)
    assert workspaces_zero()


# Debug variants that change the shipped forms' blocks or unit order, not their sums: the bits
# each adds at two row groups and at four (variant 71's wide blocks and 80's claims serve four groups only).
_BLOCK_VARIANTS = {61: (SA_WIDE, SA_WIDE), 70: (SA_ROTATE, SA_ROTATE), 71: (0, SA_WIDE | SA_ROTATE),
                   72: (0, SA_STAMP), 73: (0, SA_ROTATE | SA_STAMP), 76: (0, SA_WIDE | SA_STAMP),
                   78: (SA_TWIN, SA_TWIN), 79: (SA_TWIN | SA_STAMP, SA_TWIN | SA_STAMP), 80: (0, SA_STEAL)}


@pytest.mark.parametrize("variant,n_in,n_out", [(v, i, o) for v in _BLOCK_VARIANTS
                                                for i, o in ((14336, 4096), (8192, 1536), (128, 2048))])
def test_block_variants_match_shipped(variant, n_in, n_out):
    """Debug variants 61 (kSaWide: blocks of 16 warps, one to an SM, slices twice as deep), 70
    (kSaRotate: each k slice's units start whole column units further on and wrap), 71 (both), 72
    and 73 (the shipped and rotated four-group forms with stamps, no buffer set: none written), 76
    (61 with stamps), 78 and 79 (kSaTwin: the grid's blocks two to a launched block, an odd
    grid's last half idle; stamps in 79), 80 (kSaSteal, four row groups: units claimed at run
    time, from other teams' ranges once a team's own is done), at two and four row groups (12,
    17, 24 and 32 rows), with many k slices of uneven length (14,336 and 8,192 inputs) and one
    chunk of 128 inputs, MUL1's row sums in play: the reference's product, and the shipped form's up to fp32 order. One row group (5 rows) keeps the
    shipped form (a row's chunk sums would span two warps in a wide block)."""
    ext = ops.extension()
    t = rand_layer(n_in, n_out, 4, "mul1", seed=variant, bias=True)
    w = fmt.reconstruct(t.trellis, "mul1")
    two, four = _BLOCK_VARIANTS[variant]
    try:
        ext.set_gemv_shared_acts(2)  # the block-shared kernel at every row count and size
        for rows in (5, 12, 17, 24, 32):
            x = torch.randn(rows, n_in, device=DEV).half()
            x[:, 9] = 16.0
            run = lambda: ops.exl3_gemm(x, t, mode="fused", int8=False, version=3)  # noqa: E731
            (cfg_shipped,) = _sa_cfgs(run)
            y_shipped = run()
            with ops.debug_variant(variant):
                (cfg,) = _sa_cfgs(run)
                y = run()
            bits = 0 if rows <= 8 else two if rows <= 16 else four
            assert cfg == cfg_shipped | bits, (rows, cfg, cfg_shipped)
            assert bool(cfg & SA_WGMMA) == (HOPPER and rows > 16), (rows, cfg)
            assert rel_rms(y, fmt.exl3_matmul_reference(x.float(), t, w)) < 2e-3, rows
            assert rel_rms(y, y_shipped) < 1e-3, rows
    finally:
        ext.set_gemv_shared_acts(ops.GV_SHARED)
    assert workspaces_zero()


@pytest.mark.parametrize("variant", [70, 71, 78, 80])
def test_reordered_units_of_grouped_members(variant):
    """Rotation (70, 71) wraps inside each member of a grouped product, twin blocks (78) may
    hold blocks of two members, and claims (80) stay inside a member's slice (gate/up- and
    q/k/v-like, K = 4 MUL1, 8,192 inputs so several k slices, members of unequal widths on whole
    wgmma units): every member matches its reference product at 12, 24 and 32 rows, and the
    kernels that ran carry the variant's bit."""
    members = [rand_layer(8192, n, 4, "mul1", seed=90 + i, bias=(i == 1)) for i, n in enumerate((1024, 512, 768))]
    g = ops.join_linears(members)
    ext = ops.extension()
    bit = {78: SA_TWIN, 80: SA_STEAL}.get(variant, SA_ROTATE)
    try:
        ext.set_gemv_shared_acts(2)
        for rows in (12, 24, 32):
            x = torch.randn(rows, 8192, device=DEV).half()
            with ops.debug_variant(variant):
                cfgs = _sa_cfgs(lambda: ops.exl3_gemm_group(x, g, int8=False))
                got = ops.exl3_gemm_group(x, g, int8=False)
            want_bit = bit if variant in (70, 78) or rows > 16 else 0
            assert cfgs and all((c & bit) == want_bit for c in cfgs), (rows, cfgs)
            for m, y in zip(members, got):
                assert rel_rms(y, fmt.exl3_matmul_reference(x.float(), m)) < 2e-3, (rows, m.out_features)
    finally:
        ext.set_gemv_shared_acts(ops.GV_SHARED)
    assert workspaces_zero()


def test_claimed_units_over_repeated_products_and_graph_replays():
    """Debug variant 80 (kSaSteal) leaves its claim words zeroed for the next product: products of
    two layers in turn, eagerly and then replayed from a CUDA graph, each match the shipped form's
    (17 and 32 rows: on Hopper the wgmma form at four and two tiles a unit), many times over, and
    the kernels that ran carry the bit."""
    layers = [rand_layer(8192, 8192, 4, "mul1", seed=81), rand_layer(4096, 14336, 4, "mul1", seed=82, bias=True)]
    ext = ops.extension()
    try:
        ext.set_gemv_shared_acts(2)
        for rows in (17, 32):
            xs = [torch.randn(rows, t.in_features, device=DEV).half() for t in layers]

            def steps():
                return [ops.exl3_gemm(x, t, mode="fused", int8=False, version=3) for x, t in zip(xs, layers)]

            want = steps()
            with ops.debug_variant(80):
                cfgs = _sa_cfgs(steps)
                assert cfgs and all(c & SA_STEAL for c in cfgs), (rows, cfgs)
                for _ in range(5):
                    for y, w in zip(steps(), want):
                        assert rel_rms(y, w) < 1e-3, rows
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    outs = steps()
                for _ in range(5):
                    graph.replay()
                    torch.cuda.synchronize()
                    for y, w in zip(outs, want):
                        assert rel_rms(y, w) < 1e-3, rows
    finally:
        ext.set_gemv_shared_acts(ops.GV_SHARED)
    assert workspaces_zero()


@pytest.mark.parametrize("variant", [72, 73, 79])
def test_stamps_of_every_team(variant):
    """Debug variants 72 / 73 / 79 (kSaStamp) with a buffer set: every team of the 32-row product
    (two warpgroups a block on Hopper, else eight warps; 79's launched blocks hold two grid blocks)
    writes its SM, slice, grid block, units and flush count and four times in order, which
    bench/sa_stamps.py reads; the product stays right, and without a buffer nothing is written."""
    from bench.sa_stamps import STAMP_WORDS, decode_stamps, summarize

    ext = ops.extension()
    t = rand_layer(8192, 8192, 4, "mul1", seed=variant)  # a grid of two blocks an SM
    x = torch.randn(32, 8192, device=DEV).half()
    slots = 4096
    buf = torch.zeros(slots * STAMP_WORDS, dtype=torch.int64, device=DEV)
    ext.set_gemv_shared_acts(2)  # the block-shared kernel at this size too (the rule's sizes are big)
    try:
        ext.set_sa_stamp_buffer(buf.data_ptr(), slots)
        with ops.debug_variant(variant):
            (cfg,) = _sa_cfgs(lambda: ops.exl3_gemm(x, t, mode="fused", int8=False, version=3))
            buf.zero_()
            y = ops.exl3_gemm(x, t, mode="fused", int8=False, version=3)
        torch.cuda.synchronize()
    finally:
        ext.set_sa_stamp_buffer(0, 0)
    assert cfg & SA_STAMP and bool(cfg & SA_ROTATE) == (variant == 73) and bool(cfg & SA_TWIN) == (variant == 79), cfg
    assert rel_rms(y, fmt.exl3_matmul_reference(x.float(), t)) < 2e-3
    teams = decode_stamps(buf.cpu().tolist())
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    blocks, slices, _ = ext.gemv_sa_plan(4, 32, 8192, 8192, sms)
    assert blocks > sms
    assert len(teams) == (2 if HOPPER else 8) * blocks, (len(teams), blocks)  # warpgroups or warps
    assert {tm["slice"] for tm in teams} == set(range(slices))
    assert {tm["grid_block"] for tm in teams} == set(range(blocks))
    for tm in teams:
        assert tm["start"] <= tm["first_unit"] <= tm["last_flush"] <= tm["end"], tm
        assert tm["flushes"] >= 1 and tm["units"] >= 1 and tm["sm"] < sms, tm
    # every unit once: 32 rows of a layer under 4096 x 18432 weights take two tiles a unit, four k
    # rows, a warpgroup's 4 column groups on Hopper
    ct, gw = (2 if cfg & SA_TWO_TILES else 4), (4 if cfg & SA_WGMMA else 1)
    assert sum(tm["units"] for tm in teams) == (8192 // 16 // ct // gw) * (8192 // 16 // 4), cfg
    assert summarize(teams, sms)["span_us"] > 0
    buf.zero_()
    try:
        with ops.debug_variant(variant):
            assert _sa_cfgs(lambda: ops.exl3_gemm(x, t, mode="fused", int8=False, version=3)) == [cfg]
        torch.cuda.synchronize()
    finally:
        ext.set_gemv_shared_acts(ops.GV_SHARED)
    assert not decode_stamps(buf.cpu().tolist())


def test_wgmma_form_by_default_on_a_large_layer_and_not_past_k4():
    """Under the default rules: 32 and 20 rows of a 4096x14336 layer take the wgmma form on Hopper
    at K = 4; K = 5 keeps the synchronous MMAs; 16 rows (two groups) never take it."""
    for K, rows, wg in ((4, 32, HOPPER), (4, 20, HOPPER), (5, 32, False), (4, 16, False)):
        t = rand_layer(4096, 14336, K, "mul1", seed=60 + K + rows)
        x = torch.randn(rows, 4096, device=DEV).half()
        run = lambda: ops.exl3_gemm(x, t, mode="fused", int8=False, version=3)  # noqa: E731
        cfgs = _sa_cfgs(run)
        assert any(c & SA_WGMMA for c in cfgs) == wg, (K, rows, cfgs)
        y = run()
        assert rel_rms(y, fmt.exl3_matmul_reference(x.float(), t)) < 2e-3, (K, rows)
    assert workspaces_zero()


def test_wgmma_form_needs_whole_warpgroup_units():
    """A layer whose columns are not a whole number of a warpgroup's units (1408 = 5.5 units of
    4 x 4 tiles at 17..24 rows) keeps the synchronous form there; at 25..32 rows (units of 4 x 2
    tiles, 11 of them) it takes the wgmma form on Hopper. Grouped members (q/k/v-like, starts at
    512 and 768 columns) take it where each starts on a unit: every member matches its reference."""
    ext = ops.extension()
    t = rand_layer(1024, 1408, 4, "mul1", seed=71)
    members = [rand_layer(1024, n, 4, "3inst", seed=72 + i, bias=(i == 1)) for i, n in enumerate((512, 256, 768))]
    g = ops.join_linears(members)
    try:
        ext.set_gemv_shared_acts(2)
        for rows, wg in ((20, False), (32, HOPPER)):
            x = torch.randn(rows, 1024, device=DEV).half()
            run = lambda: ops.exl3_gemm(x, t, mode="fused", int8=False, version=3)  # noqa: E731
            assert [bool(c & SA_WGMMA) for c in _sa_cfgs(run)] == [wg], rows
            assert rel_rms(run(), fmt.exl3_matmul_reference(x.float(), t)) < 2e-3, rows
        for rows in (17, 32):
            x = torch.randn(rows, 1024, device=DEV).half()
            cfgs = _sa_cfgs(lambda: ops.exl3_gemm_group(x, g, int8=False))
            assert cfgs and all(bool(c & SA_WGMMA) == HOPPER for c in cfgs), (rows, cfgs)
            got = ops.exl3_gemm_group(x, g, int8=False)
            for m, y in zip(members, got):
                assert rel_rms(y, fmt.exl3_matmul_reference(x.float(), m)) < 2e-3, (rows, m.out_features)
    finally:
        ext.set_gemv_shared_acts(ops.GV_SHARED)
    assert workspaces_zero()
