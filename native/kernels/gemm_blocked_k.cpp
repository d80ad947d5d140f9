// The entry points of GGUF's K-quants with mins (w = d sc q - dmin m), kept as stored (their kernels:
// gemm_blocked.h, shared, and each ISA's folder; no AMX path).
#include "kernels/avx2/gemm_blocked_avx2.h"
#include "kernels/avx512/gemm_blocked_avx512.h"
#include "kernels/portable/gemm_blocked_ref.h"

namespace moe {

MOE_BLOCKED_ENTRIES(q4k, Q4K)
MOE_BLOCKED_ENTRIES(q5k, Q5K)
MOE_BLOCKED_ENTRIES(q2k, Q2K)

}  // namespace moe
