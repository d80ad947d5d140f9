// The entry points of GGUF's grid types as stored (their kernels: gemm_iq.h, shared, and each ISA's folder; AMX
// machines run the AVX-512 ones).
#include "kernels/avx2/gemm_iq_avx2.h"
#include "kernels/avx512/gemm_iq_avx512.h"
#include "kernels/portable/gemm_iq_ref.h"

namespace moe {

MOE_IQ_ENTRIES(iq2xxs, IQ2XXS)
MOE_IQ_ENTRIES(iq2xs, IQ2XS)
MOE_IQ_ENTRIES(iq2s, IQ2S)
MOE_IQ_ENTRIES(iq3xxs, IQ3XXS)
MOE_IQ_ENTRIES(iq3s, IQ3S)
MOE_IQ_ENTRIES(iq1s, IQ1S)
MOE_IQ_ENTRIES(iq1m, IQ1M)

}  // namespace moe
