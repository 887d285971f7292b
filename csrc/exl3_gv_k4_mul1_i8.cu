// K = 4 MUL1 version-3 products on the integer path (1..8 rows, decode chains, self prep), apart
// from exl3_mm_k4.cu so that the two compile in parallel (TRELLIS_GV_MUL1_I8, exl3_gemv_sa.cuh).
#include "exl3_gemv_sa.cuh"

namespace trellis {
TRELLIS_GV_MUL1_I8(, 4)
}  // namespace trellis
