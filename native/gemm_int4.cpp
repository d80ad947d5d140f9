// 4-bit (and int8g32's 8-bit) weights x int8 activations: AVX-512 VNNI, AVX-VNNI, AVX2 and portable. The formats
// share the kernels (template argument MODE), which differ only in what a nibble means and how many scales a group
// has:
// - int4: nibbles q in 0..15 stand for q - 8; one scale per 64-weight group;
// - int4g32: the same nibbles, one fp32 scale per 32 weights (int4 checkpoints' groups of 32, 64 or 128, their
//   scales repeated: compressed-tensors, symmetric GPTQ), kept without requantizing;
// - mxfp4: nibbles are e2m1 codes, looked up (vpshufb) as twice their value, {0, 1, 2, 3, 4, 6, 8, 12}
//   with bit 3 the sign, exact in int8; one scale per 32 weights, kept as the published 1-byte exponent
//   and turned into 2^(e - 127) / 2 in registers (4.25 bits a weight read, as published);
// - iq4nl: nibbles are codes of ggml's non-linear 4-bit grid (IQ4_NL, IQ4_XS), looked up as int8 values in
//   -127..113; one fp32 scale per 32 (the file's fp16 scale times its 6-bit sub-scale: exact);
// - int8g32: not nibbles but int8 bytes, one fp32 scale per 32 (GGUF's Q8_0 kept: its fp16 scales); read per
//   64-group as the nibble formats' low (elements 0-31) and high (32-63) halves;
// - uint4g32: nibbles q in 0..15 as they are, w = scale * q - min with an fp32 scale and min per 32 (ggml's
//   Q4_K and Q4_1, AWQ and GPTQ zero points: scale * zero is exact in fp32). The micro-kernels run it as int4g32
//   without the - 8; the mins' share, sum_g min_g * (the activations' sum over group g), is a short dot product per
//   row and token (K/32 terms) the driver adds, over group sums it takes once per call (their +128s taken out in
//   int32, exactly, so that the term stays at the size of the result). A min term inside the micro-kernel cost
//   1.6x int4g32's decode time (the extra permutes and FMAs per 64 weights: compute-bound on 2 cores).
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
// ggml's kvalues_iq4nl: the IQ4_NL / IQ4_XS code -> its value
constexpr int8_t IQ4NL_LUT[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

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
// The 4-bit formats: int4 (q - 8, a scale per 64), mxfp4 (e2m1, an exponent per 32), int4g32 (q - 8, an fp32
// scale per 32: int4 checkpoints' groups, kept), iq4nl (the IQ4 grid, an fp32 scale per 32), uint4g32 (q, an fp32
// scale per 32 as int4g32's; an expert's mins after all its scales, a row's Kp/32 at a time). The micro-kernels
// read scale 2g and 2g + 1 of 64-group g (one per 64 for int4).
enum Mode { INT4, MX, G32, IQ, ASYM, Q8 };
// bytes of weights a 64-group takes
template <int MODE>
constexpr int group_bytes = MODE == Q8 ? 64 : 32;
// scales a row has per 64 weights
template <int MODE>
constexpr int per64 = MODE == INT4 ? 1 : 2;
// whether a nibble's value exceeds what AVX2's vpmaddubsw pairs take with u8 activations (|w| <= 15)
template <int MODE>
constexpr bool wide_values = MODE == IQ || MODE == Q8;
template <int MODE>
inline const int8_t* lut_of() { return MODE == IQ ? IQ4NL_LUT : MX4_LUT; }
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

// a vector of nibbles -> its weights: q - 8 (int4, int4g32), q (uint4g32) or the looked-up value (mxfp4, iq4nl; lut
// in every lane)
template <int MODE>
__attribute__((target("avx512f,avx512bw"))) inline __m512i decode(__m512i q, __m512i lut) {
  if constexpr (MODE == MX || MODE == IQ) return _mm512_shuffle_epi8(lut, q);
  else if constexpr (MODE == ASYM) return q;
  else return _mm512_sub_epi8(q, _mm512_set1_epi8(8));
}
template <int NT, int MODE>
__attribute__((target("avx512f,avx512bw,avx512dq,avx512vnni"))) inline void mk(const uint8_t* W, size_t ldw, size_t pf, const ScaleT<MODE>* S,
                                                                       size_t lds, int nr, const uint8_t* const* X,
                                                                       const float* const* XS, size_t moff, int K, float* C) {
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
  // mxfp4, int4g32, iq4nl, uint4g32: per 2 groups 4 scales (A low, A high, B low, B high); lanes 0-7 are group A's,
  // 8-15 B's
  const __m512i lo_lanes = _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512i hi_lanes = _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1);
  const __m512i lut = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(lut_of<MODE>())));
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
      __m512i lo, hi;
      if constexpr (MODE == Q8) {  // 128 bytes: group A's 64, B's 64, halves arranged as the activations'
        _mm_prefetch(reinterpret_cast<const char*>(w[r] + i + pf), _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(w[r] + i + 64 + pf), _MM_HINT_T1);
        const __m512i A = _mm512_loadu_si512(w[r] + i), B = _mm512_loadu_si512(w[r] + i + G);
        lo = _mm512_shuffle_i64x2(A, B, 0x44), hi = _mm512_shuffle_i64x2(A, B, 0xEE);
      } else {
        _mm_prefetch(reinterpret_cast<const char*>(w[r] + i / 2 + pf), _MM_HINT_T1);
        __m512i p = _mm512_loadu_si512(w[r] + i / 2);
        lo = decode<MODE>(_mm512_and_si512(p, lo4x), lut);
        hi = decode<MODE>(_mm512_and_si512(_mm512_srli_epi16(p, 4), lo4x), lut);
      }
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
      if constexpr (MODE == Q8) {
        _mm_prefetch(reinterpret_cast<const char*>(w[r] + i + pf), _MM_HINT_T1);
        a[r] = _mm512_loadu_si512(w[r] + i);
      } else {
        _mm_prefetch(reinterpret_cast<const char*>(w[r] + i / 2 + pf), _MM_HINT_T1);
        __m256i p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[r] + i / 2));  // 64 nibbles
        a[r] = decode<MODE>(_mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(p, lo4)),
                                               _mm256_and_si256(_mm256_srli_epi16(p, 4), lo4), 1), lut);
      }
      // lanes 0-7 hold elements 0-31 (low nibbles), 8-15 elements 32-63: the formats with a scale per 32 scale
      // them apart
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
  if constexpr (MODE == ASYM) {  // the mins: acc -= mins . the activations' group sums, 16 groups a step
    const int ng = K / 32;
    MOE_UNROLL for (int r = 0; r < RB; ++r) {
      const float* mins = sc[r] + moff;  // the row's mins
      for (int j = 0; j < ng; j += 16) {
        const __mmask16 k = ng - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (ng - j)) - 1);
        const __m512 mv = _mm512_maskz_loadu_ps(k, mins + j);
        MOE_UNROLL for (int t = 0; t < NT; ++t)
          acc[r][t] = _mm512_fnmadd_ps(mv, _mm512_maskz_loadu_ps(k, XS[t] + j), acc[r][t]);
      }
    }
  }
  reduce_tile16(acc, nr, C);
}

// ---- 256-bit: AVX2 and AVX-VNNI ----
// 4 tokens a tile on both: the spills of 4 x 4 cost less than the decode work 2 or 3 tokens repeat
constexpr int TB256 = 4;

template <class Dot, int NT, int MODE>
inline void mk256(const uint8_t* W, size_t ldw, size_t pf, const ScaleT<MODE>* S, size_t lds, int nr,
                  const uint8_t* const* X, const float* const* XS, size_t moff, int K, float* C) {
  __m256 acc[RB][NT];
  MOE_UNROLL for (int r = 0; r < RB; ++r)
    MOE_UNROLL for (int t = 0; t < NT; ++t) acc[r][t] = Ymm::zero_ps();
  const uint8_t* w[RB];
  const ScaleT<MODE>* sc[RB];
  row_streams(W, ldw, nr, w);
  row_streams(S, lds, nr, sc);
  const __m256i lut = Ymm::bytes16(lut_of<MODE>());
  for (int i = 0, g = 0; i < K; i += G, ++g) {
    __m256i xl[NT], xh[NT];  // elements 0-31 and 32-63 of each token's group
    MOE_UNROLL for (int t = 0; t < NT; ++t) {
      xl[t] = Ymm::load(X[t] + i);
      xh[t] = Ymm::load(X[t] + i + 32);
      if constexpr (wide_values<MODE>) xl[t] = Dot::act(xl[t]), xh[t] = Dot::act(xh[t]);
    }
    MOE_UNROLL for (int r = 0; r < RB; ++r) {
      __m256i lo, hi;
      if constexpr (MODE == Q8) {
        _mm_prefetch(reinterpret_cast<const char*>(w[r] + i + pf), _MM_HINT_T1);
        lo = Ymm::load(w[r] + i), hi = Ymm::load(w[r] + i + 32);
      } else {
        _mm_prefetch(reinterpret_cast<const char*>(w[r] + i / 2 + pf), _MM_HINT_T1);
        Ymm::nibbles(w[r] + i / 2, lo, hi);
      }
      if constexpr (MODE != INT4) {
        if constexpr (MODE == MX || MODE == IQ) lo = Ymm::lookup(lut, lo), hi = Ymm::lookup(lut, hi);
        else if constexpr (MODE == G32) lo = Ymm::minus8(lo), hi = Ymm::minus8(hi);
        const __m256 slo = Ymm::set1(scale_of<MODE>(sc[r][2 * g])), shi = Ymm::set1(scale_of<MODE>(sc[r][2 * g + 1]));
        MOE_UNROLL for (int t = 0; t < NT; ++t) {
          if constexpr (wide_values<MODE>) {  // the dot products of the int8 kernels: |w| up to 127
            acc[r][t] = Ymm::fmadd(Ymm::to_ps(Dot::dot(Ymm::zero_si(), xl[t], lo)), slo, acc[r][t]);
            acc[r][t] = Ymm::fmadd(Ymm::to_ps(Dot::dot(Ymm::zero_si(), xh[t], hi)), shi, acc[r][t]);
          } else {
            acc[r][t] = Ymm::fmadd(Ymm::to_ps(Dot::small(xl[t], lo)), slo, acc[r][t]);
            acc[r][t] = Ymm::fmadd(Ymm::to_ps(Dot::small(xh[t], hi)), shi, acc[r][t]);
          }
        }
      } else {
        lo = Ymm::minus8(lo), hi = Ymm::minus8(hi);
        const __m256 sv = Ymm::broadcast(sc[r] + g);
        MOE_UNROLL for (int t = 0; t < NT; ++t)
          acc[r][t] = Ymm::fmadd(Ymm::to_ps(Dot::small2(xl[t], lo, xh[t], hi)), sv, acc[r][t]);
      }
    }
  }
  if constexpr (MODE == ASYM) {  // the mins: acc -= mins . the activations' group sums (zero-padded to 8s)
    const int ng = K / 32;
    MOE_UNROLL for (int r = 0; r < RB; ++r) {
      const float* mins = sc[r] + moff;  // the row's mins
      int j = 0;
      for (; j + 8 <= ng; j += 8) {
        const __m256 mv = Ymm::loadu_ps(mins + j);
        MOE_UNROLL for (int t = 0; t < NT; ++t) acc[r][t] = Ymm::fnmadd(mv, Ymm::loadu_ps(XS[t] + j), acc[r][t]);
      }
      if (j < ng) {  // ng is even: a last 2, 4 or 6
        const __m256 mv = Ymm::loadu_first_ps(mins + j, ng - j);
        MOE_UNROLL for (int t = 0; t < NT; ++t) acc[r][t] = Ymm::fnmadd(mv, Ymm::loadu_ps(XS[t] + j), acc[r][t]);
      }
    }
  }
  Ymm::reduce(acc, nr, C);
}

#define MOE_4BIT_YMM(NAME, TARGET, DOT)                                                                              \
  template <int MODE>                                                                                                \
  MOE_YMM_ENTRY(TARGET) void NAME(const uint8_t* W, size_t ldw, size_t pf, const ScaleT<MODE>* S, size_t lds, int nr, \
                                  const uint8_t* const* X, const float* const* XS, size_t moff, int nt, int K,     \
                                  float* C) {                                                                      \
    with_tokens<TB256>(nt,                                                                                         \
                       [&](auto NT) { mk256<DOT, decltype(NT)::value, MODE>(W, ldw, pf, S, lds, nr, X, XS, moff, K, C); }); \
  }
MOE_4BIT_YMM(mk_avx2, "avx2,fma", Avx2Dot)
MOE_4BIT_YMM(mk_avxvnni, "avx2,fma,avxvnni", VnniDot)
#undef MOE_4BIT_YMM

template <int MODE>
void mk_avx512(const uint8_t* W, size_t ldw, size_t pf, const ScaleT<MODE>* S, size_t lds, int nr, const uint8_t* const* X,
               const float* const* XS, size_t moff, int nt, int K, float* C) {
  with_tokens<TB>(nt, [&](auto NT) { mk<decltype(NT)::value, MODE>(W, ldw, pf, S, lds, nr, X, XS, moff, K, C); });
}

// uint4g32: each slot's activation sums per 32 (u8 - 128 summed: exact in int32), a row of Kp/32 zero-padded to a
// multiple of 16 (the micro-kernels read whole vectors of them), and a pointer per slot
inline void group_sums(const uint8_t* const* X, int ns, int Kp, std::vector<float>& xs, std::vector<const float*>& at) {
  const int ng = Kp / 32, ld = (ng + 15) / 16 * 16;
  xs.assign(size_t(ns) * ld, 0.f);
  at.resize(ns);
  for (int s = 0; s < ns; ++s) {
    at[s] = &xs[size_t(s) * ld];
    for (int g = 0; g < ng; ++g) {
      int32_t sum = -128 * 32;
      for (int i = 0; i < 32; ++i) sum += X[s][g * 32 + i];
      xs[size_t(s) * ld + g] = float(sum);
    }
  }
}

// rows [r0, r1) of expert e on one ISA's micro-kernel (the int8 driver's twin: gemm_int8.cpp). OFFSET: what the
// micro-kernel's dot products of wide values (iq4nl) hold, (q + 128) * w (128) or q * w (0: AVX2's sign trick,
// which needs no rowcorr). uint4g32: the micro-kernels take the mins' share against the slots' group sums.
template <int MODE, int TBI, int OFFSET = 128, class MK>
inline void drive_4bit(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy, MK&& mk) {
  const int scales = m.Kp / G * per64<MODE>;  // per row
  const size_t ldw = size_t(m.Kp) / 64 * group_bytes<MODE>;
  const size_t pf = prefetch_rows(ldw, RB) * ldw;  // bytes ahead
  const uint8_t* We = static_cast<const uint8_t*>(m.w) + size_t(e) * m.rows * ldw;
  // uint4g32: an expert's mins (a row's at a time) after its scales, moff numbers on from a row's scales
  const size_t moff = MODE == ASYM ? size_t(m.rows) * scales : 0;
  const ScaleT<MODE>* Se = reinterpret_cast<const ScaleT<MODE>*>(m.scale) + size_t(e) * (m.rows * size_t(scales) + moff);
  const float* corr = m.rowcorr + size_t(e) * m.rows;
  const float keep = wide_values<MODE> && OFFSET == 0 ? 0.f : 1.f;
  auto X = reinterpret_cast<const uint8_t* const*>(x.rows);
  const int ng = m.Kp / 32;
  thread_local std::vector<float> xs;
  thread_local std::vector<const float*> xs_at;
  if constexpr (MODE == ASYM) group_sums(X, ns, m.Kp, xs, xs_at);
  drive_rows<RB, TBI, float>(
      r0, r1, ns, TBI,
      [&](int r, int nr, int s, int nt, float* C) {
        if constexpr (MODE == ASYM)  // the tile's mins, read after its weights: on their way meanwhile
          for (int j = 0; j < nr; ++j)
            for (int b = 0; b < ng * 4; b += 64)
              _mm_prefetch(reinterpret_cast<const char*>(Se + size_t(r + j) * scales + moff) + b, _MM_HINT_T0);
        mk(We + size_t(r) * ldw, ldw, pf, Se + size_t(r) * scales, size_t(scales), nr, X + s,
           MODE == ASYM ? xs_at.data() + s : nullptr, moff, nt, m.Kp, C);
      },
      [&](int r, int nr, int s, int nt, const float* C) {
        for (int t = 0; t < nt; ++t)
          for (int j = 0; j < nr; ++j)
            Y[size_t(s + t) * ldy + r + j] = (C[t * RB + j] - keep * corr[r + j]) * x.scale[s + t];
      });
}

template <int MODE>
void ref_gemm_rows_4bit(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy) {
  const int groups = m.Kp / G, scales = groups * per64<MODE>;
  const size_t ldw = size_t(groups) * group_bytes<MODE>;
  auto X = reinterpret_cast<const uint8_t* const*>(x.rows);
  auto value = [](int q) {
    return MODE == MX || MODE == IQ ? int32_t(lut_of<MODE>()[q]) : MODE == ASYM ? int32_t(q) : int32_t(q) - 8;
  };
  for (int r = r0; r < r1; ++r) {
    const size_t row = size_t(e) * m.rows + r;
    const uint8_t* wr = static_cast<const uint8_t*>(m.w) + row * ldw;
    // uint4g32: an expert's scales [rows, Kp/32], then its mins [rows, Kp/32]
    const size_t expert = size_t(e) * m.rows * scales * (MODE == ASYM ? 2 : 1);
    const ScaleT<MODE>* sr = reinterpret_cast<const ScaleT<MODE>*>(m.scale) + expert + size_t(r) * scales;
    const ScaleT<MODE>* mins = sr + size_t(m.rows) * scales;
    for (int s = 0; s < ns; ++s) {
      float acc = 0.f;
      for (int g = 0; g < groups; ++g) {
        // elements 0-31 and 32-63 of the group; their activations' sums (without the +128s)
        int32_t lo = 0, hi = 0, xlo = -128 * G / 2, xhi = -128 * G / 2;
        for (int i = 0; i < G / 2; ++i) {
          if constexpr (MODE == Q8) {
            lo += int8_t(wr[g * G + i]) * X[s][g * G + i];
            hi += int8_t(wr[g * G + G / 2 + i]) * X[s][g * G + G / 2 + i];
          } else {
            lo += value(wr[g * G / 2 + i] & 15) * X[s][g * G + i];
            hi += value(wr[g * G / 2 + i] >> 4) * X[s][g * G + G / 2 + i];
          }
          xlo += X[s][g * G + i];
          xhi += X[s][g * G + G / 2 + i];
        }
        if constexpr (MODE == INT4)
          acc += float(lo + hi) * sr[g];
        else
          acc += float(lo) * scale_of<MODE>(sr[2 * g]) + float(hi) * scale_of<MODE>(sr[2 * g + 1]);
        if constexpr (MODE == ASYM) acc -= float(xlo) * mins[2 * g] + float(xhi) * mins[2 * g + 1];
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

void ref_gemm_rows_int4g32(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy) {
  ref_gemm_rows_4bit<G32>(m, e, r0, r1, x, ns, Y, ldy);
}
void gemm_rows_int4g32_avx2(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy) {
  drive_4bit<G32, TB256>(m, e, r0, r1, x, ns, Y, ldy, mk_avx2<G32>);
}
void gemm_rows_int4g32_avxvnni(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy) {
  drive_4bit<G32, TB256>(m, e, r0, r1, x, ns, Y, ldy, mk_avxvnni<G32>);
}
void gemm_rows_int4g32_avx512(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy) {
  drive_4bit<G32, TB>(m, e, r0, r1, x, ns, Y, ldy, mk_avx512<G32>);
}

void ref_gemm_rows_iq4nl(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy) {
  ref_gemm_rows_4bit<IQ>(m, e, r0, r1, x, ns, Y, ldy);
}
void gemm_rows_iq4nl_avx2(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy) {
  drive_4bit<IQ, TB256, Avx2Dot::offset>(m, e, r0, r1, x, ns, Y, ldy, mk_avx2<IQ>);
}
void gemm_rows_iq4nl_avxvnni(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy) {
  drive_4bit<IQ, TB256, VnniDot::offset>(m, e, r0, r1, x, ns, Y, ldy, mk_avxvnni<IQ>);
}
void gemm_rows_iq4nl_avx512(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy) {
  drive_4bit<IQ, TB>(m, e, r0, r1, x, ns, Y, ldy, mk_avx512<IQ>);
}

void ref_gemm_rows_int8g32(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy) {
  ref_gemm_rows_4bit<Q8>(m, e, r0, r1, x, ns, Y, ldy);
}
void gemm_rows_int8g32_avx2(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy) {
  drive_4bit<Q8, TB256, Avx2Dot::offset>(m, e, r0, r1, x, ns, Y, ldy, mk_avx2<Q8>);
}
void gemm_rows_int8g32_avxvnni(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy) {
  drive_4bit<Q8, TB256, VnniDot::offset>(m, e, r0, r1, x, ns, Y, ldy, mk_avxvnni<Q8>);
}
void gemm_rows_int8g32_avx512(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy) {
  drive_4bit<Q8, TB>(m, e, r0, r1, x, ns, Y, ldy, mk_avx512<Q8>);
}

void ref_gemm_rows_uint4g32(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy) {
  ref_gemm_rows_4bit<ASYM>(m, e, r0, r1, x, ns, Y, ldy);
}
void gemm_rows_uint4g32_avx2(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy) {
  drive_4bit<ASYM, TB256>(m, e, r0, r1, x, ns, Y, ldy, mk_avx2<ASYM>);
}
void gemm_rows_uint4g32_avxvnni(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy) {
  drive_4bit<ASYM, TB256>(m, e, r0, r1, x, ns, Y, ldy, mk_avxvnni<ASYM>);
}
void gemm_rows_uint4g32_avx512(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy) {
  drive_4bit<ASYM, TB>(m, e, r0, r1, x, ns, Y, ldy, mk_avx512<ASYM>);
}

}  // namespace moe
