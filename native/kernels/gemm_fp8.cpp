// FP8 (e4m3) weights with one fp32 scale per 128 x 128 block, as DeepSeek-V3/R1, Kimi-K2, GLM-4.5-FP8 and
// MiniMax-M2 publish them, computed on bf16 arithmetic without dequantizing the weights in memory:
// - a byte b widens exactly to its value / 256 (the packed scale carries the 256 back). AVX-512: bf16 from a
//   128-entry table, two byte permutes (vpermt2b: low and high bytes) per 64 weights, the sign or-ed in; the
//   permutes' in-lane unpacking leaves the 64 weights as [0-7, 16-23, 32-39, 48-55 | 8-15, 24-31, ...], and
//   the scaled activations are written in that order too (the sum does not care). AVX2 (and AVX-512 CPUs
//   without VBMI, which run the AVX2 kernels): sign-extend to 16 bits, << 7, & 0xBF80 gives the fp16 bits
//   of value / 256 (subnormals included), widened by vcvtph2ps; decode instead makes value x 2^-120 by integer
//   ops against activations x 2^112 (widen8_e120_avx2). All exact: e4m3 has 4 significant bits;
// - the block scale goes onto the activations, not the weights: for the 128 rows of one block row, each
//   slot's row x becomes bf16(x * scale[k / 128]) once (1/128 of the work), so the dot products are plain
//   bf16 x bf16 -> fp32 with no per-block partial sums. The only rounding is that of x * scale to bf16,
//   the activation rounding the bf16 kernels do anyway; the weights stay exact.
// Decode (few slots): the widening happens in registers per 32 weights (inline micro-kernels). Prefill: a
// block of rows is widened once into a bf16 scratch and the bf16 kernels (or AMX tiles) run on it, so the
// widening is paid once per row, not once per token block.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/kernels.h"
#include "kernels/reduce4.h"
#include "moe.h"
#include "runtime/common.h"

namespace moe {

namespace {

constexpr int RB = 4;
constexpr int INLINE_SLOTS = 4;  // at most this many slots: widen in registers (decode); more: a bf16 scratch
constexpr int CONV_ROWS = 32;    // rows widened into the scratch at a time (32 x 7232 x 2 B: L2-resident)
constexpr int FOLD_SLOTS = 128;  // from this many slots the scales go onto the widened weights (fp8_rows)

inline int kblocks(int Kp) { return (Kp + FP8_BLOCK - 1) / FP8_BLOCK; }

// fp16 bits -> float (the portable reference's widening)
inline float half_to_f32(uint16_t h) {
  const int e = (h >> 10) & 31, f = h & 1023;
  const float v = e ? std::ldexp(1.f + f / 1024.f, e - 15) : std::ldexp(f / 1024.f, -14);
  return (h & 0x8000) ? -v : v;
}
inline uint16_t e4m3_half_bits(uint8_t b) { return uint16_t((int16_t(int8_t(b)) << 7) & 0xBF80); }

// ---- the scaled activations: xs[s][k] = bf16(x[s][k] * S[k / 128]) for one block row ----
void scale_rows_ref(const float* const* X, int ns, int Kp, const float* S, void* out) {
  auto* xs = static_cast<uint16_t*>(out);
  for (int s = 0; s < ns; ++s)
    for (int k = 0; k < Kp; ++k) xs[size_t(s) * Kp + k] = f32_to_bf16(X[s][k] * S[k / FP8_BLOCK]);
}

// AVX-512: per 64 elements, the [0-7, 16-23, 32-39, 48-55 | 8-15, 24-31, 40-47, 56-63] order of widen64
__attribute__((target("avx512f,avx512bf16"))) void scale_rows_avx512(const float* const* X, int ns, int Kp,
                                                                    const float* S, void* out) {
  auto* xs = static_cast<uint16_t*>(out);
  for (int s = 0; s < ns; ++s)
    for (int k = 0; k < Kp; k += 64) {  // Kp: a multiple of 64; blocks of 128 share a scale
      const __m512 sc = _mm512_set1_ps(S[k / FP8_BLOCK]);
      __m256i c[4];
      for (int j = 0; j < 4; ++j) c[j] = (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(X[s] + k + 16 * j), sc));
      const __m512i lo = _mm512_inserti64x4(_mm512_castsi256_si512(c[0]), c[1], 1);  // 128-bit lanes: 0-7 8-15 16-23 24-31
      const __m512i hi = _mm512_inserti64x4(_mm512_castsi256_si512(c[2]), c[3], 1);  // 32-39 40-47 48-55 56-63
      uint16_t* d = xs + size_t(s) * Kp + k;
      _mm512_storeu_si512(d, _mm512_shuffle_i64x2(lo, hi, 0x88));       // lanes 0, 2 of each
      _mm512_storeu_si512(d + 32, _mm512_shuffle_i64x2(lo, hi, 0xDD));  // lanes 1, 3
    }
}

// v rounded to bf16 (nearest even, as f32_to_bf16), kept in the top half of each lane; exact values unchanged
__attribute__((target("avx2"), always_inline)) inline __m256i round_bf16_avx2(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff),
                                                         _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1))));
  return _mm256_and_si256(r, _mm256_set1_epi32(int(0xffff0000u)));
}

// AVX2: fp32, natural order, each value rounded through bf16 (round to nearest even, as f32_to_bf16) so every
// path multiplies the same activations. E112: times 2^112 too (exact), for the decode kernels whose weights are
// value x 2^-120; false, with nothing promised about xs, where one reaches 2^16 (times 2^112 it would overflow:
// that block row then takes the plain activations and the fp16 widening)
template <bool E112>
__attribute__((target("avx2,fma"))) bool scale_rows_avx2_t(const float* const* X, int ns, int Kp, const float* S,
                                                           void* out) {
  auto* xs = static_cast<float*>(out);
  __m256i top = _mm256_setzero_si256();  // E112: the largest |rounded value|'s bits, lane-wise
  for (int s = 0; s < ns; ++s)
    for (int k = 0; k < Kp; k += 8) {
      const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(X[s] + k), _mm256_set1_ps(S[k / FP8_BLOCK]));
      __m256 r = _mm256_castsi256_ps(round_bf16_avx2(v));
      if constexpr (E112) {
        top = _mm256_max_epu32(top, _mm256_and_si256(_mm256_castps_si256(r), _mm256_set1_epi32(0x7fffffff)));
        r = _mm256_mul_ps(r, _mm256_set1_ps(0x1p112f));
      }
      _mm256_storeu_ps(xs + size_t(s) * Kp + k, r);
    }
  const __m256i big = _mm256_cmpgt_epi32(top, _mm256_set1_epi32(0x477fffff));  // >= 2^16 (or NaN, inf)
  return _mm256_testz_si256(big, big);
}
void scale_rows_avx2(const float* const* X, int ns, int Kp, const float* S, void* out) {
  scale_rows_avx2_t<false>(X, ns, Kp, S, out);
}
bool scale_rows_e112_avx2(const float* const* X, int ns, int Kp, const float* S, void* out) {
  return scale_rows_avx2_t<true>(X, ns, Kp, S, out);
}

// ---- widening e4m3 -> bf16 (value / 256) ----
// The table: low and high bytes of the bf16 of each magnitude code 0-127, as two pairs of 64-byte vectors.
struct Lut {
  alignas(64) uint8_t lo[128], hi[128];
  Lut() {
    for (int c = 0; c < 128; ++c) {
      const uint16_t b = f32_to_bf16(half_to_f32(e4m3_half_bits(uint8_t(c))));
      lo[c] = uint8_t(b), hi[c] = uint8_t(b >> 8);
    }
  }
};
const Lut LUT;

struct Lut512 {
  __m512i lo0, lo1, hi0, hi1, sign;
};
__attribute__((target("avx512f,avx512bw,avx512vbmi"), always_inline)) inline Lut512 lut512() {
  return {_mm512_load_si512(LUT.lo), _mm512_load_si512(LUT.lo + 64), _mm512_load_si512(LUT.hi),
          _mm512_load_si512(LUT.hi + 64), _mm512_set1_epi8(char(0x80))};
}
// 64 e4m3 bytes -> two vectors of 32 bf16: elements [0-7, 16-23, 32-39, 48-55] and [8-15, 24-31, 40-47, 56-63]
__attribute__((target("avx512f,avx512bw,avx512vbmi,avx512bf16"), always_inline)) inline void widen64(
    const uint8_t* p, const Lut512& t, __m512bh& a, __m512bh& b) {
  const __m512i v = _mm512_loadu_si512(p);
  const __m512i lo = _mm512_permutex2var_epi8(t.lo0, v, t.lo1);  // index bits 0-6: bit 7, the sign, is ignored
  const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(t.hi0, v, t.hi1), v, t.sign, 0xF8);  // | sign
  a = (__m512bh)_mm512_unpacklo_epi8(lo, hi);
  b = (__m512bh)_mm512_unpackhi_epi8(lo, hi);
}

// Rows widened into the prefill scratch: exact (S null), or times their block scales S[k / 128] rounded to bf16
// (folded: the weights the bf16 format would hold, bit for bit)
__attribute__((target("avx512f,avx512bw,avx512vbmi,avx512bf16"))) inline __m512bh scale_bf16(__m512bh v, __m512 sc) {
  const __m512 lo = _mm512_cvtpbh_ps((__m256bh)_mm512_castsi512_si256((__m512i)v));
  const __m512 hi = _mm512_cvtpbh_ps((__m256bh)_mm512_extracti64x4_epi64((__m512i)v, 1));
  return _mm512_cvtne2ps_pbh(_mm512_mul_ps(hi, sc), _mm512_mul_ps(lo, sc));
}
__attribute__((target("avx512f,avx512bw,avx512vbmi,avx512bf16"))) void widen_rows_avx512(const uint8_t* W, int n,
                                                                                         int Kp, const float* S,
                                                                                         uint16_t* dst) {
  const Lut512 t = lut512();
  // scaled: back to natural order (128-bit lanes a0 b0 a1 b1 | a2 b2 a3 b3), as the bf16 format's rows
  const __m512i first = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0), second = _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4);
  for (int r = 0; r < n; ++r)
    for (int k = 0; k < Kp; k += 64) {
      __m512bh a, b;
      widen64(W + size_t(r) * Kp + k, t, a, b);
      if (S) {
        const __m512 sc = _mm512_set1_ps(S[k / FP8_BLOCK]);
        const __m512i sa = (__m512i)scale_bf16(a, sc), sb = (__m512i)scale_bf16(b, sc);
        a = (__m512bh)_mm512_permutex2var_epi64(sa, first, sb);
        b = (__m512bh)_mm512_permutex2var_epi64(sa, second, sb);
      }
      _mm512_storeu_si512(dst + size_t(r) * Kp + k, (__m512i)a);
      _mm512_storeu_si512(dst + size_t(r) * Kp + k + 32, (__m512i)b);
    }
}

// 16 e4m3 bytes -> 16 fp32 (value / 256): lo = elements 0-7, hi = 8-15
__attribute__((target("avx2,fma,f16c"), always_inline)) inline void widen16_avx2(const uint8_t* p, __m256& lo, __m256& hi) {
  const __m256i h = _mm256_and_si256(
      _mm256_slli_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 7),
      _mm256_set1_epi16(short(0xBF80)));
  lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
  hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}

// 8 e4m3 bytes -> 8 fp32 of value x 2^-120, exactly, subnormal codes too: sign-extended, << 20 puts the sign at
// bit 31 (the extension's copies above the byte's own sign bit masked off) and the exponent and mantissa bits at
// the top of fp32's, whose exponent 2^(e - 127) is e4m3's 2^(e - 7) times 2^-120. Three integer ops and no
// conversion, where widen16_avx2's fp16 route takes four and two vcvtph2ps a 16
__attribute__((target("avx2"), always_inline)) inline __m256 widen8_e120_avx2(const uint8_t* p) {
  const __m256i b = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(b, 20), _mm256_set1_epi32(int(0x87F00000u))));
}

// AVX2's scratch, exact: per 16 weights, 32-bit lane j holds the bf16 of element j (low half) and of j + 8 (high),
// so the bf16 kernel's split of a load into even and odd halves gives elements 0-7 and 8-15: natural order for
// the fp32 activations. Scaled (S): natural order, as the bf16 format holds its rows.
__attribute__((target("avx2,fma,f16c"))) void widen_rows_avx2(const uint8_t* W, int n, int Kp, const float* S,
                                                              uint16_t* dst) {
  for (int r = 0; r < n; ++r)
    for (int k = 0; k < Kp; k += 16) {
      __m256 lo, hi;
      widen16_avx2(W + size_t(r) * Kp + k, lo, hi);
      __m256i p;
      if (S) {  // natural order, as the bf16 format's rows
        const __m256 sc = _mm256_set1_ps(S[k / FP8_BLOCK]);
        const __m256i a = _mm256_srli_epi32(round_bf16_avx2(_mm256_mul_ps(lo, sc)), 16);
        const __m256i b = _mm256_srli_epi32(round_bf16_avx2(_mm256_mul_ps(hi, sc)), 16);
        p = _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xD8);
      } else {  // exact: their bf16 is their top half
        p = _mm256_or_si256(_mm256_srli_epi32(_mm256_castps_si256(lo), 16),
                            _mm256_and_si256(_mm256_castps_si256(hi), _mm256_set1_epi32(int(0xffff0000u))));
      }
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + size_t(r) * Kp + k), p);
    }
}

// ---- inline micro-kernels (decode): C[t * RB + r] = dot(widened row r, xs[t]) ----
template <int NT>
__attribute__((target("avx512f,avx512bw,avx512dq,avx512vbmi,avx512bf16"))) inline void mk512(
    const uint8_t* W, size_t ldw, size_t pf, int nr, const uint16_t* const* X, int Kp, float* C) {
  __m512 acc[RB][NT];
  MOE_UNROLL for (int r = 0; r < RB; ++r)
    MOE_UNROLL for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_setzero_ps();
  const uint8_t* w[RB];
  row_streams(W, ldw, nr, w);
  const Lut512 lut = lut512();
  for (int i = 0; i < Kp; i += 64) {
    __m512bh xa[NT], xb[NT];
    MOE_UNROLL for (int t = 0; t < NT; ++t) {
      xa[t] = (__m512bh)_mm512_loadu_si512(X[t] + i);
      xb[t] = (__m512bh)_mm512_loadu_si512(X[t] + i + 32);
    }
    MOE_UNROLL for (int r = 0; r < RB; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(w[r] + i + pf), _MM_HINT_T1);
      __m512bh a, b;
      widen64(w[r] + i, lut, a, b);
      MOE_UNROLL for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(acc[r][t], a, xa[t]), b, xb[t]);
    }
  }
  reduce_tile16(acc, nr, C);
}

// E120: weights widened to value x 2^-120 against activations x 2^112 (scale_rows_e112_avx2), else to value / 256
// against the activations as they are: the same products exactly, so the same sums in the same order
template <bool E120, int NT>
__attribute__((target("avx2,fma,f16c"))) inline void mk256(const uint8_t* W, size_t ldw, size_t pf, int nr,
                                                           const float* const* X, int Kp, float* C) {
  constexpr int CH = NT == 1 ? 2 : 1;  // one token: two FMA chains a row, or the FMA latency sets the pace
  __m256 acc[RB][NT * CH];
  MOE_UNROLL for (int r = 0; r < RB; ++r)
    MOE_UNROLL for (int t = 0; t < NT * CH; ++t) acc[r][t] = _mm256_setzero_ps();
  const uint8_t* w[RB];
  row_streams(W, ldw, nr, w);
  for (int i = 0; i < Kp; i += 32) {  // 32 weights a row per step: one prefetch per 64-byte line
    MOE_UNROLL for (int r = 0; r < RB; ++r) {
      if ((i & 63) == 0) _mm_prefetch(reinterpret_cast<const char*>(w[r] + i + pf), _MM_HINT_T1);
      __m256 v[4];
      if constexpr (E120) {
        MOE_UNROLL for (int j = 0; j < 4; ++j) v[j] = widen8_e120_avx2(w[r] + i + 8 * j);
      } else {
        widen16_avx2(w[r] + i, v[0], v[1]);
        widen16_avx2(w[r] + i + 16, v[2], v[3]);
      }
      MOE_UNROLL for (int t = 0; t < NT; ++t)
        MOE_UNROLL for (int j = 0; j < 4; ++j) {
          __m256& a = acc[r][t * CH + (j % CH)];
          a = _mm256_fmadd_ps(v[j], _mm256_loadu_ps(X[t] + i + 8 * j), a);
        }
    }
  }
  __m256 sum[RB][NT];
  MOE_UNROLL for (int r = 0; r < RB; ++r)
    MOE_UNROLL for (int t = 0; t < NT; ++t)
      sum[r][t] = CH == 2 ? _mm256_add_ps(acc[r][t * CH], acc[r][t * CH + CH - 1]) : acc[r][t * CH];
  reduce_tile4(sum, nr, C);
}

__attribute__((target("avx512f,avx512bw,avx512dq,avx512vbmi,avx512bf16"))) void inline_avx512(const uint8_t* W, size_t ldw, size_t pf,
                                                                                  int nr, const void* const* Xv,
                                                                                  int nt, int Kp, float* C) {
  auto X = reinterpret_cast<const uint16_t* const*>(Xv);
  with_tokens<INLINE_SLOTS>(nt, [&](auto NT) { mk512<decltype(NT)::value>(W, ldw, pf, nr, X, Kp, C); });
}
// One token on AVX-512: a row at a time (one stream a task, as the bf16 format's rows1; 10% less time than the tiles
// on a Zen 4, docs/performance/kernels.md), each row's chain and the 4 rows' reduce4 the tile's (mk512), so the same bits as a
// token among a few
__attribute__((target("avx512f,avx512bw,avx512dq,avx512vbmi,avx512bf16"))) void rows1_avx512(const uint8_t* W, int Kp,
                                                                                             int n, const float* xv,
                                                                                             float* y) {
  const uint16_t* x = reinterpret_cast<const uint16_t*>(xv);  // scale_rows_avx512's bf16 row
  const Lut512 lut = lut512();
  for (int r = 0; r < n; r += RB) {
    const int nr = std::min(RB, n - r);
    __m512 acc[RB];
    MOE_UNROLL for (int j = 0; j < RB; ++j) {
      acc[j] = _mm512_setzero_ps();
      if (j >= nr) continue;
      const uint8_t* w = W + size_t(r + j) * Kp;
      for (int i = 0; i < Kp; i += 64) {
        __m512bh a, b;
        widen64(w + i, lut, a, b);
        acc[j] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(acc[j], a, (__m512bh)_mm512_loadu_si512(x + i)), b,
                                  (__m512bh)_mm512_loadu_si512(x + i + 32));
      }
    }
    alignas(16) float out[4];
    _mm_store_ps(out, reduce4_ps(acc[0], acc[1], acc[2], acc[3]));
    for (int j = 0; j < nr; ++j) y[r + j] = out[j];
  }
}

// One token: a row at a time (one sequential stream a task, as int8's one-token rows: the 4-row tiles' four
// streams 2 KB and more apart read the experts' short matrices below the DRAM's speed), four multiply-add chains
// a row; E120 as mk256's (both widenings give the same products, so the same bits)
template <bool E120>
__attribute__((target("avx2,fma,f16c"))) void rows1_avx2(const uint8_t* W, int Kp, int n, const float* x, float* y) {
  for (int r = 0; r < n; ++r) {
    const uint8_t* w = W + size_t(r) * Kp;
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int i = 0; i < Kp; i += 32) {
      __m256 v[4];
      if constexpr (E120) {
        MOE_UNROLL for (int j = 0; j < 4; ++j) v[j] = widen8_e120_avx2(w + i + 8 * j);
      } else {
        widen16_avx2(w + i, v[0], v[1]);
        widen16_avx2(w + i + 16, v[2], v[3]);
      }
      MOE_UNROLL for (int j = 0; j < 4; ++j) acc[j] = _mm256_fmadd_ps(v[j], _mm256_loadu_ps(x + i + 8 * j), acc[j]);
    }
    y[r] = sum8(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
  }
}

template <bool E120>
__attribute__((target("avx2,fma,f16c"))) void inline_avx2(const uint8_t* W, size_t ldw, size_t pf, int nr,
                                                          const void* const* Xv, int nt, int Kp, float* C) {
  auto X = reinterpret_cast<const float* const*>(Xv);
  // 4 x 2 tiles: 8 accumulators + 4 activation vectors + the widened pair fill the 16 ymm
  for (int s = 0; s < nt; s += 2) {
    if (nt - s >= 2) mk256<E120, 2>(W, ldw, pf, nr, X + s, Kp, C + s * RB);
    else mk256<E120, 1>(W, ldw, pf, nr, X + s, Kp, C + s * RB);
  }
}

// ---- the portable reference ----
void inline_ref(const uint8_t* W, size_t ldw, size_t, int nr, const void* const* Xv, int nt, int Kp, float* C) {
  auto X = reinterpret_cast<const uint16_t* const*>(Xv);
  for (int r = 0; r < nr; ++r)
    for (int t = 0; t < nt; ++t) {
      float a[16] = {};
      for (int i = 0; i < Kp; i += 16)
        for (int j = 0; j < 16; ++j)
          a[j] += half_to_f32(e4m3_half_bits(W[size_t(r) * ldw + i + j])) * bf16_to_f32(X[t][i + j]);
      float acc = 0.f;
      for (float v : a) acc += v;
      C[t * RB + r] = acc;
    }
}
void widen_rows_ref(const uint8_t* W, int n, int Kp, const float* S, uint16_t* dst) {
  for (size_t i = 0; i < size_t(n) * Kp; ++i)
    dst[i] = f32_to_bf16(half_to_f32(e4m3_half_bits(W[i])) * (S ? S[(i % Kp) / FP8_BLOCK] : 1.f));
}

// One ISA's pieces: the scaled activations, the inline kernel, the row widening and the bf16 rows (the bf16
// format's kernels, or AMX tiles).
// One ISA's pieces: the scaled activations (act_bytes an element: bf16, or fp32 on AVX2), the inline kernel,
// the row widening and the bf16 rows over the widened rows (the bf16 format's kernels; AMX tiles beside).
struct Path {
  void (*scale_rows)(const float* const* X, int ns, int Kp, const float* S, void* xs);
  void (*inline_rows)(const uint8_t* W, size_t ldw, size_t pf, int nr, const void* const* X, int nt, int Kp, float* C);
  void (*widen_rows)(const uint8_t* W, int n, int Kp, const float* S, uint16_t* dst);
  void (*bf16_rows)(const uint16_t* We, int Kp, int r0, int r1, const void* const* X, int ns, float* Y, size_t ldy);
  // folded: the bf16 format's kernel on natural-order rows and activations
  void (*natural_rows)(const uint16_t* We, int Kp, int r0, int r1, const void* const* X, int ns, float* Y, size_t ldy);
  int act_bytes;
  bool amx;
  // decode's faster pair where the path has one (AVX2): activations x 2^112 (false: out of its range) and the
  // kernel for them; the same results as scale_rows + inline_rows
  bool (*scale_rows_wide)(const float* const* X, int ns, int Kp, const float* S, void* xs) = nullptr;
  void (*inline_wide)(const uint8_t* W, size_t ldw, size_t pf, int nr, const void* const* X, int nt, int Kp,
                      float* C) = nullptr;
  // one token, n rows: on the activations as scale_rows or scale_rows_wide left them
  void (*rows1)(const uint8_t* W, int Kp, int n, const float* x, float* y) = nullptr;
  void (*rows1_wide)(const uint8_t* W, int Kp, int n, const float* x, float* y) = nullptr;
};

void fp8_rows(const Path& p, const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy) {
  const int Kp = m.Kp, nkb = kblocks(Kp), nrb = (m.rows + FP8_BLOCK - 1) / FP8_BLOCK;
  const uint8_t* We = static_cast<const uint8_t*>(m.w) + size_t(e) * m.rows * Kp;
  const float* Se = m.scale + size_t(e) * nrb * nkb;
  auto X = reinterpret_cast<const float* const*>(x.rows);
  const size_t pf = prefetch_rows(size_t(Kp), RB) * Kp;  // bytes ahead
  thread_local std::vector<uint16_t> wb;
  thread_local std::vector<uint8_t> xs, amx_b;
  thread_local std::vector<const void*> xr;
  const size_t row_bytes = size_t(Kp) * p.act_bytes;
  xs.resize(size_t(ns) * row_bytes);
  xr.resize(ns);
  for (int s = 0; s < ns; ++s) xr[s] = xs.data() + size_t(s) * row_bytes;
  const bool tiles = p.amx && ns >= AMX_MIN_SLOTS;
  // Many slots: the block scales go onto the widened weights instead (bf16(value x scale), the bf16 format's
  // weights bit for bit) and the activations are the bf16 rows quantize_row made once per forward: rescaling
  // every slot's row for each block row would stream ns x Kp activations per 128 rows, out of L2 at this size
  const bool fold = ns >= FOLD_SLOTS;
  auto pack_tiles = [&](Acts& xa) {  // the activations in tile layout (bf16: the AVX-512 paths)
    xa.amx_b = line_aligned(amx_b, amx_b_bytes(Fmt::Bf16, ns, Kp));
    pack_amx_b(Fmt::Bf16, xa, ns, Kp, const_cast<uint8_t*>(xa.amx_b));
  };
  Acts xa{xr.data(), nullptr, nullptr};
  thread_local std::vector<const void*> xn;  // folded: each slot's bf16 row, made once by quantize_row
  if (fold) {
    xn.resize(ns);
    for (int s = 0; s < ns; ++s) xn[s] = static_cast<const uint8_t*>(x.rows[s]) + size_t(Kp) * 4;
    xa.rows = xn.data();
    if (tiles) pack_tiles(xa);
  }
  for (int r = r0; r < r1;) {
    const int rb = r / FP8_BLOCK, rz = std::min(r1, (rb + 1) * FP8_BLOCK);
    const float* S = Se + size_t(rb) * nkb;
    const bool wide = ns <= INLINE_SLOTS && p.scale_rows_wide && p.scale_rows_wide(X, ns, Kp, S, xs.data());
    if (!fold && !wide) p.scale_rows(X, ns, Kp, S, xs.data());
    const void* const* xp = xr.data();
    if (ns == 1 && p.rows1) {
      (wide ? p.rows1_wide : p.rows1)(We + size_t(r) * Kp, Kp, rz - r, reinterpret_cast<const float*>(xs.data()),
                                      Y + r);
    } else if (ns <= INLINE_SLOTS) {
      const auto kernel = wide ? p.inline_wide : p.inline_rows;
      for (int q = r; q < rz; q += RB) {
        float C[INLINE_SLOTS * RB];
        const int nr = std::min(RB, rz - q);
        kernel(We + size_t(q) * Kp, Kp, pf, nr, xp, ns, Kp, C);
        for (int t = 0; t < ns; ++t)
          for (int j = 0; j < nr; ++j) Y[size_t(t) * ldy + q + j] = C[t * RB + j];
      }
    } else {
      if (tiles && !fold) pack_tiles(xa);  // this block row's scaled activations
      wb.resize(size_t(CONV_ROWS) * Kp);
      for (int q = r; q < rz; q += CONV_ROWS) {
        const int n = std::min(CONV_ROWS, rz - q);
        p.widen_rows(We + size_t(q) * Kp, n, Kp, fold ? S : nullptr, wb.data());
        // the next chunk's bytes come from DRAM while this one computes: a share of them prefetched before
        // each group of rows (the widening reads them at cache speed then; without this it waited on DRAM,
        // a third of the prefill time)
        const char* next = reinterpret_cast<const char*>(We + size_t(q + n) * Kp);
        const size_t next_bytes = size_t(std::min(CONV_ROWS, r1 - (q + n))) * Kp;
        const int whole = tiles ? n / 16 * 16 : 0;
        const int groups = whole ? 1 + (n - whole + RB - 1) / RB : (n + RB - 1) / RB;
        size_t ahead = 0;
        auto prefetch_share = [&](int g) {  // lines [ahead, next_bytes * (g + 1) / groups) of the next chunk
          const size_t until = next_bytes * size_t(g + 1) / size_t(groups);
          for (; ahead < until; ahead += 64) _mm_prefetch(next + ahead, _MM_HINT_T1);
        };
        int g = 0;
        if (whole) {
          prefetch_share(g++);
          const Matrix wm{wb.data(), nullptr, nullptr, nullptr, n, m.K, Kp};
          gemm_rows_amx(Fmt::Bf16, wm, 0, 0, whole, xa, ns, Y + q, ldy);
        }
        for (int j = whole; j < n; j += RB) {  // the widened rows are in cache: no prefetching of them
          prefetch_share(g++);
          if (fold) p.natural_rows(wb.data(), Kp, j, std::min(n, j + RB), xn.data(), ns, Y + q, ldy);
          else p.bf16_rows(wb.data(), Kp, j, std::min(n, j + RB), xp, ns, Y + q, ldy);
        }
      }
    }
    r = rz;
  }
}

void bf16_rows_ref(const uint16_t* We, int Kp, int r0, int r1, const void* const* X, int ns, float* Y, size_t ldy) {
  const Matrix m{We, nullptr, nullptr, nullptr, r1, Kp, Kp};
  ref_gemm_rows_bf16(m, 0, r0, r1, Acts{X, nullptr}, ns, Y, ldy);
}
void widened_rows_avx2(const uint16_t* We, int Kp, int r0, int r1, const void* const* X, int ns, float* Y, size_t ldy) {
  bf16_rows_avx2_widened(We, Kp, r0, r1, reinterpret_cast<const float* const*>(X), ns, Y, ldy);
}
void bf16_rows_zmm(const uint16_t* We, int Kp, int r0, int r1, const void* const* X, int ns, float* Y, size_t ldy) {
  bf16_rows_avx512(We, Kp, r0, r1, reinterpret_cast<const uint16_t* const*>(X), ns, Y, ldy, 0);
}
void natural_rows_avx2(const uint16_t* We, int Kp, int r0, int r1, const void* const* X, int ns, float* Y, size_t ldy) {
  bf16_rows_avx2(We, Kp, r0, r1, reinterpret_cast<const uint16_t* const*>(X), ns, Y, ldy, 0);
}

constexpr Path REF{scale_rows_ref, inline_ref, widen_rows_ref, bf16_rows_ref, bf16_rows_ref, 2, false};
constexpr Path AVX2{scale_rows_avx2, inline_avx2<false>, widen_rows_avx2, widened_rows_avx2, natural_rows_avx2, 4,
                    false, scale_rows_e112_avx2, inline_avx2<true>, rows1_avx2<false>, rows1_avx2<true>};
constexpr Path AVX512{scale_rows_avx512, inline_avx512, widen_rows_avx512, bf16_rows_zmm, bf16_rows_zmm, 2, false,
                      nullptr, nullptr, rows1_avx512, nullptr};
constexpr Path AMX{scale_rows_avx512, inline_avx512, widen_rows_avx512, bf16_rows_zmm, bf16_rows_zmm, 2, true,
                   nullptr, nullptr, rows1_avx512, nullptr};

// AVX-512 without VBMI (Cooper Lake): the AVX2 kernels
const Path& zmm_path(const Path& p) { return detect_cpu().avx512vbmi ? p : AVX2; }

}  // namespace

void ref_gemm_rows_fp8(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy) {
  fp8_rows(REF, m, e, r0, r1, x, ns, Y, ldy);
}
void gemm_rows_fp8_avx2(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy) {
  fp8_rows(AVX2, m, e, r0, r1, x, ns, Y, ldy);
}
void gemm_rows_fp8_avx512(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy) {
  fp8_rows(zmm_path(AVX512), m, e, r0, r1, x, ns, Y, ldy);
}
void gemm_rows_fp8_amx(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy) {
  fp8_rows(zmm_path(AMX), m, e, r0, r1, x, ns, Y, ldy);
}

}  // namespace moe
