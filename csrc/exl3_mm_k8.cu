// Instantiates the fused EXL3 product for K = 8 (one file per K so builds run in parallel).
#include "exl3_mm.cuh"

namespace trellis {
cudaError_t exl3_mm_k8(const MmArgs& a, cudaStream_t stream) { return launch_mm_k<8>(a, stream); }
}  // namespace trellis
