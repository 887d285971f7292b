// Gemma 2's attention probabilities at prefill, in one pass over the scores.
//
// Prefill attention with Gemma 2's soft cap has no fused kernel to run on (SDPA cannot cap), so
// capped_attention (engine/models/layers.py) materializes each chunk's scores and then runs
// tanh, the cap's multiply, the mask and the softmax as four PyTorch passes, each reading and
// writing every score: at 4,096 tokens a Gemma-2-9B layer's chunk of scores is 268 MB, so those
// passes are most of the attention's time. This kernel does the four in one read and one write,
// with each step rounded as those passes round it (tanh and the cap's product to fp16, the masked
// scores to -inf, a softmax in fp32 written as fp16).
#include <math.h>

#include "exl3_mm.cuh"
#include "kernels.h"

namespace trellis {

namespace {

constexpr int kCsThreads = 256;
constexpr float kCsLog2e = 1.4426950408889634f;

// tanh(x) = 1 - 2 / (1 + e^2x) from the exp2 and reciprocal units (saturating to +-1, ~1e-7 from
// tanhf near 0), where tanhf's ~20 instructions a score would make this kernel compute-bound.
__device__ __forceinline__ float fast_tanh(float x) {
    // tanh(10) is 1 in fp32, and e^2x stays finite. Comparisons, not fminf / fmaxf, which would
    // turn a NaN score into -10: a NaN stays NaN and spreads over its row, as in the passes.
    x = x > 10.f ? 10.f : (x < -10.f ? -10.f : x);
    return 1.f - __fdividef(2.f, 1.f + exp2f(2.f * kCsLog2e * x));
}

// One block per row of S scores, in place: p = softmax(mask(fp16(fp16(tanh(s)) * softcap))).
// The scores are [..., q_rows, S]: row r is the chunk's query r % q_rows, whose mask row is q0 +
// that (mask_ld 0: one mask row for every query; no mask: every key allowed). The transformed
// row waits in shared memory (S floats) between the max, the sum and the write.
__global__ void capped_softmax_kernel(half* __restrict__ scores, int S, float softcap,
                                      const uint8_t* __restrict__ mask, long mask_ld, int q_rows, int q0) {
    pdl_launch_dependents();
    pdl_wait_primary();
    extern __shared__ float cs_row[];
    __shared__ float scratch[kCsThreads / 32];
    half* row = scores + (size_t)blockIdx.x * S;
    const uint8_t* allowed = mask ? mask + (size_t)(q0 + (int)(blockIdx.x % q_rows)) * mask_ld : nullptr;
    float mx = -INFINITY;
    for (int i = threadIdx.x; i < S; i += kCsThreads) {
        const float t = __half2float(__float2half_rn(fast_tanh(__half2float(row[i]))));
        float v = __half2float(__float2half_rn(t * softcap));
        if (allowed && !allowed[i]) v = -INFINITY;
        cs_row[i] = v;
        mx = fmaxf(mx, v);
    }
    mx = block_reduce(mx, scratch, [](float a, float b) { return fmaxf(a, b); }, -INFINITY);
    float sum = 0.f;
    for (int i = threadIdx.x; i < S; i += kCsThreads) {
        const float e = exp2f((cs_row[i] - mx) * kCsLog2e);
        cs_row[i] = e;
        sum += e;
    }
    __syncthreads();  // every thread has read the max from scratch
    const float inv = 1.f / block_reduce(sum, scratch, [](float a, float b) { return a + b; }, 0.f);
    for (int i = threadIdx.x; i < S; i += kCsThreads) row[i] = __float2half_rn(cs_row[i] * inv);
}

}  // namespace

int capped_softmax_max_len() {
    // The transformed row stays in shared memory: S floats in one block's opt-in limit.
    const int smem = current_device_attr<cudaDevAttrMaxSharedMemoryPerBlockOptin>();
    return (smem - 1024) / 4;
}

cudaError_t capped_softmax(half* scores, long rows, int S, float softcap, const uint8_t* mask, long mask_ld,
                           int q_rows, int q0, cudaStream_t stream) {
    if (rows < 1 || S < 1 || q_rows < 1 || rows % q_rows || !(softcap > 0.f) || S > capped_softmax_max_len())
        return cudaErrorInvalidValue;
    return launch_pdl_smem(capped_softmax_kernel, dim3((unsigned)rows), dim3(kCsThreads), (size_t)S * 4, stream,
                           glue_pdl(), scores, S, softcap, mask, mask_ld, q_rows, q0);
}

}  // namespace trellis
