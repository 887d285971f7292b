// K = 4 MUL1 version-3 products on the fp16 path (1..32 rows), apart from exl3_mm_k4.cu so that
// the two compile in parallel (TRELLIS_GV_MUL1_F16, exl3_gemv_sa.cuh).
#include "exl3_gemv_sa.cuh"

namespace trellis {
TRELLIS_GV_MUL1_F16(, 4)
}  // namespace trellis
