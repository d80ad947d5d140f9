// Vector math shared by the kernels: e^x on 16 and 8 fp32 lanes.
#pragma once
#include <immintrin.h>

namespace moe {

// Cephes expf's polynomial for e^r on [-ln2/2, ln2/2], highest power first
constexpr float EXP_POLY[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
// ln 2 in two parts (exact high part, then the rest) for the range reduction
constexpr float LN2_HI = 0.693359375f, LN2_LO = -2.12194440e-4f;

// e^x, 16 lanes (Cephes expf: range reduction by ln 2 in two parts, degree-6 polynomial,
// 2^n by scalef); within 2 ulp of std::exp.
__attribute__((target("avx512f"))) inline __m512 exp_ps(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-88.f)), _mm512_set1_ps(88.f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
  __m512 p = _mm512_set1_ps(EXP_POLY[0]);
  for (int j = 1; j < 6; ++j) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_POLY[j]));
  __m512 y = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(y, n);
}

// The same on 8 lanes (2^n built in the exponent bits).
__attribute__((target("avx2,fma"))) inline __m256 exp_ps(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-88.f)), _mm256_set1_ps(88.f));
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
  __m256 p = _mm256_set1_ps(EXP_POLY[0]);
  for (int j = 1; j < 6; ++j) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_POLY[j]));
  __m256 y = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  // |n| <= 127: 2^n is exactly the float with exponent field n + 127 (0 for n = -127: e^-88 ~ 0)
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

}  // namespace moe
