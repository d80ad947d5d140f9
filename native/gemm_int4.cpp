// 4-bit weights x int8 activations: AVX-512 VNNI, AVX-VNNI, AVX2 and portable. Two formats share the kernels
// (template flag MX), which differ only in what a nibble means and how many scales a group has:
// - int4: nibbles q in 0..15 stand for q - 8; one scale per 64-weight group;
// - mxfp4: nibbles are e2m1 codes, looked up (vpshufb) as twice their value, {0, 1, 2, 3, 4, 6, 8, 12}
//   with bit 3 the sign, exact in int8; one scale per 32 weights, kept as the published 1-byte exponent
//   and turned into 2^(e - 127) / 2 in registers (4.25 bits a weight read, as published).
// Activations come as u8 = x + 128, so per group sum((x + 128) * w) is one vpdpbusd, the scale applies
// in fp32, and the +128 comes back out through the per-row constant rowcorr. On AVX2, vpmaddubsw
// cannot saturate here (pairs of 255 * 12 products at most), so int4 adds two of them in int16 before
// one vpmaddwd widens the group's sum (mxfp4's halves have their own scales: widened apart); AVX-VNNI
// does both in vpdpbusd.
#include <immintrin.h>

#include <cstring>
#include <type_traits>

#include "common.h"
#include "moe.h"
#include "reduce4.h"

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
template <bool MX>
using ScaleT = std::conditional_t<MX, uint8_t, float>;  // what a row's scales are stored as

// a vector of nibbles -> its weights: q - 8 (int4) or the looked-up e2m1 value (mxfp4; lut in every lane)
template <bool MX>
__attribute__((target("avx512f,avx512bw"))) inline __m512i decode(__m512i q, __m512i lut) {
  return MX ? _mm512_shuffle_epi8(lut, q) : _mm512_sub_epi8(q, _mm512_set1_epi8(8));
}
template <bool MX>
__attribute__((target("avx2"))) inline __m256i decode(__m256i q, __m256i lut) {
  return MX ? _mm256_shuffle_epi8(lut, q) : _mm256_sub_epi8(q, _mm256_set1_epi8(8));
}

#define MOE_AVX2_INLINE __attribute__((target("avx2"), always_inline)) inline
// the 256-bit kernels' operands for one 64-group: elements 0-31 and 32-63 of each token's activations
template <int NT>
MOE_AVX2_INLINE void load_group(const uint8_t* const* X, int i, __m256i (&xl)[NT], __m256i (&xh)[NT]) {
  MOE_UNROLL for (int t = 0; t < NT; ++t) {
    xl[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(X[t] + i));
    xh[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(X[t] + i + 32));
  }
}
// ... and a row's 32 bytes of the group: its low nibbles (elements 0-31) and high nibbles, decoded
template <bool MX>
MOE_AVX2_INLINE void load_nibbles(const uint8_t* w, __m256i lut, __m256i& lo, __m256i& hi) {
  const __m256i lo4 = _mm256_set1_epi8(0x0f), p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  lo = decode<MX>(_mm256_and_si256(p, lo4), lut);
  hi = decode<MX>(_mm256_and_si256(_mm256_srli_epi16(p, 4), lo4), lut);
}
#undef MOE_AVX2_INLINE

template <int NT, bool MX>
__attribute__((target("avx512f,avx512bw,avx512dq,avx512vnni"))) inline void mk(const uint8_t* W, size_t ldw, size_t pf, const ScaleT<MX>* S,
                                                                       size_t lds, int nr, const uint8_t* const* X,
                                                                       int K, float* C) {
  __m512 acc[RB][NT];
  MOE_UNROLL for (int r = 0; r < RB; ++r)
    MOE_UNROLL for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_setzero_ps();
  const uint8_t* w[RB];
  const ScaleT<MX>* sc[RB];
  row_streams(W, ldw, nr, w);
  row_streams(S, lds, nr, sc);
  const __m256i lo4 = _mm256_set1_epi8(0x0f);
  const __m512i lo4x = _mm512_set1_epi8(0x0f);
  const __m512i scale_lanes = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  // mxfp4: per 2 groups 4 scales (A low, A high, B low, B high); lanes 0-7 are group A's, 8-15 B's
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
      __m512i p = _mm512_loadu_si512(w[r] + i / 2);
      __m512i lo = decode<MX>(_mm512_and_si512(p, lo4x), lut);
      __m512i hi = decode<MX>(_mm512_and_si512(_mm512_srli_epi16(p, 4), lo4x), lut);
      if constexpr (MX) {
        const __m512 s4 = _mm512_castps128_ps512(mx_scales4(sc[r] + 2 * g));
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
      a[r] = decode<MX>(_mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(p, lo4)),
                                           _mm256_and_si256(_mm256_srli_epi16(p, 4), lo4), 1), lut);
      // lanes 0-7 hold elements 0-31 (low nibbles), 8-15 elements 32-63: mxfp4 scales them apart
      if constexpr (MX)
        s[r] = _mm512_insertf32x8(_mm512_set1_ps(mx_scale(sc[r][2 * g])), _mm256_set1_ps(mx_scale(sc[r][2 * g + 1])), 1);
      else
        s[r] = _mm512_set1_ps(sc[r][g]);
    }
    MOE_UNROLL for (int t = 0; t < NT; ++t) {
      __m512i xv = _mm512_loadu_si512(X[t] + i);
      MOE_UNROLL for (int r = 0; r < RB; ++r)
        acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), xv, a[r])),
                                    s[r], acc[r][t]);
    }
  }
  alignas(64) float tile[NT][RB][16];  // parked before reducing: see gemm_int8.cpp
  MOE_UNROLL for (int t = 0; t < NT; ++t)
    MOE_UNROLL for (int r = 0; r < RB; ++r) _mm512_store_ps(tile[t][r], acc[r][t]);
  static_assert(RB == 4, "reduce4 sums 4 rows at a time");
  for (int t = 0; t < NT; ++t) {
    alignas(16) float out[4];
    _mm_store_ps(out, reduce4_ps(_mm512_load_ps(tile[t][0]), _mm512_load_ps(tile[t][1]), _mm512_load_ps(tile[t][2]),
                                 _mm512_load_ps(tile[t][3])));
    for (int r = 0; r < nr; ++r) C[t * RB + r] = out[r];
  }
}

template <bool MX>
void mk_dispatch(const uint8_t* W, size_t ldw, size_t pf, const ScaleT<MX>* S, size_t lds, int nr, const uint8_t* const* X, int nt,
                 int K, float* C) {
  switch (nt) {
    case 4: return mk<4, MX>(W, ldw, pf, S, lds, nr, X, K, C);
    case 3: return mk<3, MX>(W, ldw, pf, S, lds, nr, X, K, C);
    case 2: return mk<2, MX>(W, ldw, pf, S, lds, nr, X, K, C);
    default: return mk<1, MX>(W, ldw, pf, S, lds, nr, X, K, C);
  }
}

// ---- AVX2 ----
constexpr int TB2 = 4;

template <int NT, bool MX>
__attribute__((target("avx2,fma"))) inline void mk_avx2(const uint8_t* W, size_t ldw, size_t pf, const ScaleT<MX>* S,
                                                       size_t lds, int nr, const uint8_t* const* X, int K, float* C) {
  __m256 acc[RB][NT];
  MOE_UNROLL for (int r = 0; r < RB; ++r)
    MOE_UNROLL for (int t = 0; t < NT; ++t) acc[r][t] = _mm256_setzero_ps();
  const uint8_t* w[RB];
  const ScaleT<MX>* sc[RB];
  row_streams(W, ldw, nr, w);
  row_streams(S, lds, nr, sc);
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i lut = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(MX4_LUT)));
  for (int i = 0, g = 0; i < K; i += G, ++g) {
    __m256i xl[NT], xh[NT];
    load_group(X, i, xl, xh);
    MOE_UNROLL for (int r = 0; r < RB; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(w[r] + i / 2 + pf), _MM_HINT_T1);
      __m256i lo, hi;
      load_nibbles<MX>(w[r] + i / 2, lut, lo, hi);
      if constexpr (MX) {
        const __m256 slo = _mm256_set1_ps(mx_scale(sc[r][2 * g])), shi = _mm256_set1_ps(mx_scale(sc[r][2 * g + 1]));
        MOE_UNROLL for (int t = 0; t < NT; ++t) {
          acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(xl[t], lo), ones)),
                                      slo, acc[r][t]);
          acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(xh[t], hi), ones)),
                                      shi, acc[r][t]);
        }
      } else {
        const __m256 sv = _mm256_broadcast_ss(sc[r] + g);
        MOE_UNROLL for (int t = 0; t < NT; ++t) {
          const __m256i d = _mm256_add_epi16(_mm256_maddubs_epi16(xl[t], lo), _mm256_maddubs_epi16(xh[t], hi));
          acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(d, ones)), sv, acc[r][t]);
        }
      }
    }
  }
  reduce_tile4(acc, nr, C);
}

template <bool MX>
void mk_avx2_dispatch(const uint8_t* W, size_t ldw, size_t pf, const ScaleT<MX>* S, size_t lds, int nr,
                      const uint8_t* const* X, int nt, int K, float* C) {
  switch (nt) {
    case 4: return mk_avx2<4, MX>(W, ldw, pf, S, lds, nr, X, K, C);
    case 3: return mk_avx2<3, MX>(W, ldw, pf, S, lds, nr, X, K, C);
    case 2: return mk_avx2<2, MX>(W, ldw, pf, S, lds, nr, X, K, C);
    default: return mk_avx2<1, MX>(W, ldw, pf, S, lds, nr, X, K, C);
  }
}

// ---- AVX-VNNI: the AVX2 kernel with vpdpbusd in place of vpmaddubsw + vpmaddwd ----
constexpr int TBV = 4;  // as AVX2's: the spills of 4 x 4 cost less than the decode work 2 or 3 tokens repeat

template <int NT, bool MX>
__attribute__((target("avx2,fma,avxvnni"))) inline void mk_vnni(const uint8_t* W, size_t ldw, size_t pf,
                                                               const ScaleT<MX>* S, size_t lds, int nr,
                                                               const uint8_t* const* X, int K, float* C) {
  __m256 acc[RB][NT];
  MOE_UNROLL for (int r = 0; r < RB; ++r)
    MOE_UNROLL for (int t = 0; t < NT; ++t) acc[r][t] = _mm256_setzero_ps();
  const uint8_t* w[RB];
  const ScaleT<MX>* sc[RB];
  row_streams(W, ldw, nr, w);
  row_streams(S, lds, nr, sc);
  const __m256i zero = _mm256_setzero_si256();
  const __m256i lut = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(MX4_LUT)));
  for (int i = 0, g = 0; i < K; i += G, ++g) {
    __m256i xl[NT], xh[NT];
    load_group(X, i, xl, xh);
    MOE_UNROLL for (int r = 0; r < RB; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(w[r] + i / 2 + pf), _MM_HINT_T1);
      __m256i lo, hi;
      load_nibbles<MX>(w[r] + i / 2, lut, lo, hi);
      if constexpr (MX) {
        const __m256 slo = _mm256_set1_ps(mx_scale(sc[r][2 * g])), shi = _mm256_set1_ps(mx_scale(sc[r][2 * g + 1]));
        MOE_UNROLL for (int t = 0; t < NT; ++t) {
          acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_dpbusd_avx_epi32(zero, xl[t], lo)), slo, acc[r][t]);
          acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_dpbusd_avx_epi32(zero, xh[t], hi)), shi, acc[r][t]);
        }
      } else {
        const __m256 sv = _mm256_broadcast_ss(sc[r] + g);
        MOE_UNROLL for (int t = 0; t < NT; ++t) {
          const __m256i d = _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(zero, xl[t], lo), xh[t], hi);
          acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), sv, acc[r][t]);
        }
      }
    }
  }
  reduce_tile4(acc, nr, C);
}

template <bool MX>
void mk_vnni_dispatch(const uint8_t* W, size_t ldw, size_t pf, const ScaleT<MX>* S, size_t lds, int nr,
                      const uint8_t* const* X, int nt, int K, float* C) {
  switch (nt) {
    case 4: return mk_vnni<4, MX>(W, ldw, pf, S, lds, nr, X, K, C);
    case 3: return mk_vnni<3, MX>(W, ldw, pf, S, lds, nr, X, K, C);
    case 2: return mk_vnni<2, MX>(W, ldw, pf, S, lds, nr, X, K, C);
    default: return mk_vnni<1, MX>(W, ldw, pf, S, lds, nr, X, K, C);
  }
}

template <bool MX>
void gemm_rows_4bit(Isa isa, const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy) {
  const int groups = m.Kp / G, scales = MX ? m.Kp / MX_BLOCK : groups;  // scales per row
  const size_t ldw = weight_row_bytes(Fmt::Int4, m.Kp);
  const size_t pf = prefetch_rows(ldw, RB) * ldw;  // bytes ahead
  const uint8_t* We = static_cast<const uint8_t*>(m.w) + size_t(e) * m.rows * ldw;
  const ScaleT<MX>* Se = reinterpret_cast<const ScaleT<MX>*>(m.scale) + size_t(e) * m.rows * scales;
  auto X = reinterpret_cast<const uint8_t* const*>(x.rows);
  const int tb = isa == Isa::Avx2 ? TB2 : isa == Isa::AvxVnni ? TBV : TB;
  for (int r = r0; r < r1; r += RB) {
    const int nr = std::min(RB, r1 - r);
    for (int s = 0; s < ns; s += tb) {
      const int nt = std::min(tb, ns - s);
      float C[TB * RB];
      if (isa == Isa::Portable) {
        for (int t = 0; t < nt; ++t)
          for (int j = 0; j < nr; ++j) {
            const uint8_t* wr = We + size_t(r + j) * ldw;
            float acc = 0.f;
            const ScaleT<MX>* sr = Se + size_t(r + j) * scales;
            auto value = [](int q) { return MX ? int32_t(MX4_LUT[q]) : int32_t(q) - 8; };
            for (int g = 0; g < groups; ++g) {
              int32_t lo = 0, hi = 0;  // elements 0-31 and 32-63 of the group
              for (int i = 0; i < G / 2; ++i) {
                lo += value(wr[g * G / 2 + i] & 15) * X[s + t][g * G + i];
                hi += value(wr[g * G / 2 + i] >> 4) * X[s + t][g * G + G / 2 + i];
              }
              if constexpr (MX)
                acc += float(lo) * mx_scale(sr[2 * g]) + float(hi) * mx_scale(sr[2 * g + 1]);
              else
                acc += float(lo + hi) * sr[g];
            }
            C[t * RB + j] = acc;
          }
      } else if (isa == Isa::Avx2) {
        mk_avx2_dispatch<MX>(We + size_t(r) * ldw, ldw, pf, Se + size_t(r) * scales, scales, nr, X + s, nt, m.Kp, C);
      } else if (isa == Isa::AvxVnni) {
        mk_vnni_dispatch<MX>(We + size_t(r) * ldw, ldw, pf, Se + size_t(r) * scales, scales, nr, X + s, nt, m.Kp, C);
      } else {
        mk_dispatch<MX>(We + size_t(r) * ldw, ldw, pf, Se + size_t(r) * scales, scales, nr, X + s, nt, m.Kp, C);
      }
      const float* corr = m.rowcorr + size_t(e) * m.rows;
      for (int t = 0; t < nt; ++t)
        for (int j = 0; j < nr; ++j) Y[size_t(s + t) * ldy + r + j] = (C[t * RB + j] - corr[r + j]) * x.scale[s + t];
    }
  }
}

}  // namespace

void gemm_rows_int4(Isa isa, const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy) {
  gemm_rows_4bit<false>(isa, m, e, r0, r1, x, ns, Y, ldy);
}

void gemm_rows_mxfp4(Isa isa, const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy) {
  gemm_rows_4bit<true>(isa, m, e, r0, r1, x, ns, Y, ldy);
}

}  // namespace moe
