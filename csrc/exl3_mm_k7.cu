// Instantiates the fused EXL3 products (version 2 and 3) for K = 7 (one file per K so builds run in parallel).
#include "exl3_gemv_sa.cuh"

namespace trellis {
cudaError_t exl3_mm_k7(const MmArgs& a, cudaStream_t stream) { return launch_mm_k<7>(a, stream); }
cudaError_t exl3_gv_k7(const MmArgs& a, int variant, cudaStream_t stream) {
    return launch_gemv_k<7>(a, variant, stream);
}
}  // namespace trellis
