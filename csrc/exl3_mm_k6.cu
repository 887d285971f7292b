// Instantiates the fused EXL3 product for K = 6 (one file per K so builds run in parallel).
#include "exl3_mm.cuh"

namespace trellis {
cudaError_t exl3_mm_k6(const MmArgs& a, cudaStream_t stream) { return launch_mm_k<6>(a, stream); }
}  // namespace trellis
