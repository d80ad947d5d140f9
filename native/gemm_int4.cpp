// 4-bit weights x int8 activations in the row-major layout: int4 (nibbles q in 0..15 stand for q - 8; one scale per
// 64-weight group) and mxfp4 (nibbles are e2m1 codes, looked up (vpshufb) as twice their value, {0, 1, 2, 3, 4, 6,
// 8, 12} with bit 3 the sign, exact in int8; one scale per 32 weights, kept as the published 1-byte exponent and
// turned into 2^(e - 127) / 2 in registers: 4.25 bits a weight read, as published). AVX-512 VNNI, AVX-VNNI, AVX2
// and portable; the formats with an fp32 scale per 32 (int4g32, iq4nl, uint4g32, int8g32) are row-interleaved
// blocks with kernels of their own (gemm_g32.cpp).
// Activations come as u8 = x + 128, so per group sum((x + 128) * w) is one vpdpbusd, the scale applies
// in fp32, and the +128 comes back out through the per-row constant rowcorr. One 256-bit micro-kernel serves
// AVX2 and AVX-VNNI, their dot products apart (ymm.h: Avx2Dot::small2 adds a group's two halves in int16
// before one widening; VnniDot does both in vpdpbusd); the portable loops are the reference.
#include <immintrin.h>

#include <cstring>
#include <type_traits>
#include <vector>

#include "common.h"
#include "kernels.h"
#include "moe.h"
#include "reduce4.h"
#include "ymm.h"

namespace moe {

namespace {

constexpr int RB = 4, TB = 4;
constexpr int G = INT4_GROUP;

// e2m1 code -> twice its value, as int8 (mxfp4's lookup table)
constexpr int8_t MX4_LUT[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// mxfp4's scale of a published exponent e (e8m0): 2^(e - 127) / 2 (the kernels multiply twice the e2m1
// value), the float whose exponent field is e - 1; 0 for e <= 1 (blocks below 2^-127)
inline float mx_scale(uint8_t e) {
  const uint32_t b = e > 1 ? uint32_t(e - 1) << 23 : 0;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}
__attribute__((target("avx512f,sse4.1"))) inline __m128 mx_scales4(const uint8_t* e) {
  int32_t v;
  std::memcpy(&v, e, 4);
  const __m128i x = _mm_max_epi32(_mm_cvtepu8_epi32(_mm_cvtsi32_si128(v)), _mm_set1_epi32(1));
  return _mm_castsi128_ps(_mm_slli_epi32(_mm_sub_epi32(x, _mm_set1_epi32(1)), 23));
}
// The formats: int4 (q - 8, a scale per 64), mxfp4 (e2m1, an exponent per 32). The micro-kernels read scale 2g and
// 2g + 1 of 64-group g (one per 64 for int4).
enum Mode { INT4, MX };
// scales a row has per 64 weights
template <int MODE>
constexpr int per64 = MODE == INT4 ? 1 : 2;
template <int MODE>
using ScaleT = std::conditional_t<MODE == MX, uint8_t, float>;  // what a row's scales are stored as
// a row's 4 scales of two 64-groups (A low, A high, B low, B high), as floats
template <int MODE>
__attribute__((target("avx512f,sse4.1"))) inline __m128 scales4(const ScaleT<MODE>* s) {
  if constexpr (MODE == MX) return mx_scales4(s);
  else return _mm_loadu_ps(s);
}
template <int MODE>
inline float scale_of(ScaleT<MODE> s) {
  if constexpr (MODE == MX) return mx_scale(s);
  else return s;
}

// a vector of nibbles -> its weights: q - 8 (int4) or the looked-up value (mxfp4; lut in every lane)
template <int MODE>
__attribute__((target("avx512f,avx512bw"))) inline __m512i decode(__m512i q, __m512i lut) {
  if constexpr (MODE == MX) return _mm512_shuffle_epi8(lut, q);
  else return _mm512_sub_epi8(q, _mm512_set1_epi8(8));
}
template <int NT, int MODE>
__attribute__((target("avx512f,avx512bw,avx512dq,avx512vnni"))) inline void mk(const uint8_t* W, size_t ldw, size_t pf, const ScaleT<MODE>* S,
                                                                       size_t lds, int nr, const uint8_t* const* X,
                                                                       int K, float* C) {
  __m512 acc[RB][NT];
  MOE_UNROLL for (int r = 0; r < RB; ++r)
    MOE_UNROLL for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_setzero_ps();
  const uint8_t* w[RB];
  const ScaleT<MODE>* sc[RB];
  row_streams(W, ldw, nr, w);
  row_streams(S, lds, nr, sc);
  const __m256i lo4 = _mm256_set1_epi8(0x0f);
  const __m512i lo4x = _mm512_set1_epi8(0x0f);
  const __m512i scale_lanes = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  // mxfp4: per 2 groups 4 scales (A low, A high, B low, B high); lanes 0-7 are group A's,
  // 8-15 B's
  const __m512i lo_lanes = _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512i hi_lanes = _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1);
  const __m512i lut = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(MX4_LUT)));
  int i = 0, g = 0;
  // Two groups per step: one 512-bit load of 128 nibbles per row, the low nibbles of both groups
  // in one vector and the high ones in another; the activations are arranged to match (the low
  // nibbles of a group are its elements 0-31, the high ones 32-63). dpbusd lanes 0-7 then belong
  // to the first group and 8-15 to the second, whose scales are spread the same way. About half
  // the instructions per weight byte of the one-group loop below: int4 decode is otherwise
  // compute-bound on Zen 4 with short rows.
  for (; i + 2 * G <= K; i += 2 * G, g += 2) {
    __m512i xl[NT], xh[NT];
    MOE_UNROLL for (int t = 0; t < NT; ++t) {
      __m512i A = _mm512_loadu_si512(X[t] + i), B = _mm512_loadu_si512(X[t] + i + G);
      xl[t] = _mm512_shuffle_i64x2(A, B, 0x44);  // [A elems 0-31 | B elems 0-31]
      xh[t] = _mm512_shuffle_i64x2(A, B, 0xEE);  // [A elems 32-63 | B elems 32-63]
    }
    MOE_UNROLL for (int r = 0; r < RB; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(w[r] + i / 2 + pf), _MM_HINT_T1);
      const __m512i p = _mm512_loadu_si512(w[r] + i / 2);
      const __m512i lo = decode<MODE>(_mm512_and_si512(p, lo4x), lut);
      const __m512i hi = decode<MODE>(_mm512_and_si512(_mm512_srli_epi16(p, 4), lo4x), lut);
      if constexpr (MODE != INT4) {
        const __m512 s4 = _mm512_castps128_ps512(scales4<MODE>(sc[r] + 2 * g));
        const __m512 slo = _mm512_permutexvar_ps(lo_lanes, s4), shi = _mm512_permutexvar_ps(hi_lanes, s4);
        MOE_UNROLL for (int t = 0; t < NT; ++t) {
          acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), xl[t], lo)), slo,
                                      acc[r][t]);
          acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), xh[t], hi)), shi,
                                      acc[r][t]);
        }
      } else {
        __m512 sv = _mm512_permutexvar_ps(
            scale_lanes, _mm512_castps128_ps512(_mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(sc[r] + g)))));
        MOE_UNROLL for (int t = 0; t < NT; ++t)
          acc[r][t] = _mm512_fmadd_ps(
              _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), xl[t], lo), xh[t], hi)),
              sv, acc[r][t]);
      }
    }
  }
  for (; i < K; i += G, ++g) {  // an odd last group
    __m512i a[RB];
    __m512 s[RB];
    MOE_UNROLL for (int r = 0; r < RB; ++r) {
      // rows about tuning().pf_bytes further on, same offset: in L2 by the time they are read
      _mm_prefetch(reinterpret_cast<const char*>(w[r] + i / 2 + pf), _MM_HINT_T1);
      __m256i p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[r] + i / 2));  // 64 nibbles
      a[r] = decode<MODE>(_mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(p, lo4)),
                                             _mm256_and_si256(_mm256_srli_epi16(p, 4), lo4), 1), lut);
      // lanes 0-7 hold elements 0-31 (low nibbles), 8-15 elements 32-63: mxfp4 scales them apart
      if constexpr (MODE == INT4) {
        s[r] = _mm512_set1_ps(sc[r][g]);
      } else {
        s[r] = _mm512_insertf32x8(_mm512_set1_ps(scale_of<MODE>(sc[r][2 * g])), _mm256_set1_ps(scale_of<MODE>(sc[r][2 * g + 1])), 1);
      }
    }
    MOE_UNROLL for (int t = 0; t < NT; ++t) {
      __m512i xv = _mm512_loadu_si512(X[t] + i);
      MOE_UNROLL for (int r = 0; r < RB; ++r)
        acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), xv, a[r])),
                                    s[r], acc[r][t]);
    }
  }
  reduce_tile16(acc, nr, C);
}

// ---- 256-bit: AVX2 and AVX-VNNI ----
// 4 tokens a tile on both: the spills of 4 x 4 cost less than the decode work 2 or 3 tokens repeat
constexpr int TB256 = 4;

template <class Dot, int NT, int MODE>
inline void mk256(const uint8_t* W, size_t ldw, size_t pf, const ScaleT<MODE>* S, size_t lds, int nr,
                  const uint8_t* const* X, int K, float* C) {
  __m256 acc[RB][NT];
  MOE_UNROLL for (int r = 0; r < RB; ++r)
    MOE_UNROLL for (int t = 0; t < NT; ++t) acc[r][t] = Ymm::zero_ps();
  const uint8_t* w[RB];
  const ScaleT<MODE>* sc[RB];
  row_streams(W, ldw, nr, w);
  row_streams(S, lds, nr, sc);
  const __m256i lut = Ymm::bytes16(MX4_LUT);
  for (int i = 0, g = 0; i < K; i += G, ++g) {
    __m256i xl[NT], xh[NT];  // elements 0-31 and 32-63 of each token's group
    MOE_UNROLL for (int t = 0; t < NT; ++t) {
      xl[t] = Ymm::load(X[t] + i);
      xh[t] = Ymm::load(X[t] + i + 32);
    }
    MOE_UNROLL for (int r = 0; r < RB; ++r) {
      __m256i lo, hi;
      _mm_prefetch(reinterpret_cast<const char*>(w[r] + i / 2 + pf), _MM_HINT_T1);
      Ymm::nibbles(w[r] + i / 2, lo, hi);
      if constexpr (MODE == MX) {
        lo = Ymm::lookup(lut, lo), hi = Ymm::lookup(lut, hi);
        const __m256 slo = Ymm::set1(scale_of<MODE>(sc[r][2 * g])), shi = Ymm::set1(scale_of<MODE>(sc[r][2 * g + 1]));
        MOE_UNROLL for (int t = 0; t < NT; ++t) {
          acc[r][t] = Ymm::fmadd(Ymm::to_ps(Dot::small(xl[t], lo)), slo, acc[r][t]);
          acc[r][t] = Ymm::fmadd(Ymm::to_ps(Dot::small(xh[t], hi)), shi, acc[r][t]);
        }
      } else {
        lo = Ymm::minus8(lo), hi = Ymm::minus8(hi);
        const __m256 sv = Ymm::broadcast(sc[r] + g);
        MOE_UNROLL for (int t = 0; t < NT; ++t)
          acc[r][t] = Ymm::fmadd(Ymm::to_ps(Dot::small2(xl[t], lo, xh[t], hi)), sv, acc[r][t]);
      }
    }
  }
  Ymm::reduce(acc, nr, C);
}

#define MOE_4BIT_YMM(NAME, TARGET, DOT)                                                                              \
  template <int MODE>                                                                                                \
  MOE_YMM_ENTRY(TARGET) void NAME(const uint8_t* W, size_t ldw, size_t pf, const ScaleT<MODE>* S, size_t lds, int nr, \
                                  const uint8_t* const* X, int nt, int K, float* C) {                              \
    with_tokens<TB256>(nt, [&](auto NT) { mk256<DOT, decltype(NT)::value, MODE>(W, ldw, pf, S, lds, nr, X, K, C); }); \
  }
MOE_4BIT_YMM(mk_avx2, "avx2,fma", Avx2Dot)
MOE_4BIT_YMM(mk_avxvnni, "avx2,fma,avxvnni", VnniDot)
#undef MOE_4BIT_YMM

template <int MODE>
void mk_avx512(const uint8_t* W, size_t ldw, size_t pf, const ScaleT<MODE>* S, size_t lds, int nr, const uint8_t* const* X,
               int nt, int K, float* C) {
  with_tokens<TB>(nt, [&](auto NT) { mk<decltype(NT)::value, MODE>(W, ldw, pf, S, lds, nr, X, K, C); });
}

// rows [r0, r1) of expert e on one ISA's micro-kernel (the int8 driver's twin: gemm_int8.cpp)
template <int MODE, int TBI, class MK>
inline void drive_4bit(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy, MK&& mk) {
  const int scales = m.Kp / G * per64<MODE>;  // per row
  const size_t ldw = size_t(m.Kp) / 2;
  const size_t pf = prefetch_rows(ldw, RB) * ldw;  // bytes ahead
  const uint8_t* We = static_cast<const uint8_t*>(m.w) + size_t(e) * m.rows * ldw;
  const ScaleT<MODE>* Se = reinterpret_cast<const ScaleT<MODE>*>(m.scale) + size_t(e) * m.rows * size_t(scales);
  const float* corr = m.rowcorr + size_t(e) * m.rows;
  auto X = reinterpret_cast<const uint8_t* const*>(x.rows);
  drive_rows<RB, TBI, float>(
      r0, r1, ns, TBI,
      [&](int r, int nr, int s, int nt, float* C) {
        mk(We + size_t(r) * ldw, ldw, pf, Se + size_t(r) * scales, size_t(scales), nr, X + s, nt, m.Kp, C);
      },
      [&](int r, int nr, int s, int nt, const float* C) {
        for (int t = 0; t < nt; ++t)
          for (int j = 0; j < nr; ++j) Y[size_t(s + t) * ldy + r + j] = (C[t * RB + j] - corr[r + j]) * x.scale[s + t];
      });
}

template <int MODE>
void ref_gemm_rows_4bit(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy) {
  const int groups = m.Kp / G, scales = groups * per64<MODE>;
  const size_t ldw = size_t(m.Kp) / 2;
  auto X = reinterpret_cast<const uint8_t* const*>(x.rows);
  auto value = [](int q) { return MODE == MX ? int32_t(MX4_LUT[q]) : int32_t(q) - 8; };
  for (int r = r0; r < r1; ++r) {
    const size_t row = size_t(e) * m.rows + r;
    const uint8_t* wr = static_cast<const uint8_t*>(m.w) + row * ldw;
    const ScaleT<MODE>* sr = reinterpret_cast<const ScaleT<MODE>*>(m.scale) + row * scales;
    for (int s = 0; s < ns; ++s) {
      float acc = 0.f;
      for (int g = 0; g < groups; ++g) {
        int32_t lo = 0, hi = 0;  // elements 0-31 and 32-63 of the group
        for (int i = 0; i < G / 2; ++i) {
          lo += value(wr[g * G / 2 + i] & 15) * X[s][g * G + i];
          hi += value(wr[g * G / 2 + i] >> 4) * X[s][g * G + G / 2 + i];
        }
        if constexpr (MODE == INT4)
          acc += float(lo + hi) * sr[g];
        else
          acc += float(lo) * scale_of<MODE>(sr[2 * g]) + float(hi) * scale_of<MODE>(sr[2 * g + 1]);
      }
      Y[size_t(s) * ldy + r] = (acc - m.rowcorr[row]) * x.scale[s];
    }
  }
}

}  // namespace

void ref_gemm_rows_int4(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy) {
  ref_gemm_rows_4bit<INT4>(m, e, r0, r1, x, ns, Y, ldy);
}
void ref_gemm_rows_mxfp4(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy) {
  ref_gemm_rows_4bit<MX>(m, e, r0, r1, x, ns, Y, ldy);
}
void gemm_rows_int4_avx2(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy) {
  drive_4bit<INT4, TB256>(m, e, r0, r1, x, ns, Y, ldy, mk_avx2<INT4>);
}
void gemm_rows_mxfp4_avx2(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy) {
  drive_4bit<MX, TB256>(m, e, r0, r1, x, ns, Y, ldy, mk_avx2<MX>);
}
void gemm_rows_int4_avxvnni(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy) {
  drive_4bit<INT4, TB256>(m, e, r0, r1, x, ns, Y, ldy, mk_avxvnni<INT4>);
}
void gemm_rows_mxfp4_avxvnni(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy) {
  drive_4bit<MX, TB256>(m, e, r0, r1, x, ns, Y, ldy, mk_avxvnni<MX>);
}
void gemm_rows_int4_avx512(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy) {
  drive_4bit<INT4, TB>(m, e, r0, r1, x, ns, Y, ldy, mk_avx512<INT4>);
}
void gemm_rows_mxfp4_avx512(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy) {
  drive_4bit<MX, TB>(m, e, r0, r1, x, ns, Y, ldy, mk_avx512<MX>);
}

}  // namespace moe
