"""The fused product on its compact ring (csrc/exl3_gemv_geom.cuh), run on the GPU machine
(pytest -m gpu).

The shipped rings are sized for the H200's 228 KB of shared memory per SM. An RTX 30/40/50 SM has
100 KB and an A100 SM 164 KB, so there a block of the shipped ring may not fit twice on an SM, or
at all. The compact ring fits two blocks in 100 KB. set_gemv_compact(1) makes the H200 run what
such a GPU would, so the compact kernels are checked here against the reference. gemv_plan shows
the configuration a product would take on a GPU with other limits."""
from __future__ import annotations

import itertools

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from engine import ops  # noqa: E402
from engine.formats import exl3 as fmt  # noqa: E402
from engine.ops import chain as chain_links  # noqa: E402
from tests.gpu_layers import kernels_run, rand_layer, rel_rms, template_args, workspaces_zero  # noqa: E402
from tests.test_chain_gpu import _restore_split, _set_split, _zero_state  # noqa: E402
from tests.test_self_prep_gpu import prep_kernels  # noqa: E402

DEV = torch.device("cuda")
COMPACT_CFG = 12  # kGvCompact
NEEDED, ALWAYS, NEVER, TWO_BLOCKS = 0, 1, 2, 3
# cudaDevAttrMaxSharedMemoryPerBlockOptin, ...PerMultiprocessor, ReservedSharedMemoryPerBlock
RTX = (101376, 102400, 1024)  # sm_86 / sm_89 / sm_120
A100 = (166912, 167936, 1024)  # sm_80
H200 = (232448, 233472, 1024)  # sm_90
SHAPES = [(1024, 1536), (4096, 4096), (4096, 14336), (8192, 28672)]


@pytest.fixture
def compact():
    """Sets the compact ring's mode; restores the configured one (and the lean-units setting,
    which tests that compare plans with the shipped ones turn off) after the test."""
    ext = ops.extension()
    yield ext.set_gemv_compact
    ext.set_gemv_compact(ops.GV_COMPACT)
    ext.set_gemv_lean_units(ops.GV_LEAN_UNITS)
    ext.set_gemv_lean_groups(ops.GV_LEAN_GROUPS)


def _plan(K, int8, rows, n_in, n_out, limits=(0, 0, 0), sp=False, chain=False):
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    return ops.extension().gemv_plan(K, int8, rows, sp, chain, n_in, n_out, sms, *limits)


def _gemv_cfgs(fn) -> set[str]:
    """The (CFG, SP, CH) template arguments of the per-warp product kernels fn() launches."""
    return {", ".join(a[5:]) for a in template_args(kernels_run(fn, "exl3_gemv_kernel<"), "exl3_gemv_kernel")}


@pytest.mark.parametrize("K,cb", list(itertools.product(range(1, 9), ["3inst", "mcg", "mul1"])))
def test_compact_products_match_the_reference(K, cb, compact):
    """Every K and codebook on the compact ring, at one and several groups of rows (both arithmetic
    paths for MUL1), gives the reference's product, and the shipped ring's up to fp32 summation
    order; the kernel that ran is the one gemv_plan names."""
    n_in, n_out = 1024, 1536
    t = rand_layer(n_in, n_out, K, cb, seed=200 + K, bias=True)
    ref_w = fmt.reconstruct(t.trellis, cb)
    for rows, int8 in ((1, True), (5, True), (1, False), (17, False)):
        if int8 and cb != "mul1":
            continue
        x = torch.randn(rows, n_in, device=DEV).half()
        x[:, 5] = 30.0
        compact(ALWAYS)
        y = ops.exl3_gemm(x, t, mode="fused", int8=int8, version=3)
        ran = _gemv_cfgs(lambda: ops.exl3_gemm(x, t, mode="fused", int8=int8, version=3))
        cfg, smem, blocks = _plan(K, int8, rows, n_in, n_out)
        compact(NEVER)
        y0 = ops.exl3_gemm(x, t, mode="fused", int8=int8, version=3)
        assert rel_rms(y, fmt.exl3_matmul_reference(x.float(), t, ref_w)) < 2e-3, (rows, int8)
        assert rel_rms(y, y0) < 1e-3, (rows, int8)
        assert ran == {f"{cfg}, false, false"}, (rows, int8, ran, cfg)
        assert blocks == 2 and (cfg != COMPACT_CFG or smem <= 48 * 1024), (rows, int8, cfg, smem)
    assert workspaces_zero()


@pytest.mark.parametrize("K,cb,n_in,n_out", [(4, "mul1", 4096, 14336), (8, "mul1", 8192, 28672), (3, "3inst", 4096, 28672),
                                            (6, "mcg", 14336, 4096)])
def test_compact_ring_of_large_layers(K, cb, n_in, n_out, compact):
    """Layers that ship with two or four k rows per unit take the compact ring's one instead and
    still give the reference's product."""
    t = rand_layer(n_in, n_out, K, cb, seed=300 + K)
    compact(ALWAYS)
    for rows, int8 in ((1, True), (3, True), (1, False), (8, False), (24, False)):
        if int8 and cb != "mul1":
            continue
        x = torch.randn(rows, n_in, device=DEV).half()
        y = ops.exl3_gemm(x, t, mode="fused", int8=int8, version=3)
        assert rel_rms(y, fmt.exl3_matmul_reference(x.float(), t)) < 2e-3, (rows, int8)
    assert workspaces_zero()


@pytest.mark.parametrize("n_in,n_out,K", [(4096, 4096, 4), (4096, 28672, 2), (2048, 1024, 6), (1024, 2048, 8)])
def test_compact_self_prepped_product(n_in, n_out, K, compact):
    """Self prep on the compact ring (its chunk slots beside a smaller ring) matches the reference
    with the prep kernel skipped, so the product's own prep is what it read. At K = 8 the slots
    leave no room for two stages: that product keeps CFG 0."""
    t = rand_layer(n_in, n_out, K, "mul1", seed=n_in + K, bias=True)
    x = torch.randn(1, n_in, device=DEV).half()
    x[0, 7] = 40.0
    compact(ALWAYS)
    with prep_kernels(skipped=True):
        own = ops.exl3_gemm(x, t, mode="fused", int8=True)
        ran = _gemv_cfgs(lambda: ops.exl3_gemm(x, t, mode="fused", int8=True))
    assert rel_rms(own, fmt.exl3_matmul_reference(x.float(), t)) < 2e-3
    cfg, _, _ = _plan(K, True, 1, n_in, n_out, sp=True)
    assert ran == {f"{cfg}, true, false"} and (cfg == COMPACT_CFG) == (K < 8), (ran, cfg)
    assert workspaces_zero()


@pytest.mark.parametrize("split", [4, 5])
@pytest.mark.parametrize("hidden,inter,K", [(1024, 2816, 4), (4096, 14336, 8), (640, 384, 6)])
def test_compact_gated_chain(hidden, inter, K, split, compact, monkeypatch, request):
    """The gate/up product writing the down projection's input (a chain output) on the compact
    ring gives what the separate kernels give: with split finish 4 the product kernel built with
    chain code writes it, with 5 (the default) a plain product on the compact ring and then
    gv_finish_chain_kernel."""
    monkeypatch.setattr(ops, "CHAIN", chain_links.LINKS)
    _set_split(split)
    request.addfinalizer(_restore_split)
    seed = hidden + inter + K
    gate, up = rand_layer(hidden, inter, K, "mul1", seed), rand_layer(hidden, inter, K, "mul1", seed + 1, bias=True)
    down = rand_layer(inter, hidden, K, "mul1", seed + 2, bias=True)
    g = ops.join_linears([gate, up])
    x = (torch.randn(1, 1, hidden, device=DEV, generator=torch.Generator(device=DEV).manual_seed(seed)) / 4).half()
    compact(ALWAYS)
    gy, uy = ops.exl3_gemm_group(x, g)
    want = ops.exl3_gemm(gy, down, up=uy, act="silu")
    got = ops.gated_chain(x, g, down, "silu", hidden)
    ran = _gemv_cfgs(lambda: ops.gated_chain(x, g, down, "silu", hidden))
    finish = kernels_run(lambda: ops.gated_chain(x, g, down, "silu", hidden), "gv_finish_chain_kernel<2,")
    assert got is not None
    assert rel_rms(got.reshape(1, -1), want.reshape(1, -1)) < 5e-4
    assert f"{COMPACT_CFG}, false, {'true' if split == 4 else 'false'}" in ran, ran
    assert bool(finish) == (split == 5), finish
    _zero_state()


def _all_plans(limits, mode):
    ops.extension().set_gemv_compact(mode)
    for K, (n_in, n_out), rows, int8, sp in itertools.product(range(1, 9), SHAPES, (1, 4, 8, 16, 32), (True, False),
                                                              (False, True)):
        if int8 and rows > 8 or sp and not (int8 and rows == 1):
            continue
        for chain in (False, True) if int8 and rows == 1 and not sp else (False,):
            yield (K, int8, rows, n_in, n_out, sp, chain), _plan(K, int8, rows, n_in, n_out, limits, sp, chain)


def test_plans_on_an_rtx_gpu_fit_two_blocks_per_sm(compact):
    """With 100 KB per SM, every product takes a block that fits twice on an SM when the setting
    asks for two (3), except self prep at K >= 7, which then keeps the prep kernel. By default (0)
    only what could not launch at all changes: the integer path at K = 8 (with the lean-units
    setting off: test_small_products_take_the_compact_ring)."""
    ops.extension().set_gemv_lean_units(0)
    for key, (cfg, smem, blocks) in _all_plans(RTX, TWO_BLOCKS):
        K, sp = key[0], key[5]
        if sp and K >= 7:
            assert blocks < 2, key
        else:
            assert blocks == 2 and smem <= RTX[1] // 2 - RTX[2], (key, cfg, smem)
    before = dict(_all_plans(RTX, NEVER))
    for key, plan in _all_plans(RTX, NEEDED):
        if before[key][2] == 0 and not key[5]:
            assert plan[0] == COMPACT_CFG and plan[2] == 2, (key, plan)
        elif not key[5]:
            assert plan == before[key], (key, plan, before[key])
    assert any(b[2] == 0 for b in before.values())  # the shipped rings had products that could not launch


def test_plans_on_an_a100_take_two_rows_where_they_fit(compact):
    """With 164 KB per SM the largest layers at K = 4 fit two blocks per SM with two k rows per unit
    (72 KB), not four (96 KB)."""
    plans = dict(_all_plans(A100, TWO_BLOCKS))
    assert plans[(4, True, 1, 8192, 28672, False, False)][0] == 9
    assert all(p[2] == 2 for k, p in plans.items() if not (k[5] and k[0] >= 7))


def test_plans_on_the_h200_are_the_shipped_ones(compact):
    """With 228 KB per SM nothing changes in any mode but 1: the H200 keeps its measured rings
    (with the lean-units setting off, which gives small products the compact ring on any GPU)."""
    ops.extension().set_gemv_lean_units(0)
    shipped = dict(_all_plans(H200, NEVER))
    assert {p[0] for p in shipped.values()} == {0, 9, 10}
    for mode in (NEEDED, TWO_BLOCKS):
        assert dict(_all_plans(H200, mode)) == shipped, mode


def test_small_products_take_the_compact_ring(compact):
    """With the lean-units setting at 16 a product that would take one k row per unit with
    fewer than that many units per resident warp takes the compact ring, on the H200 too: at one
    row Llama-3.1-8B's q/k/v (4096x6144) and o_proj (4096x4096) do, its gate/up and down (four k
    rows) and 8192x28672 at 8 rows (108 units per warp) do not, nor, with the lean-groups setting
    at its default 1, do products of more than one group of rows (4096x4096 at 32 rows has 15.5
    units per warp). Setting 2 (never) and 0 (lean off) keep CFG 0; what runs is what the plan
    names."""
    ext = ops.extension()
    ext.set_gemv_compact(TWO_BLOCKS)
    ext.set_gemv_lean_units(16)
    assert _plan(4, True, 1, 4096, 6144, H200)[0] == COMPACT_CFG
    assert _plan(4, True, 1, 4096, 4096, H200)[0] == COMPACT_CFG
    assert _plan(4, True, 1, 4096, 28672, H200)[0] == 10
    assert _plan(4, True, 1, 14336, 4096, H200)[0] == 10
    assert _plan(4, True, 8, 8192, 28672, H200)[0] == 0
    assert _plan(4, False, 8, 4096, 4096, H200)[0] == COMPACT_CFG  # one group on the fp16 path
    assert _plan(4, False, 32, 4096, 4096, H200)[0] == 0  # four groups
    t = rand_layer(4096, 4096, 4, "mul1", seed=77, bias=True)
    x = torch.randn(1, 4096, device=DEV).half()
    ran = _gemv_cfgs(lambda: ops.exl3_gemm(x, t, mode="fused", int8=True, version=3))
    assert ran == {f"{COMPACT_CFG}, false, false"}, ran
    y = ops.exl3_gemm(x, t, mode="fused", int8=True, version=3)
    ext.set_gemv_lean_units(0)
    assert _plan(4, True, 1, 4096, 4096, H200)[0] == 0
    assert _gemv_cfgs(lambda: ops.exl3_gemm(x, t, mode="fused", int8=True, version=3)) == {"0, false, false"}
    assert rel_rms(y, ops.exl3_gemm(x, t, mode="fused", int8=True, version=3)) < 1e-3
    ext.set_gemv_lean_units(16)
    ext.set_gemv_compact(NEVER)
    assert _plan(4, True, 1, 4096, 4096, H200)[0] == 0
    assert workspaces_zero()


def test_lean_groups_widen_the_rule(compact):
    """The lean-groups setting lets products of more groups of rows take the rule: at 4 a 4096x4096
    product of 32 fp16 rows (15.5 units per warp) takes the compact ring, and its result matches
    the shipped ring's; 8192x28672 at 32 rows has too many units either way."""
    ext = ops.extension()
    ext.set_gemv_compact(TWO_BLOCKS)
    ext.set_gemv_lean_units(16)
    ext.set_gemv_lean_groups(4)
    assert _plan(4, False, 32, 4096, 4096, H200)[0] == COMPACT_CFG
    assert _plan(4, False, 16, 4096, 4096, H200)[0] == COMPACT_CFG
    assert _plan(4, False, 32, 8192, 28672, H200)[0] == 0
    t = rand_layer(4096, 4096, 4, "mul1", seed=78)
    x = torch.randn(32, 4096, device=DEV).half()
    y = ops.exl3_gemm(x, t, mode="fused", int8=False, version=3)
    ext.set_gemv_lean_groups(1)
    assert _plan(4, False, 32, 4096, 4096, H200)[0] == 0
    assert rel_rms(y, ops.exl3_gemm(x, t, mode="fused", int8=False, version=3)) < 1e-3
    assert workspaces_zero()
