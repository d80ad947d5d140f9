// GGUF's grid types as stored (kernels/gemm_iq.h) in portable C++: the portable path and the tests' reference, each
// row's weights decoded one 32 at a time into the integers the SIMD kernels sum.
#pragma once

#include "kernels/gemm_iq.h"

namespace moe {

namespace {

template <int T>
void ref_iq(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy) {
  const auto [nsb, ldw, lds, We, Se] = iq_rows<T>(m, e);
  auto X = reinterpret_cast<const uint8_t* const*>(x.rows);
  for (int r = r0; r < r1; ++r) {
    const int b0 = r / BLK * BLK, n = std::min(BLK, m.rows - b0), j = r - b0;
    const uint8_t* wb = We + size_t(b0) * ldw;
    const uint8_t* sb = Se + size_t(b0) * lds;
    for (int s = 0; s < ns; ++s) {
      float acc = 0.f;
      for (int g = 0; g < nsb; ++g) {
        const uint8_t* S[2];
        for (int f = 0; f < 2; ++f) S[f] = sb + iq_sfield_off(T, n, g, f) + size_t(j) * iq_sfield(T, f);
        int32_t qi = 0;  // the 256's sum of m x dot
        for (int h = 0; h < 8; ++h) {
          const uint8_t* F[4];
          for (int f = 0; f < 4; ++f) F[f] = wb + iq_field_off(T, n, g, f, h) + size_t(j) * iq_field(T, f);
          int v[32], mm[2];
          iq_decode32<T>(F, S, h, v, mm);
          for (int half = 0; half < 2; ++half) {
            int32_t dot = 0;
            for (int i = 0; i < IQ_SUB; ++i) {
              const int at = g * IQ_QK + h * 32 + half * IQ_SUB + i;
              dot += v[half * IQ_SUB + i] * (int32_t(X[s][at]) - 128);
            }
            qi += mm[half] * dot;
          }
        }
        acc = std::fma(float(qi), iq_d<T>(S), acc);
      }
      Y[size_t(s) * ldy + r] = acc * x.scale[s];
    }
  }
}

}  // namespace

}  // namespace moe
