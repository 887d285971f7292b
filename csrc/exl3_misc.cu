// Dispatcher for the fused product and its host-side plans and settings, plus the kernels that
// feed it or stand in for it: the activation preps and the dense reconstruct (long prefills).
// The 128-point Hadamards and the norms are in hadamard_norm.cu, the other glue in glue.cu.
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
// F16 with wg (ng = 4): a group's word w = 2 lane + kk / 8 goes to lane + 32 (kk / 8) instead, wgmma's
// K-major core matrices (exl3_gemv_sa_kernel.cuh); with csum, each chunk's sum of xh too.
template <bool OPEN, bool PRE = false>
__global__ void prep_frag_kernel(const PrepInput x, const half* __restrict__ suh,
                                 uint32_t* __restrict__ xb, float2* __restrict__ scales,
                                 float* __restrict__ csum, int rows, int in, int ng, const PreNorm pre, bool wg) {
    pdl_launch_dependents();  // the product after it may start fetching its trellis
    const int lane = threadIdx.x & 31;
    const int nch = in >> 7;
    {  // segment blockIdx.y of a grouped product: its own signs and output series
        const int seg = blockIdx.y;
        suh += (size_t)seg * in;
        xb += (size_t)seg * (in >> 4) * ng * 32 * (scales ? 4 : 2);
        if (scales) scales += (size_t)seg * rows * nch;
        if (csum) csum += (size_t)seg * rows * nch;
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
        const size_t fb = ((size_t)i * ng + (r >> 3)) * 64;
#pragma unroll
        for (int p = 0; p < 2; ++p) {
            const int kk = kk0 + 2 * p;
            const int fl = (r & 7) * 4 + ((kk & 7) >> 1);
            xb[fb + (wg ? fl + 32 * (kk >> 3) : 2 * fl + (kk >> 3))] = as_u32(p ? o1 : o0);
        }
        if (csum) {
            const float t = warp_sum((__low2float(o0) + __high2float(o0)) + (__low2float(o1) + __high2float(o1)));
            if (lane == 0) csum[(size_t)r * nch + c] = t;
        }
        return;
    }
    const float f[4] = {__low2float(o0), __high2float(o0), __low2float(o1), __high2float(o1)};
    store_i8_chunk(xb, scales, csum, r, c, nch, ng, lane, f);
}

cudaError_t prep_frag(const half* x, int ldx, const half* suh, uint32_t* xb, float2* scales,
                      float* csum, int rows, int in, int ng, int nseg, cudaStream_t stream,
                      const half* up, int ldu, int act, const PrepNorm& norm, const OpenSums& xo,
                      const OpenSums& uo, bool wgmma_layout) {
    if (in % 128 || rows < 1 || nseg < 1 || nseg > 4 || act < 0 || act > 2) return cudaErrorInvalidValue;
    if (wgmma_layout && (scales || ng != 4)) return cudaErrorInvalidValue;
    const bool gated = up || uo.z;
    if (norm.w && (gated || (norm.residual && !norm.residual_out))) return cudaErrorInvalidValue;
    if ((xo.z && !xo.svh) || (uo.z && (!uo.svh || !xo.z))) return cudaErrorInvalidValue;
    if (norm.pre.w && (!norm.w || !norm.residual || xo.z)) return cudaErrorInvalidValue;
    if (prep_skip_flag()) return cudaSuccess;
    const long tasks = (long)rows * (in / 128);
    const dim3 grid((unsigned)((tasks + 7) / 8), (unsigned)nseg);
    const PrepInput pin = prep_input(x, xo.z ? in : ldx, up, ldu, act, norm, xo, uo);
    auto* kernel = norm.pre.w ? prep_frag_kernel<false, true> : xo.z ? prep_frag_kernel<true> : prep_frag_kernel<false>;
    return launch_glue(kernel, grid, dim3(256), stream, pin, suh, xb, scales, csum, rows, in, ng, norm.pre,
                       wgmma_layout);
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
void set_gemv_sa_tiles(int rule) { gemv_sa_tiles() = rule >= 0 && rule <= 2 ? rule : 1; }
void set_sa_stamp_buffer(int64_t ptr, int64_t slots) {
    sa_stamp_buffer() = slots > 0 ? reinterpret_cast<uint64_t*>(ptr) : nullptr;
    sa_stamp_slots() = slots > 0 ? (long)slots : 0;
}
void set_gemv_wgmma(int mode) { gemv_wgmma() = mode == 0 ? 0 : 1; }
void set_gemv_shared_acts(int mode) { gemv_shared_acts() = mode >= 0 && mode <= 3 ? mode : 3; }
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
        if (ng == 4) return sa_two_tiles<kK>(a) ? sa_grid<kK, 4, kSaTwoTiles>(a) : sa_grid<kK, 4>(a);
        return ng == 1 ? sa_grid<kK, 1>(a) : sa_grid<kK, 2>(a);
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
    // Debug variants other than those that keep the shipped schedule (gv_shipped_schedule: the
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

int gemv_f16_acts(const MmArgs& a) {
    if (a.version != 3 || a.m < 1 || a.m > kMaxFusedRows || a.in % 128 || a.out % 128) return 0;
    const int v = mm_debug_variant();
    const SaForm f = with_k(a.K, SaForm{}, [&](auto k) {
        constexpr int kK = decltype(k)::value;
        const int ng = gemv_groups(a.m, false);
        return ng == 4 ? sa_form<kK, 4>(a, v) : ng == 2 ? sa_form<kK, 2>(a, v) : sa_form<kK, 1>(a, v);
    });
    return (f.shared && a.codebook == CB_MUL1 ? kActsChunkSums : 0) | (f.wgmma ? kActsWgmma : 0);
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
void set_gemv_block_cap(int on) { gemv_block_cap() = on ? 1 : 0; }
void set_gemv_two_row_units(int units) { gemv_two_row_units() = units > 0 ? units : 1; }
void set_gemv_four_row_units(int units) { gemv_four_row_units() = units > 0 ? units : 0; }
void set_gemv_lean_units(int units) { gemv_lean_units() = units > 0 ? units : 0; }
void set_gemv_lean_groups(int groups) { gemv_lean_groups() = groups < 1 ? 1 : groups; }

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

}  // namespace trellis
