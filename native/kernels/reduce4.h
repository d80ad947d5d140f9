// Four 16-lane partial-sum vectors -> their four sums, with one shuffle tree (13 ops instead of
// four separate horizontal reductions of ~8 each: with short rows the reductions are a tenth of a
// micro-kernel's time). Used by the kernels whose accumulators hold one (row, token) pair each;
// AVX-512 (16 lanes) and AVX2 (8 lanes) overloads.
#pragma once
#include <immintrin.h>

#include <cstdint>

namespace moe {

#define MOE_SIMD_INLINE __attribute__((target("avx512f,avx512dq"), always_inline)) inline

MOE_SIMD_INLINE __m256 fold_ps(__m512 v) {
  return _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
}

MOE_SIMD_INLINE __m256i fold_epi32(__m512i v) {
  return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
}

// hadd pairs: [a a b b | a a b b], then [a b c d | a b c d] per 128-bit half, then the halves
MOE_SIMD_INLINE __m128 reduce4_ps(__m512 a, __m512 b, __m512 c, __m512 d) {
  __m256 q = _mm256_hadd_ps(_mm256_hadd_ps(fold_ps(a), fold_ps(b)), _mm256_hadd_ps(fold_ps(c), fold_ps(d)));
  return _mm_add_ps(_mm256_castps256_ps128(q), _mm256_extractf128_ps(q, 1));
}

MOE_SIMD_INLINE __m128i reduce4_epi32(__m512i a, __m512i b, __m512i c, __m512i d) {
  __m256i q = _mm256_hadd_epi32(_mm256_hadd_epi32(fold_epi32(a), fold_epi32(b)),
                                _mm256_hadd_epi32(fold_epi32(c), fold_epi32(d)));
  return _mm_add_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
}

// A 512-bit kernel's 4-row x NT-token tile of partial sums -> C[t * 4 + r] for its nr valid rows. Parked in
// memory first: reducing straight from the registers makes GCC 12 spill and copy the accumulators inside the
// K loop.
MOE_SIMD_INLINE void store16(int32_t* p, __m512i v) { _mm512_store_si512(p, v); }
MOE_SIMD_INLINE void store16(float* p, __m512 v) { _mm512_store_ps(p, v); }
MOE_SIMD_INLINE __m128i reduce4_16(const int32_t (&t)[4][16]) {
  return reduce4_epi32(_mm512_load_si512(t[0]), _mm512_load_si512(t[1]), _mm512_load_si512(t[2]),
                       _mm512_load_si512(t[3]));
}
MOE_SIMD_INLINE __m128 reduce4_16(const float (&t)[4][16]) {
  return reduce4_ps(_mm512_load_ps(t[0]), _mm512_load_ps(t[1]), _mm512_load_ps(t[2]), _mm512_load_ps(t[3]));
}
MOE_SIMD_INLINE void store4_16(int32_t* p, __m128i v) { _mm_store_si128(reinterpret_cast<__m128i*>(p), v); }
MOE_SIMD_INLINE void store4_16(float* p, __m128 v) { _mm_store_ps(p, v); }

template <int NT, class V, class S>
MOE_SIMD_INLINE void reduce_tile16(const V (&acc)[4][NT], int nr, S* C) {
  alignas(64) S tile[NT][4][16];
  _Pragma("GCC unroll 16") for (int t = 0; t < NT; ++t)
    _Pragma("GCC unroll 16") for (int r = 0; r < 4; ++r) store16(tile[t][r], acc[r][t]);
  for (int t = 0; t < NT; ++t) {
    alignas(16) S out[4];
    store4_16(out, reduce4_16(tile[t]));
    for (int r = 0; r < nr; ++r) C[t * 4 + r] = out[r];
  }
}

#undef MOE_SIMD_INLINE
#define MOE_AVX2_INLINE __attribute__((target("avx2"), always_inline)) inline

// The same for the AVX2 kernels' 8-lane partial sums.
MOE_AVX2_INLINE __m128 reduce4_ps(__m256 a, __m256 b, __m256 c, __m256 d) {
  __m256 q = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(q), _mm256_extractf128_ps(q, 1));
}

MOE_AVX2_INLINE __m128i reduce4_epi32(__m256i a, __m256i b, __m256i c, __m256i d) {
  __m256i q = _mm256_hadd_epi32(_mm256_hadd_epi32(a, b), _mm256_hadd_epi32(c, d));
  return _mm_add_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
}

MOE_AVX2_INLINE void store8(int32_t* p, __m256i v) { _mm256_store_si256(reinterpret_cast<__m256i*>(p), v); }
MOE_AVX2_INLINE void store8(float* p, __m256 v) { _mm256_store_ps(p, v); }
MOE_AVX2_INLINE __m256i load8(const int32_t* p) { return _mm256_load_si256(reinterpret_cast<const __m256i*>(p)); }
MOE_AVX2_INLINE __m256 load8(const float* p) { return _mm256_load_ps(p); }
MOE_AVX2_INLINE void store4(int32_t* p, __m128i v) { _mm_store_si128(reinterpret_cast<__m128i*>(p), v); }
MOE_AVX2_INLINE void store4(float* p, __m128 v) { _mm_store_ps(p, v); }
MOE_AVX2_INLINE __m128i reduce4(__m256i a, __m256i b, __m256i c, __m256i d) { return reduce4_epi32(a, b, c, d); }

// One vector's 8 lanes summed (the row-at-a-time kernels': one row's partial sums): halves, then pairs
MOE_AVX2_INLINE float sum8(__m256 v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}
MOE_AVX2_INLINE int32_t sum8(__m256i v) {
  const __m128i h = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  const __m128i q = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4e));
  return _mm_cvtsi128_si32(_mm_add_epi32(q, _mm_shuffle_epi32(q, 0xb1)));
}
MOE_AVX2_INLINE __m128 reduce4(__m256 a, __m256 b, __m256 c, __m256 d) { return reduce4_ps(a, b, c, d); }

// A 256-bit kernel's 4-row x NT-token tile of partial sums -> C[t * 4 + r] for its nr valid rows.
// Parked in memory first: reducing straight from the registers makes GCC 12 spill and copy the
// accumulators inside the K loop.
template <int NT, class V, class S>
MOE_AVX2_INLINE void reduce_tile4(const V (&acc)[4][NT], int nr, S* C) {
  alignas(32) S tile[NT][4][8];
  _Pragma("GCC unroll 16") for (int t = 0; t < NT; ++t)
    _Pragma("GCC unroll 16") for (int r = 0; r < 4; ++r) store8(tile[t][r], acc[r][t]);
  for (int t = 0; t < NT; ++t) {
    alignas(16) S out[4];
    store4(out, reduce4(load8(tile[t][0]), load8(tile[t][1]), load8(tile[t][2]), load8(tile[t][3])));
    for (int r = 0; r < nr; ++r) C[t * 4 + r] = out[r];
  }
}

#undef MOE_AVX2_INLINE

}  // namespace moe
