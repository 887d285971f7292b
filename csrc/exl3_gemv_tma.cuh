// The fused product's ring filled by the tensor memory accelerator (debug variant 25, kGvVarTma
// in exl3_gemv_geom.cuh): one 2D tensor copy brings a unit's trellis (KR k rows of CT tiles, a box
// of a tensor map over the layer's trellis) and one bulk copy its k rows' activations, both
// issued by lane 0 and counted in bytes on the stage's mbarrier, instead of ~12 cp.async per lane
// and their address arithmetic. Why: the one-row integer product is bound by instruction issue on
// the H200 and its producer takes ~2.5 of the ~27 instructions a tile (csrc/PERF_NOTES.md,
// session 32); on an H100, where it streams at ~76% of DRAM's rate, larger requests may stream
// better. sm_90 only (the launch refuses older GPUs); the host side needs the driver's
// cuTensorMapEncodeTiled, reached through cudaGetDriverEntryPointByVersion (CUDA 12.5+).
#pragma once
#include <cuda.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

namespace trellis {

// The tensor map of a layer's trellis as the kernel sees it: k rows (dim 1) of tn * 8K words
// (dim 0), a box of CT tiles x KR k rows. Passed by value as a __grid_constant__ parameter, so
// the copy instruction can take its address.
struct GvTma {
#if CUDA_VERSION >= 12000
    CUtensorMap map;
#else  // toolkits before tensor maps: never encoded (gv_encode_trellis_map says no)
    alignas(64) unsigned char map[128];
#endif
};
struct GvNoTma {};
template <bool TMA>
using GvTmaArg = std::conditional_t<TMA, GvTma, GvNoTma>;

// Encodes the map; false where the driver lacks the call or refuses the layout.
inline bool gv_encode_trellis_map(GvTma& out, const uint32_t* trellis, long row_words, long rows, int box_words,
                                  int box_rows) {
#if CUDART_VERSION >= 12050 && CUDA_VERSION >= 12000
    using Encode = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
    static Encode encode = []() -> Encode {
        void* fn = nullptr;
        cudaDriverEntryPointQueryResult q{};
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q) !=
                cudaSuccess ||
            q != cudaDriverEntryPointSuccess)
            return nullptr;
        return reinterpret_cast<Encode>(fn);
    }();
    if (!encode) return false;
    const cuuint64_t dims[2] = {(cuuint64_t)row_words, (cuuint64_t)rows};
    const cuuint64_t strides[1] = {(cuuint64_t)row_words * 4};
    const cuuint32_t box[2] = {(cuuint32_t)box_words, (cuuint32_t)box_rows};
    const cuuint32_t elem[2] = {1, 1};
    return encode(&out.map, CU_TENSOR_MAP_DATA_TYPE_UINT32, 2, const_cast<uint32_t*>(trellis), dims, strides, box,
                  elem, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
#else
    (void)out, (void)trellis, (void)row_words, (void)rows, (void)box_words, (void)box_rows;
    return false;
#endif
}

// The device side: a stage's mbarrier (one arrival, lane 0's, plus the bytes it expects), the
// two copies that complete on it, and the consumer's wait for a phase.
__device__ __forceinline__ void mbar_init(uint32_t bar) {
#if __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar) : "memory");
#endif
}
__device__ __forceinline__ void mbar_init_fence() {
#if __CUDA_ARCH__ >= 900
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}
__device__ __forceinline__ void mbar_expect(uint32_t bar, uint32_t bytes) {
#if __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
#endif
}
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
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const void* map, int x, int y, uint32_t bar) {
#if __CUDA_ARCH__ >= 900
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(
            dst),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(bar)
        : "memory");
#endif
}
__device__ __forceinline__ void bulk_load(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
#if __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
                 "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
#endif
}

}  // namespace trellis
