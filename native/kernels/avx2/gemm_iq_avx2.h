#pragma once
#include "kernels/portable/gemm_iq_ref.h"
namespace moe {
namespace {
template <int T, bool VNNI>
void iq_avx2(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy) {
  ref_iq<T>(m, e, r0, r1, x, ns, Y, ldy);
}
}  // namespace
}  // namespace moe
