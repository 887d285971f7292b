// Dispatcher for the fused product, plus the small kernels around it: 128-point Hadamard with
// scales, dense reconstruct, RMSNorm (optionally fused with the residual add) and gated MLP glue.
#include <math.h>

#include <type_traits>
#include <utility>

#include "exl3_decode.cuh"
#include "exl3_gemv_geom.cuh"
#include "exl3_gemv_sa.cuh"  // sa_grid, for gemv_sa_plan
#include "exl3_mm.cuh"
#include "exl3_prep.cuh"
#include "kernels.h"

namespace trellis {

#define TRELLIS_DECLARE_MM(K)                                               \
    cudaError_t exl3_mm_k##K(const MmArgs& a, cudaStream_t stream);         \
    cudaError_t exl3_gv_k##K(const MmArgs& a, int variant, cudaStream_t stream);
TRELLIS_DECLARE_MM(1)
TRELLIS_DECLARE_MM(2)
TRELLIS_DECLARE_MM(3)
TRELLIS_DECLARE_MM(4)
TRELLIS_DECLARE_MM(5)
TRELLIS_DECLARE_MM(6)
TRELLIS_DECLARE_MM(7)
TRELLIS_DECLARE_MM(8)
#undef TRELLIS_DECLARE_MM

cudaError_t exl3_mm_partial(const MmArgs& a, cudaStream_t stream) {
    if (a.m < 1 || a.m > kMaxFusedRows || a.in % 128 || a.out % 128) return cudaErrorInvalidValue;
    if (a.sq && (a.m > 8 || a.codebook != CB_MUL1)) return cudaErrorInvalidValue;
    if (a.version == 3) {
        if (a.self_prep ? (a.m != 1 || a.codebook != CB_MUL1 || !a.x || !a.suh || a.norm.pre.w)
                        : (!a.xb || (a.scales && (a.m > 8 || a.codebook != CB_MUL1))))
            return cudaErrorInvalidValue;
        const int v = mm_debug_variant();
        switch (a.K) {
            case 1: return exl3_gv_k1(a, v, stream);
            case 2: return exl3_gv_k2(a, v, stream);
            case 3: return exl3_gv_k3(a, v, stream);
            case 4: return exl3_gv_k4(a, v, stream);
            case 5: return exl3_gv_k5(a, v, stream);
            case 6: return exl3_gv_k6(a, v, stream);
            case 7: return exl3_gv_k7(a, v, stream);
            case 8: return exl3_gv_k8(a, v, stream);
            default: return cudaErrorInvalidValue;
        }
    }
    switch (a.K) {
        case 1: return exl3_mm_k1(a, stream);
        case 2: return exl3_mm_k2(a, stream);
        case 3: return exl3_mm_k3(a, stream);
        case 4: return exl3_mm_k4(a, stream);
        case 5: return exl3_mm_k5(a, stream);
        case 6: return exl3_mm_k6(a, stream);
        case 7: return exl3_mm_k7(a, stream);
        case 8: return exl3_mm_k8(a, stream);
        default: return cudaErrorInvalidValue;
    }
}

// ---------------------------------------------------------------------------------------------
// Activation prep kernels (the math is in exl3_prep.cuh).

__global__ void prep_x_kernel(const half* __restrict__ x, int ldx, const half* __restrict__ suh,
                              half* __restrict__ xh, uint32_t* __restrict__ sq, int ldsq,
                              float2* __restrict__ scales, float* __restrict__ csum, int rows,
                              int in) {
    pdl_launch_dependents();  // the product after it may start fetching its trellis
    const int lane = threadIdx.x & 31;
    const int nch = in >> 7;
    const int task = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (task >= rows * nch) return;
    const int r = task / nch;
    const int c = task - r * nch;
    const int k = c * 128 + lane * 4;
    half2 o0, o1;
    const PrepInput pin{x, ldx, nullptr, 0, 0};
    prep_lane_xh(pin, PrepWeights(pin, suh, k), r, k, lane, o0, o1);
    *reinterpret_cast<uint2*>(xh + (size_t)r * in + k) = make_uint2(as_u32(o0), as_u32(o1));
    if (!sq) return;
    const float f[4] = {__low2float(o0), __high2float(o0), __low2float(o1), __high2float(o1)};
    const Int8Chunk ch(f);
    uint32_t w1[4], w2[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) ch.passes(f[q], w1[q], w2[q]);
    *reinterpret_cast<uint4*>(sq + (size_t)(2 * r) * ldsq + k) = make_uint4(w1[0], w1[1], w1[2], w1[3]);
    *reinterpret_cast<uint4*>(sq + (size_t)(2 * r + 1) * ldsq + k) = make_uint4(w2[0], w2[1], w2[2], w2[3]);
    if (lane == 0) {
        scales[(size_t)r * nch + c] = make_float2(ch.s1, ch.s2);
        csum[(size_t)r * nch + c] = ch.sum;
    }
}

cudaError_t prep_x(const half* x, int ldx, const half* suh, half* xh, uint32_t* sq, int ldsq,
                   float2* scales, float* csum, int rows, int in, cudaStream_t stream) {
    if (in % 128 || rows < 1) return cudaErrorInvalidValue;
    const long tasks = (long)rows * (in / 128);
    prep_x_kernel<<<(unsigned)((tasks + 7) / 8), 256, 0, stream>>>(x, ldx, suh, xh, sq, ldsq, scales,
                                                                   csum, rows, in);
    return cudaGetLastError();
}

// Version-3 prep: one warp per (row, 128-chunk) as above, but the outputs land in the MMA
// fragment order of exl3_gemv.cuh. Element (row r, k): k row i = k / 16, kk = k % 16, lane
// quad cq = (kk % 8) / 2.
//   F16: lane = (r % 8) * 4 + cq, word kk / 8 of the lane's pair, half kk % 2; group r / 8.
//   I8:  lane = (2 (r % 4) + pass) * 4 + cq, slot (kk % 2) + 2 (kk / 8) of the lane's 4 words;
//        group r / 4.
// OPEN: x (and up) are the open sums of the product before (PrepInput::xo, uo; kernels.h).
// PRE: x is normed on its own before the residual add and the norm (pre, PrepNorm::pre).
template <bool OPEN, bool PRE = false>
__global__ void prep_frag_kernel(const PrepInput x, const half* __restrict__ suh,
                                 uint32_t* __restrict__ xb, float2* __restrict__ scales,
                                 float* __restrict__ csum, int rows, int in, int ng, const PreNorm pre) {
    pdl_launch_dependents();  // the product after it may start fetching its trellis
    const int lane = threadIdx.x & 31;
    const int nch = in >> 7;
    {  // segment blockIdx.y of a grouped product: its own signs and output series
        const int seg = blockIdx.y;
        suh += (size_t)seg * in;
        xb += (size_t)seg * (in >> 4) * ng * 32 * (scales ? 4 : 2);
        if (scales) {
            scales += (size_t)seg * rows * nch;
            csum += (size_t)seg * rows * nch;
        }
    }
    const int task = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const bool active = task < rows * nch;  // idle warps still join the block's row statistics
    const int r = active ? task / nch : rows - 1;
    const int c = task - r * nch;
    const int k = active ? c * 128 + lane * 4 : lane * 4;
    const PrepWeights wt(x, suh, k);
    uint2 pre_w = make_uint2(0u, 0u);
    if constexpr (PRE) pre_w = __ldg(reinterpret_cast<const uint2*>(pre.w + k));
    if constexpr (OPEN) open_prefetch(x, k, in);
    pdl_wait_primary();  // from here on: inputs the previous kernel writes, outputs it may read
    const int r_first = blockIdx.x * 8 / nch, r_last = min(rows * nch - 1, blockIdx.x * 8 + 7) / nch;
    half2 o0, o1;
    if constexpr (PRE) {
        const float2 inv = block_row_inv2(x, pre, r, r_first, r_last, in);
        if (!active) return;
        prep_lane_xh_pre(x, wt, pre_w, r, k, lane, o0, o1, inv, blockIdx.y == 0);
    } else {
        const float inv = x.norm_w ? block_row_inv<OPEN>(x, r, r_first, r_last, in) : 0.f;
        if (!active) return;
        prep_lane_xh<OPEN>(x, wt, r, k, lane, o0, o1, inv, blockIdx.y == 0);
    }
    const int i = k >> 4;
    const int kk0 = k & 15;  // even; this lane's 4 values are kk0 .. kk0+3 (within one k row)
    if (!scales) {
        const size_t fb = ((size_t)i * ng + (r >> 3)) * 32;
#pragma unroll
        for (int p = 0; p < 2; ++p) {
            const int kk = kk0 + 2 * p;
            const int fl = (r & 7) * 4 + ((kk & 7) >> 1);
            xb[(fb + fl) * 2 + (kk >> 3)] = as_u32(p ? o1 : o0);
        }
        return;
    }
    const float f[4] = {__low2float(o0), __high2float(o0), __low2float(o1), __high2float(o1)};
    store_i8_chunk(xb, scales, csum, r, c, nch, ng, lane, f);
}

cudaError_t prep_frag(const half* x, int ldx, const half* suh, uint32_t* xb, float2* scales,
                      float* csum, int rows, int in, int ng, int nseg, cudaStream_t stream,
                      const half* up, int ldu, int act, const PrepNorm& norm, const OpenSums& xo,
                      const OpenSums& uo) {
    if (in % 128 || rows < 1 || nseg < 1 || nseg > 4 || act < 0 || act > 2) return cudaErrorInvalidValue;
    const bool gated = up || uo.z;
    if (norm.w && (gated || (norm.residual && !norm.residual_out))) return cudaErrorInvalidValue;
    if ((xo.z && !xo.svh) || (uo.z && (!uo.svh || !xo.z))) return cudaErrorInvalidValue;
    if (norm.pre.w && (!norm.w || !norm.residual || xo.z)) return cudaErrorInvalidValue;
    if (prep_skip_flag()) return cudaSuccess;
    const long tasks = (long)rows * (in / 128);
    const dim3 grid((unsigned)((tasks + 7) / 8), (unsigned)nseg);
    const PrepInput pin = prep_input(x, xo.z ? in : ldx, up, ldu, act, norm, xo, uo);
    auto* kernel = norm.pre.w ? prep_frag_kernel<false, true> : xo.z ? prep_frag_kernel<true> : prep_frag_kernel<false>;
    return launch_glue(kernel, grid, dim3(256), stream, pin, suh, xb, scales, csum, rows, in, ng, norm.pre);
}

void set_mm_debug_variant(int variant) { mm_debug_variant() = variant; }
void set_pdl(bool enabled) { pdl_flag() = enabled; }
bool pdl_setting() { return pdl_flag(); }
void set_early_trigger(int mode) { early_trigger_flag() = mode >= 0 && mode <= 2 ? mode : 0; }
int early_trigger_setting() { return early_trigger_flag(); }
void set_prep_skip(bool enabled) { prep_skip_flag() = enabled; }
void set_self_prep(bool enabled) { self_prep_flag() = enabled; }
static bool& attn_merge_online_flag() {
    static bool online = true;
    return online;
}
void set_attn_merge_online(bool enabled) { attn_merge_online_flag() = enabled; }
bool attn_merge_online_setting() { return attn_merge_online_flag(); }
void set_gemv_split_finish(int mode) { gemv_split_finish() = mode >= 0 && mode <= 5 ? mode : 5; }
void set_finish_early_reads(bool enabled) { finish_early_reads() = enabled; }
int gemv_split_finish_setting() { return gemv_split_finish(); }
void set_gemv_sa_grid(int rule) { gemv_sa_grid() = rule == 0 ? 0 : 1; }
void set_gemv_shared_acts(int mode) { gemv_shared_acts() = mode >= 0 && mode <= 2 ? mode : 1; }
void set_gemv_finish_rows(int rows) { gemv_finish_rows() = rows == 1 ? 1 : 8; }

// f(std::integral_constant<int, K>{}) for a K of 1..8 known only at run time; `none` for any other.
template <typename R, typename F>
static R with_k(int K, R none, F&& f) {
    switch (K) {
        case 1: return f(std::integral_constant<int, 1>{});
        case 2: return f(std::integral_constant<int, 2>{});
        case 3: return f(std::integral_constant<int, 3>{});
        case 4: return f(std::integral_constant<int, 4>{});
        case 5: return f(std::integral_constant<int, 5>{});
        case 6: return f(std::integral_constant<int, 6>{});
        case 7: return f(std::integral_constant<int, 7>{});
        case 8: return f(std::integral_constant<int, 8>{});
        default: return none;
    }
}

// gv_pick for a K, path and group count known only at run time (the host's checks below, and the
// binding that shows the tests what a product would take on another GPU).
template <int K>
static GvPick gemv_pick_k(int path, int ng, bool sp, bool ch, int in, int out, int num_sms, const SmemLimits& lim) {
    if (path == GV_I8) {
        if (ng == 2) return gv_pick<K, GV_I8, 2, false>(in, out, num_sms, false, lim);
        if (sp) return gv_pick<K, GV_I8, 1, true>(in, out, num_sms, false, lim);
        if (ch) return gv_pick<K, GV_I8, 1, false, true>(in, out, num_sms, false, lim);
        return gv_pick<K, GV_I8, 1, false>(in, out, num_sms, false, lim);
    }
    if (ng == 4) return gv_pick<K, GV_F16, 4, false>(in, out, num_sms, false, lim);
    if (ng == 2) return gv_pick<K, GV_F16, 2, false>(in, out, num_sms, false, lim);
    return gv_pick<K, GV_F16, 1, false>(in, out, num_sms, false, lim);
}
static GvPick gemv_pick(int K, int path, int ng, bool sp, bool ch, int in, int out, int num_sms,
                        const SmemLimits& lim) {
    return with_k(K, GvPick{0, 0, 0}, [&](auto k) {
        return gemv_pick_k<decltype(k)::value>(path, ng, sp, ch, in, out, num_sms, lim);
    });
}
int gemv_plan(int K, bool int8, int rows, bool self_prep, bool chain, int in, int out, int num_sms, int per_block,
               int per_sm, int reserved, int& cfg, int& smem_bytes) {
    const SmemLimits lim = per_block > 0 ? SmemLimits{per_block, per_sm, reserved} : device_smem_limits();
    const GvPick p = gemv_pick(K, int8 ? GV_I8 : GV_F16, gemv_groups(rows, int8), int8 && self_prep, int8 && chain,
                               in, out, num_sms, lim);
    cfg = p.cfg;
    smem_bytes = p.smem_bytes;
    return p.blocks_per_sm;
}
int gemv_sa_plan(int K, int rows, int in, int out, int num_sms, int& slices, int& slice_rows) {
    if (K < 1 || K > 8) return 0;
    MmArgs a;
    a.m = rows, a.in = in, a.out = out, a.K = K, a.num_sms = num_sms;
    const int ng = rows <= 8 ? 1 : rows <= 16 ? 2 : 4;
    const SaGrid g = with_k(K, SaGrid{}, [&](auto k) {
        constexpr int kK = decltype(k)::value;
        return ng == 1 ? sa_grid<kK, 1>(a) : ng == 2 ? sa_grid<kK, 2>(a) : sa_grid<kK, 4>(a);
    });
    slices = g.nsl;
    slice_rows = g.ks;
    return g.nsl * g.seg_blocks[0];
}
static GvPick gv_pick_one_row(const MmArgs& a, bool sp) {
    return gemv_pick(a.K, GV_I8, 1, sp, !sp, a.in, a.out, a.num_sms, device_smem_limits());
}

// The most units a warp of a one-group version-3 product takes in configuration `cfg` (8 tiles
// per unit), and the k rows per unit, kr.
static long gv_most_units(const MmArgs& a, int cfg, int& kr) {
    kr = gv_tune(cfg).kr;
    const long units = (long)(a.out / 128) * (a.in / 16 / kr);
    const long warps = gv_blocks(units, gv_tune(cfg).minb, a.num_sms) * 8;
    return (units + warps - 1) / warps;
}

bool gemv_chain_fits(const MmArgs& a) {
    // Debug variants other than the decode forms that keep the shipped schedule (8, 21, 22: the
    // chain then runs as their plain product and the finish kernel) have no chain output.
    const int v = mm_debug_variant();
    if ((v != 0 && !gv_shipped_schedule(v)) || a.version != 3 || a.m < 1 || a.in % 128 || a.out % 128) return false;
    // 2..4 rows: only through the finish kernel (gemv_split_finish 5), which has no limit of its own
    if (a.m > 1) return a.m <= 4 && gemv_split_finish() >= 5 && a.out / 128 <= 0xffff;
    const GvPick pick = gv_pick_one_row(a, false);
    if (pick.blocks_per_sm == 0) return false;
    // The warp with the most units spans at most (units - 1) / rows_kr + 2 column groups (the
    // kernel records up to four finished blocks for their chain output).
    int kr;
    const long most = gv_most_units(a, pick.cfg, kr);
    const long rows_kr = a.in / 16 / kr;
    return (most - 1) / rows_kr + 2 <= 4 && a.out / 128 <= 0xffff;
}

bool gemv_self_prep(const MmArgs& a) {
    if (!self_prep_flag() || mm_debug_variant() != 0 || a.version != 3 || a.m != 1 || a.codebook != CB_MUL1 ||
        a.in % 128 || a.out % 128)
        return false;
    // Where shared memory is short, self prep at K >= 7 has no configuration that fits two blocks
    // per SM (its chunk slots take 24 KB of a block): the product then takes a prep kernel.
    const GvPick pick = gv_pick_one_row(a, true);
    if (pick.blocks_per_sm < 2) return false;
    // The warp with the most units: its k rows (possibly across one column group's end) touch at
    // most (rows - 1) / 8 + 2 chunks (chunks and groups both start at multiples of 8 rows).
    int kr;
    const long rows = gv_most_units(a, pick.cfg, kr) * kr;
    return (rows - 1) / 8 + 2 <= kSpSlots;
}
bool debug_variant_in_build(int variant) { return debug_variant_built(variant); }
void set_gemv_compact(int mode) { gemv_compact() = mode >= 0 && mode <= 3 ? mode : kGvCompactTwoBlocks; }
void set_gemv_min_units(int units) { gemv_min_units() = units > 0 ? units : 1; }
void set_gemv_grid_fill(int mode) { gemv_grid_fill() = mode >= 0 && mode <= 2 ? mode : 1; }
void set_gemv_two_row_units(int units) { gemv_two_row_units() = units > 0 ? units : 1; }
void set_gemv_four_row_units(int units) { gemv_four_row_units() = units > 0 ? units : 0; }
void set_gemv_lean_units(int units) { gemv_lean_units() = units > 0 ? units : 0; }
void set_gemv_lean_groups(int groups) { gemv_lean_groups() = groups < 1 ? 1 : groups; }

// ---------------------------------------------------------------------------------------------
// 128-point Hadamard: a warp per kHadTasks (row, 128-wide block) tasks, 4 values per lane, all
// of its tasks loaded before it transforms any (one task per warp kept one 8-byte load per lane
// in flight). It serves fp32 input (a product's workspace) and rows the tile kernels below cannot
// take; those replaced it at prefill, where it moved ~1.6 TB/s (csrc/PERF_NOTES.md, session 17).

constexpr int kHadTasks = 4;

// A lane's 4 transformed values as the kernel writes them: fp16(v / sqrt(128)), times post,
// plus bias (each an fp16 operation).
__device__ __forceinline__ uint2 had_out4(const float v[4], const half* post, const half* bias, int k) {
    half2 o0 = __floats2half2_rn(v[0] * kHadNorm, v[1] * kHadNorm);
    half2 o1 = __floats2half2_rn(v[2] * kHadNorm, v[3] * kHadNorm);
    if (post) {
        const uint2 sv = *reinterpret_cast<const uint2*>(post + k);
        o0 = __hmul2(o0, as_h2(sv.x));
        o1 = __hmul2(o1, as_h2(sv.y));
    }
    if (bias) {
        const uint2 bv = *reinterpret_cast<const uint2*>(bias + k);
        o0 = __hadd2(o0, as_h2(bv.x));
        o1 = __hadd2(o1, as_h2(bv.y));
    }
    return make_uint2(as_u32(o0), as_u32(o1));
}

// Where a task's 4 values per lane come from: a row of `in` (fp16, optionally times pre, or
// fp32, optionally zeroed behind the read) ...
template <typename Tin>
struct HadRows {
    Tin* in;
    int ld;
    const half* pre;
    bool zero_input;
    __device__ __forceinline__ void load(int r, int k, int, float v[4]) const {
        Tin* src = in + (size_t)r * ld + k;
        if constexpr (sizeof(Tin) == 4) {
            const float4 f = *reinterpret_cast<const float4*>(src);
            v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
            if (zero_input) *reinterpret_cast<float4*>(src) = make_float4(0.f, 0.f, 0.f, 0.f);
        } else {
            const uint2 hv = *reinterpret_cast<const uint2*>(src);
            to_float4(hv, pre, k, v);
        }
    }
    static __device__ __forceinline__ void to_float4(uint2 hv, const half* pre, int k, float v[4]) {
        half2 p0 = as_h2(hv.x), p1 = as_h2(hv.y);
        if (pre) {
            const uint2 sv = *reinterpret_cast<const uint2*>(pre + k);
            p0 = __hmul2(p0, as_h2(sv.x));
            p1 = __hmul2(p1, as_h2(sv.y));
        }
        v[0] = __low2float(p0), v[1] = __high2float(p0);
        v[2] = __low2float(p1), v[3] = __high2float(p1);
    }
};

// ... or act(gate) * up (gated4: gated_act_kernel's rounding), times pre: a gated MLP's down
// projection input at prefill in one pass instead of gated_act and then had128.
struct HadGated {
    const half* gate;
    int ld_gate;
    const half* up;
    int ld_up;
    int act;
    const half* pre;
    // open: gate and up are the gate/up product's sums before its output transform (had128,
    // svh, bias), which this applies first, rounded as had128_kernel's output: the MLP's whole
    // gate/up -> down hand-off at prefill is then one read of the sums and one write.
    const half *svh_gate = nullptr, *svh_up = nullptr, *bias_gate = nullptr, *bias_up = nullptr;
    __device__ __forceinline__ void load(int r, int k, int lane, float v[4]) const {
        uint2 g = *reinterpret_cast<const uint2*>(gate + (size_t)r * ld_gate + k);
        uint2 u = *reinterpret_cast<const uint2*>(up + (size_t)r * ld_up + k);
        if (svh_gate) {
            g = finished(g, svh_gate, bias_gate, k, lane);
            u = finished(u, svh_up, bias_up, k, lane);
        }
        HadRows<const half>::to_float4(gated4(g, u, act), pre, k, v);
    }
    static __device__ __forceinline__ uint2 finished(uint2 zv, const half* post, const half* bias, int k, int lane) {
        float f[4];
        HadRows<const half>::to_float4(zv, nullptr, k, f);
        wht128_lane4(f, lane);
        return had_out4(f, post, bias, k);
    }
};

template <typename Src>
__global__ void had128_kernel(const Src src, half* out, int ld_out, const half* post, const half* bias, int rows,
                              int n) {
    const int lane = threadIdx.x & 31;
    const long task0 = ((long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * kHadTasks;
    const int blocks_per_row = n >> 7;
    const long tasks = (long)rows * blocks_per_row;
    float v[kHadTasks][4];
    int rs[kHadTasks], ks[kHadTasks];
#pragma unroll
    for (int j = 0; j < kHadTasks; ++j) {
        const long task = task0 + j;
        rs[j] = (int)(task / blocks_per_row);
        ks[j] = (int)(task - (long)rs[j] * blocks_per_row) * 128 + lane * 4;
        if (task < tasks) src.load(rs[j], ks[j], lane, v[j]);
    }
#pragma unroll
    for (int j = 0; j < kHadTasks; ++j) {
        if (task0 + j >= tasks) break;
        wht128_lane4(v[j], lane);
        *reinterpret_cast<uint2*>(out + (size_t)rs[j] * ld_out + ks[j]) = had_out4(v[j], post, bias, ks[j]);
    }
}

static unsigned had_blocks(int rows, int n) {
    const long warps = ((long)rows * (n / 128) + kHadTasks - 1) / kHadTasks;
    return (unsigned)((warps + 7) / 8);
}

// ---------------------------------------------------------------------------------------------
// The same Hadamard over fp16 rows in tiles (prefill): a block stages 64 rows x one 128-column
// block in shared memory with 16-byte loads, then 4 threads take a row, 32 values each, so 5 of
// the 7 butterfly stages run in registers and 2 cross threads: 8 shuffles per row block against
// the warp kernel's 20. That one moved ~1.6 TB/s in an 8,192-token prefill, and by count its
// shuffles alone took about as long as its memory traffic (csrc/PERF_NOTES.md, session 17). The
// stages pair the same elements in the same order as
// wht128_lane4 (x + y to the lower, x - y to the upper, bits 0 to 6), so the bits are the same.

constexpr int kHtRows = 64;     // rows per tile (256 threads, 4 per row)
constexpr int kHtStride = 136;  // halfs per staged row: 16 bytes of padding against bank conflicts

struct HtTile {
    half v[kHtRows][kHtStride];
};

// f(r, j) for every 16-byte chunk (tile row r, columns j .. j + 7) of a tile whose row r0 + r is
// below `rows`, spread over the block's threads: the one walk the staging copies share.
template <typename F>
__device__ __forceinline__ void ht_chunks(int r0, int rows, F&& f) {
    for (int c = threadIdx.x; c < kHtRows * 16; c += blockDim.x) {
        const int r = c >> 4, j = (c & 15) * 8;
        if (r0 + r < rows) f(r, j);
    }
}

// Rows [r0, r0 + 64) (those below `rows`) x columns [c0, c0 + 128) of src into the tile.
__device__ __forceinline__ void ht_stage(HtTile& t, const half* src, int ld, int r0, int c0, int rows) {
    ht_chunks(r0, rows, [&](int r, int j) {
        *reinterpret_cast<uint4*>(&t.v[r][j]) = *reinterpret_cast<const uint4*>(src + (size_t)(r0 + r) * ld + c0 + j);
    });
}

// The tile back out to rows [r0, r0 + 64) x columns [c0, c0 + 128) of dst.
__device__ __forceinline__ void ht_unstage(const HtTile& t, half* dst, int ld, int r0, int c0, int rows) {
    ht_chunks(r0, rows, [&](int r, int j) {
        *reinterpret_cast<uint4*>(dst + (size_t)(r0 + r) * ld + c0 + j) = *reinterpret_cast<const uint4*>(&t.v[r][j]);
    });
}

// A thread's 16 pairs of its row (columns 32 q .. 32 q + 31 of the block).
__device__ __forceinline__ void ht_pairs(const HtTile& t, int r, int q, half2 h[16]) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const uint4 w = *reinterpret_cast<const uint4*>(&t.v[r][32 * q + 8 * j]);
        h[4 * j] = as_h2(w.x), h[4 * j + 1] = as_h2(w.y), h[4 * j + 2] = as_h2(w.z), h[4 * j + 3] = as_h2(w.w);
    }
}

__device__ __forceinline__ void ht_put_pairs(HtTile& t, int r, int q, const half2 h[16]) {
#pragma unroll
    for (int j = 0; j < 4; ++j)
        *reinterpret_cast<uint4*>(&t.v[r][32 * q + 8 * j]) =
            make_uint4(as_u32(h[4 * j]), as_u32(h[4 * j + 1]), as_u32(h[4 * j + 2]), as_u32(h[4 * j + 3]));
}

// fp16 pairs (times pre, an fp16 multiply, where given: pre points at this thread's 32 columns)
// -> the unnormalized transform of the row's 128 values, this thread's 32.
__device__ __forceinline__ void ht_transform(const half2 h[16], const half* pre, float v[32]) {
#pragma unroll
    for (int j = 0; j < 8; ++j)
        HadRows<const half>::to_float4(make_uint2(as_u32(h[2 * j]), as_u32(h[2 * j + 1])), pre, 4 * j, v + 4 * j);
#pragma unroll
    for (int s = 1; s < 32; s <<= 1) {
#pragma unroll
        for (int i = 0; i < 32; ++i) {
            if (!(i & s)) {
                const float x = v[i], y = v[i + s];
                v[i] = x + y;
                v[i + s] = x - y;
            }
        }
    }
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int s = 1; s < 4; s <<= 1) {
        // upper ? p - v : v + p as one FFMA (p + sign * v, exact but for its one rounding, so the
        // same bits): the select form compiled to an FSEL and an FADD per value.
        const float sign = lane & s ? -1.f : 1.f;
#pragma unroll
        for (int i = 0; i < 32; ++i) v[i] = fmaf(sign, v[i], __shfl_xor_sync(0xffffffffu, v[i], s));
    }
}

// had_out4 for the thread's 32 values (post and bias at its columns).
__device__ __forceinline__ void ht_out(const float v[32], const half* post, const half* bias, half2 h[16]) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const uint2 o = had_out4(v + 4 * j, post, bias, 4 * j);
        h[2 * j] = as_h2(o.x), h[2 * j + 1] = as_h2(o.y);
    }
}

__device__ __forceinline__ const half* ht_at(const half* vec, int k) { return vec ? vec + k : nullptr; }

// One staged tile's transform (rows r0.., columns c0..): each thread's row quarter from the tile,
// back into its own slots, then the tile out.
__device__ __forceinline__ void had128_tile_work(HtTile& t, int r0, int c0, const half* pre, half* out, int ld_out,
                                                 const half* post, const half* bias, int rows) {
    const int r = threadIdx.x >> 2, q = threadIdx.x & 3, k = c0 + 32 * q;
    half2 h[16];
    float v[32];
    ht_pairs(t, r, q, h);
    ht_transform(h, ht_at(pre, k), v);
    ht_out(v, ht_at(post, k), ht_at(bias, k), h);
    ht_put_pairs(t, r, q, h);  // only this thread's own slots: no barrier before
    __syncthreads();
    ht_unstage(t, out, ld_out, r0, c0, rows);
}

__global__ void __launch_bounds__(256) had128_tile_kernel(const half* __restrict__ in, int ld_in, const half* pre,
                                                          half* __restrict__ out, int ld_out, const half* post,
                                                          const half* bias, int rows) {
    __shared__ __align__(16) HtTile t;
    const int r0 = blockIdx.x * kHtRows, c0 = blockIdx.y * 128;
    ht_stage(t, in, ld_in, r0, c0, rows);
    __syncthreads();
    had128_tile_work(t, r0, c0, pre, out, ld_out, post, bias, rows);
}

// ---------------------------------------------------------------------------------------------
// The tile kernels with the next tile's loads in flight (the plain and the gated transform). A
// block of the one-tile kernels loads, waits, computes and stores in turn; ncu (session 18) found
// them neither at the DRAM's bandwidth (27-45% of it) nor at the issue limit (46-70%), waiting on
// their loads with no other work in flight. Here a resident block loops over tiles (grid = what
// fits at once) with two buffers: it stages the next tile by cp.async while it transforms the
// current one. The work per tile is the same function, so the bits are the same. Measured in a
// 4,096-token prefill (session 18, one process): the plain transform 27.9 us a call against 33.2,
// the gated one 220.4 against 235.8. The normed transform looped the same way took 59.9 us against
// 59.0 (its loop needs 80 registers, 3 blocks per SM), so it keeps a block per tile.

// ht_stage by cp.async (no commit).
__device__ __forceinline__ void ht_stage_async(HtTile& t, const half* src, int ld, int r0, int c0, int rows) {
    ht_chunks(r0, rows, [&](int r, int j) { cp_async16(&t.v[r][j], src + (size_t)(r0 + r) * ld + c0 + j); });
}

// work(tiles, r0, c0) for every tile position of the [rows, n] sources this block takes (b,
// b + grid, ...; rows fastest), each position's NSRC tiles staged while the previous position is
// worked on. buf: 2 x NSRC tiles, stage s's tiles at buf + s * NSRC.
template <int NSRC, typename Work>
__device__ __forceinline__ void ht_tile_loop(HtTile* buf, const half* const (&src)[NSRC], const int (&ld)[NSRC],
                                             int rows, int n, Work&& work) {
    const int row_tiles = (rows + kHtRows - 1) / kHtRows, tiles = row_tiles * (n / 128);
    auto stage = [&](int tile, HtTile* to) {
#pragma unroll
        for (int j = 0; j < NSRC; ++j)
            ht_stage_async(to[j], src[j], ld[j], (tile % row_tiles) * kHtRows, (tile / row_tiles) * 128, rows);
        cp_async_commit();
    };
    int tile = blockIdx.x;
    if (tile >= tiles) return;
    stage(tile, buf);
    for (int i = 0; tile < tiles; ++i, tile += gridDim.x) {
        const int next = tile + gridDim.x;
        __syncthreads();  // every thread is done with the buffers the next tiles go into
        if (next < tiles) {
            stage(next, buf + ((i + 1) & 1) * NSRC);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();  // this position's tiles are in
        work(buf + (i & 1) * NSRC, (tile % row_tiles) * kHtRows, (tile / row_tiles) * 128);
    }
}

__global__ void __launch_bounds__(256) had128_tile_loop_kernel(const half* __restrict__ in, int ld_in, const half* pre,
                                                               half* __restrict__ out, int ld_out, const half* post,
                                                               const half* bias, int rows, int n) {
    __shared__ __align__(16) HtTile buf[2];
    const half* src[1] = {in};
    const int ld[1] = {ld_in};
    ht_tile_loop<1>(buf, src, ld, rows, n, [&](HtTile* t, int r0, int c0) {
        had128_tile_work(*t, r0, c0, pre, out, ld_out, post, bias, rows);
    });
}

// Whether fp16 Hadamards (prefill) run in 64-row tiles where aligned (set_had_tiles; on by
// default), and whether the plain and gated tile transforms then loop with their next loads in
// flight (set_had_pipeline; on by default).
static bool& had_tiles_flag() {
    static bool v = true;
    return v;
}
static bool& had_pipeline_flag() {
    static bool v = true;
    return v;
}

// Blocks of a looping tile kernel: as many as are resident at once, at most one per tile (any
// count is correct: the loop takes whatever tiles the grid leaves). per_sm: the caller's cache of
// the kernel's resident blocks per SM (0: not asked yet).
template <typename Kernel>
static unsigned ht_loop_blocks(Kernel kernel, int rows, int n, size_t smem, int& per_sm) {
    if (!per_sm && cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, 256, smem) != cudaSuccess) per_sm = 1;
    const long tiles = (long)((rows + kHtRows - 1) / kHtRows) * (n / 128);
    const long resident = (long)(per_sm > 0 ? per_sm : 1) * current_device_attr<cudaDevAttrMultiProcessorCount>();
    return (unsigned)(tiles < resident ? tiles : resident);
}

// gated_had128's work on one staged tile pair; OPEN: gate and up are sums before gate/up's output
// transform. The result goes back into tg's thread-own slots and out from there.
template <bool OPEN>
__device__ __forceinline__ void gated_had128_tile_work(HtTile& tg, const HtTile& tu, int r0, int c0, int act,
                                                       const half* pre, half* out, int ld_out, int rows,
                                                       const half* svh_gate, const half* svh_up,
                                                       const half* bias_gate, const half* bias_up) {
    const int r = threadIdx.x >> 2, q = threadIdx.x & 3, k = c0 + 32 * q;
    half2 g[16], u[16];
    ht_pairs(tg, r, q, g);
    ht_pairs(tu, r, q, u);
    float v[32];
    if constexpr (OPEN) {
        ht_transform(g, nullptr, v);
        ht_out(v, svh_gate + k, ht_at(bias_gate, k), g);
        ht_transform(u, nullptr, v);
        ht_out(v, svh_up + k, ht_at(bias_up, k), u);
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const uint2 h = gated4(make_uint2(as_u32(g[2 * j]), as_u32(g[2 * j + 1])),
                               make_uint2(as_u32(u[2 * j]), as_u32(u[2 * j + 1])), act);
        g[2 * j] = as_h2(h.x), g[2 * j + 1] = as_h2(h.y);
    }
    ht_transform(g, pre + k, v);
    ht_out(v, nullptr, nullptr, g);
    ht_put_pairs(tg, r, q, g);
    __syncthreads();
    ht_unstage(tg, out, ld_out, r0, c0, rows);
}

template <bool OPEN>
__global__ void __launch_bounds__(256) gated_had128_tile_kernel(const half* __restrict__ gate, int ld_gate,
                                                                const half* __restrict__ up, int ld_up, int act,
                                                                const half* pre, half* __restrict__ out, int ld_out,
                                                                int rows, const half* svh_gate, const half* svh_up,
                                                                const half* bias_gate, const half* bias_up) {
    __shared__ __align__(16) HtTile tg, tu;
    const int r0 = blockIdx.x * kHtRows, c0 = blockIdx.y * 128;
    ht_stage(tg, gate, ld_gate, r0, c0, rows);
    ht_stage(tu, up, ld_up, r0, c0, rows);
    __syncthreads();
    gated_had128_tile_work<OPEN>(tg, tu, r0, c0, act, pre, out, ld_out, rows, svh_gate, svh_up, bias_gate, bias_up);
}

// The same with the next tile pair's loads in flight (ht_tile_loop); 4 tiles of shared memory, so
// dynamic (69.6 KB).
template <bool OPEN>
__global__ void __launch_bounds__(256) gated_had128_tile_loop_kernel(const half* __restrict__ gate, int ld_gate,
                                                                     const half* __restrict__ up, int ld_up, int act,
                                                                     const half* pre, half* __restrict__ out,
                                                                     int ld_out, int rows, int n,
                                                                     const half* svh_gate, const half* svh_up,
                                                                     const half* bias_gate, const half* bias_up) {
    extern __shared__ __align__(16) HtTile gbuf[];
    const half* src[2] = {gate, up};
    const int ld[2] = {ld_gate, ld_up};
    ht_tile_loop<2>(gbuf, src, ld, rows, n, [&](HtTile* t, int r0, int c0) {
        gated_had128_tile_work<OPEN>(t[0], t[1], r0, c0, act, pre, out, ld_out, rows, svh_gate, svh_up, bias_gate,
                                     bias_up);
    });
}

// Whether the tile kernels take these: tiles on (set_had_tiles), every row start and vector
// 16-byte aligned.
static bool ht_aligned(std::initializer_list<const half*> ptrs, std::initializer_list<int> lds) {
    for (const half* p : ptrs)
        if (reinterpret_cast<uintptr_t>(p) % 16) return false;
    for (int ld : lds)
        if (ld % 8) return false;
    return had_tiles_flag();
}

static dim3 ht_grid(int rows, int n) { return dim3((unsigned)((rows + kHtRows - 1) / kHtRows), (unsigned)(n / 128)); }

void set_had_tiles(bool enabled) { had_tiles_flag() = enabled; }
void set_had_pipeline(bool enabled) { had_pipeline_flag() = enabled; }

cudaError_t had128_f32(float* in, int ld_in, half* out, int ld_out, const half* post,
                       const half* bias, int rows, int n, bool zero_input, cudaStream_t stream) {
    if (n % 128 || rows < 1) return cudaErrorInvalidValue;
    had128_kernel<<<had_blocks(rows, n), 256, 0, stream>>>(HadRows<float>{in, ld_in, nullptr, zero_input}, out,
                                                           ld_out, post, bias, rows, n);
    return cudaGetLastError();
}

cudaError_t had128_f16(const half* in, int ld_in, half* out, int ld_out, const half* pre,
                       const half* post, const half* bias, int rows, int n, cudaStream_t stream) {
    if (n % 128 || rows < 1) return cudaErrorInvalidValue;
    if (ht_aligned({in, out, pre, post, bias}, {ld_in, ld_out})) {
        if (had_pipeline_flag()) {
            static int per_sm = 0;
            had128_tile_loop_kernel<<<ht_loop_blocks(had128_tile_loop_kernel, rows, n, 0, per_sm), 256, 0, stream>>>(
                in, ld_in, pre, out, ld_out, post, bias, rows, n);
        } else {
            had128_tile_kernel<<<ht_grid(rows, n), 256, 0, stream>>>(in, ld_in, pre, out, ld_out, post, bias, rows);
        }
        return cudaGetLastError();
    }
    had128_kernel<<<had_blocks(rows, n), 256, 0, stream>>>(HadRows<const half>{in, ld_in, pre, false}, out, ld_out,
                                                           post, bias, rows, n);
    return cudaGetLastError();
}

cudaError_t gated_had128(const half* gate, int ld_gate, const half* up, int ld_up, int act, const half* pre,
                         half* out, int ld_out, int rows, int n, const half* svh_gate, const half* svh_up,
                         const half* bias_gate, const half* bias_up, cudaStream_t stream) {
    if (n % 128 || rows < 1 || act < 0 || act > 2 || !svh_gate != !svh_up) return cudaErrorInvalidValue;
    if (ht_aligned({gate, up, pre, out, svh_gate, svh_up, bias_gate, bias_up}, {ld_gate, ld_up, ld_out})) {
        if (had_pipeline_flag()) {
            auto* kernel = svh_gate ? gated_had128_tile_loop_kernel<true> : gated_had128_tile_loop_kernel<false>;
            constexpr size_t smem = 4 * sizeof(HtTile);
            const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
            if (e != cudaSuccess) return e;
            static int per_sm[2] = {0, 0};
            kernel<<<ht_loop_blocks(kernel, rows, n, smem, per_sm[svh_gate != nullptr]), 256, smem, stream>>>(
                gate, ld_gate, up, ld_up, act, pre, out, ld_out, rows, n, svh_gate, svh_up, bias_gate, bias_up);
            return cudaGetLastError();
        }
        auto* kernel = svh_gate ? gated_had128_tile_kernel<true> : gated_had128_tile_kernel<false>;
        kernel<<<ht_grid(rows, n), 256, 0, stream>>>(gate, ld_gate, up, ld_up, act, pre, out, ld_out, rows, svh_gate,
                                                     svh_up, bias_gate, bias_up);
        return cudaGetLastError();
    }
    const HadGated src{gate, ld_gate, up, ld_up, act, pre, svh_gate, svh_up, bias_gate, bias_up};
    had128_kernel<<<had_blocks(rows, n), 256, 0, stream>>>(src, out, ld_out, nullptr, nullptr, rows, n);
    return cudaGetLastError();
}

// ---------------------------------------------------------------------------------------------
// Dense reconstruct: block = 8 warps over tiles (i, 8 adjacent j); each warp decodes one tile
// into a shared 16 x 128 strip, which the block writes out with 16-byte row stores.

template <int K, int CB>
__global__ void __launch_bounds__(256) reconstruct_kernel(const uint32_t* __restrict__ trellis,
                                                          half* __restrict__ out, int n_out) {
    __shared__ half strip[16][128 + 8];
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int tn = n_out >> 4;
    const int i = blockIdx.y;
    const int j = blockIdx.x * 8 + warp;
    const uint32_t* words = trellis + ((size_t)i * tn + j) * (8 * K);
    int wa, shift;
    lane_window<K>(lane, wa, shift);
    uint32_t v[4];
    decode_lane<K, CB>(__ldg(words + wa), __ldg(words + wrap_word<K>(wa + 1)),
                       __ldg(words + wrap_word<K>(wa + 2)), shift, v);
    // Spec 3.4: lane t, slot jj -> (row r0 + {0,1,8,9}, col c0 or c0 + 8).
    const int r0 = (lane & 3) * 2;
    const int c0 = warp * 16 + (lane >> 2);
    strip[r0][c0] = __low2half(as_h2(v[0]));
    strip[r0 + 1][c0] = __high2half(as_h2(v[0]));
    strip[r0 + 8][c0] = __low2half(as_h2(v[1]));
    strip[r0 + 9][c0] = __high2half(as_h2(v[1]));
    strip[r0][c0 + 8] = __low2half(as_h2(v[2]));
    strip[r0 + 1][c0 + 8] = __high2half(as_h2(v[2]));
    strip[r0 + 8][c0 + 8] = __low2half(as_h2(v[3]));
    strip[r0 + 9][c0 + 8] = __high2half(as_h2(v[3]));
    __syncthreads();
    const int row = threadIdx.x >> 4;
    const int chunk = threadIdx.x & 15;
    *reinterpret_cast<uint4*>(out + (size_t)(i * 16 + row) * n_out + blockIdx.x * 128 + chunk * 8) =
        *reinterpret_cast<const uint4*>(&strip[row][chunk * 8]);
}

template <int K>
static cudaError_t reconstruct_k(const uint32_t* trellis, half* out, int in, int n_out, int cb,
                                 cudaStream_t stream) {
    dim3 grid(n_out / 128, in / 16);
    switch (cb) {
        case CB_3INST: reconstruct_kernel<K, CB_3INST><<<grid, 256, 0, stream>>>(trellis, out, n_out); break;
        case CB_MCG: reconstruct_kernel<K, CB_MCG><<<grid, 256, 0, stream>>>(trellis, out, n_out); break;
        case CB_MUL1: reconstruct_kernel<K, CB_MUL1><<<grid, 256, 0, stream>>>(trellis, out, n_out); break;
        default: return cudaErrorInvalidValue;
    }
    return cudaGetLastError();
}

cudaError_t exl3_reconstruct(const uint32_t* trellis, half* out, int in, int n_out, int K,
                             int codebook, cudaStream_t stream) {
    if (in % 16 || n_out % 128) return cudaErrorInvalidValue;
    return with_k(K, cudaErrorInvalidValue, [&](auto k) {
        return reconstruct_k<decltype(k)::value>(trellis, out, in, n_out, codebook, stream);
    });
}

// ---------------------------------------------------------------------------------------------
// RMSNorm (+ residual add). One block per row.

// The row's x + residual (stored to residual_out where given) and 1 / rms. rms_norm_kernel and
// rms_inv_kernel both take it from here, one block per row of the same size, so norm_had128's
// rows are scaled by the same inv, to the bit, as rms_norm's.
__device__ __forceinline__ float row_rms_inv(const half2* x2, const half2* r2, half2* ro2, int n, float eps,
                                             float* scratch) {
    const int n2 = n >> 1;
    float ss = 0.f;
    for (int q = threadIdx.x; q < n2; q += blockDim.x) {
        half2 v = x2[q];
        if (r2) {
            v = __hadd2(v, r2[q]);
            ro2[q] = v;
        }
        ss += pair_square_sum(__half22float2(v));
    }
    return rsqrtf(block_reduce(ss, scratch, [](float a, float b) { return a + b; }, 0.f) / n + eps);
}

__global__ void rms_norm_kernel(const half* __restrict__ x, const half* __restrict__ residual,
                                const half* __restrict__ w, half* __restrict__ y,
                                half* __restrict__ residual_out, int n, float eps) {
    pdl_launch_dependents();
    pdl_wait_primary();
    __shared__ float scratch[32];
    const size_t base = (size_t)blockIdx.x * n;
    const half2* x2 = reinterpret_cast<const half2*>(x + base);
    const half2* r2 = residual ? reinterpret_cast<const half2*>(residual + base) : nullptr;
    half2* ro2 = residual_out ? reinterpret_cast<half2*>(residual_out + base) : nullptr;
    const float inv = row_rms_inv(x2, r2, ro2, n, eps, scratch);
    const half2* src = r2 ? ro2 : x2;
    const half2* w2 = reinterpret_cast<const half2*>(w);
    half2* y2 = reinterpret_cast<half2*>(y + base);
    for (int q = threadIdx.x; q < (n >> 1); q += blockDim.x) {
        const float2 f = __half22float2(src[q]);
        y2[q] = __hmul2(w2[q], __floats2half2_rn(f.x * inv, f.y * inv));
    }
}

static int rms_norm_threads(int n) { return n >= 4096 ? 1024 : (n >= 1024 ? 512 : 128); }

// rms_norm's first half: the residual sum and each row's 1 / rms, for norm_had128_tile_kernel.
__global__ void rms_inv_kernel(const half* __restrict__ x, const half* __restrict__ residual,
                               half* __restrict__ residual_out, float* __restrict__ inv, int n, float eps) {
    pdl_launch_dependents();
    pdl_wait_primary();
    __shared__ float scratch[32];
    const size_t base = (size_t)blockIdx.x * n;
    const half2* r2 = residual ? reinterpret_cast<const half2*>(residual + base) : nullptr;
    half2* ro2 = residual_out ? reinterpret_cast<half2*>(residual_out + base) : nullptr;
    const float v = row_rms_inv(reinterpret_cast<const half2*>(x + base), r2, ro2, n, eps, scratch);
    if (threadIdx.x == 0) inv[blockIdx.x] = v;
}

// A grouped product's inputs at prefill: for each of nm members (q/k/v or gate/up, whose input
// signs differ), had128 of rms_norm(src) * w with that member's pre-scale, in 64-row tiles as
// had128_tile_kernel. Apart, the norm wrote its output and each member's transform read it again
// (the Llama-3.1-8B q/k/v: 10 row-sized passes against 7 here, counting the stats kernel's).
// The normed values are rms_norm_kernel's (its roundings, inv from row_rms_inv) and each
// member's transform is had128_tile_kernel's, so the bits are those of the passes it replaces.
__device__ __forceinline__ void norm_had128_tile_work(const HtTile& t, int r0, int c0, const float* inv, const half* w,
                                                      const half* pre, int nm, int n, half* out, int rows) {
    const int r = threadIdx.x >> 2, q = threadIdx.x & 3, k = c0 + 32 * q;
    const bool live = r0 + r < rows;  // the others compute too: ht_transform's shuffles need all lanes
    half2 h[16];
    ht_pairs(t, r, q, h);
    const float iv = live ? inv[r0 + r] : 0.f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const uint4 wv = *reinterpret_cast<const uint4*>(w + k + 8 * j);
        const uint32_t ws[4] = {wv.x, wv.y, wv.z, wv.w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const float2 f = __half22float2(h[4 * j + e]);
            h[4 * j + e] = __hmul2(as_h2(ws[e]), __floats2half2_rn(f.x * iv, f.y * iv));
        }
    }
    for (int i = 0; i < nm; ++i) {
        float v[32];
        half2 o[16];
        ht_transform(h, pre + (size_t)i * n + k, v);
        ht_out(v, nullptr, nullptr, o);
        if (live) {
            uint4* dst = reinterpret_cast<uint4*>(out + ((size_t)i * rows + r0 + r) * n + k);
#pragma unroll
            for (int j = 0; j < 4; ++j)
                dst[j] = make_uint4(as_u32(o[4 * j]), as_u32(o[4 * j + 1]), as_u32(o[4 * j + 2]), as_u32(o[4 * j + 3]));
        }
    }
}

__global__ void __launch_bounds__(256) norm_had128_tile_kernel(const half* __restrict__ src, int ld,
                                                               const float* __restrict__ inv, const half* w,
                                                               const half* pre, int nm, int n,
                                                               half* __restrict__ out, int rows) {
    __shared__ __align__(16) HtTile t;
    const int r0 = blockIdx.x * kHtRows, c0 = blockIdx.y * 128;
    ht_stage(t, src, ld, r0, c0, rows);
    __syncthreads();
    norm_had128_tile_work(t, r0, c0, inv, w, pre, nm, n, out, rows);
}

cudaError_t norm_had128(const half* x, const half* residual, half* residual_out, const half* w, float eps,
                        float* inv, const half* pre, int nm, half* out, int rows, int n, cudaStream_t stream) {
    if (n % 128 || rows < 1 || nm < 1 || (residual && !residual_out)) return cudaErrorInvalidValue;
    const half* src = residual ? residual_out : x;
    const size_t member = (size_t)rows * n;
    if (!ht_aligned({x, residual, residual_out, w, pre, out}, {n})) {
        // The passes apart (the warp Hadamard, or tiles off): the norm into the last member's slot,
        // the other members' transforms from it, then its own in place (each 128-block is read
        // before it is written, by the same warp or tile).
        half* normed = out + (nm - 1) * member;
        cudaError_t e = rms_norm(x, residual, w, normed, residual_out, rows, n, eps, stream);
        for (int i = 0; i < nm && e == cudaSuccess; ++i)
            e = had128_f16(normed, n, out + i * member, n, pre + (size_t)i * n, nullptr, nullptr, rows, n, stream);
        return e;
    }
    cudaError_t e = launch_glue(rms_inv_kernel, dim3(rows), dim3(rms_norm_threads(n)), stream, x, residual,
                                residual_out, inv, n, eps);
    if (e != cudaSuccess) return e;
    norm_had128_tile_kernel<<<ht_grid(rows, n), 256, 0, stream>>>(src, n, inv, w, pre, nm, n, out, rows);
    return cudaGetLastError();
}

cudaError_t rms_norm(const half* x, const half* residual, const half* w, half* y,
                     half* residual_out, int rows, int n, float eps, cudaStream_t stream) {
    if (n % 2 || rows < 1 || (residual && !residual_out)) return cudaErrorInvalidValue;
    return launch_glue(rms_norm_kernel, dim3(rows), dim3(rms_norm_threads(n)), stream, x, residual, w, y, residual_out,
                       n, eps);
}

// ---------------------------------------------------------------------------------------------
// Gated activation: y = fp16(act(gate)) * up, as the PyTorch fp16 modules round.

__global__ void gated_act_kernel(const half* __restrict__ gate, const half* __restrict__ up,
                                 half* __restrict__ y, int rows, int n, int ld_gate, int ld_up,
                                 int act) {
    pdl_launch_dependents();
    pdl_wait_primary();
    const long total = (long)rows * n;
    for (long idx = (long)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (long)gridDim.x * blockDim.x) {
        const int r = (int)(idx / n);
        const int c = (int)(idx - (long)r * n);
        y[idx] = gated_value(gate[(size_t)r * ld_gate + c], up[(size_t)r * ld_up + c], act);
    }
}

cudaError_t gated_act(const half* gate, const half* up, half* y, int rows, int n, int ld_gate,
                      int ld_up, int act, cudaStream_t stream) {
    if (rows < 1 || n < 1 || act < 0 || act > 2) return cudaErrorInvalidValue;
    const long total = (long)rows * n;
    const long blocks = (total + 255) / 256;
    return launch_glue(gated_act_kernel, dim3((unsigned)(blocks < 65535 * 8 ? blocks : 65535 * 8)), dim3(256),
                       stream, gate, up, y, rows, n, ld_gate, ld_up, act);
}

// ---------------------------------------------------------------------------------------------
// RoPE, rotate-half convention, on q and k in one launch and in place. Blocks (token, slice);
// each thread rotates one pair (i, i + d/2) of some head. Rounds like the PyTorch fp16 ops it
// replaces (x*cos and rot(x)*sin each rounded, then their sum), so both paths give the same bits.

// W: pairs per thread. 2 (half2 loads and stores) wherever every row and head starts 4-byte
// aligned: one pair per thread moved ~0.9 TB/s in a 4,096-token prefill (99 us a layer, where its
// ~120 MB take ~28 us at copy speed; csrc/PERF_NOTES.md, session 17). The same bits either way.
template <int W>
__global__ void rope_kernel(half* __restrict__ q, half* __restrict__ k, const half* __restrict__ cos,
                            const half* __restrict__ sin, int T, int hq, int hk, int d,
                            long q_batch, long q_tok, long k_batch, long k_tok, KvStore st) {
    pdl_launch_dependents();
    pdl_wait_primary();
    const int b = blockIdx.x / T, t = blockIdx.x - b * T;
    // With a KV store: this token's slot in the cache (its position lives on the device, so a
    // replayed CUDA graph writes where the cache has got to).
    half* kc = nullptr;
    half* vc = nullptr;
    const half* vrow = nullptr;
    const long slot = st.kc ? *st.pos + t : 0;
    if (st.kc && slot >= 0 && slot < st.slots) {
        kc = st.kc + b * st.c_batch + slot * st.c_tok;
        vc = st.vc + b * st.c_batch + slot * st.c_tok;
        vrow = st.v + b * st.v_batch + t * st.v_tok;
    }
    const int half_d = d >> 1;
    const half* c = cos + (size_t)t * d;
    const half* s = sin + (size_t)t * d;
    half* qrow = q + b * q_batch + t * q_tok;
    half* krow = k + b * k_batch + t * k_tok;
    const int pairs = (hq + hk) * half_d;
    // One thread per rotated pair, then (with a store) one per value copied into the cache,
    // spread over blockIdx.y: a decode step's one token fills ~30 blocks instead of looping in one.
    const int p = (blockIdx.y * blockDim.x + threadIdx.x) * W;
    using V = std::conditional_t<W == 2, half2, half>;
    auto at = [](const half* ptr, int i) { return *reinterpret_cast<const V*>(ptr + i); };
    auto put = [](half* ptr, int i, V v) { *reinterpret_cast<V*>(ptr + i) = v; };
    if (p < pairs) {
        const int head = p / half_d, i = p - head * half_d;  // W = 2: half_d is even, so i + 1 is this head's
        half* base = head < hq ? qrow + (size_t)head * d : krow + (size_t)(head - hq) * d;
        const V lo = at(base, i), hi = at(base, i + half_d);
        // _rn forms: a plain mul + add may be contracted into one fma, which rounds once less
        V r0, r1;
        if constexpr (W == 2) {
            r0 = __hadd2_rn(__hmul2_rn(lo, at(c, i)), __hmul2_rn(__hneg2(hi), at(s, i)));
            r1 = __hadd2_rn(__hmul2_rn(hi, at(c, i + half_d)), __hmul2_rn(lo, at(s, i + half_d)));
        } else {
            r0 = __hadd_rn(__hmul_rn(lo, c[i]), __hmul_rn(__hneg(hi), s[i]));
            r1 = __hadd_rn(__hmul_rn(hi, c[i + half_d]), __hmul_rn(lo, s[i + half_d]));
        }
        put(base, i, r0);
        put(base, i + half_d, r1);
        if (kc && head >= hq) {
            half* dst = kc + (size_t)(head - hq) * st.c_head;
            put(dst, i, r0);
            put(dst, i + half_d, r1);
        }
    } else if (vc && p - pairs < hk * d) {
        const int e = p - pairs, head = e / d, i = e - head * d;
        put(vc + (size_t)head * st.c_head, i, at(vrow + (size_t)head * d, i));
    }
}

// Whether every row, head and table start the kernel touches is 4-byte aligned (rope_kernel<2>).
static bool rope_pairs_aligned(const half* q, const half* k, const half* cos, const half* sin, int d, long q_batch,
                               long q_tok, long k_batch, long k_tok, const KvStore& st) {
    auto even = [](long v) { return v % 2 == 0; };
    auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 4 == 0; };
    bool ok = d % 4 == 0 && aligned(q) && aligned(k) && aligned(cos) && aligned(sin) && even(q_batch) &&
              even(q_tok) && even(k_batch) && even(k_tok);
    if (st.kc) {
        ok = ok && aligned(st.kc) && aligned(st.vc) && aligned(st.v) && even(st.c_batch) && even(st.c_head) &&
             even(st.c_tok) && even(st.v_batch) && even(st.v_tok);
    }
    return ok;
}

cudaError_t rope_qk(half* q, half* k, const half* cos, const half* sin, int batch, int T, int hq,
                    int hk, int d, long q_batch, long q_tok, long k_batch, long k_tok,
                    const KvStore& store, cudaStream_t stream) {
    if (batch < 1 || T < 1 || d % 2 || hq < 0 || hk < 0) return cudaErrorInvalidValue;
    const int work = (hq + hk) * (d / 2) + (store.kc ? hk * d : 0);
    const int threads = 128;
    const bool pairs2 = rope_pairs_aligned(q, k, cos, sin, d, q_batch, q_tok, k_batch, k_tok, store);
    const int per_thread = pairs2 ? 2 : 1;
    const dim3 grid((unsigned)(batch * T), (unsigned)((work + threads * per_thread - 1) / (threads * per_thread)));
    return launch_glue(pairs2 ? rope_kernel<2> : rope_kernel<1>, grid, dim3(threads), stream, q, k, cos, sin, T, hq,
                       hk, d, q_batch, q_tok, k_batch, k_tok, store);
}

}  // namespace trellis
