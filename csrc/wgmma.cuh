// Hopper's asynchronous warpgroup MMA (wgmma), as the block-shared product (exl3_gemv_sa.cuh,
// kSaWgmma) and bench/wgmma_probe.cu use it: A (the decoded tiles) from the four warps' registers,
// B (the activations) from shared memory through a descriptor.
//
// Why a header of its own: the instructions exist only in sm_90a code (the build compiles sm_90
// as sm_90a where CUDA is 12 or newer, engine/ops/build.py). Elsewhere the wrappers compile to a
// trap, and the host never launches a kernel that reaches them (wgmma_available).
#pragma once
#include <cstdint>

#include "kernels.h"

namespace trellis {

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define TRELLIS_WGMMA 1
#else
#define TRELLIS_WGMMA 0
#endif

// Whether this device runs sm_90a code of this build: the build made some (TRELLIS_SM90A, set by
// engine/ops/build.py where it targets sm_90a, which needs CUDA 12) and the device is a 9.0 one.
inline bool wgmma_available() {
#ifdef TRELLIS_SM90A
    return current_device_attr<cudaDevAttrComputeCapabilityMajor>() == 9 &&
           current_device_attr<cudaDevAttrComputeCapabilityMinor>() == 0;
#else
    return false;
#endif
}

// Shared-memory matrix descriptor without swizzle: the start address, then the byte distances
// between core matrices (8 rows x 16 bytes, contiguous) adjacent along K (lbo) and along M or N
// (sbo), each in units of 16 bytes.
__device__ __forceinline__ uint64_t wg_smem_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
    return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)(lbo >> 4) << 16) | ((uint64_t)(sbo >> 4) << 32);
}

// Orders this thread's register writes (accumulators, A) before the wgmmas that follow.
__device__ __forceinline__ void wg_fence() {
#if TRELLIS_WGMMA
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#else
    __trap();
#endif
}
__device__ __forceinline__ void wg_commit() {
#if TRELLIS_WGMMA
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
// Waits until at most N committed groups are still running.
template <int N>
__device__ __forceinline__ void wg_wait() {
#if TRELLIS_WGMMA
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}
// Makes this thread's ordinary shared-memory writes visible to wgmma's operand reads (the async
// proxy); then a barrier, so that every warp's are.
__device__ __forceinline__ void wg_fence_smem_writes() {
#if TRELLIS_WGMMA
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// D (64 x M fp32; this thread's M / 2) += A (64 x 16 fp16 from the 4 warps' registers, each
// warp's 16 rows in m16n8k16 A-fragment order) x B (16 x M from shared memory, K-major core
// matrices); scale_d 0 overwrites D instead. D's quad i is the m16n8k16 accumulator of B's
// columns 8 i .. 8 i + 7.
template <int M>
__device__ __forceinline__ void wgmma_rs(float* d, const uint32_t a[4], uint64_t desc, int scale_d);

// The m64n32k16 form with D as four quads (the m16n8k16 accumulators of B's column groups), which
// need not lie together: the block-shared kernel keeps them as acc[group][tile][4].
__device__ __forceinline__ void wgmma_rs_n32(float (&q0)[4], float (&q1)[4], float (&q2)[4], float (&q3)[4],
                                             const uint32_t a[4], uint64_t desc, int scale_d) {
#if TRELLIS_WGMMA
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %20, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 "
        "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, {%16,%17,%18,%19}, %21, p, 1, 1, 0;\n}\n"
        : "+f"(q0[0]), "+f"(q0[1]), "+f"(q0[2]), "+f"(q0[3]), "+f"(q1[0]), "+f"(q1[1]), "+f"(q1[2]), "+f"(q1[3]),
          "+f"(q2[0]), "+f"(q2[1]), "+f"(q2[2]), "+f"(q2[3]), "+f"(q3[0]), "+f"(q3[1]), "+f"(q3[2]), "+f"(q3[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(scale_d), "l"(desc));
#else
    __trap();
#endif
}

template <>
__device__ __forceinline__ void wgmma_rs<32>(float* d, const uint32_t a[4], uint64_t desc, int scale_d) {
    float(*q)[4] = reinterpret_cast<float(*)[4]>(d);
    wgmma_rs_n32(q[0], q[1], q[2], q[3], a, desc, scale_d);
}

template <>
__device__ __forceinline__ void wgmma_rs<16>(float* d, const uint32_t a[4], uint64_t desc, int scale_d) {
#if TRELLIS_WGMMA
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %12, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 "
        "{%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9,%10,%11}, %13, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(scale_d), "l"(desc));
#else
    __trap();
#endif
}

template <>
__device__ __forceinline__ void wgmma_rs<8>(float* d, const uint32_t a[4], uint64_t desc, int scale_d) {
#if TRELLIS_WGMMA
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %8, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n8k16.f32.f16.f16 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, %9, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(scale_d), "l"(desc));
#else
    __trap();
#endif
}

}  // namespace trellis
