// The entry points of GGUF's super-blocked formats with signed sub-scales (w = d sc value), kept as stored (their
// kernels: gemm_blocked.h, shared, and each ISA's folder).
#include "kernels/amx/gemm_blocked_amx.h"
#include "kernels/avx2/gemm_blocked_avx2.h"
#include "kernels/avx512/gemm_blocked_avx512.h"
#include "kernels/portable/gemm_blocked_ref.h"

namespace moe {

MOE_BLOCKED_ENTRIES(q3k, Q3K)
MOE_BLOCKED_ENTRIES(q6k, Q6K)
MOE_BLOCKED_ENTRIES(iq4xs, IQXS)
MOE_BLOCKED_AMX(q6k, Q6K)
MOE_BLOCKED_AMX(iq4xs, IQXS)

}  // namespace moe
