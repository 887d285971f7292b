// Would Hopper's asynchronous warpgroup MMA (wgmma) make the many-row product faster?
//
// Why: at 32 rows the block-shared product (csrc/exl3_gemv_sa.cuh) issues on ~55% of cycles with
// no pipe saturated; each tile costs 4 synchronous m16n8k16 MMAs (which run at about half the
// tensor cores' rate on Hopper) plus the B fragments' shared loads, and every MMA's latency sits on
// the warp's own dependency chain. A wgmma reads B straight from shared memory, runs while the warp
// decodes the next tiles, and covers 4 warps' tiles (64 outputs) x 32 rows in one instruction.
//
// This probe runs the same work both ways, with the same grid, ring and tile ownership, on the
// 8192x28672 K = 4 MUL1 shape (raw decode, as the shipped kernel at 17..32 rows): a block owns a
// k slice of the activations (copied once into shared memory in wgmma's K-major core-matrix
// layout), its two warpgroups take contiguous ranges of (column group, k rows) units, each warp
// streams its own tiles through a cp.async ring, and partial sums leave by atomics into z.
//   - mma.sync form: per k row, NB B fragments by shared loads, CT x NB m16n8k16 MMAs a warp.
//   - wgmma form: per k row, CT m64nMk16 wgmmas a warpgroup (A from the warps' registers, double
//     buffered; one group in flight while the next k row decodes).
// The integer path (1..8 rows; u8 x s8 MMAs of the MUL1 products' bytes) the same two ways.
// All are checked against a plain per-tile kernel reading global memory (relative RMS); the
// mma.sync form is the baseline in the same run (the shipped kernel and dense fp16 come from
// bench.linear in the same device call).
//
// Standalone (no torch):
//   nvcc -O3 -std=c++17 -arch=sm_90a -Icsrc bench/wgmma_probe.cu -o /tmp/wgmma_probe
//   /tmp/wgmma_probe [reps]
// One JSON line per case.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "exl3_gemv.cuh"  // gv_decode_f16, lane_words, gv_cp16, cp_async_*, mma_16816
#include "wgmma.cuh"      // wg_smem_desc, wg_fence / commit / wait, wgmma_rs

namespace {

using namespace trellis;

constexpr int kIn = 8192, kOut = 28672;
constexpr int kTk = kIn / 16, kTn = kOut / 16;
constexpr int kTW = 32;  // words per tile at K = 4
constexpr int kThreads = 256;

#define CK(x)                                                                                     \
    do {                                                                                          \
        cudaError_t e_ = (x);                                                                     \
        if (e_ != cudaSuccess) {                                                                  \
            printf("{\"error\": \"%s at line %d\"}\n", cudaGetErrorString(e_), __LINE__);          \
            exit(1);                                                                              \
        }                                                                                         \
    } while (0)

// Integer form: D (64 x N s32) += A (64 x 32 u8: the products' bytes, m16n8k32 A fragment order)
// x B (32 x N s8 from shared memory).
template <int N>
__device__ __forceinline__ void wgmma_i8(int* d, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint64_t desc,
                                         int scale_d);

template <>
__device__ __forceinline__ void wgmma_i8<8>(int* d, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint64_t desc,
                                            int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %8, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n8k32.s32.u8.s8 {%0,%1,%2,%3}, {%4,%5,%6,%7}, %9, p;\n}\n"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(scale_d), "l"(desc));
}

template <>
__device__ __forceinline__ void wgmma_i8<16>(int* d, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint64_t desc,
                                             int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %12, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k32.s32.u8.s8 {%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9,%10,%11}, %13, p;\n}\n"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(scale_d), "l"(desc));
}

// Activations of one k row for M rows, as wgmma's K-major B: core matrix (nb, kb) (rows 8 nb ..,
// k 8 kb ..) at byte (2 nb + kb) * 128, row r % 8 of it at 16 (r % 8): 8 fp16 along k.
template <int M>
__global__ void lay_out_x(const half* __restrict__ x, half* __restrict__ xs) {
    const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;  // one 8-value chunk
    if (i >= (long)M * kIn / 8) return;
    const int r = (int)(i / (kIn / 8)), kc = (int)(i % (kIn / 8));  // row, chunk of 8 k
    const int kt = kc / 2, kb = kc % 2;
    const long dst = (long)kt * M * 16 + ((r / 8) * 2 + kb) * 64 + (r % 8) * 8;
    *reinterpret_cast<uint4*>(xs + dst) = *reinterpret_cast<const uint4*>(x + (long)r * kIn + kc * 8);
}

// The oracle: one warp a tile, everything from global memory.
template <int M>
__global__ void reference_kernel(const uint32_t* __restrict__ trellis, const half* __restrict__ x, float* __restrict__ z) {
    const long t = (long)blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5);
    if (t >= (long)kTk * kTn) return;
    const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const int i = (int)(t / kTn), j = (int)(t % kTn);
    int wa, wb, wc, shift;
    lane_words<4>(lane, wa, wb, wc, shift);
    uint32_t v[4];
    gv_decode_f16<4, CB_MUL1, true, true>(trellis + t * kTW, 0, wa, wb, wc, shift, v);
#pragma unroll
    for (int nb = 0; nb < M / 8; ++nb) {
        const half* xr = x + (long)(nb * 8 + g) * kIn + i * 16 + 2 * c;
        const uint32_t b0 = *reinterpret_cast<const uint32_t*>(xr);
        const uint32_t b1 = *reinterpret_cast<const uint32_t*>(xr + 8);
        float d[4] = {0.f, 0.f, 0.f, 0.f};
        mma_16816(d, v[0], v[2], v[1], v[3], b0, b1);
#pragma unroll
        for (int q = 0; q < 4; ++q)
            atomicAdd(z + (long)(nb * 8 + 2 * c + (q & 1)) * kOut + j * 16 + g + 8 * (q >> 1), d[q]);
    }
}

// Where a warpgroup works and how each of its warps streams its tiles (both probe kernels): the
// block's k slice of ks rows (blocks / nsl of them per slice), the warpgroup's contiguous range of
// (column group of 4 CT tiles, KR k rows) units, the slice's activations (rb bytes a k row) copied
// into shared memory once, and a per-warp cp.async ring of NS stages; warp wi of a warpgroup takes
// tiles ct * 4 + wi of each group. The constructor fills NS - 1 stages and waits for the
// activations. The warp index comes through a shuffle from lane 0, so that ptxas knows it (and
// the unit bounds and descriptors derived from it) to be warp-uniform and keeps the wgmma
// descriptors in uniform registers (without it, two R2UR a wgmma).
template <int KR, int CT, int NS>
struct ProbeStream {
    static constexpr int SW = KR * CT * kTW;  // ring stage words
    static constexpr int GT = 4 * CT;         // tiles a column group
    static constexpr int kLaneChunks = (KR * CT * 8 + 31) / 32;
    const uint32_t* trellis;
    int lane, warp, wi, ks, r0, nru, n_units;
    long u0;
    uint32_t acts_sa, ring_sa;
    int ring;  // the warp's ring, in words of shared memory
    int src_off[kLaneChunks], dst_off[kLaneChunks];
    int p_grp, p_row;
    uint32_t p_dst;
    const uint32_t* p_src;
    int c_grp, c_row, c_slot = 0;  // the unit being computed: its column group, first k row, ring slot

    __device__ ProbeStream(const uint32_t* trellis_, const void* xs, int rb, uint32_t* smem, int nsl, int bps)
        : trellis(trellis_) {
        ks = kTk / nsl;
        const int slice = blockIdx.x / bps, bi = blockIdx.x % bps;
        r0 = slice * ks;
        lane = threadIdx.x & 31;
        warp = __shfl_sync(0xffffffffu, (int)threadIdx.x >> 5, 0);
        const int wg = warp >> 2;
        wi = warp & 3;
        nru = ks / KR;
        const long units = (long)(kTn / GT) * nru;
        const long b0 = units * bi / bps, b1 = units * (bi + 1) / bps;
        u0 = b0 + (b1 - b0) * wg / 2;
        n_units = (int)(b0 + (b1 - b0) * (wg + 1) / 2 - u0);
        acts_sa = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
        const char* src = reinterpret_cast<const char*>(xs) + (size_t)r0 * rb;
        for (int i = threadIdx.x; i < ks * rb / 16; i += kThreads) gv_cp16(acts_sa + i * 16, src + i * 16);
        cp_async_commit();
        ring = ks * rb / 4 + warp * NS * SW;
        ring_sa = acts_sa + ring * 4;
        // The lane's chunks of a unit (KR k rows x CT tiles x 8 chunks of 16 bytes) at fixed
        // offsets from the unit's first tile, so that a unit costs a pointer step.
#pragma unroll
        for (int i = 0; i < kLaneChunks; ++i) {
            const int ch = i * 32 + lane;
            const int kr = ch / (CT * 8), ct = (ch / 8) % CT, q = ch % 8;
            src_off[i] = (kr * kTn + ct * 4 + wi) * kTW + q * 4;
            dst_off[i] = ((kr * CT + ct) * kTW + q * 4) * 4;
        }
        p_grp = c_grp = (int)(u0 / nru);
        p_row = c_row = r0 + KR * (int)(u0 % nru);
        p_dst = ring_sa;
        p_src = trellis + ((size_t)p_row * kTn + (size_t)p_grp * GT) * kTW;
#pragma unroll
        for (int s = 0; s < NS - 1; ++s) issue(s);
        cp_async_wait<NS - 1>();  // the activations (the oldest group)
        __syncthreads();
    }

    // Fetch unit s of this warpgroup's range into the next stage (an empty group past the end).
    __device__ void issue(int s) {
        if (s < n_units) {
#pragma unroll
            for (int i = 0; i < kLaneChunks; ++i)
                if ((KR * CT * 8) % 32 == 0 || i * 32 + lane < KR * CT * 8) gv_cp16(p_dst + dst_off[i], p_src + src_off[i]);
            p_dst = p_dst + SW * 4 == ring_sa + NS * SW * 4 ? ring_sa : p_dst + SW * 4;
            p_src += (size_t)KR * kTn * kTW;
            if ((p_row += KR) == r0 + ks) {
                p_row = r0;
                ++p_grp;
                p_src = trellis + ((size_t)r0 * kTn + (size_t)p_grp * GT) * kTW;
            }
        }
        cp_async_commit();
    }

    // Unit s's stage (its first word in shared memory), once its trellis has landed; fetches unit
    // s + NS - 1 into the stage freed before it.
    __device__ int next_stage(int s) {
        cp_async_wait<NS - 2>();
        __syncwarp();
        issue(s + NS - 1);
        const int stage = ring + c_slot * SW;
        c_slot = c_slot + 1 == NS ? 0 : c_slot + 1;
        return stage;
    }

    // After unit s: whether its column group's sums are complete (the slice's last k rows, or the
    // warpgroup's last unit), so that they leave by flush() before next_group().
    __device__ bool group_done(int s) { return (c_row += KR) == r0 + ks || s + 1 == n_units; }
    __device__ void next_group() {
        c_row = r0;
        ++c_grp;
    }

    // This warp's sums of the current column group (N / 2 a tile: m16n8k16 accumulators of N / 8
    // row groups) added into z; ZERO: and cleared.
    template <bool ZERO, int N>
    __device__ void flush(float* __restrict__ z, float (&acc)[CT][N / 2]) const {
        const int g = lane >> 2, c = lane & 3;
#pragma unroll
        for (int ct = 0; ct < CT; ++ct) {
            const int col = (c_grp * GT + ct * 4 + wi) * 16 + g;
#pragma unroll
            for (int i = 0; i < N / 2; ++i) {
                const int row = 8 * (i >> 2) + 2 * c + (i & 1);
                atomicAdd(z + (size_t)row * kOut + col + 8 * ((i >> 1) & 1), acc[ct][i]);
                if constexpr (ZERO) acc[ct][i] = 0.f;
            }
        }
    }
};

// The probe kernel. WG: wgmma form, else mma.sync. CT tiles a warp per k row (a column group is
// the warpgroup's 4 CT adjacent tiles; warp wi of it takes tiles ct * 4 + wi), KR k rows a unit,
// NS ring stages. Layout checks: SWAP exchanges the descriptor's two offsets, AORD 1 passes the
// decoded registers to wgmma in decode order instead of m16n8k16's (v0, v2, v1, v3).
template <int M, int CT, int KR, int NS, bool WG, bool SWAP = false, int AORD = 0>
__global__ void __launch_bounds__(kThreads, 2)
probe_kernel(const uint32_t* __restrict__ trellis, const half* __restrict__ xs, float* __restrict__ z, int nsl, int bps) {
    constexpr int RB = M * 32;            // bytes of B a k row
    constexpr int NB = M / 8;
    static_assert(KR % 2 == 0, "A double buffer alternates by k row");
    extern __shared__ __align__(128) uint32_t smem[];
    ProbeStream<KR, CT, NS> st(trellis, xs, RB, smem, nsl, bps);
    if (st.n_units <= 0) return;
    const int lane = st.lane, r0 = st.r0;
    const uint32_t acts_sa = st.acts_sa;
    const int g = lane >> 2, c = lane & 3;
    int wa, wb, wc, shift;
    lane_words<4>(lane, wa, wb, wc, shift);
    float acc[CT][M / 2];
#pragma unroll
    for (int ct = 0; ct < CT; ++ct)
#pragma unroll
        for (int i = 0; i < M / 2; ++i) acc[ct][i] = 0.f;
    uint32_t a[2][CT][4];
    int scale_d = 0;  // wgmma: 0 for the first k row of a column group

    for (int s = 0; s < st.n_units; ++s) {
        const int stage = st.next_stage(s);
        const uint32_t unit_b = acts_sa + (uint32_t)(st.c_row - r0) * RB;
        const uint64_t unit_desc = SWAP ? wg_smem_desc(unit_b, 256, 128) : wg_smem_desc(unit_b, 128, 256);
#pragma unroll
        for (int kr = 0; kr < KR; ++kr) {
            uint32_t(&ab)[CT][4] = a[kr & 1];
#pragma unroll
            for (int ct = 0; ct < CT; ++ct) {
                uint32_t v[4];
                gv_decode_f16<4, CB_MUL1, true, true>(smem, stage + (kr * CT + ct) * kTW, wa, wb, wc, shift, v);
                ab[ct][0] = v[0];
                ab[ct][1] = AORD ? v[1] : v[2];
                ab[ct][2] = AORD ? v[2] : v[1];
                ab[ct][3] = v[3];
            }
            const uint32_t brow = acts_sa + (uint32_t)(st.c_row + kr - r0) * RB;
            if constexpr (WG) {
                const uint64_t desc = unit_desc + (uint64_t)((kr * RB) >> 4);
                wg_fence();
#pragma unroll
                for (int ct = 0; ct < CT; ++ct) wgmma_rs<M>(acc[ct], ab[ct], desc, scale_d);
                wg_commit();
                wg_wait<1>();
                scale_d = 1;
            } else {
#pragma unroll
                for (int nb = 0; nb < NB; ++nb) {
                    uint32_t bf0, bf1;
                    const uint32_t ad = brow + (2 * nb) * 128 + 16 * g + 4 * c;
                    asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(bf0) : "r"(ad));
                    asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(bf1) : "r"(ad + 128));
#pragma unroll
                    for (int ct = 0; ct < CT; ++ct)
                        mma_16816(&acc[ct][nb * 4], ab[ct][0], ab[ct][1], ab[ct][2], ab[ct][3], bf0, bf1);
                }
            }
        }
        if (st.group_done(s)) {
            if constexpr (WG) wg_wait<0>();
            st.template flush<!WG, M>(z, acc);  // wgmma: the next k row's scale_d 0 clears them
            scale_d = 0;
            st.next_group();
        }
    }
    if constexpr (WG) wg_wait<0>();
    cp_async_wait<0>();
}

// ---- The integer path (the one-row product's form at 1..8 rows): u8 x s8 MMAs of the MUL1
// products' bytes against int8 activations repeated in each weight's 4 k slots. B columns: NCOL
// (8: up to 4 rows x 2 passes; 16: up to 8 rows). k slots of chunk h (k32) of a k row: slot s
// holds k = 8 h + 2 ((s % 16) / 4) + s / 16 (the shipped path's A order x0 x4 x1 x5 / x2 x6 x3 x7).

// int8 activations xq [NCOL][in] -> per k row, chunk h at h * NB * 256 bytes, core (nb, kc) at
// (2 nb + kc) * 128, column n % 8 at 16 (n % 8): 16 slots.
template <int NCOL>
__global__ void lay_out_xq(const int8_t* __restrict__ xq, uint8_t* __restrict__ xs) {
    constexpr int NB = NCOL / 8, RB = NB * 512;
    const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;  // one (n, k)
    if (i >= (long)NCOL * kIn) return;
    const int n = (int)(i / kIn), k = (int)(i % kIn);
    const int kt = k / 16, kk = k % 16, h = kk / 8, j = kk % 8, cq = j / 2, kc = j % 2;
    const long at = (long)kt * RB + h * NB * 256 + ((n / 8) * 2 + kc) * 128 + (n % 8) * 16 + 4 * cq;
    const uint8_t v = (uint8_t)xq[i];
    xs[at] = xs[at + 1] = xs[at + 2] = xs[at + 3] = v;
}

__device__ __forceinline__ uint32_t rep4(int8_t v) { return __byte_perm((uint32_t)(uint8_t)v, 0u, 0x0000); }

// The oracle: one warp a tile from global memory; every k row's integer sums scaled by 1/128.
template <int NCOL>
__global__ void reference_i8_kernel(const uint32_t* __restrict__ trellis, const int8_t* __restrict__ xq, float* __restrict__ z) {
    const long t = (long)blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5);
    if (t >= (long)kTk * kTn) return;
    const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const int i = (int)(t / kTn), j = (int)(t % kTn);
    uint32_t x[8];
    lane_products_k4<true>(trellis[t * kTW + ((lane + 31) & 31)], trellis[t * kTW + lane], x);
#pragma unroll
    for (int nb = 0; nb < NCOL / 8; ++nb) {
        const int8_t* xr = xq + (long)(nb * 8 + g) * kIn + i * 16;
        int d[4] = {0, 0, 0, 0};
        mma_16832_u8s8(d, x[0], x[4], x[1], x[5], rep4(xr[2 * c]), rep4(xr[2 * c + 1]));
        mma_16832_u8s8(d, x[2], x[6], x[3], x[7], rep4(xr[8 + 2 * c]), rep4(xr[8 + 2 * c + 1]));
#pragma unroll
        for (int q = 0; q < 4; ++q)
            atomicAdd(z + (long)(nb * 8 + 2 * c + (q & 1)) * kOut + j * 16 + g + 8 * (q >> 1), (float)d[q] * (1.f / 128));
    }
}

// The probe, integer form: as probe_kernel, with a unit of KR = 8 k rows (one 128-input chunk,
// whose integer sums fold into fp32 once at its end, as the shipped path does per chunk).
template <int NCOL, int CT, int NS, bool WG>
__global__ void __launch_bounds__(kThreads, 2)
probe_i8_kernel(const uint32_t* __restrict__ trellis, const uint8_t* __restrict__ xs, float* __restrict__ z, int nsl, int bps) {
    constexpr int KR = 8;
    constexpr int NB = NCOL / 8, RB = NB * 512;
    extern __shared__ __align__(128) uint32_t smem[];
    ProbeStream<KR, CT, NS> st(trellis, xs, RB, smem, nsl, bps);
    if (st.n_units <= 0) return;
    const int lane = st.lane, r0 = st.r0;
    const uint32_t acts_sa = st.acts_sa;
    const int g = lane >> 2, c = lane & 3;
    const int wa = (lane + 31) & 31, wb = lane;  // K = 4: word t - 1 and word t
    int iacc[CT][NCOL / 2];
    float facc[CT][NCOL / 2];
#pragma unroll
    for (int ct = 0; ct < CT; ++ct)
#pragma unroll
        for (int i = 0; i < NCOL / 2; ++i) iacc[ct][i] = 0, facc[ct][i] = 0.f;
    uint32_t a[2][CT][8];
    const float step = 1.f / 128;  // a chunk's scale (the shipped path's per-128 steps)

    for (int s = 0; s < st.n_units; ++s) {
        const int stage = st.next_stage(s);
        const uint64_t unit_desc = wg_smem_desc(acts_sa + (uint32_t)(st.c_row - r0) * RB, 128, 256);
#pragma unroll
        for (int kr = 0; kr < KR; ++kr) {
            uint32_t(&ab)[CT][8] = a[kr & 1];
#pragma unroll
            for (int ct = 0; ct < CT; ++ct) {
                const int tile = stage + (kr * CT + ct) * kTW;
                lane_products_k4<true>(smem[tile + wa], smem[tile + wb], ab[ct]);
            }
            const uint32_t brow = acts_sa + (uint32_t)(st.c_row + kr - r0) * RB;
            if constexpr (WG) {
                // The unit's first descriptor plus compile-time steps (a k row is RB bytes, chunk
                // 1 NB * 256 further): one 64-bit add each, the same for every tile.
                const uint64_t d0 = unit_desc + (uint64_t)((kr * RB) >> 4), d1 = d0 + (uint64_t)((NB * 256) >> 4);
                const int sc = kr == 0 ? 0 : 1;
                wg_fence();
#pragma unroll
                for (int ct = 0; ct < CT; ++ct) wgmma_i8<NCOL>(iacc[ct], ab[ct][0], ab[ct][4], ab[ct][1], ab[ct][5], d0, sc);
#pragma unroll
                for (int ct = 0; ct < CT; ++ct) wgmma_i8<NCOL>(iacc[ct], ab[ct][2], ab[ct][6], ab[ct][3], ab[ct][7], d1, 1);
                wg_commit();
                wg_wait<1>();
            } else {
#pragma unroll
                for (int nb = 0; nb < NB; ++nb) {
                    uint32_t bq[4];
                    const uint32_t ad = brow + (2 * nb) * 128 + 16 * g + 4 * c;
                    asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(bq[0]) : "r"(ad));
                    asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(bq[1]) : "r"(ad + 128));
                    asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(bq[2]) : "r"(ad + NB * 256));
                    asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(bq[3]) : "r"(ad + NB * 256 + 128));
#pragma unroll
                    for (int ct = 0; ct < CT; ++ct) {
                        mma_16832_u8s8(&iacc[ct][nb * 4], ab[ct][0], ab[ct][4], ab[ct][1], ab[ct][5], bq[0], bq[1]);
                        mma_16832_u8s8(&iacc[ct][nb * 4], ab[ct][2], ab[ct][6], ab[ct][3], ab[ct][7], bq[2], bq[3]);
                    }
                }
            }
        }
        // The chunk's fold.
        if constexpr (WG) wg_wait<0>();
#pragma unroll
        for (int ct = 0; ct < CT; ++ct)
#pragma unroll
            for (int i = 0; i < NCOL / 2; ++i) {
                facc[ct][i] = fmaf(step, (float)iacc[ct][i], facc[ct][i]);
                if constexpr (!WG) iacc[ct][i] = 0;
            }
        if (st.group_done(s)) {
            st.template flush<true, NCOL>(z, facc);
            st.next_group();
        }
    }
    cp_async_wait<0>();
}

struct Bufs {
    uint32_t* trellis;
    half* x;
    half* xs;
    float* z;
    float* zref;
};

double rel_rms(const std::vector<float>& a, const std::vector<float>& b) {
    double num = 0, den = 0;
    for (size_t i = 0; i < a.size(); ++i) {
        num += (double)(a[i] - b[i]) * (a[i] - b[i]);
        den += (double)b[i] * b[i];
    }
    return std::sqrt(num / (den > 0 ? den : 1));
}

// What a case measured: its error against the oracle, its time, its launch shape.
struct CaseResult {
    double err;  // relative RMS against the oracle
    double us;
    int blocks, blocks_per_sm;
};

// One probe kernel: a checked run from a zero workspace against zref, then `reps` timed launches
// after 3 warm-ups (the sums pile up in z; only the first run's are checked). `kernel` takes
// (trellis, activations, z, nsl, blocks per slice) and runs two blocks an SM.
template <typename Kernel, typename Acts>
CaseResult measure(Kernel kernel, const uint32_t* trellis, const Acts* xs, float* z, const float* zref, size_t zn,
                   int nsl, int smem, int reps) {
    CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    int sms = 0, per_sm = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, smem));
    const int bps = 2 * sms / nsl;
    auto launch = [&]() { kernel<<<nsl * bps, kThreads, smem>>>(trellis, xs, z, nsl, bps); };
    CK(cudaMemset(z, 0, zn * 4));
    launch();
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
    std::vector<float> hz(zn), hr(zn);
    CK(cudaMemcpy(hz.data(), z, zn * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hr.data(), zref, zn * 4, cudaMemcpyDeviceToHost));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    for (int i = 0; i < 3; ++i) launch();
    CK(cudaEventRecord(e0));
    for (int i = 0; i < reps; ++i) launch();
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    return {rel_rms(hz, hr), 1000.0 * ms / reps, nsl * bps, per_sm};
}

// One JSON line: the case's name and shape, then what measure() found.
void report(const char* name, const char* shape, int nsl, int smem, const CaseResult& r) {
    printf("{\"case\": \"%s\", %s, \"nsl\": %d, \"blocks\": %d, \"blocks_per_sm\": %d, \"smem\": %d, \"us\": %.2f, "
           "\"rel_rms\": %.3g}\n",
           name, shape, nsl, r.blocks, r.blocks_per_sm, smem, r.us, r.err);
    fflush(stdout);
}

// zref from zero by the oracle, and the activations laid out for the probes (two launches).
template <typename Oracle, typename Layout>
void prepare(float* zref, size_t zn, Oracle oracle, Layout layout) {
    CK(cudaMemset(zref, 0, zn * 4));
    oracle();
    layout();
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
}

template <int M, int CT, int KR, int NS, bool WG, bool SWAP = false, int AORD = 0>
void run_case(const Bufs& b, int nsl, int reps, const char* name) {
    const int smem = kTk / nsl * M * 32 + 8 * NS * KR * CT * kTW * 4;
    const CaseResult r = measure(probe_kernel<M, CT, KR, NS, WG, SWAP, AORD>, b.trellis, b.xs, b.z, b.zref,
                                 (size_t)M * kOut, nsl, smem, reps);
    char shape[160];
    snprintf(shape, sizeof shape, "\"m\": %d, \"ct\": %d, \"kr\": %d, \"ns\": %d, \"wgmma\": %d", M, CT, KR, NS, (int)WG);
    report(name, shape, nsl, smem, r);
}

template <int M>
void run_rows(const Bufs& b, int reps) {
    prepare(b.zref, (size_t)M * kOut, [&] { reference_kernel<M><<<(int)((long)kTk * kTn / 8), 256>>>(b.trellis, b.x, b.zref); },
            [&] { lay_out_x<M><<<(M * kIn / 8 + 255) / 256, 256>>>(b.x, b.xs); });
    const int nsl = M == 32 ? 8 : (M == 16 ? 4 : 2);  // 64 KB of activations a slice
    run_case<M, 4, 2, 4, false>(b, nsl, reps, "mma_sync");
    run_case<M, 4, 2, 4, true>(b, nsl, reps, "wgmma");
    if constexpr (M == 32) {
        run_case<M, 4, 2, 4, true, true>(b, nsl, reps, "wgmma_swapped_desc");
        run_case<M, 4, 2, 4, true, false, 1>(b, nsl, reps, "wgmma_decode_order_a");
    }
    run_case<M, 2, 4, 4, false>(b, nsl, reps, "mma_sync");
    run_case<M, 2, 4, 4, true>(b, nsl, reps, "wgmma");
    run_case<M, 4, 4, 3, false>(b, nsl, reps, "mma_sync");
    run_case<M, 4, 4, 3, true>(b, nsl, reps, "wgmma");
    run_case<M, 2, 2, 6, true>(b, nsl, reps, "wgmma");
}

struct BufsI8 {
    uint32_t* trellis;
    int8_t* xq;
    uint8_t* xs;
    float* z;
    float* zref;
};

template <int NCOL, int CT, int NS, bool WG>
void run_case_i8(const BufsI8& b, int nsl, int reps, const char* name) {
    const int smem = kTk / nsl * (NCOL / 8) * 512 + 8 * NS * 8 * CT * kTW * 4;
    const CaseResult r = measure(probe_i8_kernel<NCOL, CT, NS, WG>, b.trellis, b.xs, b.z, b.zref, (size_t)NCOL * kOut,
                                 nsl, smem, reps);
    char shape[160];
    snprintf(shape, sizeof shape, "\"path\": \"int8\", \"ncol\": %d, \"ct\": %d, \"kr\": 8, \"ns\": %d, \"wgmma\": %d", NCOL, CT,
             NS, (int)WG);
    report(name, shape, nsl, smem, r);
}

template <int NCOL>
void run_cols_i8(const BufsI8& b, int reps) {
    prepare(b.zref, (size_t)NCOL * kOut,
            [&] { reference_i8_kernel<NCOL><<<(int)((long)kTk * kTn / 8), 256>>>(b.trellis, b.xq, b.zref); },
            [&] { lay_out_xq<NCOL><<<(NCOL * kIn + 255) / 256, 256>>>(b.xq, b.xs); });
    const int nsl = NCOL == 8 ? 8 : 16;  // 32 KB of activations a slice
    run_case_i8<NCOL, 2, 3, false>(b, nsl, reps, "mma_sync");
    run_case_i8<NCOL, 2, 3, true>(b, nsl, reps, "wgmma");
    run_case_i8<NCOL, 2, 4, true>(b, nsl, reps, "wgmma");
    if constexpr (NCOL == 8) {  // at 16 columns the wgmma form spills with four tiles
        run_case_i8<NCOL, 4, 2, false>(b, nsl, reps, "mma_sync");
        run_case_i8<NCOL, 4, 2, true>(b, nsl, reps, "wgmma");
    }
}

}  // namespace

int main(int argc, char** argv) {
    const int reps = argc > 1 ? atoi(argv[1]) : 20;
    Bufs b{};
    const size_t words = (size_t)kTk * kTn * kTW;
    CK(cudaMalloc(&b.trellis, words * 4));
    CK(cudaMalloc(&b.x, (size_t)32 * kIn * 2));
    CK(cudaMalloc(&b.xs, (size_t)32 * kIn * 2));
    CK(cudaMalloc(&b.z, (size_t)32 * kOut * 4));
    CK(cudaMalloc(&b.zref, (size_t)32 * kOut * 4));
    {
        std::vector<uint32_t> ht(words);
        uint64_t s = 0x9E3779B97F4A7C15ull;
        for (auto& w : ht) {
            s ^= s << 13, s ^= s >> 7, s ^= s << 17;
            w = (uint32_t)(s >> 11);
        }
        CK(cudaMemcpy(b.trellis, ht.data(), words * 4, cudaMemcpyHostToDevice));
        std::vector<half> hx((size_t)32 * kIn);
        for (auto& v : hx) {
            s ^= s << 13, s ^= s >> 7, s ^= s << 17;
            v = __float2half((float)((s >> 40) % 2001) / 1000.f - 1.f);
        }
        CK(cudaMemcpy(b.x, hx.data(), hx.size() * 2, cudaMemcpyHostToDevice));
    }
    {
        BufsI8 bi{b.trellis, nullptr, nullptr, b.z, b.zref};
        CK(cudaMalloc(&bi.xq, (size_t)16 * kIn));
        CK(cudaMalloc(&bi.xs, (size_t)16 * kIn * 4));
        std::vector<int8_t> hq((size_t)16 * kIn);
        uint64_t s = 0x2545F4914F6CDD1Dull;
        for (auto& v : hq) {
            s ^= s << 13, s ^= s >> 7, s ^= s << 17;
            v = (int8_t)((s >> 24) & 0xff);
        }
        CK(cudaMemcpy(bi.xq, hq.data(), hq.size(), cudaMemcpyHostToDevice));
        run_cols_i8<8>(bi, reps);
        run_cols_i8<16>(bi, reps);
    }
    run_rows<32>(b, reps);
    run_rows<16>(b, reps);
    run_rows<8>(b, reps);
    return 0;
}
