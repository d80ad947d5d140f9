// The entry points of GGUF's super-blocked formats with signed sub-scales (w = d sc value), kept as stored (their
// kernels: gemm_blocked.h).
#include "gemm_blocked.h"

namespace moe {

MOE_BLOCKED_ENTRIES(q3k, Q3K)
MOE_BLOCKED_ENTRIES(q6k, Q6K)
MOE_BLOCKED_ENTRIES(iq4xs, IQXS)
MOE_BLOCKED_AMX(q6k, Q6K)
MOE_BLOCKED_AMX(iq4xs, IQXS)

}  // namespace moe
