// The entry points of the formats of 32-weight groups (their kernels: gemm_blocked.h).
#include "gemm_blocked.h"

namespace moe {

MOE_BLOCKED_ENTRIES(int4, INT4)
MOE_BLOCKED_ENTRIES(mxfp4, MX)
MOE_BLOCKED_ENTRIES(int4g32, G32)
MOE_BLOCKED_ENTRIES(iq4nl, IQ)
MOE_BLOCKED_ENTRIES(uint4g32, ASYM)
MOE_BLOCKED_ENTRIES(int8g32, Q8)
MOE_BLOCKED_AMX(int4, INT4)
MOE_BLOCKED_AMX(mxfp4, MX)
MOE_BLOCKED_AMX(int4g32, G32)
MOE_BLOCKED_AMX(iq4nl, IQ)
MOE_BLOCKED_AMX(int8g32, Q8)

}  // namespace moe
