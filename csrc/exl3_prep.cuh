// Activation prep math shared by the prep kernels (exl3_misc.cu) and the product that preps its
// own input (exl3_gemv.cuh, decode at m = 1): the product's input (plain, gated, or normed with the
// residual add), the input signs, the 128-point Hadamard and the MUL1 integer path's int8 steps.
#pragma once
#include <cuda_fp16.h>
#include <math.h>
#include <stdint.h>

#include "exl3_decode.cuh"
#include "exl3_mm.cuh"
#include "kernels.h"

namespace trellis {

// The prep kernels run one warp per (row, 128-chunk); both of their layouts (version 2 row-major,
// version 3 MMA fragment order) and the self-prepping product share the transform below.

// act(g) * u for one element, rounded like gated_act_kernel (act in fp32, one fp16 rounding,
// then an fp16 product), so the fused and the separate paths feed the product the same bits.
__device__ __forceinline__ half gated_value(half gh, half u, int act) {
    const float g = __half2float(gh);
    float a;
    if (act == 0) {
        a = g / (1.f + __expf(-g));
    } else if (act == 1) {
        const float k0 = 0.7978845608028654f, k1 = 0.044715f;
        a = 0.5f * g * (1.f + tanhf(k0 * (g + k1 * g * g * g)));
    } else {
        a = 0.5f * g * (1.f + erff(g * 0.7071067811865476f));
    }
    return __hmul(__float2half_rn(a), u);
}

// One (x, y) pair's share of an RMSNorm's sum of squares, rounded one fixed way (x*x fused onto
// the rounded y*y, the compiler's own choice for rms_norm_kernel's `x*x + y*y`), so that a kernel
// that norms a row as rms_norm_kernel does (decode attention's per-head q/k norm) adds the same bits.
__device__ __forceinline__ float pair_square_sum(float2 f) { return __fmaf_rn(f.x, f.x, __fmul_rn(f.y, f.y)); }

// a + b for a lane's 4 fp16 values (the residual add of the norm kernels: one fp16 add each).
__device__ __forceinline__ uint2 add4(uint2 a, uint2 b) {
    return make_uint2(as_u32(__hadd2(as_h2(a.x), as_h2(b.x))), as_u32(__hadd2(as_h2(a.y), as_h2(b.y))));
}

// act(g) * u for a lane's 4 values (gated_value each).
__device__ __forceinline__ uint2 gated4(uint2 g, uint2 u, int act) {
    const half2 g0 = as_h2(g.x), g1 = as_h2(g.y), u0 = as_h2(u.x), u1 = as_h2(u.y);
    return make_uint2(as_u32(__halves2half2(gated_value(__low2half(g0), __low2half(u0), act),
                                            gated_value(__high2half(g0), __high2half(u0), act))),
                      as_u32(__halves2half2(gated_value(__low2half(g1), __low2half(u1), act),
                                            gated_value(__high2half(g1), __high2half(u1), act))));
}

// A product's input as the prep kernels read it: x itself, or act(x) * up where a gated MLP's
// down projection takes its activation straight from the gate/up outputs (one launch fewer).
// Or rms_norm(x (+ residual)) * norm_w, the input of q/k/v and gate/up: each warp takes its
// row's statistics itself (the row is a few KB, read from L2), so the norm needs no launch of
// its own; segment 0 writes x + residual, the residual stream, to res_out.
struct PrepInput {
    const half* x;
    int ldx;
    const half* up;  // nullptr: plain input
    int ldu;
    int act;
    const half* norm_w = nullptr;  // nullptr: no norm
    const half* res = nullptr;     // row-major [rows, in] like x, optional
    half* res_out = nullptr;       // required with res
    float eps = 0.f;
    OpenSums xo, uo;  // prep_frag<OPEN>: x / up as the open sums of the product before (kernels.h)
    // Not here: a double norm's PreNorm (kernels.h), a kernel parameter of its own. Two more
    // fields here changed the code NVVM made of every prep kernel (its loops unrolled less).
};

// A product's prep input from the launcher's pieces (prep_frag's arguments, MmArgs' self-prep fields).
inline PrepInput prep_input(const half* x, int ldx, const half* up, int ldu, int act, const PrepNorm& norm,
                            const OpenSums& xo = OpenSums{}, const OpenSums& uo = OpenSums{}) {
    return PrepInput{x, ldx, up, ldu, act, norm.w, norm.residual, norm.residual_out, norm.eps, xo, uo};
}

// fp16(v * inv) * w for a lane's 4 values: rms_norm_kernel's output rounding (cast, then the
// weight's fp16 product), given the row's 1 / rms.
__device__ __forceinline__ uint2 normed4(uint2 v, uint2 w, float inv) {
    const float2 a = __half22float2(as_h2(v.x)), b = __half22float2(as_h2(v.y));
    return make_uint2(as_u32(__hmul2(as_h2(w.x), __floats2half2_rn(a.x * inv, a.y * inv))),
                      as_u32(__hmul2(as_h2(w.y), __floats2half2_rn(b.x * inv, b.y * inv))));
}

// Open sums (kernels.h): a lane's 4 values k..k+3 (k = 128 b + 4 lane) of row r of the product
// before, as its split-k sums with the output transform's weights. Loaded apart from the
// transform so that a reader issues all of its loads before the first shuffle.
struct OpenLoad {
    float4 f;
    uint2 sv, bv;
};

__device__ __forceinline__ OpenLoad open_load(const OpenSums& o, int r, int k) {
    OpenLoad l;
    // Read-only while the prep runs (the reader's product zeroes z after it), and not read before
    // the prep's programmatic-dependent wait: cached loads, so a normed prep's second read of its
    // chunk (after the row's statistics) hits L1.
    l.f = __ldg(reinterpret_cast<const float4*>(o.z + (size_t)r * o.ld + k));
    l.sv = __ldg(reinterpret_cast<const uint2*>(o.svh + k));
    l.bv = o.bias ? __ldg(reinterpret_cast<const uint2*>(o.bias + k)) : make_uint2(0u, 0u);
    return l;
}

// The open sums' weights (svh, bias) into L2 before the prep's programmatic-dependent wait: no
// kernel writes them, and after the wait their DRAM latency would sit on the critical path (the
// product before them streamed the layer's trellis through L2 since they were last read). The
// norm's statistics read the whole row, so a normed prep's threads fetch their share of it;
// otherwise a lane fetches only its own 4 values at k.
__device__ __forceinline__ void open_prefetch(const PrepInput& in, int k, int n) {
    auto fetch = [](const half* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); };
    const int first = in.norm_w ? (int)threadIdx.x * 4 : k;
    const int step = in.norm_w ? (int)blockDim.x * 4 : n;
    for (int c = first; c < n; c += step) {
        fetch(in.xo.svh + c);
        if (in.xo.bias) fetch(in.xo.bias + c);
        if (in.uo.z) {
            fetch(in.uo.svh + c);
            if (in.uo.bias) fetch(in.uo.bias + c);
        }
    }
}

// The output transform of the loaded sums (finish_lane4, the product's own output stage), so
// the bits are those of the finished output. Every lane of the warp takes part (the shuffles).
__device__ __forceinline__ uint2 open_finish(const OpenLoad& l, int lane, bool has_bias) {
    float v[4] = {l.f.x, l.f.y, l.f.z, l.f.w};
    return finish_lane4(v, lane, kHadNorm, l.sv, l.bv, has_bias);
}

// x + residual for one lane's 4 values (the rms_norm kernel's fp16 add).
__device__ __forceinline__ uint2 norm_input(const PrepInput& in, int r, int k) {
    uint2 v = *reinterpret_cast<const uint2*>(in.x + (size_t)r * in.ldx + k);
    if (in.res) v = add4(v, *reinterpret_cast<const uint2*>(in.res + (size_t)r * in.ldx + k));
    return v;
}

// A double-normed input's residual sum for one lane's 4 values (PreNorm): rms_norm(x) * pre.w
// given x's 1 / rms, then + residual, each rounded as the norm kernel and the prep round them.
// Given the same 1 / rms these are the bits a post-norm kernel and then a normed prep would add;
// but x's 1 / rms is summed in the prep's order, not the norm kernel's, so in rare rows it differs
// in its last bit and a value of the sum moves by an fp16 step (an emulation: ~1 value in 250k).
__device__ __forceinline__ uint2 pre_normed_sum(const PrepInput& in, const PreNorm& pre, int r, int k, float pre_inv) {
    const uint2 w = __ldg(reinterpret_cast<const uint2*>(pre.w + k));
    uint2 v = normed4(*reinterpret_cast<const uint2*>(in.x + (size_t)r * in.ldx + k), w, pre_inv);
    if (in.res) v = add4(v, *reinterpret_cast<const uint2*>(in.res + (size_t)r * in.ldx + k));
    return v;
}

// A lane's share of a row's sum of squares (the order block_row_inv and block_row_inv2 add in).
__device__ __forceinline__ void add_squares4(float& acc, uint2 v) {
    const float2 a = __half22float2(as_h2(v.x)), b = __half22float2(as_h2(v.y));
    acc += a.x * a.x + a.y * a.y + b.x * b.x + b.y * b.y;
}

constexpr int kPrepWarps = 8;  // prep and product blocks are 256 threads

// The block's sums of squares of its rows r_first..r_last (ss: this thread's share of each) into
// part, one row of part per warp, then a barrier: what block_row_inv and block_row_inv2 reduce.
__device__ __forceinline__ void publish_row_sums(float (&ss)[kPrepWarps], float (*part)[kPrepWarps], int r_first,
                                                 int r_last) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int lr = 0; lr < kPrepWarps; ++lr) {
        if (r_first + lr <= r_last) {
            ss[lr] = warp_sum(ss[lr]);
            if (lane == 0) part[warp][lr] = ss[lr];
        }
    }
    __syncthreads();
}

// 1 / rms of the block's local row lr from its published sums (the warps' totals in warp order).
__device__ __forceinline__ float published_row_inv(const float (*part)[kPrepWarps], int lr, int n, float eps) {
    float t = 0.f;
#pragma unroll
    for (int w = 0; w < kPrepWarps; ++w) t += part[w][lr];
    return rsqrtf(t / n + eps);
}

// 1 / rms of row r, for a block of 8 warps whose threads all call this (a barrier) and whose
// warps need rows r_first..r_last (r_last - r_first < 8). The block reads each row once, 4 values
// per thread, and reduces through shared memory. Session 5 measured ~5 us per prep while each
// warp read its whole row itself (8 warps x 16 KB from L2 on one SM, in four dependent batches);
// this is one batch of 16 KB per block.
// OPEN: x is open sums (in.xo); a batch of 4 of the thread's chunks is loaded before any is
// transformed, one L2 round trip per batch instead of one per chunk.
template <bool OPEN = false>
__device__ __forceinline__ float block_row_inv(const PrepInput& in, int r, int r_first, int r_last, int n) {
    constexpr int kWarps = kPrepWarps;
    __shared__ float part[kWarps][kWarps];
    const int lane = threadIdx.x & 31;
    float ss[kWarps];
#pragma unroll
    for (int lr = 0; lr < kWarps; ++lr) {
        ss[lr] = 0.f;
        if (r_first + lr <= r_last) {
            if constexpr (OPEN) {
                constexpr int kBatch = 4;
                for (int c0 = threadIdx.x * 4; c0 < n; c0 += kBatch * kWarps * 128) {
                    OpenLoad l[kBatch];
                    uint2 rv[kBatch];
#pragma unroll
                    for (int j = 0; j < kBatch; ++j) {
                        const int c = c0 + j * kWarps * 128;
                        if (c < n) {  // warp-uniform: n is a multiple of 128
                            l[j] = open_load(in.xo, r_first + lr, c);
                            if (in.res) rv[j] = *reinterpret_cast<const uint2*>(in.res + (size_t)(r_first + lr) * in.ldx + c);
                        }
                    }
#pragma unroll
                    for (int j = 0; j < kBatch; ++j) {
                        if (c0 + j * kWarps * 128 < n) {
                            uint2 v = open_finish(l[j], lane, in.xo.bias != nullptr);
                            if (in.res) v = add4(v, rv[j]);
                            add_squares4(ss[lr], v);
                        }
                    }
                }
            } else {
#pragma unroll 4
                for (int c = threadIdx.x * 4; c < n; c += kWarps * 128) add_squares4(ss[lr], norm_input(in, r_first + lr, c));
            }
        }
    }
    publish_row_sums(ss, part, r_first, r_last);
    return published_row_inv(part, min(max(r - r_first, 0), kWarps - 1), n, in.eps);
}

// Both statistics of a double-normed row (PreNorm) for block_row_inv's block layout and
// callers: .x is x's 1 / rms (its own norm), .y that of s = rms_norm(x) * pre.w + residual
// (pre_normed_sum), the sum the main norm takes. The second pass needs every row's first
// statistic, so the block reduces twice; it reads the row again, from L1.
__device__ __forceinline__ float2 block_row_inv2(const PrepInput& in, const PreNorm& pre, int r, int r_first, int r_last,
                                                int n) {
    constexpr int kWarps = kPrepWarps;
    __shared__ float part[2][kWarps][kWarps];
    float ss[kWarps], pre_inv[kWarps];
#pragma unroll
    for (int lr = 0; lr < kWarps; ++lr) {
        ss[lr] = 0.f;
        if (r_first + lr <= r_last) {
            const half* row = in.x + (size_t)(r_first + lr) * in.ldx;
#pragma unroll 4
            for (int c = threadIdx.x * 4; c < n; c += kWarps * 128)
                add_squares4(ss[lr], *reinterpret_cast<const uint2*>(row + c));
        }
    }
    publish_row_sums(ss, part[0], r_first, r_last);
#pragma unroll
    for (int lr = 0; lr < kWarps; ++lr) {
        pre_inv[lr] = r_first + lr <= r_last ? published_row_inv(part[0], lr, n, pre.eps) : 0.f;
        ss[lr] = 0.f;
        if (r_first + lr <= r_last) {
#pragma unroll 4
            for (int c = threadIdx.x * 4; c < n; c += kWarps * 128)
                add_squares4(ss[lr], pre_normed_sum(in, pre, r_first + lr, c, pre_inv[lr]));
        }
    }
    publish_row_sums(ss, part[1], r_first, r_last);
    const int lr = min(max(r - r_first, 0), kWarps - 1);
    return make_float2(published_row_inv(part[0], lr, n, pre.eps), published_row_inv(part[1], lr, n, in.eps));
}

// The weights a prep lane needs (its 4 input signs and norm weights). Read before
// pdl_wait_primary: no kernel writes them, so their DRAM latency overlaps the previous kernel's
// tail instead of adding to the chain after it.
struct PrepWeights {
    uint2 suh, norm_w;

    PrepWeights() = default;
    __device__ __forceinline__ PrepWeights(const PrepInput& in, const half* __restrict__ suh_row, int k) {
        suh = __ldg(reinterpret_cast<const uint2*>(suh_row + k));
        norm_w = in.norm_w ? __ldg(reinterpret_cast<const uint2*>(in.norm_w + k)) : make_uint2(0u, 0u);
    }
};

// A lane's 4 raw input values k..k+3 of row r: x, and the residual (normed input) or up (gated
// input) beside it. Loaded apart from the math so that a loop over chunks can load the next
// chunk's values while it transforms this one's.
struct LaneRaw {
    uint2 x, aux;

    LaneRaw() = default;
    __device__ __forceinline__ LaneRaw(const PrepInput& in, int r, int k) {
        x = *reinterpret_cast<const uint2*>(in.x + (size_t)r * in.ldx + k);
        aux = make_uint2(0u, 0u);
        if (in.norm_w && in.res) aux = *reinterpret_cast<const uint2*>(in.res + (size_t)r * in.ldx + k);
        if (in.up) aux = *reinterpret_cast<const uint2*>(in.up + (size_t)r * in.ldu + k);
    }
    // prep_frag<OPEN>: x (and up) from open sums, every load issued before the transforms.
    __device__ __forceinline__ static LaneRaw from_open(const PrepInput& in, int r, int k) {
        const int lane = (k >> 2) & 31;
        const OpenLoad lx = open_load(in.xo, r, k);
        OpenLoad lu;
        LaneRaw raw;
        raw.aux = make_uint2(0u, 0u);
        if (in.uo.z) lu = open_load(in.uo, r, k);
        else if (in.norm_w && in.res) raw.aux = *reinterpret_cast<const uint2*>(in.res + (size_t)r * in.ldx + k);
        raw.x = open_finish(lx, lane, in.xo.bias != nullptr);
        if (in.uo.z) raw.aux = open_finish(lu, lane, in.uo.bias != nullptr);
        return raw;
    }
    // x + residual where the norm has one (the residual stream), else x.
    __device__ __forceinline__ uint2 sum(const PrepInput& in) const {
        if (!(in.norm_w && in.res)) return x;
        return add4(x, aux);
    }
};

// The product's input from a lane's raw values: rms_norm(x (+ residual)) * w given the row's
// 1 / rms, act(gate) * up, or x.
template <bool OPEN = false>
__device__ __forceinline__ uint2 lane_input(const PrepInput& in, const LaneRaw& raw, float inv, uint2 w) {
    if (in.norm_w) return normed4(raw.sum(in), w, inv);
    if (OPEN ? in.uo.z != nullptr : in.up != nullptr) return gated4(raw.x, raw.aux, in.act);
    return raw.x;
}

// xh = fp16(had128(fp16(x * suh)) / sqrt(128)) of a lane's 4 input values (all 32 lanes of the
// warp take part).
__device__ __forceinline__ void lane_xh(uint2 xv, uint2 suh, int lane, half2& o0, half2& o1) {
    const half2 p0 = __hmul2(as_h2(xv.x), as_h2(suh.x));
    const half2 p1 = __hmul2(as_h2(xv.y), as_h2(suh.y));
    float v[4] = {__low2float(p0), __high2float(p0), __low2float(p1), __high2float(p1)};
    wht128_lane4(v, lane);
    o0 = __floats2half2_rn(v[0] * kHadNorm, v[1] * kHadNorm);
    o1 = __floats2half2_rn(v[2] * kHadNorm, v[3] * kHadNorm);
}

// This lane's 4 values k..k+3 of xh for row r; inv is the row's 1 / rms where the norm is on
// (block_row_inv) and write_sum selects the warps that store x + residual. OPEN: x (and up) are
// open sums.
template <bool OPEN = false>
__device__ __forceinline__ void prep_lane_xh(const PrepInput& in, const PrepWeights& wt, int r, int k,
                                             int lane, half2& o0, half2& o1, float inv = 0.f,
                                             bool write_sum = false) {
    const LaneRaw raw = OPEN ? LaneRaw::from_open(in, r, k) : LaneRaw(in, r, k);
    if (write_sum && in.norm_w && in.res)
        *reinterpret_cast<uint2*>(in.res_out + (size_t)r * in.ldx + k) = raw.sum(in);
    lane_xh(lane_input<OPEN>(in, raw, inv, wt.norm_w), wt.suh, lane, o0, o1);
}

// prep_lane_xh for a double-normed input (PreNorm): x is normed by pre.w first, with
// x's 1 / rms inv.x (the sum's values are the bits pre_normed_sum gave block_row_inv2), then goes
// on as a normed input with the sum's 1 / rms inv.y. pre_w: this lane's 4 weights of pre.w.
__device__ __forceinline__ void prep_lane_xh_pre(const PrepInput& in, const PrepWeights& wt, uint2 pre_w, int r,
                                                 int k, int lane, half2& o0, half2& o1, float2 inv,
                                                 bool write_sum) {
    LaneRaw raw(in, r, k);
    raw.x = normed4(raw.x, pre_w, inv.x);
    if (write_sum && in.res) *reinterpret_cast<uint2*>(in.res_out + (size_t)r * in.ldx + k) = raw.sum(in);
    lane_xh(lane_input(in, raw, inv.y, wt.norm_w), wt.suh, lane, o0, o1);
}

// The MUL1 integer path's two int8 passes of one 128-chunk: q1 at step s1 = absmax / 127, q2 the
// residual at s2 = s1 / 254 (about 15 bits together); `sum` is the chunk's sum of xh.
struct Int8Chunk {
    float s1, s2, inv1, inv2, sum;

    __device__ __forceinline__ Int8Chunk(const float f[4]) {
        float amax = fmaxf(fmaxf(fabsf(f[0]), fabsf(f[1])), fmaxf(fabsf(f[2]), fabsf(f[3])));
        sum = f[0] + f[1] + f[2] + f[3];
#pragma unroll
        for (int s = 16; s > 0; s >>= 1) {
            amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, s));
            sum += __shfl_xor_sync(0xffffffffu, sum, s);
        }
        s1 = amax / 127.f;
        s2 = s1 / 254.f;
        inv1 = amax > 0.f ? 127.f / amax : 0.f;
        inv2 = amax > 0.f ? 254.f / s1 : 0.f;
    }
    // The two passes' levels of one value, each in -127..127.
    __device__ __forceinline__ void levels(float f, int& q1, int& q2) const {
        const float l1 = fminf(fmaxf(rintf(f * inv1), -127.f), 127.f);
        const float l2 = fminf(fmaxf(rintf((f - l1 * s1) * inv2), -127.f), 127.f);
        q1 = (int)l1;
        q2 = (int)l2;
    }
    // The two passes of one value, each repeated in the 4 bytes of a word.
    __device__ __forceinline__ void passes(float f, uint32_t& w1, uint32_t& w2) const {
        int q1, q2;
        levels(f, q1, q2);
        w1 = ((uint32_t)q1 & 0xffu) * 0x01010101u;
        w2 = ((uint32_t)q2 & 0xffu) * 0x01010101u;
    }
};

// Store one 128-chunk's int8 passes (prep_frag's version-3 I8 layout) with its steps and sum:
// row r, chunk c of nch, fragment groups ng; f = this lane's 4 values c * 128 + lane * 4 + 0..3.
// Element (r, k): k row i = k / 16, kk = k % 16, lane quad cq = (kk % 8) / 2; B lane
// (2 (r % 4) + pass) * 4 + cq, slot (kk % 2) + 2 (kk / 8) of the lane's 4 words, group r / 4.
__device__ __forceinline__ void store_i8_chunk(uint32_t* __restrict__ xb, float2* __restrict__ scales,
                                               float* __restrict__ csum, int r, int c, int nch, int ng,
                                               int lane, const float f[4]) {
    const Int8Chunk ch(f);
    const int k = c * 128 + lane * 4;
    const int kk0 = k & 15;  // even; the lane's 4 values are kk0 .. kk0+3 of k row k / 16
    const size_t fb = ((size_t)(k >> 4) * ng + (r >> 2)) * 32;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        const int kk = kk0 + q;
        const int cq = (kk & 7) >> 1;
        const int slot = (kk & 1) + 2 * (kk >> 3);
        uint32_t w1, w2;
        ch.passes(f[q], w1, w2);
        xb[(fb + (2 * (r & 3)) * 4 + cq) * 4 + slot] = w1;
        xb[(fb + (2 * (r & 3) + 1) * 4 + cq) * 4 + slot] = w2;
    }
    if (lane == 0) {
        scales[(size_t)r * nch + c] = make_float2(ch.s1, ch.s2);
        csum[(size_t)r * nch + c] = ch.sum;
    }
}

// What decode chain mode 1 reads besides the block's outputs, at the lane's 4 columns of block
// blk: the residual (rv), the norm's weight (w) and each segment's input signs (sv).
struct NormedLoads {
    uint2 rv, w, sv[4];
};
// The norm's weight and the first `nseg` segments' signs: weights, which a kernel may read before
// its PDL wait. CG: L2 loads (ld.global.cg), which ptxas keeps ahead of a griddepcontrol.wait,
// where it moved read-only (.nc) loads below it (gv_finish_chain_kernel's SASS, session 30).
template <bool CG>
__device__ __forceinline__ NormedLoads normed_weights(const ChainOut& nx, int nseg, int blk, int lane) {
    const int k = blk * 128 + lane * 4;
    auto load = [](const half* p) {
        return CG ? __ldcg(reinterpret_cast<const uint2*>(p)) : __ldg(reinterpret_cast<const uint2*>(p));
    };
    NormedLoads l;
    l.rv = make_uint2(0u, 0u);
    l.w = load(nx.norm_w + k);
#pragma unroll
    for (int seg = 0; seg < 4; ++seg)
        if (seg < nseg) l.sv[seg] = load(nx.suh + (size_t)seg * nx.n + k);
    return l;
}
// The residual at the lane's 4 columns of block blk of row r (zero without one), an L2 load.
__device__ __forceinline__ uint2 normed_residual_cg(const ChainOut& nx, int blk, int lane, int r = 0) {
    return nx.res ? __ldcg(reinterpret_cast<const uint2*>(nx.res + (size_t)r * nx.n + blk * 128 + lane * 4))
                  : make_uint2(0u, 0u);
}

// Decode chain mode 1 for NSEG segments: (y + res) * norm_w * suh[seg] through the Hadamard
// into int8 chunks, with its loads (NormedLoads) already issued. The segments' transforms are
// unrolled together, so their shuffle chains overlap. Row r of `rows` (gv_finish_chain_kernel at
// 2..4 rows; the in-warp chain writes one): prep_frag's layout, scales and sums [nseg, rows, n /
// 128], part [rows, n / 128], the residual rows n apart.
template <int NSEG>
__device__ __forceinline__ void chain_normed(const ChainOut& nx, half2 o0, half2 o1, int blk, int lane,
                                             const NormedLoads& l, int r = 0, int rows = 1) {
    const int nch = nx.n >> 7;
    const size_t seg_words = (size_t)(nx.n >> 4) * 32 * 4;
    const uint2 rv = l.rv, w = l.w;
    const uint2* sv = l.sv;
    const int k = blk * 128 + lane * 4;
    uint2 h = make_uint2(as_u32(o0), as_u32(o1));
    if (nx.res) h = add4(h, rv);
    if (nx.res_out) *reinterpret_cast<uint2*>(nx.res_out + (size_t)r * nx.n + k) = h;
    const float2 a = __half22float2(as_h2(h.x)), b = __half22float2(as_h2(h.y));
    const float hv[4] = {a.x, a.y, b.x, b.y};
    float ss = hv[0] * hv[0] + hv[1] * hv[1] + hv[2] * hv[2] + hv[3] * hv[3];
    const float2 wa = __half22float2(as_h2(w.x)), wb = __half22float2(as_h2(w.y));
    const float hw[4] = {hv[0] * wa.x, hv[1] * wa.y, hv[2] * wb.x, hv[3] * wb.y};
    float f[NSEG][4];
#pragma unroll
    for (int seg = 0; seg < NSEG; ++seg) {
        const float2 sa = __half22float2(as_h2(sv[seg].x)), sb = __half22float2(as_h2(sv[seg].y));
        f[seg][0] = hw[0] * sa.x, f[seg][1] = hw[1] * sa.y, f[seg][2] = hw[2] * sb.x, f[seg][3] = hw[3] * sb.y;
    }
    ss = warp_sum(ss);
#pragma unroll
    for (int seg = 0; seg < NSEG; ++seg) wht128_lane4(f[seg], lane);
#pragma unroll
    for (int seg = 0; seg < NSEG; ++seg) {
#pragma unroll
        for (int q = 0; q < 4; ++q) f[seg][q] *= kHadNorm;
        const size_t seg_rows = (size_t)seg * rows * nch;
        store_i8_chunk(nx.xb + seg * seg_words, nx.scales + seg_rows, nx.csum + seg_rows, r, blk, nch, 1, lane, f[seg]);
    }
    if (lane == 0) nx.part[r * nch + blk] = ss;
}
// chain_normed for the chain's nseg (1..4, known at run time).
__device__ __forceinline__ void chain_normed_segs(const ChainOut& nx, half2 o0, half2 o1, int blk, int lane,
                                                  const NormedLoads& l, int r = 0, int rows = 1) {
    switch (nx.nseg) {
        case 1: return chain_normed<1>(nx, o0, o1, blk, lane, l, r, rows);
        case 2: return chain_normed<2>(nx, o0, o1, blk, lane, l, r, rows);
        case 3: return chain_normed<3>(nx, o0, o1, blk, lane, l, r, rows);
        default: return chain_normed<4>(nx, o0, o1, blk, lane, l, r, rows);
    }
}

// Decode chain mode 2 for chunk j of the next input, from the lane's 4 gate and 4 up outputs (g,
// u) and the next product's input signs s there: the same bits as the down projection's own prep
// (lane_input's gated branch, then lane_xh), into row r (gv_finish_chain_kernel at 2..4 rows; the
// in-warp chain writes one).
__device__ __forceinline__ void chain_gated_chunk(const ChainOut& nx, uint2 g, uint2 u, uint2 s, int j, int lane,
                                                  int r = 0) {
    half2 x0, x1;
    lane_xh(gated4(g, u, nx.act), s, lane, x0, x1);
    const float f[4] = {__low2float(x0), __high2float(x0), __low2float(x1), __high2float(x1)};
    store_i8_chunk(nx.xb, nx.scales, nx.csum, r, j, nx.n >> 7, 1, lane, f);
}

// Decode chain (ChainOut, m = 1), run by the warp that finished output block `blk` of a product
// after it wrote y there: o0, o1 are this lane's 4 outputs (columns blk * 128 + lane * 4 ..).
// Writes the block's part of the next product's int8 input (see ChainOut in kernels.h).
__device__ __forceinline__ void chain_block(const ChainOut& nx, const half* y, half2 o0, half2 o1, int blk,
                                            int lane) {
    if (nx.mode == 1) {  // every load first (one round trip): this runs on the product's tail
        const uint2 rv = nx.res ? *reinterpret_cast<const uint2*>(nx.res + blk * 128 + lane * 4) : make_uint2(0u, 0u);
        NormedLoads l = normed_weights<false>(nx, nx.nseg, blk, lane);
        l.rv = rv;
        return chain_normed_segs(nx, o0, o1, blk, lane, l);
    }
    // mode 2: blocks j (gate) and j + nch (up) make chunk j of act(gate) * up. The first of the
    // two to finish only counts; the second reads the other's y through L2.
    const int nch = nx.n >> 7;
    const int j = blk < nch ? blk : blk - nch;
    const uint2 s = __ldg(reinterpret_cast<const uint2*>(nx.suh + j * 128 + lane * 4));
    fence_acq_rel_gpu();  // release: this warp's y before its count
    __syncwarp();
    int prev = 0;
    if (lane == 0) prev = atomicAdd(nx.pairs + j, 1);
    prev = __shfl_sync(0xffffffffu, prev, 0);
    if (prev == 0) return;
    fence_acq_rel_gpu();  // acquire: the other block's y
    const int other = blk < nch ? blk + nch : blk - nch;
    const uint2 ov = __ldcg(reinterpret_cast<const uint2*>(y + other * 128 + lane * 4));
    const uint2 own = make_uint2(as_u32(o0), as_u32(o1));
    chain_gated_chunk(nx, blk < nch ? own : ov, blk < nch ? ov : own, s, j, lane);
    if (lane == 0) nx.pairs[j] = 0;
}

}  // namespace trellis
