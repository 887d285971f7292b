// Fused EXL3 product for small batches, version 3: persistent warps over (column group, k row).
//
// Why this shape (csrc/PERF_NOTES.md has the measurements behind it):
// - At batch 1..32 the layer is bound by streaming the trellis and by the integer work of
//   decoding it. Each warp owns a contiguous range of "units" (one k row of 16 inputs times CT
//   adjacent 16-column tiles, CT*32K contiguous bytes), so the grid is exactly the resident
//   warps and every warp gets the same number of units whatever the shape: no wave tails.
// - A warp streams its units through a private cp.async ring (no block barrier). A stage holds
//   the unit's tiles plus that k row's activations, already in MMA fragment order (prep_x), so a
//   lane reads its B operand with one 16-byte shared load per k row and reuses it for CT tiles.
// - Every tile is decoded once, into the A operand of tensor-core MMAs that cover all rows.
// - Shared memory is indexed from the kernel's own extern array, so loads are LDS with
//   immediate offsets, not generic loads with 64-bit address arithmetic.
// - Partial sums go to the fp32 workspace with atomics only when a warp's range leaves a column
//   group (about twice per warp).
//
// Two arithmetic paths:
// - I8 (MUL1, m <= 8): decode stops after the multiply s * 0x83DCD12D; its four bytes are four k
//   slots of a u8 x s8 m16n8k32 MMA against the activation repeated in those slots (two int8
//   passes, hi + residual, about 15 bits; B columns are (row, pass)). Folded to fp32 with the
//   per-128 steps once per 8 k rows. About 2.4 integer ops per weight.
// - F16 (any codebook, m <= 32): fp16 decode into m16n8k16 A fragments.
#pragma once
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

#include "exl3_decode.cuh"
#include "exl3_gemv_finish.cuh"  // GvChain, the output stage and the finish kernels
#include "exl3_gemv_geom.cuh"
#include "exl3_mm.cuh"  // kMul1Inv, kMul1C0, kMul1Bias (MUL1 value = kMul1Inv * byte sum + kMul1C0)
#include "exl3_prep.cuh"
#include "kernels.h"

namespace trellis {

// K = 4 states from the lane's two words: A = word t-1, B = word t (the 48-bit window H = A's low
// 16 bits : B). State j is bits [28-4j, 44-4j) of H (the same states as state_at<4(j+1)>). Byte-
// aligned windows are one PRMT against zero; the odd-nibble ones come from one funnel shift of
// H by 4. 11 ALU ops for 8 states instead of 16.
// A12: the two states that reach into A take A's low 12 bits once (a12 = A & 0xfff) instead of
// one mask each: state 0 is then the funnel shift of a12 : B alone (nothing above bit 15), state 1
// one PRMT whose two top bytes are a12's zero byte 2. 10 ALU ops, the same states. Shipped on the
// integer path since session 32 (through lane_products_k4, with kLdsm), in K = 4 MUL1's
// block-shared forms where sa_decode_cfg says (sessions 45, 48) and on the per-warp fp16 path
// since session 51 (kF16A12).
template <bool A12 = false>
__device__ __forceinline__ void lane_states_k4(uint32_t A, uint32_t B, uint32_t st[8]) {
    const uint32_t V = __funnelshift_r(B, A, 4);  // H >> 4 (low 32 bits)
    const uint32_t a12 = A & 0xfffu;              // A12 only
    st[7] = B & 0xffffu;
    st[5] = __byte_perm(B, 0u, 0x4421);
    st[3] = B >> 16;
    st[1] = A12 ? __byte_perm(B, a12, 0x6643) : __byte_perm(B, A & 0xffu, 0x5543);
    st[6] = V & 0xffffu;
    st[4] = __byte_perm(V, 0u, 0x4421);
    st[2] = V >> 16;
    st[0] = A12 ? __funnelshift_r(B, a12, 28) : __funnelshift_r(B, A, 28) & 0xffffu;
}

// lane_states_k4 followed by the MUL1 multiply (x = s * 0x83DCD12D), with one of the four 32-bit
// windows split on the FMA pipe instead of the ALU pipe. The word B holds two states, hi = B >> 16
// and lo = B & 0xffff, and lo * M = B * M - (hi * M) << 16 (mod 2^32): the mask becomes one more
// IMAD, the instruction count stays. Why: the integer product at one row issues on only ~63% of
// cycles and math-pipe throttle is its largest stall (ncu); the ALU pipe, half rate on Hopper, did
// 11 of the decode's 19 integer operations per tile and the FMA pipe (IMAD, also half rate) 8.
// This is ~1% faster on the large layers. Splitting two windows (H >> 4 too) measured the same,
// all four (12 IMADs per tile) no faster, and one on the fp16 path (5..8 rows, whose IDP4As also
// take the FMA pipe) 1-2% slower (csrc/PERF_NOTES.md, session 15).
// A12: states 0 and 1 as lane_states_k4<true> takes them (19 -> 18 integer ops a tile, 10 -> 9 on
// the ALU pipe).
template <bool A12 = false>
__device__ __forceinline__ void lane_products_k4(uint32_t A, uint32_t B, uint32_t x[8]) {
    constexpr uint32_t M = 0x83DCD12Du;
    constexpr uint32_t kNegM16 = 0u - (M << 16);  // hi * kNegM16 = -(hi * M) << 16 (mod 2^32)
    const uint32_t V = __funnelshift_r(B, A, 4);  // as in lane_states_k4
    const uint32_t s3 = B >> 16;
    x[3] = s3 * M;
    x[7] = s3 * kNegM16 + B * M;  // (B & 0xffff) * M
    x[2] = (V >> 16) * M;
    x[6] = (V & 0xffffu) * M;
    const uint32_t a12 = A & 0xfffu;  // A12 only
    x[5] = __byte_perm(B, 0u, 0x4421) * M;
    x[1] = (A12 ? __byte_perm(B, a12, 0x6643) : __byte_perm(B, A & 0xffu, 0x5543)) * M;
    x[4] = __byte_perm(V, 0u, 0x4421) * M;
    x[0] = (A12 ? __funnelshift_r(B, a12, 28) : __funnelshift_r(B, A, 28) & 0xffffu) * M;
}

// The lane's 8 raw states of one tile, read from shared memory (words of the tile at `tile`).
template <int K, bool A12 = false>
__device__ __forceinline__ void gv_states(const uint32_t* smem, int tile, int wa, int wb, int wc,
                                          int shift, uint32_t st[8]) {
    if constexpr (K == 4) {
        lane_states_k4<A12>(smem[tile + wa], smem[tile + wb], st);
    } else {
        lane_states<K>(smem[tile + wa], smem[tile + wb], smem[tile + wc], shift, st);
    }
}

// An integer-path B lane's 4 registers from its packed word (the self prep slots' form): byte j of
// w repeated in the 4 bytes of register j, as the IMMAs take it.
__device__ __forceinline__ uint4 b_of_packed_word(uint32_t w) {
    return make_uint4(__byte_perm(w, 0u, 0x0000), __byte_perm(w, 0u, 0x1111), __byte_perm(w, 0u, 0x2222),
                      __byte_perm(w, 0u, 0x3333));
}

// Self prep (SP, decode at m = 1 on the integer path): the warp's lane preps its 4 values of one
// 128-chunk (x is already in `xv` order: prep_lane_xh) into the chunk slot at word `slot`:
// data word ((pass * 8 + k row) * 4 + cq) holds the int8 values a B lane (pass, cq) needs for
// that k row in its 4 byte slots (kk % 2 + 2 (kk / 8), the order of prep_frag's I8 layout, each
// byte to be repeated 4 times by the reader); then the two steps and each k row's sum of the
// dequantized values (the MUL1 constant part of that k row, added by the warp that takes it).
__device__ __forceinline__ void sp_store_chunk(uint32_t* slot, half2 o0, half2 o1, int lane) {
    const float f[4] = {__low2float(o0), __high2float(o0), __low2float(o1), __high2float(o1)};
    const Int8Chunk ch(f);
    int q1[4], q2[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) ch.levels(f[q], q1[q], q2[q]);
    const int krow = lane >> 2, kk0 = (lane & 3) * 4;
    const int cqa = (kk0 & 7) >> 1, h = kk0 >> 3;
    uint16_t* s16 = reinterpret_cast<uint16_t*>(slot);
#pragma unroll
    for (int p = 0; p < 2; ++p) {
        const int* v = p ? q2 : q1;
        const int w = (p * 8 + krow) * 4 + cqa;
        s16[w * 2 + h] = (uint16_t)((v[0] & 0xff) | ((v[1] & 0xff) << 8));
        s16[(w + 1) * 2 + h] = (uint16_t)((v[2] & 0xff) | ((v[3] & 0xff) << 8));
    }
    float rs = ch.s1 * (float)(q1[0] + q1[1] + q1[2] + q1[3]) + ch.s2 * (float)(q2[0] + q2[1] + q2[2] + q2[3]);
    rs += __shfl_xor_sync(0xffffffffu, rs, 1);
    rs += __shfl_xor_sync(0xffffffffu, rs, 2);
    if (lane == 0) {
        slot[kSpStepWord] = __float_as_uint(ch.s1);
        slot[kSpStepWord + 1] = __float_as_uint(ch.s2);
    }
    if ((lane & 3) == 0) slot[kSpRowSumWord + krow] = __float_as_uint(rs);
}

// MUL1's byte sums by the tensor cores (debug variants 21 and 40, kTcSum): the fp16 path's MUL1
// decode spends an IDP4A a weight on t, the byte sum of x = s * M (decode_pair_mul1_raw). Two u8 x s8
// MMAs make all 256 sums of a tile instead: their A is the integer path's (x[0], x[4], x[1], x[5]
// and x[2], x[6], x[3], x[7]: k slot group c holds step 2c's x in a0 / a1 and step 2c + 1's in
// a2 / a3), B selects group c into column 2c and group 4 + c into column 2c + 1 (b0 of lane (g,
// cq): ones where g = 2cq, b1: where g = 2cq + 1), and C is 0x6400 everywhere, so D holds the fp16
// bits of 1024 + t in the m16n8 accumulator layout, which is the m16n8k16 A fragment's (rows g,
// g + 8; k 2cq, 2cq + 1): one PRMT a pair packs them. 8 IDP4A a tile become 2 IMMA.
struct Mul1SumSelect {
    uint32_t b0, b1;
    __device__ __forceinline__ explicit Mul1SumSelect(int lane) {
        const int g = lane >> 2, cq = lane & 3;
        b0 = g == 2 * cq ? 0x01010101u : 0u;
        b1 = g == 2 * cq + 1 ? 0x01010101u : 0u;
    }
};
// x: the lane's 8 products (lane_products_k4); v as gv_decode_f16's (v[q]: steps 2q, 2q + 1). RAW: no
// affine step (decode_pair_mul1_raw's values), else decode_pair<CB_MUL1>'s.
template <bool RAW>
__device__ __forceinline__ void mul1_f16_by_mma(const uint32_t x[8], Mul1SumSelect sel, uint32_t v[4]) {
    int d[4], e[4];
    mma_16832_u8s8_plus(d, x[0], x[4], x[1], x[5], sel.b0, sel.b1, 0x6400);
    mma_16832_u8s8_plus(e, x[2], x[6], x[3], x[7], sel.b0, sel.b1, 0x6400);
    v[0] = __byte_perm(d[0], d[1], 0x5410);  // steps 0, 1
    v[2] = __byte_perm(d[2], d[3], 0x5410);  // steps 4, 5
    v[1] = __byte_perm(e[0], e[1], 0x5410);  // steps 2, 3
    v[3] = __byte_perm(e[2], e[3], 0x5410);  // steps 6, 7
    if constexpr (!RAW) {
        const half2 k_inv = as_h2(0x1EEE1EEEu);
        const half2 k_bias = as_h2(0xC931C931u);
#pragma unroll
        for (int q = 0; q < 4; ++q) v[q] = as_u32(__hfma2(as_h2(v[q]), k_inv, k_bias));
    }
}

// Tile decode of the fp16 path: the lane's 8 states of the tile at word `tile` of shared memory,
// as the 4 half2 registers of an m16n8k16 A fragment (v[0], v[2], v[1], v[3] in MMA order).
// RAW (MUL1 only): stop before MUL1's affine step (decode_pair_mul1_raw); the product applies it
// per output. TC (K = 4 MUL1): A12's products with their byte sums by MMAs (mul1_f16_by_mma, `sel`).
// PX (K = 4 MUL1 raw): the integer path's products (lane_products_k4<true>: A12, one window's mask
// by an IMAD), then the byte sums by IDP4A as shipped (mul1_raw_pair): 9 ALU ops and 9 IMADs for
// the states and products where lane_states_k4 takes 11 ALU ops and 8 IMADs.
template <int K, int CB, bool RAW = false, bool A12 = false, bool TC = false, bool PX = false>
__device__ __forceinline__ void gv_decode_f16(const uint32_t* smem, int tile, int wa, int wb, int wc, int shift,
                                              uint32_t v[4], Mul1SumSelect sel = Mul1SumSelect(0)) {
    static_assert(!RAW || CB == CB_MUL1, "only MUL1 has a raw decode");
    static_assert(!TC || (K == 4 && CB == CB_MUL1), "byte sums by MMAs: K = 4 MUL1");
    static_assert(!PX || (K == 4 && RAW && !TC), "the integer path's products: K = 4 MUL1, raw");
    if constexpr (TC) {
        uint32_t x[8];
        lane_products_k4<true>(smem[tile + wa], smem[tile + wb], x);
        mul1_f16_by_mma<RAW>(x, sel, v);
    } else if constexpr (PX) {
        uint32_t x[8];
        lane_products_k4<true>(smem[tile + wa], smem[tile + wb], x);
#pragma unroll
        for (int q = 0; q < 4; ++q) v[q] = mul1_raw_pair(x[2 * q], x[2 * q + 1]);
    } else {
        uint32_t st[8];
        gv_states<K, A12>(smem, tile, wa, wb, wc, shift, st);
#pragma unroll
        for (int q = 0; q < 4; ++q)
            v[q] = RAW ? decode_pair_mul1_raw(st[2 * q], st[2 * q + 1]) : decode_pair<CB>(st[2 * q], st[2 * q + 1]);
    }
}

// MUL1's affine step for the fp16 path, applied per output: the k row's B fragment times an A of
// ones adds sum(x) over the k row to `sacc` (the same D layout as the tile accumulators; columns
// g and g + 8 alike), one MMA per k row instead of one HFMA2 per weight pair and tile.
__device__ __forceinline__ void gv_mul1_row_sum(float (&sacc)[4], uint2 b) {
    constexpr uint32_t kOnes = 0x3C003C00u;
    mma_16816(sacc, kOnes, kOnes, kOnes, kOnes, b.x, b.y);
}

// The split products' atomics into z. ptxas makes an atomic whose result is unused a REDG (no
// answer from the L2) unless a fence may follow it; the kernels that carry the warps' output
// stage (gv_in_finish: the decode chain kernels, the debug variants off the shipped schedule)
// have that fence and so flushed by ATOMG until session 42, although split products never run the
// stage. ATOMG costs: every flush as ATOMG made 8 rows of 8192x28672 13% slower and 32 rows 38%
// (H100, session 41's A/B build, since removed). So the stage-carrying kernels write each flushed
// sum as an explicit `red`, a REDG although a fence may follow; the PTX memory model orders it
// before the completion count's release fence like any write. Measured (H100, session 42, while
// the two-group kernels still carried the stage): 12 and 16 rows of mid-size layers 0.8-8.3%
// faster, decode at batch 12 / 16 +1.8-3.0%, batch 1 417.0 / 399.9 against 419.1 / 416.6 tok/s
// (two passes each). Only those kernels: an inline-asm `red` everywhere also renumbered the
// registers of kernels that already flushed by REDG (session 41). TRELLIS_FLUSH_ATOMIC (an A/B
// build, TRELLIS_NVCC_DEFINES in engine/ops/build.py): atomicAdd there too, as shipped until
// session 42.
#ifdef TRELLIS_FLUSH_ATOMIC
constexpr bool kFlushRed = false;
#else
constexpr bool kFlushRed = true;
#endif

// kStage: the kernel carries the warps' output stage (gv_in_finish).
template <bool kStage>
__device__ __forceinline__ void add_to_workspace(float* p, float v) {
    if constexpr (kStage && kFlushRed) {
        asm volatile("red.relaxed.gpu.global.add.f32 [%0], %1;\n" ::"l"(p), "f"(v));
    } else {
        atomicAdd(p, v);
    }
}

// fp16 path: add a warp's partial sums of column group `grp` (CT tiles, NG groups of 8 rows) to
// z. D fragment: c0/c1 = (out col g, rows 2cq, 2cq + 1), c2/c3 = the same for col g + 8.
// MUL1 (the raw decode): each sum is k_inv * acc + k_bias * sacc, sacc the rows' sums of x.
template <int NG, int CT, bool MUL1 = false, bool kStage = false>
__device__ __forceinline__ void gv_flush_f16(float* __restrict__ z, const float (&acc)[NG][CT][4], int grp, int m,
                                             int out, int lane, const float (*sacc)[4] = nullptr) {
    const int g = lane >> 2, cq = lane & 3;
#pragma unroll
    for (int gr = 0; gr < NG; ++gr) {
        auto val = [&](int ct, int q) {
            return MUL1 ? fmaf(kMul1Inv, acc[gr][ct][q], kMul1Bias * sacc[gr][q & 1]) : acc[gr][ct][q];
        };
#pragma unroll
        for (int ct = 0; ct < CT; ++ct) {
            const int col = (grp * CT + ct) * 16 + g;
            const int row = gr * 8 + 2 * cq;
            if (row < m) {
                add_to_workspace<kStage>(z + (size_t)row * out + col, val(ct, 0));
                add_to_workspace<kStage>(z + (size_t)row * out + col + 8, val(ct, 2));
            }
            if (row + 1 < m) {
                add_to_workspace<kStage>(z + (size_t)(row + 1) * out + col, val(ct, 1));
                add_to_workspace<kStage>(z + (size_t)(row + 1) * out + col + 8, val(ct, 3));
            }
        }
    }
}

// The completion count of block blk: the warp adds the k rows it did (after its atomics, fenced);
// true for the warp whose count completes the block's `total`.
__device__ __forceinline__ bool gv_count_block(int* __restrict__ counters, int blk, int units, int total, int lane) {
    fence_acq_rel_gpu();  // release: this warp's atomics to z before its count
    __syncwarp();
    int prev = 0;
    if (lane == 0) prev = atomicAdd(counters + blk, units);
    prev = __shfl_sync(0xffffffffu, prev, 0);
    return prev + units == total;
}

// Finished 128-column blocks whose remaining work a warp runs after its main loop, where the
// loop's registers are free: a many-row product's output transform (8 rows per round trip), a
// decode chain's output. Up to four 16-bit block indices, newest in the low bits; add() refuses a
// fifth (the output transform then runs at once, row by row; chains never need one, the host's
// gemv_chain_fits makes sure).
struct GvBlockList {
    uint64_t blocks = 0;
    int n = 0;
    __device__ __forceinline__ bool add(int blk) {
        if (n == 4 || blk > 0xffff) return false;
        blocks = blocks << 16 | (uint64_t)blk;
        ++n;
        return true;
    }
    template <typename F>
    __device__ __forceinline__ void drain(F&& f) {
        for (; n > 0; --n, blocks >>= 16) f((int)(blocks & 0xffffu));
    }
};

// VAR: timing probes (0 normal, 1 no decode: raw words as operands, 2 no MMA, 3 each warp's
// trellis read as one contiguous stream instead of k rows a layer's width apart: wrong values,
// the same work, to time the memory layout; the split of a small product's fixed cost: 4 the
// launch alone (every warp returns after the PDL wait), 5 no split-k tail (no atomics, no
// completion count, no output stage), 6 the atomics but no completion count or output stage;
// 7, K = 4 integer path: the right results with all of the state extraction on the ALU pipe (the
// previous version; the shipped kernel splits one window onto the FMA pipe, lane_products_k4);
// 8, K = 4: the right results with A's 12 low bits masked once (lane_states_k4's A12), in the
// shipped configurations, the integer path's words by shared loads (no kLdsm); 21, K = 4 MUL1 fp16
// path: A12 with the byte sums by MMAs, kTcSum; 22, K = 4 integer path: session 31's shipped decode,
// two masks and shared loads).
template <int K, int CB, int PATH, int NG, int VAR, int CFG, bool SP, bool CH>
__global__ void __launch_bounds__(kGvWarps * 32, GvShape<PATH, NG, CFG>::MINB)
exl3_gemv_kernel(const PrepInput pin, const half* __restrict__ suh,  // SP only
                 const uint32_t* __restrict__ xb,       // fragment-ordered activations
                 const float2* __restrict__ scales,     // I8: [m, in/128] steps of the 2 passes
                 const float* __restrict__ csum,        // I8: [m, in/128] chunk sums of xh
                 const uint32_t* __restrict__ trellis, float* __restrict__ z, int m, int in,
                 int out, half* __restrict__ y, int ldy, const half* __restrict__ svh,
                 const half* __restrict__ bias, int* __restrict__ counters, int seg_c1, int seg_c2,
                 int seg_c3, int early_trigger, int finish_rows, float* __restrict__ zero_after, int zero_n,
                 const __grid_constant__ GvChainArg<CH> chain) {
    static_assert(!SP || (PATH == GV_I8 && NG == 1), "self prep: integer path, one row");
    constexpr bool kInFinish = gv_in_finish(VAR, CH, NG);  // finish_rows > 0 possible (unsplit)
    using S = GvShape<PATH, NG, CFG>;
    constexpr int CT = S::CT;
    constexpr int NS = gv_ring_stages<K, PATH, NG, CFG, SP>();
    constexpr int SW = gv_stage_words<K, PATH, NG, CFG, SP>();
    constexpr int KR = S::KR;
    constexpr int RW = gv_row_words<K, PATH, NG, CFG, SP>();
    constexpr int TW = 8 * K;  // words per tile
    extern __shared__ __align__(16) uint32_t gv_smem[];

    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int tk = in >> 4;
    const int tn = out >> 4;
    const int groups = tn / CT;
    const int rows_kr = tk / KR;  // units per column group (tk is a multiple of 8)
    const long units = (long)groups * rows_kr;
    const long nwarps = (long)gridDim.x * kGvWarps;
    const long gw = (long)blockIdx.x * kGvWarps + warp;
    const long u0 = units * gw / nwarps;
    const long u1 = units * (gw + 1) / nwarps;
    // The open sums this product's prep read (MmArgs::zero_after): zeroed once that prep is done,
    // a 16-byte store per lane by the grid's first warps (a few KB at one row).
    auto zero_consumed = [&]() {
        for (long i = (gw * 32 + lane) * 4; i < zero_n; i += nwarps * 128)
            __stcg(reinterpret_cast<float4*>(zero_after + i), make_float4(0.f, 0.f, 0.f, 0.f));
    };
    if constexpr (VAR == 4) {
        pdl_wait_primary();
        if (zero_after) zero_consumed();
        return;
    }
    if (!SP && u0 >= u1) {
        if (zero_after) {
            pdl_wait_primary();
            zero_consumed();
        }
        return;  // SP: the block's norm statistics need every warp (a barrier)
    }
    const int n_units = (int)(u1 - u0);
    const int ring = warp * NS * SW;
    const uint32_t ring_sa = static_cast<uint32_t>(__cvta_generic_to_shared(gv_smem + ring));

    // Which lanes carry activations: group gr covers rows [gr*RPG, gr*RPG + RPG).
    bool has_b[NG];
#pragma unroll
    for (int gr = 0; gr < NG; ++gr) {
        const int row = gr * S::ROWS_PER_GROUP + (PATH == GV_I8 ? (lane >> 3) : (lane >> 2));
        has_b[gr] = row < m;
    }

    // Producer state: the next unit to fetch, as (column group, k row), with running source
    // pointers (already offset by this lane's 16-byte chunk) so that a fetch is a few adds.
    constexpr int kChunks = CT * TW / 4;    // 16-byte chunks of trellis per unit
    constexpr int kBChunks = PATH == GV_I8 ? 0 : NG * 16;  // F16 fragments: NG x 256 bytes
    int p_grp = (int)(u0 / rows_kr);
    int p_row = (int)(u0 - (long)p_grp * rows_kr) * KR;
    const int p_grp0 = p_grp, p_row0 = p_row;  // SP: where the warp's chunks start
    int p_slot = 0;
    const size_t row_step = (size_t)tn * TW;  // words from one k row of tiles to the next
    const uint32_t* p_src = trellis + (size_t)p_row * row_step + (size_t)p_grp * CT * TW + lane * 4;
    if constexpr (VAR == 3) p_src = trellis + (size_t)u0 * KR * CT * TW + lane * 4;  // probe: one stream
    const size_t src_row = VAR == 3 ? (size_t)CT * TW : row_step;  // source words from a unit's k row to the next
    constexpr int kBRowWords = NG * 32 * S::BW;  // activation words per k row
    constexpr int kBLaneWords = PATH == GV_I8 ? S::BW : 4;  // source words before this lane's chunk
    // Grouped products (q/k/v or gate/up in one launch): the trellis of up to four linears that
    // share an input is concatenated along the columns, and segment s (columns from seg_cs) has
    // its own input signs, so its own activations: xb holds one k-row series per segment.
    auto seg_of = [&](int grp) {
        const int c = grp * CT * 16;
        return (int)(c >= seg_c1) + (int)(c >= seg_c2) + (int)(c >= seg_c3);
    };
    const size_t seg_words = (size_t)tk * kBRowWords;
    const uint32_t* p_b = xb + seg_of(p_grp) * seg_words + (size_t)p_row * kBRowWords + lane * kBLaneWords;
    // A stage is one unit's trellis plus its k row's activations; `weights` / `acts` select
    // which of the two to fetch (the prologue fetches them apart, see below).
    auto issue = [&](int s, bool weights, bool acts) {
        if (s < n_units) {
#pragma unroll
            for (int kr = 0; kr < KR; ++kr) {
                const uint32_t dst = ring_sa + (uint32_t)(p_slot * SW + kr * RW + lane * 4) * 4u;
                if (weights) {
#pragma unroll
                    for (int c0 = 0; c0 < kChunks; c0 += 32) {
                        if (kChunks % 32 == 0 || c0 + lane < kChunks)
                            gv_cp16(dst + c0 * 16, p_src + kr * src_row + c0 * 4);
                    }
                }
                if (acts && !SP) {
                    const uint32_t* b = p_b + kr * kBRowWords;
                    if constexpr (PATH == GV_I8) {
                        // 16 bytes per lane per group, only for lanes whose B column is a real row.
#pragma unroll
                        for (int gr = 0; gr < NG; ++gr)
                            if (has_b[gr]) gv_cp16(dst + (CT * TW + gr * 128) * 4, b + gr * 128);
                    } else {
#pragma unroll
                        for (int c0 = 0; c0 < kBChunks; c0 += 32) {
                            if (kBChunks % 32 == 0 || c0 + lane < kBChunks)
                                gv_cp16(dst + (CT * TW + c0 * 4) * 4, b + c0 * 4);
                        }
                    }
                }
            }
            p_slot = p_slot + 1 == NS ? 0 : p_slot + 1;
            p_src += KR * src_row;
            p_b += KR * kBRowWords;
            if ((p_row += KR) == tk) {
                p_row = 0;
                ++p_grp;
                if constexpr (VAR != 3) p_src = trellis + (size_t)p_grp * CT * TW + lane * 4;
                p_b = xb + seg_of(p_grp) * seg_words + lane * kBLaneWords;
            }
        }
        if (acts || (SP && weights)) cp_async_commit();  // SP: each stage its own group
    };

    // SP: the chunks the warp's units touch, in the order it takes them (at most kSpSlots: the
    // host's gemv_self_prep makes sure). k(): this lane's first input index of the chunk.
    struct SpWalk {
        int grp, row, left;  // the chunk's column group and first k row; units from there on
        __device__ __forceinline__ int k(int lane) const { return (row >> 3) * 128 + lane * 4; }
        __device__ __forceinline__ SpWalk next(int tk) const {
            const int rows_here = min(((row >> 3) + 1) * 8, tk) - row;
            SpWalk w{grp, row + rows_here, left - rows_here / KR};
            if (w.row == tk) w.row = 0, ++w.grp;
            return w;
        }
    };
    const SpWalk sp_first{p_grp0, p_row0, u1 > u0 ? n_units : 0};

    // Prologue. Launched with programmatic dependent launch, this kernel runs while the prep
    // kernel that writes xb (and the I8 scales) may still be running: the trellis, a weight, is
    // fetched first; activations, workspace and counters only after pdl_wait_primary. The
    // trellis fetches join the first commit group, so stage s is complete when group s is.
    {
        const int grp0 = p_grp, row0 = p_row;
        const uint32_t *src0 = p_src, *b0 = p_b;
#pragma unroll
        for (int s = 0; s < NS - 1; ++s) issue(s, true, false);
        // Trigger mode 1: the kernel after this one (glue that waits for this grid before it
        // reads anything) may launch now. The grid is all resident by now (one wave), so its
        // blocks take only what this grid leaves free. Not the default: the product after that
        // glue then also starts early and its trellis prefetch competes with this one for DRAM
        // (mode 2, at the tail, is the default; see the main loop).
        if (early_trigger == 1) pdl_launch_dependents();
        if constexpr (SP) {  // the prep's weights into L2 while the previous kernel runs
            SpWalk w = sp_first;
            for (int j = 0; j < kSpSlots && w.left > 0; ++j, w = w.next(tk)) {
                asm volatile("prefetch.global.L2 [%0];" ::"l"(suh + (size_t)seg_of(w.grp) * in + w.k(lane)));
                if (pin.norm_w) asm volatile("prefetch.global.L2 [%0];" ::"l"(pin.norm_w + w.k(lane)));
            }
        }
        pdl_wait_primary();
        if constexpr (!SP) {
            p_grp = grp0, p_row = row0, p_slot = 0, p_src = src0, p_b = b0;
#pragma unroll
            for (int s = 0; s < NS - 1; ++s) issue(s, false, true);
        }
        if (zero_after) zero_consumed();  // after the activation fetches, off their path
    }

    // Self prep: each warp preps the 128-chunks its units touch, in the order it takes them,
    // into its own slots (sp_store_chunk), so no prep kernel, no activation round trip through
    // global memory and no kernel boundary sit between the previous product and this one. The
    // norm's row statistics are the block's (one read of the row per block).
    const int sp_base = kGvWarps * NS * SW + warp * kSpSlots * kSpSlotWords;
    if constexpr (SP) {
        const float inv = pin.norm_w ? block_row_inv(pin, 0, 0, 0, in) : 0.f;
        if (pin.res && blockIdx.x == 0) {  // the residual stream x + residual, once
            for (int k = threadIdx.x * 4; k < in; k += kGvWarps * 128)
                *reinterpret_cast<uint2*>(pin.res_out + k) = norm_input(pin, 0, k);
        }
        if (u0 >= u1) return;
        // Two chunks per step, loaded together and transformed as two independent chains of
        // shuffles (a chunk is ~30 dependent ones: measured on the H200, one chunk at a time made
        // the prologue of 8-chunk warps cost more than the prep kernel it replaces). Without a
        // second chunk the step repeats the first into the next (unused) slot, so the code has no
        // branch the compiler would have to schedule around.
        SpWalk w = sp_first;
        for (int j = 0; j < kSpSlots && w.left > 0; j += 2) {
            const SpWalk w1 = w.next(tk);
            const SpWalk wl = j + 1 < kSpSlots && w1.left > 0 ? w1 : w;
            const LaneRaw ra(pin, 0, w.k(lane)), rb(pin, 0, wl.k(lane));
            const PrepWeights ta(pin, suh + (size_t)seg_of(w.grp) * in, w.k(lane));
            const PrepWeights tb(pin, suh + (size_t)seg_of(wl.grp) * in, wl.k(lane));
            half2 a0, a1, b0, b1;
            lane_xh(lane_input(pin, ra, inv, ta.norm_w), ta.suh, lane, a0, a1);
            lane_xh(lane_input(pin, rb, inv, tb.norm_w), tb.suh, lane, b0, b1);
            sp_store_chunk(gv_smem + sp_base + j * kSpSlotWords, a0, a1, lane);
            static_assert(kSpSlots % 2 == 0, "slots are filled in pairs");
            sp_store_chunk(gv_smem + sp_base + (j + 1) * kSpSlotWords, b0, b1, lane);
            w = w1.next(tk);
        }
        __syncwarp();
    }

    int wa, wb, wc, shift;
    lane_words<K>(lane, wa, wb, wc, shift);
    // K = 4 integer path (kLdsm, shipped since session 32): the words of four tiles by one
    // ldmatrix, lane i giving the address of chunk i % 8 of tile i / 8, so that lane l gets word l
    // of each (its B); its A, word l - 1 (wa), is the lane before's B, one shuffle a tile: 10
    // shared-memory instructions per k row of 8 tiles instead of 16 loads; then the A12 decode.
    // 51 fewer instructions a unit of 32 tiles at CFG 10 (SASS). On an H100: 2-3% faster at
    // 14336x4096 and 4096x4096, ~0.9% slower at 8192x28672, a decode step 1-2% faster
    // (csrc/PERF_NOTES.md, session 32). Not in the previous forms (variants 7, 8 and 22), the
    // no-decode probe (1), or the self-prepping and in-warp chain kernels (off by default; the
    // self-prepping one spilled with it at CFG 9).
    constexpr bool kLdsm = K == 4 && PATH == GV_I8 && CT % 4 == 0 && !SP && !CH && VAR != 1 && VAR != 7 &&
                           VAR != kGvVarA12 && VAR != kGvVarS31;
    const uint32_t smem_sa = static_cast<uint32_t>(__cvta_generic_to_shared(gv_smem));
    const uint32_t ldsm_lane = (uint32_t)((lane >> 3) * TW + (lane & 7) * 4) * 4u;
    const int lane_before = (lane + 31) & 31;  // wa's lane for K = 4
    // Debug variant 21 (kGvVarTcSum): the fp16 path's MUL1 byte sums by two MMAs a tile, A12's states.
    constexpr bool kTcSum = VAR == kGvVarTcSum && K == 4 && CB == CB_MUL1 && PATH == GV_F16;
    // The fp16 path's K = 4 states with A masked once (A12, any codebook) since session 51: one ALU
    // op a tile less on the pipe that is its busiest (ncu, 8 rows: ALU 64%, csrc/PERF_NOTES.md
    // session 43). On an H100 0.5-3.0% faster at 5..8 rows (8192x28672 at 8 rows 51.0 against 52.6
    // us), -2.0..+0.9% at 9..16 rows of mid-size layers (session 51; session 32 had 0.9-2.9% at 8
    // rows). Debug variant 64 keeps the form before (two masks).
    constexpr bool kF16A12 = VAR != kGvVarF16NoA12;
    const Mul1SumSelect tc_select(lane);
    const int g = lane >> 2;
    const int cq = lane & 3;

    // Consumer state.
    int c_grp = (int)(u0 / rows_kr);
    int c_row = (int)(u0 - (long)c_grp * rows_kr) * KR;
    int c_slot = 0;
    int c_seg = seg_of(c_grp);  // I8: which segment's scales and sums
    bool seg_has_row0 = c_row == 0;  // this warp's part of the current column group starts at k row 0
    int seg_units = 0;               // k rows of the current column group done by this warp
    const int nch = in >> 7;

    int c_slot_sp = 0;  // SP: the chunk slot of the current k row
    float cpart = 0.f;  // SP: sum of the dequantized input over this warp's k rows of the group
    // I8 accumulators: integer per 128-chunk, folded into fp32.
    int iacc[NG][CT][4];
    float facc[NG][CT][2];
    float cadd[NG];
    float2 cur_sc[NG];
    // F16 accumulators. MUL1 with one group of 8 rows: of 1024 + t, with the rows' sums of x in
    // sacc (gv_mul1_row_sum, gv_flush_f16): 8-10% faster at 5..8 rows of large layers. With
    // more groups the registers it takes cost more than the HFMA2s it saves (7% slower at 16
    // rows; csrc/PERF_NOTES.md, session 10); the block-shared kernel (17..32 rows of large
    // layers) takes its row sums from its slice's copy of the activations instead (session 27).
    float acc[NG][CT][4];
    constexpr bool kRawMul1 = PATH == GV_F16 && CB == CB_MUL1 && NG == 1;
    float sacc[NG][4];

    auto zero_acc = [&]() {
        cpart = 0.f;
#pragma unroll
        for (int gr = 0; gr < NG; ++gr) {
            cadd[gr] = 0.f;
#pragma unroll
            for (int ct = 0; ct < CT; ++ct) {
#pragma unroll
                for (int q = 0; q < 4; ++q) {
                    if constexpr (PATH == GV_I8) iacc[gr][ct][q] = 0; else acc[gr][ct][q] = 0.f;
                }
                facc[gr][ct][0] = facc[gr][ct][1] = 0.f;
            }
#pragma unroll
            for (int q = 0; q < 4; ++q) sacc[gr][q] = 0.f;
        }
    };
    auto load_scales = [&]() {
        if constexpr (SP) {
            const uint32_t* slot = gv_smem + sp_base + c_slot_sp * kSpSlotWords;
            cur_sc[0] = cq == 0 ? make_float2(__uint_as_float(slot[kSpStepWord]), __uint_as_float(slot[kSpStepWord + 1]))
                                : make_float2(0.f, 0.f);
        } else if constexpr (PATH == GV_I8) {
            const int ch = c_row >> 3;
#pragma unroll
            for (int gr = 0; gr < NG; ++gr) {
                const int row = gr * 4 + cq;
                cur_sc[gr] = row < m ? scales[((size_t)c_seg * m + row) * nch + ch] : make_float2(0.f, 0.f);
            }
        }
    };
    auto fold = [&]() {
        if constexpr (PATH == GV_I8) {
#pragma unroll
            for (int gr = 0; gr < NG; ++gr) {
#pragma unroll
                for (int ct = 0; ct < CT; ++ct) {
                    facc[gr][ct][0] = fmaf(cur_sc[gr].y, (float)iacc[gr][ct][1], fmaf(cur_sc[gr].x, (float)iacc[gr][ct][0], facc[gr][ct][0]));
                    facc[gr][ct][1] = fmaf(cur_sc[gr].y, (float)iacc[gr][ct][3], fmaf(cur_sc[gr].x, (float)iacc[gr][ct][2], facc[gr][ct][1]));
                    iacc[gr][ct][0] = iacc[gr][ct][1] = iacc[gr][ct][2] = iacc[gr][ct][3] = 0;
                }
            }
        }
    };
    // Add this warp's partial sums for column group c_grp to z.
    auto flush = [&]() {
        if constexpr (PATH == GV_I8 && !SP) {
            // The constant part of MUL1 (kMul1C0 per weight) adds kMul1C0 * sum(xh row) to every
            // output column; exactly one warp per column group (the one holding k row 0) adds it.
            // (SP: every warp adds its own k rows' part, cpart.)
            // The row sums over all nch chunks are taken by the whole warp (a strided share per
            // lane, then a butterfly), one memory round trip instead of nch / 4 dependent ones
            // on the warp that holds k row 0 (SASS: the serial loop sat on the kernel's tail).
            // Not where the finish kernel adds it (finish_rows 0, the split finish: GvC0), which
            // gathers the sums before its PDL wait, off the product's tail (variant 41: here).
            if (seg_has_row0 && (finish_rows || VAR == kGvVarC0Tail)) {
#pragma unroll
                for (int gr = 0; gr < NG; ++gr) {
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        const int row = gr * 4 + j;
                        float t = 0.f;
                        if (row < m)
                            for (int c = lane; c < nch; c += 32) t += csum[((size_t)c_seg * m + row) * nch + c];
                        t = warp_sum(t);
                        if (cq == j) cadd[gr] = t;
                    }
                }
            }
        }
        if constexpr (PATH == GV_I8) {
#pragma unroll
            for (int gr = 0; gr < NG; ++gr) {
#pragma unroll
                for (int ct = 0; ct < CT; ++ct) {
                    const int col = (c_grp * CT + ct) * 16 + g;
                    // D: c0/c1 = (out col g, row cq pass 1/2), c2/c3 = the same for col g+8.
                    const int row = gr * 4 + cq;
                    if (row < m) {
                        const float base = SP ? kMul1C0 * cpart : seg_has_row0 ? kMul1C0 * cadd[gr] : 0.f;
                        add_to_workspace<kInFinish>(z + (size_t)row * out + col, kMul1Inv * facc[gr][ct][0] + base);
                        add_to_workspace<kInFinish>(z + (size_t)row * out + col + 8, kMul1Inv * facc[gr][ct][1] + base);
                    }
                }
            }
        } else {
            gv_flush_f16<NG, CT, kRawMul1, kInFinish>(z, acc, c_grp, m, out, lane, sacc);
        }
    };

    // Fused output stage: the warp that completes a 128-column block (every k row of every
    // column group in it, counted in `counters`) applies had128 / sqrt(128), svh and bias, writes
    // y and zeroes the block's workspace and counter, so no separate kernel runs after the
    // product. The fence orders this warp's atomics before its count; the finisher reads z
    // through L2 (__ldcg) after the count shows every contribution.
    // The block's output scales and bias (weights) are read before the flush's atomics, so their
    // DRAM latency overlaps those and the fence instead of following the completion count.
    GvBlockList chained;   // blocks whose chain output is still to write (gv_chain_block)
    GvBlockList deferred;  // fp16 path: blocks whose output transform runs after the main loop
    auto finish_block = [&](uint2 sv, uint2 bv) {
        const int blk = (c_grp * CT) >> 3;
        if (!gv_count_block(counters, blk, seg_units, tk * (8 / CT), lane)) return;
        if constexpr (CH) {
            gv_finish_block<true>(z, y, ldy, sv, bv, bias != nullptr, m, out, blk, lane, in, &chain);
        } else if (PATH == GV_I8 || finish_rows == 1 || !deferred.add(blk)) {
            gv_finish_block<false>(z, y, ldy, sv, bv, bias != nullptr, m, out, blk, lane, in, nullptr);
        }
        if (lane == 0) counters[blk] = 0;
        if constexpr (CH) {
            if (chain.next.mode) chained.add(blk);  // its chain output after the main loop
        }
    };

    zero_acc();
    load_scales();
    for (int s = 0; s < n_units; ++s) {
        cp_async_wait<NS - 2>();
        __syncwarp();
        issue(s + NS - 1, true, true);
        const int stage = ring + c_slot * SW;
        c_slot = c_slot + 1 == NS ? 0 : c_slot + 1;
#pragma unroll
        for (int kr = 0; kr < KR; ++kr) {
            const int base = stage + kr * RW;

            if constexpr (PATH == GV_I8) {
                uint4 b[NG];
                if constexpr (SP) {
                    const uint32_t* slot = gv_smem + sp_base + c_slot_sp * kSpSlotWords;
                    const int krow = (c_row + kr) & 7;
                    const uint32_t w = lane < 8 ? slot[((lane >> 2) * 8 + krow) * 4 + (lane & 3)] : 0u;
                    b[0] = b_of_packed_word(w);
                    cpart += __uint_as_float(slot[kSpRowSumWord + krow]);
                } else {
#pragma unroll
                    for (int gr = 0; gr < NG; ++gr) {
                        const int ba = base + CT * TW + (gr * 32 + lane) * 4;
                        b[gr] = has_b[gr] ? *reinterpret_cast<const uint4*>(gv_smem + ba) : make_uint4(0u, 0u, 0u, 0u);
                    }
                }
                // kLdsm: the k row's words, B by ldmatrix (four tiles a load), A from the lane before.
                uint32_t wA[kLdsm ? CT : 1], wB[kLdsm ? CT : 1];
                if constexpr (kLdsm) {
#pragma unroll
                    for (int h = 0; h < CT; h += 4)
                        ldmatrix_x4(smem_sa + (uint32_t)(base + h * TW) * 4u + ldsm_lane, wB[h], wB[h + 1], wB[h + 2], wB[h + 3]);
#pragma unroll
                    for (int ct = 0; ct < CT; ++ct) wA[ct] = __shfl_sync(0xffffffffu, wB[ct], lane_before);
                }
#pragma unroll
                for (int ct = 0; ct < CT; ++ct) {
                    const int tile = base + ct * TW;
                    uint32_t x[8];
                    if constexpr (VAR == 1) {
#pragma unroll
                        for (int q = 0; q < 8; ++q) x[q] = gv_smem[tile + (q & 1 ? wb : wa)] + q;
                    } else if constexpr (kLdsm) {
                        lane_products_k4<true>(wA[ct], wB[ct], x);
                    } else if constexpr (K == 4 && VAR != 7) {  // one window on the FMA pipe
                        lane_products_k4<VAR == kGvVarA12>(gv_smem[tile + wa], gv_smem[tile + wb], x);
                    } else {
                        gv_states<K>(gv_smem, tile, wa, wb, wc, shift, x);
#pragma unroll
                        for (int q = 0; q < 8; ++q) x[q] *= 0x83DCD12Du;
                    }
                    if constexpr (VAR == 2) {
                        iacc[0][ct][0] += x[0] ^ x[1] ^ x[2] ^ x[3] ^ x[4] ^ x[5] ^ x[6] ^ x[7];
                    } else {
#pragma unroll
                        for (int gr = 0; gr < NG; ++gr) {
                            mma_16832_u8s8(iacc[gr][ct], x[0], x[4], x[1], x[5], b[gr].x, b[gr].y);
                            mma_16832_u8s8(iacc[gr][ct], x[2], x[6], x[3], x[7], b[gr].z, b[gr].w);
                        }
                    }
                }
            } else {
                uint2 b[NG];
#pragma unroll
                for (int gr = 0; gr < NG; ++gr) {
                    const int ba = base + CT * TW + (gr * 32 + lane) * 2;
                    b[gr] = has_b[gr] ? *reinterpret_cast<const uint2*>(gv_smem + ba) : make_uint2(0u, 0u);
                    if constexpr (kRawMul1) gv_mul1_row_sum(sacc[gr], b[gr]);
                }
#pragma unroll
                for (int ct = 0; ct < CT; ++ct) {
                    const int tile = base + ct * TW;
                    uint32_t v[4];
                    if constexpr (VAR == 1) {
                        v[0] = gv_smem[tile + wa]; v[1] = gv_smem[tile + wb]; v[2] = v[0] ^ 0x3c003c00u; v[3] = v[1] ^ 0x3c003c00u;
                    } else {
                        gv_decode_f16<K, CB, kRawMul1, kF16A12, kTcSum>(gv_smem, tile, wa, wb, wc, shift, v,
                                                                        tc_select);
                    }
                    if constexpr (VAR == 2) {
                        acc[0][ct][0] += __uint_as_float((v[0] ^ v[1] ^ v[2] ^ v[3]) & 0x00ffffffu);
                    } else {
#pragma unroll
                        for (int gr = 0; gr < NG; ++gr) mma_16816(acc[gr][ct], v[0], v[2], v[1], v[3], b[gr].x, b[gr].y);
                    }
                }
            }
        }

        // Advance the consumer: fold at the end of each 128-wide chunk, flush at the end of a
        // column group.
        const bool last = s + 1 == n_units;
        const bool chunk_end = ((c_row + KR - 1) & 7) == 7 || c_row + KR == tk || last;
        if (chunk_end) fold();
        seg_units += KR;
        if ((c_row += KR) == tk || last) {
            // Mode 2: the next kernel may launch once every warp is past its stream (its blocks
            // then take what the finished ones leave, and prefetch during this tail).
            if (last && early_trigger == 2) pdl_launch_dependents();
            uint2 sv = make_uint2(0u, 0u), bv = make_uint2(0u, 0u);
            if constexpr (VAR == 5) {  // probe: keep the sums alive without the tail
                float t = 0.f;
#pragma unroll
                for (int gr = 0; gr < NG; ++gr)
#pragma unroll
                    for (int ct = 0; ct < CT; ++ct)
                        t += PATH == GV_I8 ? facc[gr][ct][0] + facc[gr][ct][1] : acc[gr][ct][0] + acc[gr][ct][3];
                if (t == 1.25e-37f) z[lane] = t;
            } else {
                // finish_rows 0: gv_finish_kernel transforms the output after this kernel (no count).
                if (kInFinish && y && VAR != 6 && finish_rows) gv_block_weights(svh, bias, (c_grp * CT) >> 3, lane, sv, bv);
                flush();
                if (kInFinish && y && VAR != 6 && finish_rows) finish_block(sv, bv);
            }
            if (!last) {
                zero_acc();
                c_row = 0;
                ++c_grp;
                c_seg = seg_of(c_grp);
                seg_has_row0 = true;
                seg_units = 0;
            }
        }
        if (chunk_end && !last) {
            if constexpr (SP) ++c_slot_sp;
            load_scales();
        }
    }
    if constexpr (CH) chained.drain([&](int blk) { gv_chain_block(&chain.next, y, blk, lane); });
    if constexpr (PATH == GV_F16 && kInFinish)
        deferred.drain([&](int blk) { gv_finish_block_rows8(z, y, ldy, svh, bias, m, out, blk, lane); });
    cp_async_wait<0>();
}

template <bool CH>
GvChainArg<CH> chain_arg(const MmArgs& a) {
    if constexpr (CH) {
        return GvChain{a.in_part, a.in_eps, a.next};
    } else {
        return GvNoChain{};
    }
}

// Host side: grid = resident warps (MINB blocks of 8 warps per SM), capped so that every warp has
// at least gemv_min_units() units (gv_blocks).
template <int K, int CB, int PATH, int NG, int VAR, int CFG = 0, bool SP = false, bool CH = false>
cudaError_t launch_gemv_var(const MmArgs& a, cudaStream_t stream) {
    using S = GvShape<PATH, NG, CFG>;
    const long units = (long)(a.out / 16 / S::CT) * (a.in / 16 / S::KR);
    // The grid cap (gv_blocks) counts units of two k rows for four-row units, so that CFG 10 keeps
    // the grid CFG 9 would have.
    const long blocks = gv_blocks(S::KR > 2 ? units * S::KR / 2 : units, S::MINB, a.num_sms);
    const size_t smem = gv_capped_smem((size_t)gv_smem_words<K, PATH, NG, CFG, SP>() * 4, S::MINB);
    const PrepInput pin = prep_input(a.x, a.ldx, a.up, a.ldu, a.act, a.norm);
    // finish_rows 0: the output transform runs in gv_finish_kernel after the product (fp16 path:
    // 9..32 rows with gemv_split_finish 2, 1..8 too with 3; the integer path's 1..4 rows with 4;
    // with 5 also a decode chain's product, launched here without its chain code: CH false).
    const int split_from = PATH == GV_I8 ? 4 : NG >= 2 ? 2 : 3;
    // A kernel without the warps' output stage (gv_in_finish) always splits; unsplit, a shipped-
    // schedule product takes debug variant 47's kernel, which has it (debug builds only: a shipped
    // build splits regardless).
    constexpr bool kInFinish = gv_in_finish(VAR, CH, NG);
    if constexpr (!kInFinish && kDebugVariants) {
        if (a.y && gemv_split_finish() < split_from)
            return launch_gemv_var<K, CB, PATH, NG, kGvVarInFinish, CFG, SP, CH>(a, stream);
    }
    const bool split = !CH && gv_shipped_schedule(VAR) && a.y && (!kInFinish || gemv_split_finish() >= split_from);
    // Split, the integer path leaves MUL1's constant term to the finish kernel (GvC0; not with self
    // prep, whose warps add their own k rows' part).
    const bool c0_late = split && PATH == GV_I8 && !SP && VAR != kGvVarC0Tail;
    const cudaError_t e = launch_pdl_smem(exl3_gemv_kernel<K, CB, PATH, NG, VAR, CFG, SP, CH>, dim3((unsigned)blocks),
                                          dim3(kGvWarps * 32), smem, stream, a.pdl, pin, a.suh, a.xb,
                                          a.scales, a.csum, a.trellis, a.z, a.m, a.in, a.out, a.y, a.ldy, a.svh, a.bias,
                                          a.counters, a.seg_cols[0], a.seg_cols[1], a.seg_cols[2], a.early_trigger,
                                          split ? 0 : gemv_finish_rows(), a.zero_after, a.zero_n, chain_arg<CH>(a));
    return e != cudaSuccess || !split ? e : launch_gv_finish(a, stream, c0_late);
}

// The shipped configurations. Large layers take two k rows per unit (CFG 9): per-unit work is
// paid half as often (ncu, 8192x28672 K=4 int8: 13% fewer instructions, 52 us instead of 59).
// Small ones keep one (CFG 0), so that they still have enough units to spread over every SM.
// one_row: debug variant 10, one k row everywhere.
// The largest take four (CFG 10, gv_four_rows: 2-4% faster on the integer path at 1..4 rows,
// 3-7% on the fp16 path at 5..8; plain products only: no self prep, chain output or timing probe).
// Where shared memory is short, the compact configuration (gv_pick, exl3_gemv_geom.cuh).
template <int K, int CB, int PATH, int NG, bool SP, bool CH = false, int VAR = 0>
cudaError_t launch_gemv_shipped(const MmArgs& a, bool one_row, cudaStream_t stream) {
    const GvPick pick = gv_pick<K, PATH, NG, SP, CH, VAR>(a.in, a.out, a.num_sms, one_row, device_smem_limits());
    if constexpr (NG == 1 && K <= kGvFourRowMaxK && !SP && !CH && (gv_shipped_schedule(VAR) || VAR == 7)) {
        if (pick.cfg == 10) return launch_gemv_var<K, CB, PATH, NG, VAR, 10, SP, CH>(a, stream);
    }
    if constexpr (NG == 1 && K <= kGvTwoRowMaxK) {
        if (pick.cfg == 9) return launch_gemv_var<K, CB, PATH, NG, VAR, 9, SP, CH>(a, stream);
    }
    if constexpr (gv_shipped_schedule(VAR) && gv_has_compact<K, PATH, NG, SP>()) {
        if (pick.cfg == kGvCompact)
            return launch_gemv_var<K, CB, PATH, NG, VAR, kGvCompact, SP, CH>(a, stream);
    }
    if (pick.blocks_per_sm == 0) return cudaErrorInvalidConfiguration;  // more than a block may have here
    return launch_gemv_var<K, CB, PATH, NG, VAR, 0, SP, CH>(a, stream);
}

// A product in the shipped schedule (gv_shipped_schedule): the shipped kernels, or the K = 4 decode
// form kept for A/Bs that `variant` names where this path has it (debug variants 8 and 22 on the
// integer path, 21 on MUL1's fp16 one, 64 on the fp16 one); a form the path lacks runs the shipped
// kernels (variant 8's decode on the fp16 path is the shipped one since session 51).
// Decode chains at split finish 5 come here too, so a whole decode step runs the form.
template <int K, int CB, int PATH, int NG>
cudaError_t launch_gemv_schedule(const MmArgs& a, int variant, cudaStream_t stream) {
    if constexpr (kDebugVariants && K == 4) {
        if constexpr (PATH == GV_I8) {
            if (variant == kGvVarA12) return launch_gemv_shipped<K, CB, PATH, NG, false, false, kGvVarA12>(a, false, stream);
            if (variant == kGvVarS31) return launch_gemv_shipped<K, CB, PATH, NG, false, false, kGvVarS31>(a, false, stream);
            if constexpr (CB == CB_MUL1) {
                if (variant == kGvVarC0Tail) return launch_gemv_shipped<K, CB, PATH, NG, false, false, kGvVarC0Tail>(a, false, stream);
            }
        }
        if constexpr (PATH == GV_F16) {
            if constexpr (CB == CB_MUL1) {
                if (variant == kGvVarTcSum) return launch_gemv_shipped<K, CB, PATH, NG, false, false, kGvVarTcSum>(a, false, stream);
            }
            if (variant == kGvVarF16NoA12) return launch_gemv_shipped<K, CB, PATH, NG, false, false, kGvVarF16NoA12>(a, false, stream);
        }
        if (variant == kGvVarInFinish) return launch_gemv_shipped<K, CB, PATH, NG, false, false, kGvVarInFinish>(a, false, stream);
    }
    return launch_gemv_shipped<K, CB, PATH, NG, false>(a, false, stream);
}

// Debug variants: 1-6 the timing probes (one-group shapes; 4-6 K = 4 MUL1 only), 10 + CFG an occupancy configuration
// (K = 4, MUL1 only, so that builds stay short).
template <int K, int CB, int PATH, int NG>
cudaError_t launch_gemv_ng(const MmArgs& a, int variant, cudaStream_t stream) {
    if (a.next.mode || a.in_part) {  // a decode chain: the MUL1 integer path, one group of rows
        if constexpr (PATH == GV_I8 && NG == 1) {
            // gemv_split_finish 5: a plain product, then gv_finish_chain_kernel (launch_gv_finish)
            if (gemv_split_finish() >= 5) return launch_gemv_schedule<K, CB, PATH, NG>(a, variant, stream);
            if (a.m != 1) return cudaErrorInvalidValue;  // the in-warp chain writes one row
            return launch_gemv_shipped<K, CB, PATH, NG, false, true>(a, false, stream);
        }
        return cudaErrorInvalidValue;
    }
    if constexpr (PATH == GV_I8 && NG == 1) {  // the host chose self prep (gemv_self_prep)
        if (a.self_prep) return launch_gemv_shipped<K, CB, PATH, NG, true>(a, false, stream);
    }
    if constexpr (kDebugVariants) {
        if constexpr (NG == 1) {
            if (variant == 1) return launch_gemv_var<K, CB, PATH, NG, 1>(a, stream);
            if (variant == 2) return launch_gemv_var<K, CB, PATH, NG, 2>(a, stream);
            if (variant == 3) return launch_gemv_var<K, CB, PATH, NG, 3>(a, stream);
            if constexpr (K == 4 && CB == CB_MUL1) {  // the fixed-cost probes, in the shipped configuration
                if (variant == 4) return launch_gemv_shipped<K, CB, PATH, NG, false, false, 4>(a, false, stream);
                if (variant == 5) return launch_gemv_shipped<K, CB, PATH, NG, false, false, 5>(a, false, stream);
                if (variant == 6) return launch_gemv_shipped<K, CB, PATH, NG, false, false, 6>(a, false, stream);
            }
            if constexpr (K == 4 && CB == CB_MUL1 && PATH == GV_I8) {  // the previous ALU / FMA split
                if (variant == 7) return launch_gemv_shipped<K, CB, PATH, NG, false, false, 7>(a, false, stream);
            }
        }
        if (variant != 0 && gv_shipped_schedule(variant)) return launch_gemv_schedule<K, CB, PATH, NG>(a, variant, stream);
        if constexpr (K == 4 && CB == CB_MUL1 && PATH == GV_I8 && NG == 2) {  // CFG 13 (exl3_gemv_geom.cuh)
            if (variant == kGvVarI8FourRows && a.in % 64 == 0) return launch_gemv_var<K, CB, PATH, NG, 0, 13>(a, stream);
        }
        if constexpr (K == 4 && CB == CB_MUL1 && (NG == 1 || (PATH == GV_F16 && NG == 4))) {
            switch (variant) {
                case 10: return launch_gemv_var<K, CB, PATH, NG, 0, 0>(a, stream);  // one k row per unit always
                case 11: return launch_gemv_var<K, CB, PATH, NG, 0, 1>(a, stream);
                case 12: return launch_gemv_var<K, CB, PATH, NG, 0, 2>(a, stream);
                case 13: return launch_gemv_var<K, CB, PATH, NG, 0, 3>(a, stream);
                case 14: return launch_gemv_var<K, CB, PATH, NG, 0, 4>(a, stream);
                case 15: return launch_gemv_var<K, CB, PATH, NG, 0, 5>(a, stream);
                case 16: return launch_gemv_var<K, CB, PATH, NG, 0, 6>(a, stream);
                case 17: return launch_gemv_var<K, CB, PATH, NG, 0, 7>(a, stream);
                default: break;
            }
            if constexpr (NG == 1) {  // two k rows per unit: too many registers for four groups
                if (variant == 18) return launch_gemv_var<K, CB, PATH, NG, 0, 8>(a, stream);
                if (variant == 19) return launch_gemv_var<K, CB, PATH, NG, 0, 9>(a, stream);
                if (variant == 20) return launch_gemv_var<K, CB, PATH, NG, 0, 10>(a, stream);
            }
        }
    }
    if (!debug_variant_built(variant)) return cudaErrorNotSupported;  // not built without TRELLIS_DEBUG_VARIANTS
    return launch_gemv_shipped<K, CB, PATH, NG, false>(a, variant == 10, stream);
}
}  // namespace trellis
