// Instantiates the fused EXL3 products (version 2 and 3) for K = 4 (one file per K so builds run in parallel).
// MUL1's version-3 products are compiled in exl3_gv_k4_mul1_f16.cu and exl3_gv_k4_mul1_i8.cu.
#include "exl3_gemv_sa.cuh"

namespace trellis {
TRELLIS_GV_MUL1_F16(extern, 4)
TRELLIS_GV_MUL1_I8(extern, 4)

cudaError_t exl3_mm_k4(const MmArgs& a, cudaStream_t stream) { return launch_mm_k<4>(a, stream); }
cudaError_t exl3_gv_k4(const MmArgs& a, int variant, cudaStream_t stream) {
    return launch_gemv_k<4>(a, variant, stream);
}
}  // namespace trellis
