// The 128-point Hadamards (over a product's fp32 workspace, and prefill's input and output
// transforms) and RMSNorm, kept together because norm_had128 (a grouped product's normed inputs at
// prefill) applies the norm kernel's 1 / rms inside the Hadamard tile kernel.
#include <math.h>

#include <initializer_list>

#include "exl3_mm.cuh"
#include "exl3_prep.cuh"
#include "kernels.h"

namespace trellis {

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

}  // namespace trellis
