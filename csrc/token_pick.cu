// Picking the next token on the GPU: greedy decoding's argmax and the sampler's draw among the
// most likely tokens. Small, latency-bound kernels that run once per generated token, after the
// head (engine/ops argmax and sample_top; csrc/PERF_NOTES.md, session 13).
#include <cuda_fp16.h>
#include <math.h>
#include <stdint.h>

#include "exl3_mm.cuh"
#include "kernels.h"

namespace trellis {

// ---------------------------------------------------------------------------------------------
// Argmax of each row: greedy decoding's pick from a step's logits (128k fp32, just written by the
// head, so in L2) in one launch, where torch's reduce takes two launches and ~30 us. One block
// reading a whole row was latency-bound (22 us: too few loads in flight), so blocks split the row
// and meet in one 64-bit atomicMax per row: the key orders by value (NaN above everything, as
// torch.argmax) and then by the lower index. The block that arrives last takes the answer and
// leaves the scratch zero for the next call (csrc/PERF_NOTES.md, session 13).

// Larger key: larger value, then lower index. Every element's key is above 0, the scratch's rest.
__device__ __forceinline__ unsigned long long arg_key(float v, int i) {
    const uint32_t f = __float_as_uint(v);
    const uint32_t ord = v != v ? 0xffffffffu : ((f & 0x80000000u) ? ~f : (f | 0x80000000u));
    return ((unsigned long long)ord << 32) | (uint32_t)~(uint32_t)i;
}

// The index a key holds (arg_key's low half).
__device__ __forceinline__ int64_t key_index(unsigned long long key) {
    return (int64_t)(uint32_t)~(uint32_t)(key & 0xffffffffull);
}

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(half v) { return __half2float(v); }

constexpr int kArgThreads = 256, kArgAhead = 8;  // 2,048 elements per block, all loads in flight at once

template <typename T>
__global__ void __launch_bounds__(kArgThreads) argmax_rows_kernel(const T* __restrict__ x, long ld, int n, int rows,
                                                                  unsigned long long* scratch, int64_t* __restrict__ out) {
    pdl_launch_dependents();
    pdl_wait_primary();
    const int r = blockIdx.y;
    const T* row = x + (size_t)r * ld;
    const int first = blockIdx.x * kArgThreads * kArgAhead + threadIdx.x;
    float v[kArgAhead];
#pragma unroll
    for (int j = 0; j < kArgAhead; ++j) {
        const int i = first + j * kArgThreads;
        v[j] = i < n ? to_f32(row[i]) : 0.f;
    }
    unsigned long long best = 0;
#pragma unroll
    for (int j = 0; j < kArgAhead; ++j) {
        const int i = first + j * kArgThreads;
        if (i < n) best = max(best, arg_key(v[j], i));
    }
#pragma unroll
    for (int o = 16; o; o >>= 1) best = max(best, __shfl_xor_sync(0xffffffffu, best, o));
    __shared__ unsigned long long s_best[kArgThreads / 32];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) s_best[warp] = best;
    __syncthreads();
    if (threadIdx.x) return;
#pragma unroll
    for (int w = 1; w < kArgThreads / 32; ++w) best = max(best, s_best[w]);
    atomicMax(&scratch[r], best);
    fence_acq_rel_gpu();  // release: this block's atomicMax before its count (as the products' counts)
    if (atomicAdd(&scratch[rows + r], 1ull) + 1 == gridDim.x) {  // the last block of the row
        fence_acq_rel_gpu();  // acquire: every block counted has its atomicMax visible
        const unsigned long long key = atomicExch(&scratch[r], 0ull);
        scratch[rows + r] = 0;
        out[r] = key_index(key);
    }
}

cudaError_t argmax_rows(const void* x, bool f32, long ld, int rows, int n, void* scratch, int64_t* out,
                        cudaStream_t stream) {
    if (rows < 1 || rows > 65535 || n < 1) return cudaErrorInvalidValue;
    const dim3 grid((unsigned)((n + kArgThreads * kArgAhead - 1) / (kArgThreads * kArgAhead)), (unsigned)rows);
    auto* s = static_cast<unsigned long long*>(scratch);
    if (f32) return launch_glue(argmax_rows_kernel<float>, grid, dim3(kArgThreads), stream, (const float*)x, ld, n, rows, s, out);
    return launch_glue(argmax_rows_kernel<half>, grid, dim3(kArgThreads), stream, (const half*)x, ld, n, rows, s, out);
}

// ---------------------------------------------------------------------------------------------
// The sampler's draw from the most likely tokens (engine/generate/sampling.py, choose): after
// torch.topk, the probabilities, top-p and min-p cuts and the inverse-CDF draw are some twenty
// small PyTorch kernels; here they are one block, a token per thread (look <= 1024).

// Inclusive prefix sum over the block (blockDim.x a multiple of 32, at most 1024); `total` gets
// the sum of all threads' values.
template <typename T>
__device__ __forceinline__ T block_scan(T v, T& total) {
    __shared__ T warp_sums[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const T up = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o) v += up;
    }
    if (lane == 31) warp_sums[warp] = v;
    __syncthreads();
    if (warp == 0) {
        T w = lane < warps ? warp_sums[lane] : T(0);
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const T up = __shfl_up_sync(0xffffffffu, w, o);
            if (lane >= o) w += up;
        }
        if (lane < warps) warp_sums[lane] = w;
    }
    __syncthreads();
    if (warp) v += warp_sums[warp - 1];
    total = warp_sums[warps - 1];
    __syncthreads();  // warp_sums is reused by the next scan
    return v;
}

__global__ void __launch_bounds__(1024) sample_top_kernel(const float* __restrict__ vals, const int64_t* __restrict__ ids,
                                                          int look, const float* top, const float* z, float top_p,
                                                          bool min_on, float log_min_p, const double* u,
                                                          int64_t* __restrict__ out) {
    __shared__ float s_mass_last;
    __shared__ double s_cdf_last;
    const int t = threadIdx.x;
    const bool live = t < look;
    const float v0 = vals[0];
    const float v = live ? vals[t] : -INFINITY;
    const float e = live ? expf(v - v0) : 0.f;  // softmax's numerator, or the token's share of z
    float sum;
    block_scan(e, sum);
    const float p = e / (z ? *z : sum);
    float unused;
    const float mass = block_scan(p, unused);
    if (t == look - 1) s_mass_last = mass;
    int keep = look;
    if (top_p < 1.f) keep = max(1, __syncthreads_count(live && mass - p < top_p));  // a prefix
    if (min_on) keep = min(keep, max(1, __syncthreads_count(live && v - v0 >= log_min_p)));
    const double q = t < keep ? exp((double)v - (double)v0) : 0.0;
    double all;
    const double cdf = block_scan(q, all);
    if (t == keep - 1) s_cdf_last = cdf;
    __syncthreads();
    const double target = s_cdf_last * *u;
    const int at = min(__syncthreads_count(t < keep && cdf <= target), keep - 1);  // searchsorted, right
    if (t == 0) {
        out[0] = ids[at];
        // Top-p needs more than `look` tokens, unless min-p drops the last of them (and so every
        // token past them): its cut is then the smaller set, inside the look.
        out[1] = z != nullptr && top_p < 1.f && s_mass_last < top_p && !(min_on && vals[look - 1] - v0 < log_min_p);
        out[2] = !isfinite(*top);
    }
}

cudaError_t sample_top(const float* vals, const int64_t* ids, int look, const float* top, const float* z,
                       float top_p, bool min_on, float log_min_p, const double* u, int64_t* out, cudaStream_t stream) {
    if (look < 1 || look > 1024) return cudaErrorInvalidValue;
    sample_top_kernel<<<1, (look + 31) / 32 * 32, 0, stream>>>(vals, ids, look, top, z, top_p, min_on, log_min_p, u, out);
    return cudaGetLastError();
}

// ---------------------------------------------------------------------------------------------
// The k (<= 64) most likely tokens, for the sampler's top-k (engine/generate/sampling.py, choose):
// torch.topk of one 128k row takes ~58 us on the H200 (its radix select over one long row; a
// two-stage torch.topk over [R, n / R] rows was no faster: csrc/PERF_NOTES.md, session 15). Here
// two launches: each block of the first selects its chunk's k largest keys, one block of the
// second selects the k largest of those and orders them. A key is arg_key's (value, then the
// lower index), so every key is distinct, the answer exact and ties go to the lower index.

constexpr int kTopkThreads = 256, kTopkPerThread = 8;  // 2,048 logits per first-stage block
constexpr int kTopkMaxK = 64;
constexpr int kTopkFinalThreads = 1024, kTopkFinalPerThread = 8;  // at most 8,192 candidates

// The threshold of the k largest of the block's keys (distinct; k at most their count): the
// selected keys are exactly those whose bits under `mask` are >= `prefix`. A radix select, a byte
// at a time from the top: it stops at the byte where every key still matching the prefix is
// needed, so ~3 passes for logits rather than 8.
template <int PER>
__device__ __forceinline__ void block_radix_select(const unsigned long long (&key)[PER], int k,
                                                   unsigned long long& prefix, unsigned long long& mask) {
    __shared__ int hist[256];
    __shared__ int s_digit, s_above;
    prefix = 0;
    mask = 0;
    int needed = k;
    for (int shift = 56; shift >= 0; shift -= 8) {
        for (int b = threadIdx.x; b < 256; b += blockDim.x) hist[b] = 0;
        __syncthreads();
#pragma unroll
        for (int j = 0; j < PER; ++j)
            if ((key[j] & mask) == prefix) atomicAdd(&hist[(key[j] >> shift) & 255], 1);
        __syncthreads();
        if (threadIdx.x < 32) {  // one warp finds the byte where the count from the top reaches `needed`
            const int lane = threadIdx.x;
            int c[8], sum = 0;  // lane holds bins 255 - 8 lane ... 248 - 8 lane, the top first
#pragma unroll
            for (int j = 0; j < 8; ++j) sum += (c[j] = hist[255 - 8 * lane - j]);
            int incl = sum;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const int up = __shfl_up_sync(0xffffffffu, incl, o);
                if (lane >= o) incl += up;
            }
            int above = incl - sum;  // keys in the bins above this lane's
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                if (above < needed && above + c[j] >= needed) s_digit = 255 - 8 * lane - j, s_above = above;
                above += c[j];
            }
        }
        __syncthreads();
        const int digit = s_digit;
        needed -= s_above;
        prefix |= (unsigned long long)digit << shift;
        mask |= 255ull << shift;
        const bool done = hist[digit] == needed;  // every key under this prefix is in
        __syncthreads();  // hist and s_digit are rewritten by the next pass
        if (done) return;
    }
}

// Writes the block's selected keys (those at or above the threshold) to out, in thread order.
template <int PER>
__device__ __forceinline__ void block_write_selected(const unsigned long long (&key)[PER], unsigned long long prefix,
                                                     unsigned long long mask, unsigned long long* out) {
    int mine = 0;
#pragma unroll
    for (int j = 0; j < PER; ++j) mine += (key[j] & mask) >= prefix;
    int total;
    int at = block_scan(mine, total) - mine;
#pragma unroll
    for (int j = 0; j < PER; ++j)
        if ((key[j] & mask) >= prefix) out[at++] = key[j];
}

// A short last chunk's missing logits: distinct keys (the select needs distinct keys) below every
// real one (a real key's value part is at least ~(-inf) = 0x007fffff), never selected while n >= k.
__device__ __forceinline__ unsigned long long pad_key(int i) { return (unsigned long long)(uint32_t)~(uint32_t)i; }

__global__ void __launch_bounds__(kTopkThreads) topk_chunks_kernel(const float* __restrict__ x, int n, int k,
                                                                  unsigned long long* __restrict__ cand) {
    pdl_launch_dependents();
    pdl_wait_primary();
    const int first = blockIdx.x * kTopkThreads * kTopkPerThread + threadIdx.x;
    unsigned long long key[kTopkPerThread];
#pragma unroll
    for (int j = 0; j < kTopkPerThread; ++j) {
        const int i = first + j * kTopkThreads;
        key[j] = i < n ? arg_key(x[i], i) : pad_key(i);
    }
    unsigned long long prefix, mask;
    block_radix_select(key, k, prefix, mask);
    block_write_selected(key, prefix, mask, cand + (size_t)blockIdx.x * k);
}

__device__ __forceinline__ float key_value(unsigned long long key) {
    const uint32_t ord = (uint32_t)(key >> 32);
    if (ord == 0xffffffffu) return __uint_as_float(0x7fc00000u);  // NaN
    return __uint_as_float((ord & 0x80000000u) ? (ord & 0x7fffffffu) : ~ord);
}

__global__ void __launch_bounds__(kTopkFinalThreads) topk_final_kernel(const unsigned long long* __restrict__ cand,
                                                                       int m, int k, float* __restrict__ vals,
                                                                       int64_t* __restrict__ ids) {
    pdl_launch_dependents();
    pdl_wait_primary();
    unsigned long long key[kTopkFinalPerThread];
#pragma unroll
    for (int j = 0; j < kTopkFinalPerThread; ++j) {
        const int i = threadIdx.x + j * kTopkFinalThreads;
        key[j] = i < m ? cand[i] : 0ull;  // distinct candidates; the zeros are never needed (m >= k)
    }
    unsigned long long prefix, mask;
    block_radix_select(key, k, prefix, mask);
    __shared__ unsigned long long sel[kTopkMaxK];
    block_write_selected(key, prefix, mask, sel);
    __syncthreads();
    if (threadIdx.x < k) {  // each key's place: how many selected keys are larger (all distinct)
        const unsigned long long mine = sel[threadIdx.x];
        int rank = 0;
        for (int j = 0; j < k; ++j) rank += sel[j] > mine;
        vals[rank] = key_value(mine);
        ids[rank] = key_index(mine);
    }
}

static int topk_blocks(int n) { return (n + kTopkThreads * kTopkPerThread - 1) / (kTopkThreads * kTopkPerThread); }

bool topk_small_serves(long n, int k) {
    return k >= 1 && k <= kTopkMaxK && n >= k && n < (1L << 31) &&
           (long)topk_blocks((int)n) * k <= kTopkFinalThreads * kTopkFinalPerThread;
}

cudaError_t topk_small(const float* x, int n, int k, void* scratch, float* vals, int64_t* ids, cudaStream_t stream) {
    const int blocks = topk_blocks(n);
    if (!topk_small_serves(n, k)) return cudaErrorInvalidValue;
    auto* cand = static_cast<unsigned long long*>(scratch);
    cudaError_t e = launch_glue(topk_chunks_kernel, dim3(blocks), dim3(kTopkThreads), stream, x, n, k, cand);
    if (e != cudaSuccess) return e;
    return launch_glue(topk_final_kernel, dim3(1), dim3(kTopkFinalThreads), stream, (const unsigned long long*)cand,
                       blocks * k, k, vals, ids);
}

int topk_small_scratch_words(int n, int k) { return topk_blocks(n) * k; }

}  // namespace trellis
