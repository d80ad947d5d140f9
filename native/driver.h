// The pieces of the expert driver (moe_forward.cpp) that the dense layers (linear.cpp) share.
#pragma once
#include "common.h"
#include "moe.h"

namespace moe {
// Row r of b = one fp32 row of n values in the format's activation form (bf16, or u8 q + 128 with a scale).
void quantize_row(Isa isa, Fmt fmt, const float* x, int n, ActBuf& b, int r);
// Y[s * ldy + r] for rows [r0, r1) of matrix e, every slot s < ns: the format's kernel on `isa`
// (amx: whole 16-row tiles on the tiles where x.amx_b is set, the rest on AVX-512).
void gemm_rows(Isa isa, Fmt fmt, const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
}  // namespace moe
