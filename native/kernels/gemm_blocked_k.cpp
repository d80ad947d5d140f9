// The entry points of GGUF's K-quants with mins (w = d sc q - dmin m), kept as stored (their kernels:
// gemm_blocked.h).
#include "gemm_blocked.h"

namespace moe {

MOE_BLOCKED_ENTRIES(q4k, Q4K)
MOE_BLOCKED_ENTRIES(q5k, Q5K)
MOE_BLOCKED_ENTRIES(q2k, Q2K)

}  // namespace moe
