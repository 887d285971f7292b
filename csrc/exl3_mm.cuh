// Fused EXL3 product for small batches (m <= 32 rows per pass).
//
// Why this shape: at batch 1..32 the layer is bound by reading the trellis and by the integer
// work of decoding it, never by the multiply. So every 16x16 tile is decoded exactly once, in
// registers, and reused for all rows through tensor-core MMAs.
//
// The tile's lane order (spec 3.4) is the B layout of mma.m16n8k16; the same registers are also
// the A layout of the transposed tile. We use the transposed form, D[out col, row] =
// What^T[out col, k] * xh^T[k, row], so one MMA covers 8 rows of x: m <= 8 costs one MMA per tile
// instead of two.
//
// Work split: a block is 8 warps over 8 adjacent column tiles (128 output columns) and a range
// of k tiles (split-k over blocks, partial sums added with fp32 atomics into a zeroed workspace,
// then had128 * svh in a second small kernel). Each warp streams its own column of tiles through
// a private cp.async ring in shared memory, so the main loop has no block-wide barrier. The
// block first copies its slice of the prepared activations (prep_x: xh = had128(x * suh), once
// per call rather than once per column block) into shared memory while the first trellis stages
// are already in flight.
#pragma once
#include <algorithm>
#include <utility>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "exl3_decode.cuh"
#include "kernels.h"

namespace trellis {

constexpr int kMmWarps = 8;  // column tiles per block
constexpr int kMmStages = 6;  // ring depth per warp

// k tiles per pipeline stage: 8 tiles (1 KB at K = 4) for small K, 4 for large K, so that each
// warp keeps about 7 KB of trellis in flight whatever K is.
template <int K>
__host__ __device__ constexpr int mm_stage_tiles() {
    return K <= 4 ? 8 : 4;
}
template <int K>
__host__ __device__ constexpr int mm_stage_words() {
    return mm_stage_tiles<K>() * 8 * K;
}

// The sum of t over the warp's 32 lanes, in every lane (an xor butterfly: every lane gets the same
// bits, so warps that reduce the same values agree).
__device__ __forceinline__ float warp_sum(float t) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) t += __shfl_xor_sync(0xffffffffu, t, o);
    return t;
}

__device__ __forceinline__ void cp_async16(void* smem_dst, const void* gmem_src) {
    uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem_dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(gmem_src));
}
// The same copy to a shared-memory address the caller already holds (the fused products' rings,
// exl3_gemv.cuh, which keep one base address and add offsets).
__device__ __forceinline__ void gv_cp16(uint32_t smem_addr, const void* gmem_src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr), "l"(gmem_src) : "memory");
}
// "memory" clobbers: shared-memory reads of a stage must not be hoisted above its wait.
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void mma_16816(float d[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                          uint32_t a3, uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Four 8x8 b16 matrices from shared memory (lane i gives row i % 8 of matrix i / 8): lane l gets
// 32-bit word l % 4 of row l / 4 of each.
__device__ __forceinline__ void ldmatrix_x4(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr)
                 : "memory");
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2,
                                                  uint32_t& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr)
                 : "memory");
}
// u8 (weights' product bytes) x s8 (activations) -> s32, 16x8x32.
__device__ __forceinline__ void mma_16832_u8s8(int d[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                               uint32_t a3, uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// The same with D = A B + c in every element (a constant C, held in registers the compiler keeps).
__device__ __forceinline__ void mma_16832_u8s8_plus(int d[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                                    uint32_t b0, uint32_t b1, int c) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%10,%10,%10};\n"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "r"(c));
}

// In-register 128-point Walsh-Hadamard (natural order) of 4 consecutive values per lane,
// unnormalized.
__device__ __forceinline__ void wht128_lane4(float v[4], int lane) {
    float a = v[0] + v[1], b = v[0] - v[1], c = v[2] + v[3], d = v[2] - v[3];
    v[0] = a + c;
    v[1] = b + d;
    v[2] = a - c;
    v[3] = b - d;
#pragma unroll
    for (int s = 1; s < 32; s <<= 1) {
        const bool upper = lane & s;
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            float p = __shfl_xor_sync(0xffffffffu, v[q], s);
            v[q] = upper ? p - v[q] : v[q] + p;
        }
    }
}

constexpr float kHadNorm = 0.088388347648318f;  // 1/sqrt(128)

// A product's output transform of one lane's 4 split-k sums (k = 128 b + 4 lane): had128 times
// scale, one fp16 rounding, times svh, plus the bias if there is one. The product's output stage
// (gv_finish_row) and the prep that reads open sums (open_finish) share it, so both give the
// same bits; had128_f32 does the same operations in the same order.
__device__ __forceinline__ uint2 finish_lane4(float v[4], int lane, float scale, uint2 sv, uint2 bv, bool has_bias) {
    wht128_lane4(v, lane);
    half2 o0 = __floats2half2_rn(v[0] * scale, v[1] * scale);
    half2 o1 = __floats2half2_rn(v[2] * scale, v[3] * scale);
    o0 = __hmul2(o0, as_h2(sv.x));
    o1 = __hmul2(o1, as_h2(sv.y));
    if (has_bias) {
        o0 = __hadd2(o0, as_h2(bv.x));
        o1 = __hadd2(o1, as_h2(bv.y));
    }
    return make_uint2(as_u32(o0), as_u32(o1));
}

// Timing probes (0 = normal): 1 skips the decode, 2 skips the MMAs. Set from Python for the
// "which stage limits" measurements of bench.linear; never used for real work.
inline int& mm_debug_variant() {
    static int v = 0;
    return v;
}

inline bool& pdl_flag() {
    static bool v = true;
    return v;
}

// Version-3 launcher: the fewest units per warp when a small layer shrinks the grid (a benchmark
// knob: small layers are latency-bound and may want more, shorter warps).
inline int& gemv_min_units() {
    static int v = 8;
    return v;
}

// Version-3 launcher: a one-group product takes two k rows per unit (gv_two_rows) when it has at
// least this many k-row pairs per resident warp. 6 takes in 4096x14336 and 14336x4096, 4-9%
// faster at one row that way (8 left them out; csrc/PERF_NOTES.md, session 10).
inline int& gemv_two_row_units() {
    static int v = 6;
    return v;
}

inline int& early_trigger_flag() {
    static int v = 2;
    return v;
}

// Timing probe: prep_frag launches nothing (the products read whatever activations are there),
// to measure what the preps cost a decode step as it runs (bench.decode cuda-graph-noprep).
inline bool& prep_skip_flag() {
    static bool v = false;
    return v;
}

inline bool& self_prep_flag() {
    static bool v = false;
    return v;
}

// Which fp16-path products (version 3) take the block-shared activation kernel
// (exl3_gemv_sa.cuh): 0 none, 2 all, 3 (default) those it measured faster for, 1 the rule before
// session 39 (sa_applies says which).
inline int& gemv_shared_acts() {
    static int v = 3;
    return v;
}

// Whether block-shared products of 17..32 rows at K <= 4 take Hopper's warpgroup MMA where the
// device has it (exl3_gemv_sa.cuh, kSaWgmma, sa_wgmma): 1 (default) yes, 0 no (the baseline).
inline int& gemv_wgmma() {
    static int v = 1;
    return v;
}

// The block-shared kernel's units: 1 (default) two tiles per unit at 25..32 rows of layers of
// fewer than 4096 x 18432 weights at K <= 4 (sa_two_tiles), 0 four tiles everywhere (the rule
// before session 37, a benchmark baseline), 2 two tiles at every K, shape and 17..32 rows (a
// benchmark mode, to measure where the rule does not reach).
inline int& gemv_sa_tiles() {
    static int v = 1;
    return v;
}

// Which products leave their output transform to a kernel of its own (gv_finish_kernel, launched
// as their programmatic dependent) instead of the warp that completes each 128-column block: 0
// none, 1 the block-shared kernel's (17..32 rows of large layers), 2 also the per-warp kernel's
// at 9..32 rows (fp16 path, two or four groups of rows), 3 also its 1..8-row products on the fp16
// path (5..8 rows by default), 4 also the integer path's (1..4 rows), so every plain product, 5
// (default) also a decode chain's one-row product (ChainOut, MmArgs::in_part): it runs as a plain
// product and gv_finish_chain_kernel writes its chain output. On an H100, 2 made decode at batch
// 9-32 10-11% faster than 1 (csrc/PERF_NOTES.md, session 28) and 3 batch 5 and 8 8% faster than
// 2; on the H200, 4 made batch 1 3-5% and batch 4 10% faster than 3 (session 29), and 5 with every
// chain link batch 1 1-4% faster than 4 with the attention link alone (session 30).
inline int& gemv_split_finish() {
    static int v = 5;
    return v;
}

// Whether gv_finish_chain_kernel reads what the kernels before its product wrote (the input's row
// sums, the residual) before its PDL wait, where that is safe (set_finish_early_reads; default on;
// off for a same-run baseline).
inline bool& finish_early_reads() {
    static bool v = true;
    return v;
}

// The block-shared kernel's grid rule (sa_grid): 1 the shipped one, 0 the one before session 28.
inline int& gemv_sa_grid() {
    static int v = 1;
    return v;
}

// Where the block-shared product's stamp variants (kSaStamp, debug variants 72 / 73 / 76 / 79)
// write each team's times, and how many teams' stamps it holds (set_sa_stamp_buffer; none by
// default).
inline uint64_t*& sa_stamp_buffer() {
    static uint64_t* p = nullptr;
    return p;
}
inline long& sa_stamp_slots() {
    static long n = 0;
    return n;
}
// The block-shared product's claim words (kSaSteal, debug variant 80): one a team, zero between
// products (each team zeroes its own at its end). Allocated and zeroed on the stream at the first
// use on a device, which must not be under graph capture; null where it cannot be, or for more
// than kWords teams.
inline unsigned* sa_claim_words(long teams, cudaStream_t stream) {
    constexpr long kWords = 16384;
    static unsigned* per_device[64] = {};
    int dev = 0;
    if (teams > kWords || cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return nullptr;
    if (!per_device[dev]) {
        cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
        if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess || capture != cudaStreamCaptureStatusNone) return nullptr;
        void* p = nullptr;
        if (cudaMalloc(&p, kWords * sizeof(unsigned)) != cudaSuccess) return nullptr;
        if (cudaMemsetAsync(p, 0, kWords * sizeof(unsigned), stream) != cudaSuccess) {
            cudaFree(p);
            return nullptr;
        }
        per_device[dev] = static_cast<unsigned*>(p);
    }
    return per_device[dev];
}

// Rows of the workspace a finishing warp reads per round trip (8; 1 is the row-by-row baseline).
inline int& gemv_finish_rows() {
    static int v = 8;
    return v;
}

// Version-3 grid where the min-units cap leaves it short of full residency
// (TRELLIS_GV_GRID_FILL): 0 the cap's grid as it comes (before session 33); 1 (default) every
// resident block (minb per SM) where the cap gives more blocks than SMs but fewer than minb per
// SM; 2 every resident block wherever the cap gives fewer (that has a unit to take). Why: on 132
// SMs the cap gives Llama-3.1-8B's one-row q/k/v 192 blocks and its down projection 224, so 60
// and 92 SMs hold two blocks and the rest one. Every resident block made those products 4.5% and
// 6.4% faster on an H100 and decode 1.5% faster, but o_proj (128 blocks, one or none per SM)
// 3.3% slower (csrc/PERF_NOTES.md, session 33), hence 1.
inline int& gemv_grid_fill() {
    static int v = 1;
    return v;
}

// Version-3 grid: resident warps (minb blocks of 8 warps per SM), capped so that every warp has
// at least gemv_min_units() units (8 unless a benchmark sets it), then gemv_grid_fill.
inline long gv_blocks(long units, int minb, int num_sms) {
    const long sms = num_sms > 0 ? num_sms : 132;
    const long blocks = (long)minb * sms;
    const long by_units = (units / gemv_min_units() + 7) / 8;
    const long b = by_units < blocks ? (by_units > 0 ? by_units : 1) : blocks;
    const int fill = gemv_grid_fill();
    if (b < blocks && (fill == 2 || (fill == 1 && b > sms))) return std::min(blocks, std::max(b, (units + 7) / 8));
    return b;
}

// Whether a product's launch (per-warp and block-shared kernels) pads its dynamic shared memory so
// that no more blocks fit on an SM than the minb its grid is sized for (exl3_gemv_geom.cuh,
// gv_capped_smem): 1 (default) yes, 0 no. Why: a kernel whose registers and shared memory allow a
// third block (80 registers and at most ~75 KB: the compact ring, CFG 9 at 3INST / MCG, the
// four-group kernel at K >= 5, the two-group kernel; the block-shared two-tile form only with
// slices of at most ~24 k rows) gets a grid of 2 x SMs, and launched as a programmatic dependent
// (as products are) the block scheduler packs it up to three to an SM on three quarters of the
// SMs, leaving the rest idle (bench/occupancy_probe.cu, H100, session 42: 99 of 132 SMs used, 66
// with three; alone, or padded, the grid spreads two to an SM). Measured (H100, session 42,
// bench/ab_session42.sh): 6 / 12 / 16 / 32 rows of the mid-size layers and 1 / 16 of 8192x28672
// within -1.7..+0.6% of uncapped; batch-1 decode 400.3 / 405.4 against 406.1 / 414.5 tok/s
// capped; and it lets the two-group kernel drop its output stage (exl3_gemv_geom.cuh,
// kTwoGroupsInFinish).
inline int& gemv_block_cap() {
    static int v = 1;
    return v;
}

// Version-3 launcher: a one-group product (1..8 rows) takes four k rows per unit (CFG 10) when it has at
// least this many k-row quads per resident warp (gv_four_rows); 0 = never. The per-unit work
// (ring wait, cp.async issue, loop control) is then paid once per 32 tiles: ~9% fewer
// instructions per tile than two k rows (SASS, K = 4). 3 takes in every Llama-3.1-8B MLP
// product (down: 3.4 quads per warp on the H200), not q/k/v or o (csrc/PERF_NOTES.md, session 12).
inline int& gemv_four_row_units() {
    static int v = 3;
    return v;
}

// Largest K whose two-k-row configuration (CFG 9) fits two blocks per SM (K = 6: 96 KB each).
constexpr int kGvTwoRowMaxK = 6;
// Largest K built with four k rows per unit (CFG 10: two stages of 4 k rows, 96 KB per block at
// K = 4; K = 5 would fit at 112 KB, K = 6 would not).
constexpr int kGvFourRowMaxK = 4;

// Warps in a version-3 product's block.
constexpr int kGvWarps = 8;

// Warps resident on the GPU at the two blocks of kGvWarps per SM the products' grids are sized
// for (132 SMs, an H200's, where the count is unknown).
inline long gv_resident_warps(int num_sms) {
    return 2L * kGvWarps * (num_sms > 0 ? num_sms : 132);
}

// Whether a version-3 product with one group of B columns takes four k rows per unit (the
// largest layers, K <= kGvFourRowMaxK; see launch_gemv_shipped).
inline bool gv_four_rows(int in, int out, int K, int num_sms) {
    if (gemv_four_row_units() <= 0 || K > kGvFourRowMaxK || in % 64) return false;
    const long quads = (long)(out / 128) * (in / 64);
    return quads >= gemv_four_row_units() * gv_resident_warps(num_sms);
}

// Whether a version-3 product with one group of B columns takes two k rows per unit (large
// layers, K <= kGvTwoRowMaxK; see launch_gemv_shipped).
inline bool gv_two_rows(int in, int out, int K, int num_sms) {
    const long pairs = (long)(out / 128) * (in / 32);
    return K <= kGvTwoRowMaxK && pairs >= gemv_two_row_units() * gv_resident_warps(num_sms);
}

// Chunk slots of a self-prepping product's warp (exl3_gemv.cuh): the 128-chunks its k rows
// touch, each 256 bytes of int8 passes plus its steps and k-row sums.
constexpr int kSpSlots = 10;
constexpr int kSpStepWord = 64;     // the two steps (s1, s2) follow the 64 data words
constexpr int kSpRowSumWord = 66;   // then the 8 k rows' sums
constexpr int kSpSlotWords = 76;    // + 2 pad

// Programmatic dependent launch (sm_90+; no-ops elsewhere and when launched without the
// attribute). The primary lets its dependent start; the dependent waits for the primary's
// completion and memory before touching anything the primary writes.
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait_primary() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// The glue kernels (activation prep, RMSNorm, RoPE, gated activation, decode attention) are launched as
// programmatic dependents on sm_90+: the launch and block scheduling of each overlaps the tail of
// the kernel before it, the gap that a decode token's ~500 launches otherwise pay one by one. Each
// such kernel calls pdl_wait_primary before it touches memory that kernels write (it may read
// weights before), so it reads its inputs only once they are complete and writes nothing the
// previous kernel may still read.
inline bool glue_pdl() {
    return pdl_flag() && current_device_attr<cudaDevAttrComputeCapabilityMajor>() >= 9;
}

// v combined over the whole block by op (identity: its neutral value), through scratch (a float
// per warp): a butterfly in each warp, then one over the warps' results. Every thread calls it (a
// barrier) and gets the result; a second call on the same scratch needs a barrier before it.
// RMSNorm's row sum, the capped softmax's row max and sum.
template <typename Op>
__device__ __forceinline__ float block_reduce(float v, float* scratch, Op op, float identity) {
#pragma unroll
    for (int s = 16; s > 0; s >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, s));
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    const int nw = blockDim.x >> 5;
    v = lane < nw ? scratch[lane] : identity;
#pragma unroll
    for (int s = 16; s > 0; s >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, s));
    return v;
}

// The fences around a completion count (the product's output stage, decode attention's merge):
// release before a block's count, acquire after the last one is seen. An acq_rel fence
// (MEMBAR.ALL.GPU) orders exactly that; __threadfence is a sequentially consistent one
// (MEMBAR.SC.GPU). Small layers timed the same with either (session 5).
__device__ __forceinline__ void fence_acq_rel_gpu() {
    asm volatile("fence.acq_rel.gpu;\n" ::: "memory");
}

// A kernel launch that may run as a programmatic dependent of the kernel before it (pdl: the
// kernel itself must call pdl_wait_primary before it reads what its predecessor writes).
template <typename... KernelArgs, typename... Args>
cudaError_t launch_pdl(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem,
                       cudaStream_t stream, bool pdl, Args&&... args) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = pdl ? 1 : 0;
    return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

// launch_pdl for a kernel with more dynamic shared memory than a launch gets unasked (48 KB): the
// kernel's limit is raised to `smem` first.
template <typename... KernelArgs, typename... Args>
cudaError_t launch_pdl_smem(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem,
                            cudaStream_t stream, bool pdl, Args&&... args) {
    const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e != cudaSuccess) return e;
    return launch_pdl(kernel, grid, block, smem, stream, pdl, std::forward<Args>(args)...);
}

// A glue kernel's launch: a programmatic dependent where glue_pdl says so, no dynamic shared memory.
template <typename... KernelArgs, typename... Args>
cudaError_t launch_glue(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, cudaStream_t stream,
                        Args&&... args) {
    return launch_pdl(kernel, grid, block, 0, stream, glue_pdl(), std::forward<Args>(args)...);
}

// Per-warp cp.async ring over the k tiles [i0, i1) of column tile j. Each warp owns its ring,
// so the main loop needs only __syncwarp, never a block barrier.
template <int K>
struct TileRing {
    uint32_t* ring;
    const uint32_t* trellis;
    int tn, j, i0, i1, lane, n_stages;

    __device__ __forceinline__ void issue(int s) {
        constexpr int TS = mm_stage_tiles<K>();
        constexpr int kChunksPerTile = 2 * K;  // 16-byte chunks (tile = 32K bytes)
        if (s < n_stages) {
            uint32_t* dst = ring + (s % kMmStages) * mm_stage_words<K>();
#pragma unroll
            for (int c0 = 0; c0 < TS * kChunksPerTile; c0 += 32) {
                const int c = c0 + lane;
                if (c < TS * kChunksPerTile) {
                    const int tt = c / kChunksPerTile;
                    const int part = c - tt * kChunksPerTile;
                    const int i = i0 + s * TS + tt;
                    if (i < i1) {
                        const uint32_t* src = trellis + ((size_t)i * tn + j) * (8 * K) + part * 4;
                        cp_async16(dst + tt * 8 * K + part * 4, src);
                    }
                }
            }
        }
        cp_async_commit();
    }
    __device__ __forceinline__ const uint32_t* stage(int s) const {
        return ring + (s % kMmStages) * mm_stage_words<K>();
    }
};

// 8 raw 16-bit states of this lane's steps (spec 3.3), without the codebook.
template <int K>
__device__ __forceinline__ void lane_states(uint32_t w0, uint32_t w1, uint32_t w2, int shift,
                                            uint32_t st[8]) {
    uint32_t h0 = __funnelshift_l(w1, w0, shift);
    uint32_t h1 = __funnelshift_l(w2, w1, shift);
    uint32_t h2 = w2 << shift;
    st[0] = state_at<1 * K>(h0, h1, h2);
    st[1] = state_at<2 * K>(h0, h1, h2);
    st[2] = state_at<3 * K>(h0, h1, h2);
    st[3] = state_at<4 * K>(h0, h1, h2);
    st[4] = state_at<5 * K>(h0, h1, h2);
    st[5] = state_at<6 * K>(h0, h1, h2);
    st[6] = state_at<7 * K>(h0, h1, h2);
    st[7] = state_at<8 * K>(h0, h1, h2);
}

// Shared memory bytes for a block: activations + trellis rings.
template <int K>
inline size_t mm_ring_bytes() {
    return (size_t)kMmWarps * kMmStages * mm_stage_words<K>() * 4;
}

// ------------------------------------------------------------------------------------------
// fp16 path: all codebooks, up to 32 rows (MG groups of 8). xh = had(x * suh) precomputed.

template <int K, int CB, int MG>
__global__ void __launch_bounds__(256) exl3_mm_kernel(const half* __restrict__ xh, int ldxh,
                                                      const uint32_t* __restrict__ trellis,
                                                      float* __restrict__ z, int m, int in,
                                                      int out, int ktpb, int variant) {
    extern __shared__ uint4 smem_u4[];
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int tk = in >> 4;
    const int i0 = blockIdx.y * ktpb;
    const int i1 = min(i0 + ktpb, tk);
    if (i0 >= i1) return;
    const int xs_stride = ktpb * 16 + 8;  // halves; +8 keeps B-fragment loads conflict-free
    half* xs = reinterpret_cast<half*>(smem_u4);
    constexpr int TS = mm_stage_tiles<K>();
    const int n_tiles = i1 - i0;
    TileRing<K> ring{reinterpret_cast<uint32_t*>(xs + MG * 8 * xs_stride) +
                         warp * (kMmStages * mm_stage_words<K>()),
                     trellis, out >> 4, (int)blockIdx.x * kMmWarps + warp, i0, i1, lane,
                     (n_tiles + TS - 1) / TS};
#pragma unroll
    for (int s = 0; s < kMmStages - 1; ++s) ring.issue(s);

    // Activations for this k range: 16-byte copies, zero rows past m.
    {
        const int kr8 = n_tiles * 2;  // 8-half chunks per row
        for (int idx = threadIdx.x; idx < MG * 8 * kr8; idx += blockDim.x) {
            const int r = idx / kr8;
            const int c = idx - r * kr8;
            uint4 v = make_uint4(0u, 0u, 0u, 0u);
            if (r < m) v = *reinterpret_cast<const uint4*>(xh + (size_t)r * ldxh + i0 * 16 + c * 8);
            *reinterpret_cast<uint4*>(xs + r * xs_stride + c * 8) = v;
        }
    }
    __syncthreads();

    int wa, wb, wc, shift;
    lane_words<K>(lane, wa, wb, wc, shift);
    const int g = lane >> 2;
    const int c2 = (lane & 3) * 2;

    float acc[MG][4];
#pragma unroll
    for (int r = 0; r < MG; ++r) acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = 0.f;

    for (int s = 0; s < ring.n_stages; ++s) {
        cp_async_wait<kMmStages - 2>();
        __syncwarp();
        ring.issue(s + kMmStages - 1);
        const uint32_t* stage = ring.stage(s);
        const int tiles_here = min(TS, n_tiles - s * TS);
#pragma unroll
        for (int tt = 0; tt < TS; ++tt) {
            if (tt < tiles_here) {
                const uint32_t* words = stage + tt * 8 * K;
                uint32_t v[4];
                if (variant == 1) {  // timing probe: no decode, raw words as operands
                    v[0] = words[wa]; v[1] = words[wb]; v[2] = words[wc]; v[3] = v[0] ^ v[2];
                } else {
                    decode_lane<K, CB>(words[wa], words[wb], words[wc], shift, v);
                }
                if (variant == 2) {  // timing probe: decode only, no MMA
                    acc[0][0] += __uint_as_float((v[0] ^ v[1] ^ v[2] ^ v[3]) & 0x00ffffffu);
                    continue;
                }
                const int kl = (s * TS + tt) * 16 + c2;
#pragma unroll
                for (int r = 0; r < MG; ++r) {
                    const half* xrow = xs + (r * 8 + g) * xs_stride + kl;
                    const uint32_t b0 = *reinterpret_cast<const uint32_t*>(xrow);
                    const uint32_t b1 = *reinterpret_cast<const uint32_t*>(xrow + 8);
                    mma_16816(acc[r], v[0], v[2], v[1], v[3], b0, b1);
                }
            }
        }
    }

    // D fragment: d0/d1 = (out col g, rows c2, c2+1), d2/d3 = (out col g+8, same rows).
    const int col = (blockIdx.x * kMmWarps + warp) * 16 + g;
#pragma unroll
    for (int r = 0; r < MG; ++r) {
        const int row = r * 8 + c2;
        if (row < m) {
            atomicAdd(z + (size_t)row * out + col, acc[r][0]);
            atomicAdd(z + (size_t)row * out + col + 8, acc[r][2]);
        }
        if (row + 1 < m) {
            atomicAdd(z + (size_t)(row + 1) * out + col, acc[r][1]);
            atomicAdd(z + (size_t)(row + 1) * out + col + 8, acc[r][3]);
        }
    }
}

// ------------------------------------------------------------------------------------------
// MUL1 integer path, up to 8 rows (MGI groups of 4).
//
// MUL1's value is k_inv * (byte sum of s * 0x83DCD12D) - 3.453125 (spec 2), so the decode stops
// after one multiply: the four product bytes of each weight go straight into a u8 x s8 tensor
// core MMA as four k-slots, against its activation repeated in those slots. The activation is
// split into two int8 passes (q1 at absmax/127 per 128-block, q2 the residual at 1/254 of that
// step: about 15 bits, far below fp16 rounding of the output), carried as the two B columns
// (2r, 2r+1) of row r, so a lane ends up holding both passes of one row and folds them with
// their scales every 128 k. The constant -3.453125 * sum(xh) is added once per block. Skipping
// the per-weight fp16 rounding of the codebook value changes y by far less than 2e-3 relative.

constexpr float kMul1Inv = 0.0067672729492188f;  // half(0x1EEE)
constexpr float kMul1C0 = -3.453125f;             // 1024 * k_inv + k_bias, exact
constexpr float kMul1Bias = -10.3828125f;         // k_bias: half(0xC931)

template <int K, int MGI>
__global__ void __launch_bounds__(256) exl3_mm_i8_kernel(const uint32_t* __restrict__ sq, int ldsq,
                                                         const float2* __restrict__ scales,
                                                         const float* __restrict__ csum,
                                                         const uint32_t* __restrict__ trellis,
                                                         float* __restrict__ z, int m, int in,
                                                         int out, int ktpb, int variant) {
    extern __shared__ uint4 smem_u4[];
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int tk = in >> 4;
    const int nch = in >> 7;  // 128-chunks per row in scales/csum
    const int i0 = blockIdx.y * ktpb;
    const int i1 = min(i0 + ktpb, tk);
    if (i0 >= i1) return;
    constexpr int NCOL = 8 * MGI;          // B columns: (row, pass)
    const int qs_stride = ktpb * 16 + 8;   // words; stride = 8 mod 32 spreads the row groups
    const int kchunks = ktpb / 8;
    uint32_t* qs = reinterpret_cast<uint32_t*>(smem_u4);
    float2* sc = reinterpret_cast<float2*>(qs + NCOL * qs_stride);  // [4*MGI][kchunks]
    float* rsum = reinterpret_cast<float*>(sc + 4 * MGI * kchunks);  // [4*MGI]
    constexpr int TS = mm_stage_tiles<K>();
    const int n_tiles = i1 - i0;
    uint32_t* ring_base = reinterpret_cast<uint32_t*>(
        (reinterpret_cast<uintptr_t>(rsum + 4 * MGI) + 15) & ~uintptr_t(15));
    TileRing<K> ring{ring_base + warp * (kMmStages * mm_stage_words<K>()), trellis, out >> 4,
                     (int)blockIdx.x * kMmWarps + warp, i0, i1, lane, (n_tiles + TS - 1) / TS};
#pragma unroll
    for (int s = 0; s < kMmStages - 1; ++s) ring.issue(s);

    {
        const int kr4 = n_tiles * 4;  // 4-word chunks per column
        for (int idx = threadIdx.x; idx < NCOL * kr4; idx += blockDim.x) {
            const int col = idx / kr4;
            const int c = idx - col * kr4;
            uint4 v = make_uint4(0u, 0u, 0u, 0u);
            if ((col >> 1) < m)
                v = *reinterpret_cast<const uint4*>(sq + (size_t)col * ldsq + i0 * 16 + c * 4);
            *reinterpret_cast<uint4*>(qs + col * qs_stride + c * 4) = v;
        }
        const int nkc = n_tiles / 8;
        for (int idx = threadIdx.x; idx < 4 * MGI * nkc; idx += blockDim.x) {
            const int r = idx / nkc;
            const int c = idx - r * nkc;
            sc[r * kchunks + c] = r < m ? scales[(size_t)r * nch + i0 / 8 + c] : make_float2(0.f, 0.f);
        }
        if (threadIdx.x < 4 * MGI) {
            const int r = threadIdx.x;
            float t = 0.f;
            if (r < m)
                for (int c = 0; c < nkc; ++c) t += csum[(size_t)r * nch + i0 / 8 + c];
            rsum[r] = t;
        }
    }
    __syncthreads();

    int wa, wb, wc, shift;
    lane_words<K>(lane, wa, wb, wc, shift);
    const int g = lane >> 2;
    const int cq = lane & 3;

    int iacc[MGI][4];
    float facc[MGI][2];
#pragma unroll
    for (int r = 0; r < MGI; ++r) {
        iacc[r][0] = iacc[r][1] = iacc[r][2] = iacc[r][3] = 0;
        facc[r][0] = facc[r][1] = 0.f;
    }

    for (int s = 0; s < ring.n_stages; ++s) {
        cp_async_wait<kMmStages - 2>();
        __syncwarp();
        ring.issue(s + kMmStages - 1);
        const uint32_t* stage = ring.stage(s);
        const int tiles_here = min(TS, n_tiles - s * TS);
#pragma unroll
        for (int tt = 0; tt < TS; ++tt) {
            if (tt < tiles_here) {
                const uint32_t* words = stage + tt * 8 * K;
                uint32_t x[8];
                if (variant == 1) {
#pragma unroll
                    for (int q = 0; q < 8; ++q) x[q] = words[q & 1 ? wb : wa] + q;
                } else {
                    lane_states<K>(words[wa], words[wb], words[wc], shift, x);
#pragma unroll
                    for (int q = 0; q < 8; ++q) x[q] *= 0x83DCD12Du;
                }
                const int tl = s * TS + tt;  // tile index within the block
                if (variant == 2) {
                    iacc[0][0] += x[0] ^ x[1] ^ x[2] ^ x[3] ^ x[4] ^ x[5] ^ x[6] ^ x[7];
                } else {
                    const int kl = tl * 16 + 2 * cq;
#pragma unroll
                    for (int r = 0; r < MGI; ++r) {
                        const uint32_t* qrow = qs + (r * 8 + g) * qs_stride + kl;
                        const uint2 lo = *reinterpret_cast<const uint2*>(qrow);
                        const uint2 hi = *reinterpret_cast<const uint2*>(qrow + 8);
                        mma_16832_u8s8(iacc[r], x[0], x[4], x[1], x[5], lo.x, lo.y);
                        mma_16832_u8s8(iacc[r], x[2], x[6], x[3], x[7], hi.x, hi.y);
                    }
                }
                if ((tl & 7) == 7) {  // end of a 128-wide k chunk: fold with its scales
                    const int kc = tl >> 3;
#pragma unroll
                    for (int r = 0; r < MGI; ++r) {
                        const float2 s12 = sc[(r * 4 + cq) * kchunks + kc];
                        facc[r][0] += s12.x * (float)iacc[r][0] + s12.y * (float)iacc[r][1];
                        facc[r][1] += s12.x * (float)iacc[r][2] + s12.y * (float)iacc[r][3];
                        iacc[r][0] = iacc[r][1] = iacc[r][2] = iacc[r][3] = 0;
                    }
                }
            }
        }
    }

    // D: d0 (out col g, B col 2cq = row cq pass 1), d1 (pass 2), d2/d3 the same for col g+8.
    const int col = (blockIdx.x * kMmWarps + warp) * 16 + g;
#pragma unroll
    for (int r = 0; r < MGI; ++r) {
        const int row = r * 4 + cq;
        if (row < m) {
            const float base = kMul1C0 * rsum[row];
            atomicAdd(z + (size_t)row * out + col, kMul1Inv * facc[r][0] + base);
            atomicAdd(z + (size_t)row * out + col + 8, kMul1Inv * facc[r][1] + base);
        }
    }
}

// ------------------------------------------------------------------------------------------
// Launch plumbing.

// Split k over blocks (ktpb k tiles each, a multiple of 8). The activations of a block live in
// shared memory, so act_bytes_per_ktile caps ktpb. Among the splits that fit, pick the one with
// the least modeled time: whole waves of resident blocks (2 per SM) times the tiles per block,
// plus a fixed start-up per block of about one pipeline fill.
inline void mm_split(int tk, int nb, int num_sms, int act_bytes_per_ktile, int& ksplit, int& ktpb) {
    const int budget = 48 * 1024;
    int max_ktpb = ((budget / act_bytes_per_ktile) / 8) * 8;
    if (max_ktpb < 8) max_ktpb = 8;
    const int cap = 2 * (num_sms > 0 ? num_sms : 132);
    if (ksplit > 0) {
        ksplit = max(1, min(ksplit, tk / 8));
        ktpb = min(((tk + ksplit - 1) / ksplit + 7) & ~7, max_ktpb);
        ksplit = (tk + ktpb - 1) / ktpb;
        return;
    }
    long best = -1;
    for (int ks = 1; ks <= tk / 8; ++ks) {
        const int kt = ((tk + ks - 1) / ks + 7) & ~7;
        if (kt > max_ktpb) continue;
        const int ks_eff = (tk + kt - 1) / kt;
        const long blocks = (long)nb * ks_eff;
        const long waves = (blocks + cap - 1) / cap;
        const long cost = waves * (kt + 24);
        if (best < 0 || cost < best) {
            best = cost;
            ksplit = ks_eff;
            ktpb = kt;
        }
    }
    if (best < 0) {
        ktpb = max_ktpb;
        ksplit = (tk + ktpb - 1) / ktpb;
    }
}

template <int K, int CB, int MG>
cudaError_t launch_mm(const half* xh, int ldxh, const uint32_t* trellis, float* z, int m, int in,
                      int out, int ksplit, int num_sms, cudaStream_t stream) {
    const int tk = in / 16;
    const int nb = out / (16 * kMmWarps);
    int ktpb;
    mm_split(tk, nb, num_sms, MG * 8 * 16 * 2, ksplit, ktpb);
    const size_t smem = (size_t)MG * 8 * (ktpb * 16 + 8) * 2 + mm_ring_bytes<K>();
    auto kern = exl3_mm_kernel<K, CB, MG>;
    cudaError_t e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e != cudaSuccess) return e;
    kern<<<dim3(nb, ksplit), kMmWarps * 32, smem, stream>>>(xh, ldxh, trellis, z, m, in, out, ktpb,
                                                           mm_debug_variant());
    return cudaGetLastError();
}

template <int K, int MGI>
cudaError_t launch_mm_i8(const uint32_t* sq, int ldsq, const float2* scales, const float* csum,
                         const uint32_t* trellis, float* z, int m, int in, int out, int ksplit,
                         int num_sms, cudaStream_t stream) {
    const int tk = in / 16;
    const int nb = out / (16 * kMmWarps);
    int ktpb;
    mm_split(tk, nb, num_sms, 8 * MGI * 16 * 4, ksplit, ktpb);
    const size_t smem = (size_t)8 * MGI * (ktpb * 16 + 8) * 4 + (size_t)4 * MGI * (ktpb / 8) * 8 +
                        4 * MGI * 4 + 16 + mm_ring_bytes<K>();
    auto kern = exl3_mm_i8_kernel<K, MGI>;
    cudaError_t e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e != cudaSuccess) return e;
    kern<<<dim3(nb, ksplit), kMmWarps * 32, smem, stream>>>(sq, ldsq, scales, csum, trellis, z, m,
                                                           in, out, ktpb, mm_debug_variant());
    return cudaGetLastError();
}

// One K: sq != null selects the MUL1 integer path (m <= 8), else the fp16 path (m <= 32).
template <int K>
cudaError_t launch_mm_k(const MmArgs& a, cudaStream_t stream) {
    if (a.sq) {
        if (a.m <= 4)
            return launch_mm_i8<K, 1>(a.sq, a.ldsq, a.scales, a.csum, a.trellis, a.z, a.m, a.in,
                                      a.out, a.ksplit, a.num_sms, stream);
        return launch_mm_i8<K, 2>(a.sq, a.ldsq, a.scales, a.csum, a.trellis, a.z, a.m, a.in, a.out,
                                  a.ksplit, a.num_sms, stream);
    }
#define TRELLIS_MM_CASE(CBV, MGV) \
    return launch_mm<K, CBV, MGV>(a.xh, a.ldxh, a.trellis, a.z, a.m, a.in, a.out, a.ksplit, a.num_sms, stream)
#define TRELLIS_MM_MG(CBV)               \
    if (a.m <= 8) TRELLIS_MM_CASE(CBV, 1); \
    if (a.m <= 16) TRELLIS_MM_CASE(CBV, 2); \
    TRELLIS_MM_CASE(CBV, 4);
    switch (a.codebook) {
        case CB_3INST: TRELLIS_MM_MG(CB_3INST)
        case CB_MCG: TRELLIS_MM_MG(CB_MCG)
        case CB_MUL1: TRELLIS_MM_MG(CB_MUL1)
        default: return cudaErrorInvalidValue;
    }
#undef TRELLIS_MM_MG
#undef TRELLIS_MM_CASE
}

}  // namespace trellis
