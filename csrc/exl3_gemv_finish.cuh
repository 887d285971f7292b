// A fused product's output stage (exl3_gemv.cuh's kernels): its decode-chain arguments, the
// output transform of a finished 128-column block (had128, the output scales, bias, and the chain's
// next input) as the product's own warps run it, and as the finish kernels (gemv_split_finish) that
// run it after the product, with their launchers. Apart from the main loop because none of it
// touches the trellis, and the loop's register budget is what shapes the rest of that file.
#pragma once
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

#include "exl3_mm.cuh"
#include "exl3_prep.cuh"
#include "kernels.h"

namespace trellis {

// A product's decode-chain arguments (MmArgs::in_part, in_eps, next), one __grid_constant__
// kernel parameter so that the output stage reads them in place (passed by value, they cost the
// main loop spills around the call).
struct GvChain {
    const float* in_part;
    float in_eps;
    ChainOut next;
};
// The same parameter of the kernels without chain code (CH false): products that neither read
// nor write a chain are built as before, so chains cost them nothing (measured: built into every
// product, the chain code made decode 4% slower with chains off).
struct GvNoChain {};
template <bool CH>
using GvChainArg = std::conditional_t<CH, GvChain, GvNoChain>;

// The decode chain's part of the output stage (chain_block, m = 1) for a block this warp
// finished, called after the main loop: its registers on top of the loop's live state made the
// kernel spill wherever it was called inside the loop (also from within gv_finish_block or
// inlined there). Nothing waits for it earlier: the next product reads its input only once this
// whole grid is done. It reads back the outputs the warp wrote.
static __device__ __noinline__ void gv_chain_block(const ChainOut* nx, const half* y, int blk, int lane) {
    const uint2 o = *reinterpret_cast<const uint2*>(y + blk * 128 + lane * 4);
    chain_block(*nx, y, as_h2(o.x), as_h2(o.y), blk, lane);
}

// A 128-column block's output weights (svh, bias) for the lane's 4 columns. Read before a flush's
// atomics, so that their DRAM latency overlaps those and the fence.
__device__ __forceinline__ void gv_block_weights(const half* __restrict__ svh, const half* __restrict__ bias,
                                                 int blk, int lane, uint2& sv, uint2& bv) {
    const int k = blk * 128 + lane * 4;
    sv = __ldg(reinterpret_cast<const uint2*>(svh + k));
    if (bias) bv = __ldg(reinterpret_cast<const uint2*>(bias + k));
}

// One row of the output transform: had128 / sqrt(128) (times the chain's 1 / rms), svh, bias.
__device__ __forceinline__ void gv_finish_row(float4 f, float scale, half* __restrict__ yr, uint2 sv, uint2 bv,
                                              bool has_bias, int lane) {
    float v[4] = {f.x, f.y, f.z, f.w};
    *reinterpret_cast<uint2*>(yr) = finish_lane4(v, lane, scale, sv, bv, has_bias);
}

// The 1 / rms a product whose input came from a normed chain (MmArgs::in_part) applies to its output
// row: the sums of squares of the input's in / 128 blocks (part), as lanes' strided shares then a
// butterfly, so every finisher of the row gets the same bits. CG: L2 loads (ld.global.cg), which
// ptxas keeps ahead of a PDL wait (gv_finish_chain_kernel).
template <bool CG = false>
__device__ __forceinline__ float chain_input_inv_rms(const float* __restrict__ part, int in, float eps, int lane) {
    float t = 0.f;
    for (int c = lane; c < (in >> 7); c += 32) t += CG ? __ldcg(part + c) : part[c];
    return rsqrtf(warp_sum(t) / in + eps);
}

// MUL1's constant term of an integer-path product whose finish kernel runs after it: every output
// of a row gets kMul1C0 times the sum of that row's prepared input, the sum of its chunk sums
// (MmArgs::csum, [segment, row, in / 128]). csum null: none (the product added it, or is not on
// the integer path). Why here: until session 36 the product's warp that holds a column group's k
// row 0 gathered the sums at its flush, an L2 round trip and five shuffles a row on the product's
// tail. The finish kernel loads each lane's strided share before its PDL wait (L2 loads, which
// ptxas keeps ahead of the wait) and adds and reduces them once its workspace loads are out, so
// that neither round trip waits for the other.
struct GvC0 {
    static constexpr int kLoads = 8;  // chunk sums a lane holds: all of them up to in = 32768
    const float* csum = nullptr;
    int nch = 0, m = 1;
    int seg_c1 = 0x7fffffff, seg_c2 = 0x7fffffff, seg_c3 = 0x7fffffff;  // MmArgs::seg_cols
    __device__ __forceinline__ const float* row_sums(int col, int row) const {
        const int seg = (int)(col >= seg_c1) + (int)(col >= seg_c2) + (int)(col >= seg_c3);
        return csum + ((size_t)seg * m + row) * nch;
    }
    // The lane's chunk sums lane, lane + 32, ... of the output column's row and segment (zeros past
    // nch): as many loads as the row has rounds of 32 chunks (a branch the whole warp takes alike),
    // each from a clamped index, so that no lane branches apart from the others.
    __device__ __forceinline__ void load(int col, int row, int lane, float (&v)[kLoads]) const {
        const float* p = csum ? row_sums(col, row) : nullptr;
#pragma unroll
        for (int i = 0; i < kLoads; ++i) {
            const int c = lane + 32 * i;
            v[i] = 0.f;
            if (p && 32 * i < nch) {
                const float x = __ldcg(p + min(c, nch - 1));
                v[i] = c < nch ? x : 0.f;
            }
        }
    }
    // The term from those loads (and any chunk sums past the first kLoads a lane).
    __device__ __forceinline__ float term(const float (&v)[kLoads], int col, int row, int lane) const {
        if (!csum) return 0.f;
        float t = 0.f;
#pragma unroll
        for (int i = 0; i < kLoads; ++i) t += v[i];
        for (int c = lane + 32 * kLoads; c < nch; c += 32) t += __ldcg(row_sums(col, row) + c);
        return kMul1C0 * warp_sum(t);
    }
};
__device__ __forceinline__ float4 plus_c0(float4 f, float c) { return make_float4(f.x + c, f.y + c, f.z + c, f.w + c); }

// The output transform of one finished 128-column block (see finish_block in the kernel), a row
// at a time. Not inlined: it runs about once per warp, and inlined its registers would crowd the
// main loop. ch->in_part: the input came from a chain in mode 1 without the norm's 1 / rms
// (MmArgs::in_part).
template <bool CH>
static __device__ __noinline__ void gv_finish_block(float* __restrict__ z, half* __restrict__ y, int ldy,
                                             uint2 sv, uint2 bv, bool has_bias, int m, int out,
                                             int blk, int lane, int in, const GvChain* ch) {
    const float* __restrict__ in_part = CH ? ch->in_part : nullptr;
    fence_acq_rel_gpu();  // acquire: every contribution counted is visible
    const int k = blk * 128 + lane * 4;
    for (int r = 0; r < m; ++r) {
        float scale = kHadNorm;
        if (in_part) scale *= chain_input_inv_rms(in_part + (size_t)r * (in >> 7), in, ch->in_eps, lane);
        float4* zp = reinterpret_cast<float4*>(z + (size_t)r * out + k);
        const float4 f = __ldcg(zp);
        __stcg(zp, make_float4(0.f, 0.f, 0.f, 0.f));
        gv_finish_row(f, scale, y + (size_t)r * ldy + k, sv, bv, has_bias, lane);
    }
}

// The same transform with 8 workspace rows per L2 round trip, for blocks whose finish a warp of a
// many-row product deferred until after its main loop (GvBlockList): there the loop's registers
// are free for the 8 rows in flight. Row by row, the finishing warps (the grid's tail) waited for
// one dependent L2 round trip per row: ~10% of a 32-row product (ncu: SM active 90% of elapsed).
__device__ __forceinline__ void gv_finish_block_rows8(float* __restrict__ z, half* __restrict__ y, int ldy,
                                                      const half* __restrict__ svh, const half* __restrict__ bias,
                                                      int m, int out, int blk, int lane) {
    fence_acq_rel_gpu();
    const int k = blk * 128 + lane * 4;
    uint2 sv, bv = make_uint2(0u, 0u);
    gv_block_weights(svh, bias, blk, lane, sv, bv);
    for (int r0 = 0; r0 < m; r0 += 8) {
        float4 f[8];
#pragma unroll
        for (int j = 0; j < 8; ++j)
            if (r0 + j < m) f[j] = __ldcg(reinterpret_cast<const float4*>(z + (size_t)(r0 + j) * out + k));
#pragma unroll
        for (int j = 0; j < 8; ++j)
            if (r0 + j < m) __stcg(reinterpret_cast<float4*>(z + (size_t)(r0 + j) * out + k), make_float4(0.f, 0.f, 0.f, 0.f));
#pragma unroll
        for (int j = 0; j < 8; ++j)
            if (r0 + j < m) gv_finish_row(f[j], kHadNorm, y + (size_t)(r0 + j) * ldy + k, sv, bv, bias != nullptr, lane);
    }
}

// The output transform of a product as a kernel of its own (gemv_split_finish): a warp per
// task of one row of one 128-column block (kTasks per warp, loaded together), launched as the
// product's programmatic dependent, so it starts as the product's blocks leave and reads the
// workspace once the whole product is done. Why: done by the warp that completes each block, after
// its main loop, the transform of 17..32 rows sat on the product's tail as one warp's chain of L2
// round trips per block, and with the completion counts it took ~15 us of a 32-row product on
// every large shape (timing probes, csrc/PERF_NOTES.md session 28); here thousands of warps share
// it. Since session 29 every plain product takes it, down to one row: without the fence and count
// on their tails, one-row products took 0.4-1.3 us less, four-row ones 1.2-3.2 us. The same
// rounding as gv_finish_row; the workspace is zeroed behind the read.
template <int kTasks>
__global__ void __launch_bounds__(256) gv_finish_kernel(float* __restrict__ z, half* __restrict__ y, int ldy,
                                                         const half* __restrict__ svh, const half* __restrict__ bias,
                                                         int m, int out, const GvC0 c0, bool c0_early) {
    const int lane = threadIdx.x & 31;
    const long task0 = ((long)blockIdx.x * 8 + (threadIdx.x >> 5)) * kTasks;
    const int blocks = out >> 7;
    const long tasks = (long)m * blocks;
    int rs[kTasks], ks[kTasks];
    uint2 sv[kTasks], bv[kTasks];
    float cv[kTasks][GvC0::kLoads];
#pragma unroll
    for (int j = 0; j < kTasks; ++j) {  // the weights before the wait (ptxas moves the second task's
                                        // .nc loads below it; the workspace loads follow at once)
        const long t = task0 + j < tasks ? task0 + j : tasks - 1;
        rs[j] = (int)(t / blocks);
        ks[j] = (int)(t - (long)rs[j] * blocks) * 128 + lane * 4;
        bv[j] = make_uint2(0u, 0u);
        sv[j] = __ldg(reinterpret_cast<const uint2*>(svh + ks[j]));
        if (bias) bv[j] = __ldg(reinterpret_cast<const uint2*>(bias + ks[j]));
    }
    // The constant term: the product's input sums were written before the product launched, so they
    // are complete here unless the product let this grid launch before its own wait (c0_early false).
    auto gather_c0 = [&] {
#pragma unroll
        for (int j = 0; j < kTasks; ++j) c0.load(ks[j] - lane * 4, rs[j], lane, cv[j]);
    };
    if (c0_early) gather_c0();
    pdl_wait_primary();
    pdl_launch_dependents();
    if (!c0_early) gather_c0();
    float4 f[kTasks];
#pragma unroll
    for (int j = 0; j < kTasks; ++j)
        if (task0 + j < tasks) f[j] = __ldcg(reinterpret_cast<const float4*>(z + (size_t)rs[j] * out + ks[j]));
#pragma unroll
    for (int j = 0; j < kTasks; ++j) {
        if (task0 + j >= tasks) break;
        __stcg(reinterpret_cast<float4*>(z + (size_t)rs[j] * out + ks[j]), make_float4(0.f, 0.f, 0.f, 0.f));
        const float cs = c0.term(cv[j], ks[j] - lane * 4, rs[j], lane);
        gv_finish_row(plus_c0(f[j], cs), kHadNorm, y + (size_t)rs[j] * ldy + ks[j], sv[j], bv[j], bias != nullptr,
                      lane);
    }
}
constexpr int kGvFinishTasks = 2;

// The output transform of a one-row product that reads or writes a decode chain (GvChain), as a
// kernel of its own (gemv_split_finish 5), so that the product runs as a plain one: a warp per
// 128-column block, or per pair of blocks (gate j and up j) where the next input is gated
// (NEXT = ChainOut::mode 2), which then needs no pair count. The input's 1 / rms (in_part) and
// the chain output as the product's finishing warps apply and write them (gv_finish_block,
// chain_block): the same bits. Why: in the product, the chain output sat on its tail behind the
// completion counts and made every product-to-product link slower than the prep kernel it saves
// (sessions 7 and 12); this kernel's blocks do it in parallel, in place of that prep kernel.
// Everything but the workspace is read before the PDL wait, so that after it only the workspace's
// round trip is on the critical path: the weights always, and with early_reads also what kernels
// before the product wrote (the input's row sums, the residual), which have completed by the time
// this grid launches when the product triggers its dependents only after its own wait (early-
// trigger modes 0 and 2; the host passes false for mode 1, or with finish_early_reads off). After
// the wait these were one dependent round trip more (the row sums, then the workspace; the
// workspace, then the residual).
// MR: 2..4 rows (ldy apart in y, out apart in the workspace; the chain's row r at r, the input's
// row sums in_part + r * in / 128), a warp per (row, task); TRELLIS_CHAIN_ROWS (4 by default since
// session 31). Without it, one row.
template <int NEXT, bool MR = false>
__global__ void __launch_bounds__(256) gv_finish_chain_kernel(float* __restrict__ z, half* __restrict__ y,
                                                               const half* __restrict__ svh,
                                                               const half* __restrict__ bias, int out, int in,
                                                               const __grid_constant__ GvChain ch, bool early_reads,
                                                               int ldy, int rows, const GvC0 c0) {
    constexpr int NB = NEXT == 2 ? 2 : 1;  // output blocks per task
    const int lane = threadIdx.x & 31;
    const int tasks = NEXT == 2 ? ch.next.n >> 7 : out >> 7;  // gated: blocks j and j + n / 128 (chain_block)
    const int task_all = blockIdx.x * 8 + (threadIdx.x >> 5);
    if (task_all >= (MR ? tasks * rows : tasks)) return;
    const int r = MR ? task_all / tasks : 0;  // the row
    const int task = MR ? task_all - r * tasks : task_all;
    if constexpr (MR) {
        z += (size_t)r * out;
        y += (size_t)r * ldy;
    }
    const float* in_part = MR && ch.in_part ? ch.in_part + (size_t)r * (in >> 7) : ch.in_part;
    int ks[NB];
    uint2 sv[NB], bv[NB];
#pragma unroll
    for (int b = 0; b < NB; ++b) {  // L2 loads, which ptxas does not move below the wait (normed_weights)
        ks[b] = (task + b * tasks) * 128 + lane * 4;
        sv[b] = __ldcg(reinterpret_cast<const uint2*>(svh + ks[b]));
        bv[b] = bias ? __ldcg(reinterpret_cast<const uint2*>(bias + ks[b])) : make_uint2(0u, 0u);
    }
    uint2 s = make_uint2(0u, 0u);
    if constexpr (NEXT == 2) s = __ldcg(reinterpret_cast<const uint2*>(ch.next.suh + task * 128 + lane * 4));
    NormedLoads nl{};
    if constexpr (NEXT == 1) nl = normed_weights<true>(ch.next, ch.next.nseg, task, lane);
    float scale = kHadNorm;
    float cv[NB][GvC0::kLoads];
    auto read_earlier = [&] {  // what the kernels before the product wrote
        if (in_part) scale *= chain_input_inv_rms<true>(in_part, in, ch.in_eps, lane);
        if constexpr (NEXT == 1) nl.rv = normed_residual_cg(ch.next, task, lane, r);
#pragma unroll
        for (int b = 0; b < NB; ++b) c0.load(ks[b] - lane * 4, r, lane, cv[b]);  // MUL1's constant term
    };
    if (early_reads) read_earlier();
    pdl_wait_primary();
    pdl_launch_dependents();
    if (!early_reads) read_earlier();
    float4 f[NB];
#pragma unroll
    for (int b = 0; b < NB; ++b) f[b] = __ldcg(reinterpret_cast<const float4*>(z + ks[b]));
    uint2 o[NB];
#pragma unroll
    for (int b = 0; b < NB; ++b) {
        __stcg(reinterpret_cast<float4*>(z + ks[b]), make_float4(0.f, 0.f, 0.f, 0.f));
        const float cs = c0.term(cv[b], ks[b] - lane * 4, r, lane);
        float v[4] = {f[b].x + cs, f[b].y + cs, f[b].z + cs, f[b].w + cs};
        o[b] = finish_lane4(v, lane, scale, sv[b], bv[b], bias != nullptr);
        *reinterpret_cast<uint2*>(y + ks[b]) = o[b];
    }
    if constexpr (NEXT == 1) chain_normed_segs(ch.next, as_h2(o[0].x), as_h2(o[0].y), task, lane, nl, r, MR ? rows : 1);
    if constexpr (NEXT == 2) chain_gated_chunk(ch.next, o[0], o[1], s, task, lane, r);
}

// The finish kernels' GvC0 argument: the product's input sums where it left MUL1's constant term
// to them (c0_late), else none.
inline GvC0 gv_c0_arg(const MmArgs& a, bool c0_late) {
    GvC0 c;
    if (c0_late) c = GvC0{a.csum, a.in >> 7, a.m, a.seg_cols[0], a.seg_cols[1], a.seg_cols[2]};
    return c;
}

// Launch gv_finish_chain_kernel for a product of 1..4 rows with chain arguments (MmArgs::in_part,
// next).
inline cudaError_t launch_gv_finish_chain(const MmArgs& a, bool c0_late, cudaStream_t stream) {
    const GvChain ch{a.in_part, a.in_eps, a.next};
    const int tasks = (a.next.mode == 2 ? a.next.n >> 7 : a.out >> 7) * a.m;
    const bool mr = a.m > 1;
    const auto kernel = a.next.mode == 1   ? (mr ? gv_finish_chain_kernel<1, true> : gv_finish_chain_kernel<1>)
                        : a.next.mode == 2 ? (mr ? gv_finish_chain_kernel<2, true> : gv_finish_chain_kernel<2>)
                                           : (mr ? gv_finish_chain_kernel<0, true> : gv_finish_chain_kernel<0>);
    return launch_pdl(kernel, dim3((unsigned)((tasks + 7) / 8)), dim3(256), 0, stream, a.pdl, a.z, a.y, a.svh, a.bias,
                      a.out, a.in, ch, a.early_trigger != 1 && finish_early_reads(), a.ldy, a.m, gv_c0_arg(a, c0_late));
}

// Launch gv_finish_kernel for a product of m rows and `out` columns (its workspace z, output y);
// gv_finish_chain_kernel where the product reads or writes a decode chain. c0_late: the product
// left MUL1's constant term to this kernel (GvC0).
inline cudaError_t launch_gv_finish(const MmArgs& a, cudaStream_t stream, bool c0_late = false) {
    if (a.next.mode || a.in_part) return launch_gv_finish_chain(a, c0_late, stream);
    const long warps = ((long)a.m * (a.out >> 7) + kGvFinishTasks - 1) / kGvFinishTasks;
    return launch_pdl(gv_finish_kernel<kGvFinishTasks>, dim3((unsigned)((warps + 7) / 8)), dim3(256), 0, stream,
                      a.pdl, a.z, a.y, a.ldy, a.svh, a.bias, a.m, a.out, gv_c0_arg(a, c0_late), a.early_trigger != 1);
}

}  // namespace trellis
