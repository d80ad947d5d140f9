// The entry points of the formats of 32-weight groups (their kernels: gemm_blocked.h, shared, and each ISA's
// folder).
#include "kernels/amx/gemm_blocked_amx.h"
#include "kernels/avx2/gemm_blocked_avx2.h"
#include "kernels/avx512/gemm_blocked_avx512.h"
#include "kernels/portable/gemm_blocked_ref.h"

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
