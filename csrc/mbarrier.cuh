// Shared-memory mbarriers and the bulk copy (TMA, sm_90) that completes on one. The block-shared
// product loads its activation slice in parts this way, so that each warp waits only for the part
// its next k rows need (exl3_gemv_sa_kernel.cuh). Below sm_90 every function compiles to nothing
// and the caller takes its cp.async form instead. An mbarrier here completes one phase in its
// life (parity 0); the copy's bytes count against it like arrivals.
#pragma once
#include <stdint.h>

namespace trellis {

#if __CUDA_ARCH__ >= 900 || !defined(__CUDA_ARCH__)
constexpr bool kBulkCopies = true;
#else
constexpr bool kBulkCopies = false;
#endif

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t arrivals) {
#if __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(arrivals) : "memory");
#endif
}
// Makes the initialised barriers visible to the copy engine (the async proxy); a block barrier
// after it makes them visible to the other threads.
__device__ __forceinline__ void mbar_init_fence() {
#if __CUDA_ARCH__ >= 900
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}
// One arrival (release: this thread's shared-memory writes before it are seen by the waiters).
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
#if __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
#endif
}
// One arrival, and `bytes` more the phase waits for.
__device__ __forceinline__ void mbar_arrive_expect(uint32_t bar, uint32_t bytes) {
#if __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
#endif
}
// Until the phase of this parity completes (acquire: what the arrivals released, and the bytes
// copied, are visible after it).
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
#if __CUDA_ARCH__ >= 900
    uint32_t done;
    do {
        asm volatile(
            "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
    } while (!done);
#endif
}
// `bytes` (a multiple of 16, both addresses 16-byte aligned) from global src to shared dst,
// counted on the mbarrier at bar.
__device__ __forceinline__ void bulk_load(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
#if __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
                 "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
#endif
}

}  // namespace trellis
