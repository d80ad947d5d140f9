// The grouped int formats in row-interleaved blocks: int4 (q - 8, a scale per 64), int4g32 (q - 8, a scale per 32),
// uint4g32 (scale * q - min), iq4nl (ggml's IQ4_NL grid), mxfp4 (e2m1, a power-of-two scale per 32) and int8g32
// (int8). Layout (moe.h): a matrix's rows in blocks of 16 (the last may be shorter), a block holding, 32 weights
// at a time, chunk vectors whose lane j is row j's 4 weights of one chunk of 4 (the 32's 8 chunks: nibble formats
// pack chunk v in the low nibbles and chunk v + 4 in the high ones of one vector), then the block's scales group
// by group, 16 rows each. So one vpdpbusd multiplies 16 rows by one broadcast 4-byte chunk of the activations, a
// group's chunks sum in int32 per row, and one FMA applies the 16 rows' scales (a vector load): about half the
// instructions per weight byte of the row-major layout (per 64 weights: two dot products each widened and scaled
// apart, the scales permuted into lanes), which on 2 cores was compute-bound (docs/performance/kernels.md). Each row's result
// ends in its own lane: no reduction.
//
// Weights enter the dot products as u8 and activations as s8 (the callers' u8 = x + 128, flipped once per
// call): nibbles as they are, iq4nl's grid values and mxfp4's (twice e2m1) + 128, int8g32's bytes + 128. What
// the u8 weights carry in excess (8 for q - 8, else 128) times the group's activation sum comes out in int32
// before the scale. uint4g32's mins multiply that activation sum in fp32. AVX2 (no u8 x s8 dot product that
// cannot saturate on 255 x 127) multiplies iq4nl and int8g32 as signed bytes with the int8 kernels' sign trick;
// nibbles (<= 15) go through vpmaddubsw directly, 32 weights' 8 chunks summed in int16 (<= 8 x 2 x 15 x 128)
// before one widening, and mxfp4's values + 12 (<= 24) the same way 4 chunks at a time (excess 12).
//
// iq4xs (GGUF's IQ4_XS as stored): iq4nl's codes, w = d sc IQ4NL[code] with an int8 sc (the file's 6-bit ls - 32)
// per 32 and an fp32 d per 256: each 32's integer dot product times sc summed in int32 over the 256 (|sum| < 8 x 32 x
// 32 x 127 x 128 < 2^27), then one FMA with d, as q6k's below.
//
// q5k (GGUF's Q5_K as stored): q4k's numbers (w = d sc q - dmin m) with 5-bit q, its low nibbles laid out as the
// nibble formats' and its fifth bits in 1 more vector a 32 (chunk c's at bit c); AVX2 sums 4 chunks' int16 pairs
// before widening, not 8 (4 x 2 x 31 x 128 < 2^15).
//
// q3k (GGUF's Q3_K as stored): q6k's numbers with 3-bit u (w = d sc (u - 4)): a 32's low bit pairs in 2 vectors (as
// q6k's high pairs) and its high bits in 1 (as q5k's), decoded to u, then q6k's sums with an excess of 4, through
// vpdpwssd (paired16, below).
//
// q2k (GGUF's Q2_K as stored): w = d sc q - dmin m with 2-bit q and a 4-bit sc and m per 16 (a byte, as the file's:
// sc in the low nibble) under an fp32 d and dmin per 256; q3k's low bit pairs alone (2 vectors a 32), a row's two
// bytes of a 32 side by side. Per 32 its two 16s' dot products (each within int16: 16 x 3 x 128) as int16 pairs times
// the (sc, sc') pair, and (m, m') times the 16s' activation sums (within int16: 16 x 128), one vpdpwssd (AVX2:
// vpmaddwd) each, in two int32 sums: per 256 two FMAs, d and -dmin (ggml's integers and order). q3k's sums go the same
// way (its int8 sc pairs interleaved at load): with q6k's vpmulld per 16 instead, both were compute-bound further
// below the DRAM probe (docs/performance/kernels.md).
//
// q6k (GGUF's Q6_K as stored): 6-bit u (w = d sc (u - 32)), its low nibbles laid out as the nibble formats' and its
// high 2 bits in 2 more vectors a 32. A 32's two chains of dot products are its two 16s (chunks 0-3, 4-7), each
// with its own int8 sc: the 16's int32 dot product, less 32 x its activation sum, times sc, summed in int32 over
// the 256 (exact, as ggml's; |sum| < 16 x 16 x 32 x 128 x 128 = 2^27), then one FMA with the 256's d.
//
// The templates of every format, private to the files that instantiate them (gemm_blocked_g32.cpp: the formats of
// 32-weight groups; gemm_blocked_k.cpp: GGUF's super-blocked ones with mins; gemm_blocked_s.cpp: those with signed
// sub-scales): one file took as long to compile as all the others together, and the build compiles one file per
// CPU. An unnamed namespace keeps each file's instantiations its own.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#include "common.h"
#include "kernels.h"
#include "moe.h"
#include "ymm.h"

namespace moe {

namespace {

enum Mode { G32, IQ, ASYM, Q8, INT4, MX, Q4K, Q6K, IQXS, Q5K, Q3K, Q2K };
constexpr int BLK = 16;  // rows a block
constexpr int G = 32;    // weights a layout group (a scale's, or half of int4's)
// the formats whose scales are bytes read field by field: d (fp32) per 256 (q2k: and dmin), then sub-scales (and mins)
constexpr bool fielded(int mode) {
  return mode == Q4K || mode == Q5K || mode == Q6K || mode == Q3K || mode == Q2K || mode == IQXS;
}
template <int MODE>
constexpr int SPG = MODE == INT4 ? 2 : fielded(MODE) ? 8 : 1;  // layout groups a d covers
// q6k and q3k: w = d sc (u - excess), an int8 sc per 16 under an fp32 d per 256 (the same scales); q2k: w = d sc q -
// dmin m, a byte of 4-bit sc and m per 16 under an fp32 d and dmin per 256
constexpr bool sub16(int mode) { return mode == Q6K || mode == Q3K || mode == Q2K; }
// products times an integer sc, summed in int32 per 256, then d (q2k: less dmin x its mins' int32 sum)
template <int MODE>
constexpr bool int_scaled = sub16(MODE) || MODE == IQXS;
// q2k: its bytes of sc and m after d and dmin; the others' sc after d (4 bytes a row)
template <int MODE>
constexpr int sc_at = MODE == Q2K ? 8 : 4;
// q3k, q2k: a 32's two 16s' dot products fit int16 (16 x 7 x 128), and so do the 16s' activation sums times the
// excess (4 x 16 x 128): both go as int16 pairs through vpdpwssd (AVX2: vpmaddwd) with the pair of sub-scales
// (q2k: sc, and m for the sums), no vpmulld; the same integers as sc x (dot - excess x sum) summed per 256
constexpr bool paired16(int mode) { return mode == Q3K || mode == Q2K; }
// an int16 pair (lo, hi) of int32 sums x, y: the broadcast operand of vpdpwssd
inline int32_t pair_of(int32_t x, int32_t y) { return int32_t((uint32_t(y) << 16) | (uint32_t(x) & 0xFFFF)); }
// q4k and q5k: w = d sc q - dmin m, a 6-bit sc and m per 32 under an fp32 d and dmin per 256 (the same scales)
constexpr bool k_mins(int mode) { return mode == Q4K || mode == Q5K; }
template <int MODE>
using ScaleT = std::conditional_t<MODE == MX || fielded(MODE), uint8_t, float>;  // mxfp4: the exponent byte
template <int MODE>
// scale elements a row has per scale group (q4k, q5k: d, dmin, 8 sc, 8 m; q2k: d, dmin, 16 sc | m << 4; q6k, q3k: d,
// 16 sc; iq4xs: d, 8 sc: bytes)
constexpr int SGE = k_mins(MODE) || MODE == Q2K ? 24 : sub16(MODE) ? 20 : MODE == IQXS ? 12 : 1;
template <int MODE>
constexpr bool nibble = MODE != Q8;
template <int MODE>
constexpr int vectors = nibble<MODE> ? 4 : 8;  // chunk vectors a group loads (q6k: and its 2 of high bits, q5k its 1)
template <int MODE>  // vectors' worth of bytes a layout group stores
constexpr int stride_vectors = MODE == Q6K ? 6 : MODE == Q5K ? 5 : MODE == Q3K ? 3 : MODE == Q2K ? 2 : vectors<MODE>;
constexpr int Q6_SUB = 16;  // q6k, q3k, q2k: weights an sc covers
// ggml's kvalues_iq4nl: the IQ4_NL / IQ4_XS code -> its value; and + 128 as u8
constexpr int8_t IQ4NL_LUT[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
constexpr uint8_t IQ4NL_U8[16] = {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241};
// e2m1 code -> twice its value (bit 3 the sign), and + 128 as u8
constexpr int8_t MX4_LUT[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
constexpr uint8_t MX4_U8[16] = {128, 129, 130, 131, 132, 134, 136, 140, 128, 127, 126, 125, 124, 122, 120, 116};
// and + 12 (AVX2: small enough for vpmaddubsw's int16 pairs, 4 chunks summed before widening)
constexpr int MX4_SMALL = 12;
constexpr int8_t MX4_U12[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};
template <int MODE>
inline const int8_t* lut_s8() { return MODE == MX ? MX4_LUT : IQ4NL_LUT; }
template <int MODE>
inline const uint8_t* lut_u8() { return MODE == MX ? MX4_U8 : IQ4NL_U8; }
constexpr bool looked_up(int mode) { return mode == IQ || mode == MX || mode == IQXS; }
// what a group's dot product of u8 weights carries in excess, per unit of its activation sum (SIGNED: AVX2's sign
// trick on the signed values); q2k: none, but its mins take the activations' sums per 16 (prepared times 1)
template <int MODE, bool SIGNED>
constexpr int excess = MODE == G32 || MODE == INT4 ? 8 : MODE == Q6K ? 32 : MODE == Q3K ? 4 : MODE == Q2K ? 1
                     : MODE == ASYM || k_mins(MODE) || SIGNED ? 0 : 128;
// the formats with mins: the activations' float sum per 32 is needed
template <int MODE>
constexpr bool has_mins = MODE == ASYM || k_mins(MODE);
// mxfp4's scale of a published exponent e (e8m0): 2^(e - 127) / 2 (the kernels multiply twice the e2m1 value),
// the float whose exponent field is e - 1; 0 for e <= 1
inline float mx_scale(uint8_t e) {
  const uint32_t b = e > 1 ? uint32_t(e - 1) << 23 : 0;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}
template <int MODE>
inline float scale_of(ScaleT<MODE> s) {
  if constexpr (MODE == MX) return mx_scale(s);
  else if constexpr (fielded(MODE)) return 0.f;  // read field by field
  else return s;
}

// A slot's activations as the kernels take them: s8, and per scale group (gs weights) its sum times the mode's
// excess (int32) and (uint4g32) the sum as a float. Per call of a driver (one task): the rows are K bytes, this is
// cheap next to them.
struct Prepared {
  std::vector<int8_t> x;
  std::vector<int32_t> corr;
  std::vector<float> sum;
  std::vector<const int8_t*> xp;
  std::vector<const int32_t*> cp;
  std::vector<const float*> sp;
};
inline void prepare(const uint8_t* const* X, int ns, int Kp, int gs, int exc, bool sums, Prepared& p) {
  const int ng = Kp / gs;
  p.x.resize(size_t(ns) * Kp);
  p.corr.resize(size_t(ns) * ng);
  p.sum.resize(sums ? size_t(ns) * ng : 0);
  p.xp.resize(ns), p.cp.resize(ns), p.sp.resize(ns);
  for (int s = 0; s < ns; ++s) {
    int8_t* x = &p.x[size_t(s) * Kp];
    for (int i = 0; i < Kp; ++i) x[i] = int8_t(X[s][i] ^ 0x80);
    for (int g = 0; g < ng; ++g) {
      int32_t t = 0;
      for (int i = 0; i < gs; ++i) t += x[g * gs + i];
      p.corr[size_t(s) * ng + g] = exc * t;
      if (sums) p.sum[size_t(s) * ng + g] = float(t);
    }
    p.xp[s] = x, p.cp[s] = &p.corr[size_t(s) * ng], p.sp[s] = sums ? &p.sum[size_t(s) * ng] : nullptr;
  }
}

// ---- AVX-512: a unit of 16 rows (a whole block, or a shorter one: n lanes, FULL false) x NT tokens ----
template <int MODE>
__attribute__((target("avx512f,avx512bw"))) inline __m512i decode512(__m512i q) {  // u8 weights
  if constexpr (looked_up(MODE))
    return _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(lut_u8<MODE>()))), q);
  else if constexpr (MODE == Q8) return _mm512_xor_si512(q, _mm512_set1_epi8(char(0x80)));
  else return q;
}
// a block's n scales of one group (lanes past n zero)
template <int MODE>
__attribute__((target("avx512f,avx512bw"))) inline __m512 scales512(const ScaleT<MODE>* p, __mmask16 lanes) {
  if constexpr (MODE == MX) {  // exponent e -> the float of exponent field e - 1, 0 for e <= 1 (mx_scale)
    const __m512i e = _mm512_cvtepu8_epi32(_mm512_castsi512_si128(_mm512_maskz_loadu_epi8(__mmask64(lanes), p)));
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_sub_epi32(_mm512_max_epi32(e, _mm512_set1_epi32(1)), _mm512_set1_epi32(1)), 23));
  } else if constexpr (fielded(MODE)) {  // read field by field instead
    return _mm512_setzero_ps();
  } else {
    return _mm512_maskz_loadu_ps(lanes, p);
  }
}
// q6k: chunk c's (c < 4) high 2 bits, bits 2c and 2c + 1 of each byte of hv, put above its nibble (16-bit shifts:
// what crosses into the next byte lands outside bits 4-5 and is masked away)
__attribute__((target("avx512f,avx512bw"))) inline __m512i q6_value512(__m512i nib, __m512i hv, int c) {
  const __m512i h = c == 0 ? _mm512_slli_epi16(hv, 4) : c == 1 ? _mm512_slli_epi16(hv, 2) : c == 2 ? hv
                                                                               : _mm512_srli_epi16(hv, 2);
  return _mm512_ternarylogic_epi32(nib, h, _mm512_set1_epi8(0x30), 0xF8);  // nib | (h & 0x30)
}
// q3k: chunk c's value from its 2 low bits (bits 2c, 2c + 1 of lv's bytes, c < 4) and its high bit (bit c of hb's,
// c < 8) (16-bit shifts by at most 6 and 5: what crosses bytes lands outside bits 0-2, masked away)
__attribute__((target("avx512f,avx512bw"))) inline __m512i q3_value512(__m512i lv, __m512i hb, int c) {
  const int k = c % 4;
  const __m512i l = k ? _mm512_srli_epi16(lv, 2 * k) : lv;
  const __m512i h = c < 2 ? _mm512_slli_epi16(hb, 2 - c) : c == 2 ? hb : _mm512_srli_epi16(hb, c - 2);
  return _mm512_or_si512(_mm512_and_si512(l, _mm512_set1_epi8(0x03)), _mm512_and_si512(h, _mm512_set1_epi8(0x04)));
}
// q2k: chunk c's value, its 2 bits at 2 (c % 4) of lv's bytes
__attribute__((target("avx512f,avx512bw"))) inline __m512i q2_value512(__m512i lv, int c) {
  const int k = c % 4;
  return _mm512_and_si512(k ? _mm512_srli_epi16(lv, 2 * k) : lv, _mm512_set1_epi8(0x03));
}
// q5k: chunk c's (c < 8) high bit, bit c of each byte of hv, put above its nibble (16-bit shifts by at most 4: what
// crosses into the next byte lands in bits 0-3 or 5-7, masked away)
__attribute__((target("avx512f,avx512bw"))) inline __m512i q5_value512(__m512i nib, __m512i hv, int c) {
  const __m512i h = c < 4 ? _mm512_slli_epi16(hv, 4 - c) : c == 4 ? hv : _mm512_srli_epi16(hv, c - 4);
  return _mm512_ternarylogic_epi32(nib, h, _mm512_set1_epi8(0x10), 0xF8);  // nib | (h & 0x10)
}
template <int NT, int MODE, bool FULL, bool PF = true>
__attribute__((target("avx512f,avx512bw,avx512dq,avx512vnni"))) inline void mk512(
    const uint8_t* W, const ScaleT<MODE>* S, size_t moff, int n, const int8_t* const* X,
    const int32_t* const* XC, const float* const* XS, int ng, size_t pf, float* C) {
  const int vs = FULL ? 64 : 4 * n, gs = stride_vectors<MODE> * vs;  // bytes of a chunk vector, of a layout group
  const __mmask16 lanes = FULL ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
  const __m512i lo4 = _mm512_set1_epi8(0x0f);
  __m512 acc[NT];
  MOE_UNROLL for (int t = 0; t < NT; ++t) acc[t] = _mm512_setzero_ps();
  for (int g = 0; g < ng; ++g) {  // scale groups
    __m512i d[NT][2];  // two chains a dot product: half the latency
    MOE_UNROLL for (int t = 0; t < NT; ++t) d[t][0] = d[t][1] = _mm512_setzero_si512();
    __m512 qs[NT], qm[NT];  // q4k, q5k: the 256's sums of sc x dot and of m x activation sum
    if constexpr (k_mins(MODE))
      MOE_UNROLL for (int t = 0; t < NT; ++t) qs[t] = qm[t] = _mm512_setzero_ps();
    __m512i qi[NT], qn[NT];  // q6k, q3k, q2k, iq4xs: the 256's int32 sum of sc x dot; q2k: and of m x sum
    if constexpr (int_scaled<MODE>)
      MOE_UNROLL for (int t = 0; t < NT; ++t) qi[t] = qn[t] = _mm512_setzero_si512();
    MOE_UNROLL for (int h = 0; h < SPG<MODE>; ++h) {
      const int lg = g * SPG<MODE> + h;  // layout group
      __m512i u[8];
      const uint8_t* p = W + size_t(lg) * gs;
      if constexpr (MODE == Q3K || MODE == Q2K) {  // 2 vectors of low bit pairs (chunks 0-3, 4-7), q3k: 1 of high bits
        __m512i lv[3];
        MOE_UNROLL for (int k = 0; k < stride_vectors<MODE>; ++k) {
          if constexpr (FULL) {
            if constexpr (PF) _mm_prefetch(reinterpret_cast<const char*>(p + pf + 64 * k), _MM_HINT_T1);
            lv[k] = _mm512_loadu_si512(p + 64 * k);
          } else {
            lv[k] = _mm512_maskz_loadu_epi32(lanes, p + vs * k);
          }
        }
        MOE_UNROLL for (int c = 0; c < 8; ++c) {
          if constexpr (MODE == Q2K) u[c] = q2_value512(lv[c / 4], c);
          else u[c] = q3_value512(lv[c / 4], lv[2], c);
        }
      } else {
        __m512i hv[2];  // q6k: the high bits of chunks 0-3, 4-7; q5k: of all 8 in hv[0]
        if constexpr (MODE == Q6K || MODE == Q5K)
          MOE_UNROLL for (int k = 0; k < stride_vectors<MODE> - 4; ++k) {
            if constexpr (FULL) {
              if constexpr (PF) _mm_prefetch(reinterpret_cast<const char*>(p + pf + 64 * (4 + k)), _MM_HINT_T1);
              hv[k] = _mm512_loadu_si512(p + 64 * (4 + k));
            } else {
              hv[k] = _mm512_maskz_loadu_epi32(lanes, p + vs * (4 + k));
            }
          }
        MOE_UNROLL for (int v = 0; v < vectors<MODE>; ++v) {
          __m512i q;
          if constexpr (FULL) {
            if constexpr (PF) _mm_prefetch(reinterpret_cast<const char*>(p + pf + 64 * v), _MM_HINT_T1);
            q = _mm512_loadu_si512(p + 64 * v);
          } else {
            q = _mm512_maskz_loadu_epi32(lanes, p + vs * v);
          }
          if constexpr (MODE == Q6K) {
            u[v] = q6_value512(_mm512_and_si512(q, lo4), hv[0], v);
            u[v + 4] = q6_value512(_mm512_and_si512(_mm512_srli_epi16(q, 4), lo4), hv[1], v);
          } else if constexpr (MODE == Q5K) {
            u[v] = q5_value512(_mm512_and_si512(q, lo4), hv[0], v);
            u[v + 4] = q5_value512(_mm512_and_si512(_mm512_srli_epi16(q, 4), lo4), hv[0], v + 4);
          } else if constexpr (nibble<MODE>) {
            u[v] = decode512<MODE>(_mm512_and_si512(q, lo4));
            u[v + 4] = decode512<MODE>(_mm512_and_si512(_mm512_srli_epi16(q, 4), lo4));
          } else {
            u[v] = decode512<MODE>(q);
          }
        }
      }
      MOE_UNROLL for (int t = 0; t < NT; ++t) {
        const int32_t* xg = reinterpret_cast<const int32_t*>(X[t] + lg * G);
        MOE_UNROLL for (int c = 0; c < 4; ++c) {
          d[t][0] = _mm512_dpbusd_epi32(d[t][0], u[c], _mm512_set1_epi32(xg[c]));
          d[t][1] = _mm512_dpbusd_epi32(d[t][1], u[c + 4], _mm512_set1_epi32(xg[c + 4]));
        }
      }
      if constexpr (k_mins(MODE)) {  // this 32's 6-bit sc and m (a byte each, 16 rows side by side)
        const uint8_t* sg = S + size_t(g) * n * 24;
        const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
            _mm512_castsi512_si128(_mm512_maskz_loadu_epi8(__mmask64(lanes), sg + 8 * n + h * n))));
        const __m512 mn = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
            _mm512_castsi512_si128(_mm512_maskz_loadu_epi8(__mmask64(lanes), sg + 16 * n + h * n))));
        MOE_UNROLL for (int t = 0; t < NT; ++t) {
          qs[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(d[t][0], d[t][1])), sc, qs[t]);
          qm[t] = _mm512_fmadd_ps(mn, _mm512_set1_ps(XS[t][g * SPG<MODE> + h]), qm[t]);
          d[t][0] = d[t][1] = _mm512_setzero_si512();
        }
      }
      if constexpr (MODE == IQXS) {  // this 32's dot product less its excess, times its sc
        const uint8_t* sc = S + size_t(g) * n * SGE<MODE> + 4 * n + h * n;
        const __m512i scv = _mm512_cvtepi8_epi32(_mm512_castsi512_si128(_mm512_maskz_loadu_epi8(__mmask64(lanes), sc)));
        MOE_UNROLL for (int t = 0; t < NT; ++t) {
          const __m512i dd = _mm512_sub_epi32(_mm512_add_epi32(d[t][0], d[t][1]), _mm512_set1_epi32(XC[t][lg]));
          qi[t] = _mm512_add_epi32(qi[t], _mm512_mullo_epi32(dd, scv));
          d[t][0] = d[t][1] = _mm512_setzero_si512();
        }
      }
      if constexpr (sub16(MODE)) {  // this 32's two 16s: less the excess x their activation sums, times their sc
        const uint8_t* sc = S + size_t(g) * n * SGE<MODE> + sc_at<MODE> * n + 2 * h * n;
        if constexpr (paired16(MODE)) {  // the rows' sub-scale pairs as int16 pairs: scp with the dots, mp the sums
          __m512i scp, mp;
          if constexpr (MODE == Q2K) {  // stored as pairs of (sc | m << 4) bytes
            const __m512i w = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(
                _mm512_maskz_loadu_epi8(FULL ? ~__mmask64(0) : (__mmask64(1) << 2 * n) - 1, sc)));
            scp = _mm512_and_si512(w, _mm512_set1_epi16(15)), mp = _mm512_srli_epi16(w, 4);
          } else {  // q3k: the two 16s' int8 sc, n rows each, interleaved
            const __m128i b0 = _mm512_castsi512_si128(_mm512_maskz_loadu_epi8(__mmask64(lanes), sc));
            const __m128i b1 = _mm512_castsi512_si128(_mm512_maskz_loadu_epi8(__mmask64(lanes), sc + n));
            scp = mp = _mm512_cvtepi8_epi16(
                _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_unpacklo_epi8(b0, b1)), _mm_unpackhi_epi8(b0, b1), 1));
          }
          MOE_UNROLL for (int t = 0; t < NT; ++t) {
            const int32_t* xc = XC[t] + 2 * lg;
            const __m512i dp = _mm512_mask_blend_epi16(0xAAAAAAAA, d[t][0], _mm512_slli_epi32(d[t][1], 16));
            qi[t] = _mm512_dpwssd_epi32(qi[t], dp, scp);
            qn[t] = _mm512_dpwssd_epi32(qn[t], mp, _mm512_set1_epi32(pair_of(xc[0], xc[1])));
            d[t][0] = d[t][1] = _mm512_setzero_si512();
          }
          continue;
        }
        const __m512i sc0 = _mm512_cvtepi8_epi32(_mm512_castsi512_si128(_mm512_maskz_loadu_epi8(__mmask64(lanes), sc)));
        const __m512i sc1 = _mm512_cvtepi8_epi32(_mm512_castsi512_si128(_mm512_maskz_loadu_epi8(__mmask64(lanes), sc + n)));
        MOE_UNROLL for (int t = 0; t < NT; ++t) {
          const int32_t* xc = XC[t] + 2 * lg;
          const __m512i s0 = _mm512_sub_epi32(d[t][0], _mm512_set1_epi32(xc[0]));
          const __m512i s1 = _mm512_sub_epi32(d[t][1], _mm512_set1_epi32(xc[1]));
          qi[t] = _mm512_add_epi32(qi[t], _mm512_add_epi32(_mm512_mullo_epi32(s0, sc0), _mm512_mullo_epi32(s1, sc1)));
          d[t][0] = d[t][1] = _mm512_setzero_si512();
        }
      }
    }
    if constexpr (int_scaled<MODE>) {  // the 256's d (q2k: and dmin)
      const __m512 dv = _mm512_maskz_loadu_ps(lanes, S + size_t(g) * n * SGE<MODE>);
      if constexpr (MODE == Q3K)  // less the excess x the activation sums
        MOE_UNROLL for (int t = 0; t < NT; ++t) qi[t] = _mm512_sub_epi32(qi[t], qn[t]);
      MOE_UNROLL for (int t = 0; t < NT; ++t)
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(qi[t]), dv, acc[t]);
      if constexpr (MODE == Q2K) {
        const __m512 dminv = _mm512_maskz_loadu_ps(lanes, S + size_t(g) * n * SGE<MODE> + 4 * n);
        MOE_UNROLL for (int t = 0; t < NT; ++t)
          acc[t] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(qn[t]), dminv, acc[t]);
      }
      continue;
    }
    if constexpr (k_mins(MODE)) {  // the 256's d and dmin
      const uint8_t* sg = S + size_t(g) * n * 24;
      const __m512 dv = _mm512_maskz_loadu_ps(lanes, sg), dminv = _mm512_maskz_loadu_ps(lanes, sg + 4 * n);
      MOE_UNROLL for (int t = 0; t < NT; ++t) {
        acc[t] = _mm512_fmadd_ps(qs[t], dv, acc[t]);
        acc[t] = _mm512_fnmadd_ps(qm[t], dminv, acc[t]);
      }
      continue;
    }
    const __m512 sv = scales512<MODE>(S + size_t(g) * n, lanes);
    __m512 mv = sv;
    if constexpr (MODE == ASYM) mv = _mm512_maskz_loadu_ps(lanes, S + moff + size_t(g) * n);
    MOE_UNROLL for (int t = 0; t < NT; ++t) {
      __m512i dd = _mm512_add_epi32(d[t][0], d[t][1]);
      if constexpr (excess<MODE, false> != 0) dd = _mm512_sub_epi32(dd, _mm512_set1_epi32(XC[t][g]));
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dd), sv, acc[t]);
      if constexpr (MODE == ASYM) acc[t] = _mm512_fnmadd_ps(mv, _mm512_set1_ps(XS[t][g]), acc[t]);
    }
  }
  MOE_UNROLL for (int t = 0; t < NT; ++t) _mm512_storeu_ps(C + t * BLK, acc[t]);
}

// ---- 256-bit (AVX2, AVX-VNNI): a unit is half a block, 8 rows (its lanes of each chunk vector) ----
template <class Dot>
constexpr bool is_vnni = std::is_same_v<Dot, VnniDot>;
template <class Dot, int MODE>
constexpr bool signed_w = !is_vnni<Dot> && (MODE == IQ || MODE == IQXS || MODE == Q8);  // AVX2: the sign trick
template <class Dot, int MODE>
constexpr bool mx_small = !is_vnni<Dot> && MODE == MX;  // AVX2: mxfp4's values + 12, as nibbles are
template <class Dot, int MODE>
constexpr int excess256 = mx_small<Dot, MODE> ? MX4_SMALL : excess<MODE, signed_w<Dot, MODE>>;
// chunks of int16 pairs summed before a widening: nibbles (<= 15) 8 (8 x 2 x 15 x 128 fits int16), mxfp4's values
// + 12 (<= 24) and q5k's 5 bits (<= 31: 4 x 2 x 31 x 128 < 2^15) 4
template <int MODE>
constexpr int int16_run = MODE == MX || MODE == Q5K ? 4 : 8;

// (void functions with out-parameters: these templates have no target of their own, and the entry's flatten
// inlines them)
template <class Dot, int MODE>
inline void decode256(__m256i& q, __m256i lut) {
  if constexpr (looked_up(MODE)) q = Ymm::lookup(lut, q);
  else if constexpr (MODE == Q8 && !signed_w<Dot, MODE>) q = Ymm::xor80(q);
}
// 32 weights' dot product per lane, added to d: u[c] (weights) with chunk c of the activations broadcast
template <class Dot, int MODE>
inline void group_dot(const __m256i (&u)[8], const int32_t* xg, __m256i& d) {
  if constexpr (is_vnni<Dot>) {
    __m256i d1 = Ymm::zero_si();
    MOE_UNROLL for (int c = 0; c < 4; ++c) {
      d = Dot::dot(d, u[c], Ymm::set1_epi32(xg[c]));
      d1 = Dot::dot(d1, u[c + 4], Ymm::set1_epi32(xg[c + 4]));
    }
    d = Ymm::add_epi32(d, d1);
  } else if constexpr (signed_w<Dot, MODE>) {  // Avx2Dot::dot(acc, q, w): q the activations, w signed weights
    __m256i d1 = Ymm::zero_si();
    MOE_UNROLL for (int c = 0; c < 4; ++c) {
      d = Dot::dot(d, Ymm::set1_epi32(xg[c]), u[c]);
      d1 = Dot::dot(d1, Ymm::set1_epi32(xg[c + 4]), u[c + 4]);
    }
    d = Ymm::add_epi32(d, d1);
  } else {  // u8 weights x s8 activations in int16 pairs, int16_run chunks summed before a widening
    constexpr int run = int16_run<MODE>;
    MOE_UNROLL for (int c0 = 0; c0 < 8; c0 += run) {
      __m256i p = Dot::pairs(u[c0], Ymm::set1_epi32(xg[c0]));
      MOE_UNROLL for (int c = c0 + 1; c < c0 + run; ++c) p = Ymm::add_epi16(p, Dot::pairs(u[c], Ymm::set1_epi32(xg[c])));
      d = Ymm::add_epi32(d, Dot::widen(p));
    }
  }
}
// q6k, q3k, q2k: a 32's two 16s' dot products apart, d0 (chunks 0-3) and d1 (4-7); on vpmaddubsw a run of chunks'
// int16 pairs summed before a widening: q6k's 2 (2 x 2 x 63 x 128 fits int16), q3k's and q2k's 4 (4 x 2 x 7 x 128)
template <class Dot, int MODE>
inline void sub16_dots(const __m256i (&u)[8], const int32_t* xg, __m256i& d0, __m256i& d1) {
  if constexpr (is_vnni<Dot>) {
    MOE_UNROLL for (int c = 0; c < 4; ++c) {
      d0 = Dot::dot(d0, u[c], Ymm::set1_epi32(xg[c]));
      d1 = Dot::dot(d1, u[c + 4], Ymm::set1_epi32(xg[c + 4]));
    }
  } else {
    constexpr int run = MODE == Q6K ? 2 : 4;
    MOE_UNROLL for (int c0 = 0; c0 < 4; c0 += run) {
      __m256i p0 = Dot::pairs(u[c0], Ymm::set1_epi32(xg[c0])), p1 = Dot::pairs(u[c0 + 4], Ymm::set1_epi32(xg[c0 + 4]));
      MOE_UNROLL for (int c = c0 + 1; c < c0 + run; ++c) {
        p0 = Ymm::add_epi16(p0, Dot::pairs(u[c], Ymm::set1_epi32(xg[c])));
        p1 = Ymm::add_epi16(p1, Dot::pairs(u[c + 4], Ymm::set1_epi32(xg[c + 4])));
      }
      d0 = Ymm::add_epi32(d0, Dot::widen(p0)), d1 = Ymm::add_epi32(d1, Dot::widen(p1));
    }
  }
}
template <class Dot, int MODE, bool FULL>
inline void scales256(const ScaleT<MODE>* p, int m, __m256& s) {  // a half block's m scales of one group
  if constexpr (MODE == MX) {
    s = Ymm::mx_scales8(p, FULL ? 8 : m);
  } else if constexpr (fielded(MODE)) {  // read field by field instead
    s = Ymm::zero_ps();
  } else {
    s = FULL ? Ymm::loadu_ps(p) : Ymm::loadu_first_ps(p, m);
  }
}
template <class Dot, int NT, int MODE, bool FULL>
inline void mk256(const uint8_t* W, const ScaleT<MODE>* Sb, int lane0, size_t moff, int n, int m,
                  const int8_t* const* X, const int32_t* const* XC, const float* const* XS, int ng, size_t pf, float* C) {
  const ScaleT<MODE>* S = Sb + lane0;  // the half's scales (q4k: its fields at their own offsets from Sb)
  const int vs = FULL ? 64 : 4 * n, gs = stride_vectors<MODE> * vs;
  const __m256i lut = signed_w<Dot, MODE> ? Ymm::bytes16(lut_s8<MODE>())
                      : mx_small<Dot, MODE> ? Ymm::bytes16(MX4_U12)
                                            : Ymm::bytes16(reinterpret_cast<const int8_t*>(lut_u8<MODE>()));
  __m256 acc[NT];
  MOE_UNROLL for (int t = 0; t < NT; ++t) acc[t] = Ymm::zero_ps();
  for (int g = 0; g < ng; ++g) {
    __m256i d[NT];
    MOE_UNROLL for (int t = 0; t < NT; ++t) d[t] = Ymm::zero_si();
    __m256 qs[NT], qm[NT];  // q4k, q5k: as mk512's
    if constexpr (k_mins(MODE))
      MOE_UNROLL for (int t = 0; t < NT; ++t) qs[t] = qm[t] = Ymm::zero_ps();
    __m256i qi[NT], qn[NT];  // q6k, q3k, q2k, iq4xs: as mk512's
    if constexpr (int_scaled<MODE>)
      MOE_UNROLL for (int t = 0; t < NT; ++t) qi[t] = qn[t] = Ymm::zero_si();
    MOE_UNROLL for (int h = 0; h < SPG<MODE>; ++h) {
      const int lg = g * SPG<MODE> + h;
      __m256i u[8];
      const uint8_t* p = W + size_t(lg) * gs;
      if constexpr (MODE == Q3K || MODE == Q2K) {  // as mk512's
        __m256i lv[3];
        MOE_UNROLL for (int k = 0; k < stride_vectors<MODE>; ++k) {
          if constexpr (FULL) {
            _mm_prefetch(reinterpret_cast<const char*>(p + pf + 64 * k), _MM_HINT_T1);
            lv[k] = Ymm::load(p + 64 * k);
          } else {
            lv[k] = Ymm::load_first_epi32(p + vs * k, m);
          }
        }
        MOE_UNROLL for (int c = 0; c < 8; ++c) {
          if constexpr (MODE == Q2K) u[c] = Ymm::q2_value(lv[c / 4], c);
          else u[c] = Ymm::q3_value(lv[c / 4], lv[2], c);
        }
      } else {
        __m256i hv[2];  // q6k: the high bits of chunks 0-3, 4-7; q5k: of all 8 in hv[0]
        if constexpr (MODE == Q6K || MODE == Q5K)
          MOE_UNROLL for (int k = 0; k < stride_vectors<MODE> - 4; ++k) {
            if constexpr (FULL) {
              _mm_prefetch(reinterpret_cast<const char*>(p + pf + 64 * (4 + k)), _MM_HINT_T1);
              hv[k] = Ymm::load(p + 64 * (4 + k));
            } else {
              hv[k] = Ymm::load_first_epi32(p + vs * (4 + k), m);
            }
          }
        MOE_UNROLL for (int v = 0; v < vectors<MODE>; ++v) {
          __m256i q;
          if constexpr (FULL) {
            _mm_prefetch(reinterpret_cast<const char*>(p + pf + 64 * v), _MM_HINT_T1);
            q = Ymm::load(p + 64 * v);
          } else {
            q = Ymm::load_first_epi32(p + vs * v, m);
          }
          if constexpr (MODE == Q6K) {
            Ymm::split_nibbles(q, u[v], u[v + 4]);
            u[v] = Ymm::q6_value(u[v], hv[0], v), u[v + 4] = Ymm::q6_value(u[v + 4], hv[1], v);
          } else if constexpr (MODE == Q5K) {
            Ymm::split_nibbles(q, u[v], u[v + 4]);
            u[v] = Ymm::q5_value(u[v], hv[0], v), u[v + 4] = Ymm::q5_value(u[v + 4], hv[0], v + 4);
          } else if constexpr (nibble<MODE>) {
            Ymm::split_nibbles(q, u[v], u[v + 4]);
            decode256<Dot, MODE>(u[v], lut), decode256<Dot, MODE>(u[v + 4], lut);
          } else {
            u[v] = q;
            decode256<Dot, MODE>(u[v], lut);
          }
        }
      }
      if constexpr (sub16(MODE)) {  // as mk512's
        const uint8_t* sc = Sb + size_t(g) * n * SGE<MODE> + sc_at<MODE> * n + 2 * h * n;
        if constexpr (paired16(MODE)) {  // as mk512's, on vpmaddwd
          __m256i scp, mp;
          if constexpr (MODE == Q2K) Ymm::q2_scales(sc + 2 * lane0, m, scp, mp);
          else scp = mp = Ymm::s8_pairs(sc + lane0, sc + n + lane0, m);
          MOE_UNROLL for (int t = 0; t < NT; ++t) {
            __m256i d0 = Ymm::zero_si(), d1 = Ymm::zero_si();
            sub16_dots<Dot, MODE>(u, reinterpret_cast<const int32_t*>(X[t] + lg * G), d0, d1);
            const int32_t* xc = XC[t] + 2 * lg;
            qi[t] = Ymm::add_epi32(qi[t], Ymm::madd_epi16(Ymm::pair16(d0, d1), scp));
            qn[t] = Ymm::add_epi32(qn[t], Ymm::madd_epi16(mp, Ymm::set1_epi32(pair_of(xc[0], xc[1]))));
          }
          continue;
        }
        const __m256i sc0 = Ymm::s8_to_epi32(sc + lane0, m), sc1 = Ymm::s8_to_epi32(sc + n + lane0, m);
        MOE_UNROLL for (int t = 0; t < NT; ++t) {
          __m256i d0 = Ymm::zero_si(), d1 = Ymm::zero_si();
          sub16_dots<Dot, MODE>(u, reinterpret_cast<const int32_t*>(X[t] + lg * G), d0, d1);
          const int32_t* xc = XC[t] + 2 * lg;
          d0 = Ymm::sub_epi32(d0, Ymm::set1_epi32(xc[0])), d1 = Ymm::sub_epi32(d1, Ymm::set1_epi32(xc[1]));
          qi[t] = Ymm::add_epi32(qi[t], Ymm::add_epi32(Ymm::mullo_epi32(d0, sc0), Ymm::mullo_epi32(d1, sc1)));
        }
        continue;
      }
      MOE_UNROLL for (int t = 0; t < NT; ++t)
        group_dot<Dot, MODE>(u, reinterpret_cast<const int32_t*>(X[t] + lg * G), d[t]);
      if constexpr (MODE == IQXS) {  // as mk512's
        const __m256i sc = Ymm::s8_to_epi32(Sb + size_t(g) * n * SGE<MODE> + 4 * n + h * n + lane0, m);
        MOE_UNROLL for (int t = 0; t < NT; ++t) {
          qi[t] = Ymm::add_epi32(qi[t], Ymm::mullo_epi32(Ymm::sub_epi32(d[t], Ymm::set1_epi32(XC[t][lg])), sc));
          d[t] = Ymm::zero_si();
        }
        continue;
      }
      if constexpr (k_mins(MODE)) {
        const uint8_t* sg = Sb + size_t(g) * n * 24;
        const __m256 sc = Ymm::u8_to_ps(sg + 8 * n + h * n + lane0, m), mn = Ymm::u8_to_ps(sg + 16 * n + h * n + lane0, m);
        MOE_UNROLL for (int t = 0; t < NT; ++t) {
          qs[t] = Ymm::fmadd(Ymm::to_ps(d[t]), sc, qs[t]);
          qm[t] = Ymm::fmadd(mn, Ymm::set1(XS[t][lg]), qm[t]);
          d[t] = Ymm::zero_si();
        }
      }
    }
    if constexpr (int_scaled<MODE>) {
      const float* dp = reinterpret_cast<const float*>(Sb + size_t(g) * n * SGE<MODE>) + lane0;
      const __m256 dv = FULL ? Ymm::loadu_ps(dp) : Ymm::loadu_first_ps(dp, m);
      if constexpr (MODE == Q3K)
        MOE_UNROLL for (int t = 0; t < NT; ++t) qi[t] = Ymm::sub_epi32(qi[t], qn[t]);
      MOE_UNROLL for (int t = 0; t < NT; ++t) acc[t] = Ymm::fmadd(Ymm::to_ps(qi[t]), dv, acc[t]);
      if constexpr (MODE == Q2K) {
        const float* dminp = reinterpret_cast<const float*>(Sb + size_t(g) * n * SGE<MODE> + 4 * n) + lane0;
        const __m256 dminv = FULL ? Ymm::loadu_ps(dminp) : Ymm::loadu_first_ps(dminp, m);
        MOE_UNROLL for (int t = 0; t < NT; ++t) acc[t] = Ymm::fnmadd(Ymm::to_ps(qn[t]), dminv, acc[t]);
      }
      continue;
    }
    if constexpr (k_mins(MODE)) {
      const uint8_t* sg = Sb + size_t(g) * n * 24;
      const float* dp = reinterpret_cast<const float*>(sg) + lane0;
      const float* dminp = reinterpret_cast<const float*>(sg + 4 * n) + lane0;
      const __m256 dv = FULL ? Ymm::loadu_ps(dp) : Ymm::loadu_first_ps(dp, m);
      const __m256 dminv = FULL ? Ymm::loadu_ps(dminp) : Ymm::loadu_first_ps(dminp, m);
      MOE_UNROLL for (int t = 0; t < NT; ++t) acc[t] = Ymm::fnmadd(qm[t], dminv, Ymm::fmadd(qs[t], dv, acc[t]));
      continue;
    }
    __m256 sv, mv;
    scales256<Dot, MODE, FULL>(S + size_t(g) * n, m, sv);
    if constexpr (MODE == ASYM)
      mv = FULL ? Ymm::loadu_ps(S + moff + size_t(g) * n) : Ymm::loadu_first_ps(S + moff + size_t(g) * n, m);
    MOE_UNROLL for (int t = 0; t < NT; ++t) {
      if constexpr (excess256<Dot, MODE> != 0) d[t] = Ymm::sub_epi32(d[t], Ymm::set1_epi32(XC[t][g]));
      acc[t] = Ymm::fmadd(Ymm::to_ps(d[t]), sv, acc[t]);
      if constexpr (MODE == ASYM) acc[t] = Ymm::fnmadd(mv, Ymm::set1(XS[t][g]), acc[t]);
    }
  }
  MOE_UNROLL for (int t = 0; t < NT; ++t) Ymm::storeu_ps(C + t * 8, acc[t]);
}

inline bool pair_off() {  // MOE_AVX2_PAIR=0: two mk256 calls instead of mk256_pair (A/B runs)
  static const bool off = [] {
    const char* v = std::getenv("MOE_AVX2_PAIR");
    return v && v[0] == '0';
  }();
  return off;
}
template <class Dot, int MODE>
constexpr bool paired256 = !is_vnni<Dot> && !signed_w<Dot, MODE> && nibble<MODE> && !k_mins(MODE) && !sub16(MODE);
// AVX2 decode (one token) of a whole block's two halves at once, for the nibble formats on vpmaddubsw (int4,
// int4g32, uint4g32, mxfp4): each broadcast activation chunk serves both halves' 8 rows, half the broadcasts
// of two mk256 calls (on a Zen 1 the 256-bit path is instruction-bound, docs/performance/kernels.md). The same integer sums
// as mk256's (reordered, exact), the same float steps: bit for bit its result. C [16].
template <class Dot, int MODE>
inline void mk256_pair(const uint8_t* W, const ScaleT<MODE>* S, size_t moff, const int8_t* X, const int32_t* XC,
                       const float* XS, int ng, size_t pf, float* C) {
  constexpr int n = BLK, gs = 4 * 64;  // a full block: 4 chunk vectors of 64 bytes a layout group
  const __m256i lut = Ymm::bytes16(mx_small<Dot, MODE> ? MX4_U12 : reinterpret_cast<const int8_t*>(lut_u8<MODE>()));
  __m256 acc[2] = {Ymm::zero_ps(), Ymm::zero_ps()};
  for (int g = 0; g < ng; ++g) {
    __m256i d[2] = {Ymm::zero_si(), Ymm::zero_si()};
    MOE_UNROLL for (int h = 0; h < SPG<MODE>; ++h) {
      const int lg = g * SPG<MODE> + h;
      const uint8_t* p = W + size_t(lg) * gs;
      const int32_t* xg = reinterpret_cast<const int32_t*>(X + lg * G);
      __m256i plo[2], phi[2];  // per half: chunks 0-3 (low nibbles), 4-7 (high), int16 pairs
      MOE_UNROLL for (int v = 0; v < 4; ++v) {
        _mm_prefetch(reinterpret_cast<const char*>(p + pf + 64 * v), _MM_HINT_T1);
        const __m256i xl = Ymm::set1_epi32(xg[v]), xh = Ymm::set1_epi32(xg[v + 4]);
        MOE_UNROLL for (int b = 0; b < 2; ++b) {
          __m256i lo, hi;
          Ymm::split_nibbles(Ymm::load(p + 64 * v + 32 * b), lo, hi);
          decode256<Dot, MODE>(lo, lut), decode256<Dot, MODE>(hi, lut);
          const __m256i ql = Dot::pairs(lo, xl), qh = Dot::pairs(hi, xh);
          plo[b] = v ? Ymm::add_epi16(plo[b], ql) : ql;
          phi[b] = v ? Ymm::add_epi16(phi[b], qh) : qh;
        }
      }
      MOE_UNROLL for (int b = 0; b < 2; ++b) {
        if constexpr (int16_run<MODE> == 4)
          d[b] = Ymm::add_epi32(d[b], Ymm::add_epi32(Dot::widen(plo[b]), Dot::widen(phi[b])));
        else  // all 8 in int16
          d[b] = Ymm::add_epi32(d[b], Dot::widen(Ymm::add_epi16(plo[b], phi[b])));
      }
    }
    MOE_UNROLL for (int b = 0; b < 2; ++b) {
      __m256 sv;
      scales256<Dot, MODE, true>(S + size_t(g) * n + 8 * b, 8, sv);
      if constexpr (excess256<Dot, MODE> != 0) d[b] = Ymm::sub_epi32(d[b], Ymm::set1_epi32(XC[g]));
      acc[b] = Ymm::fmadd(Ymm::to_ps(d[b]), sv, acc[b]);
      if constexpr (MODE == ASYM) acc[b] = Ymm::fnmadd(Ymm::loadu_ps(S + moff + size_t(g) * n + 8 * b), Ymm::set1(XS[g]), acc[b]);
    }
  }
  Ymm::storeu_ps(C, acc[0]);
  Ymm::storeu_ps(C + 8, acc[1]);
}

// rows [r0, r1) of expert e: r0 on a block start, r1 on one or the matrix's end. LANES: rows a micro-kernel
// unit (16: AVX-512, a block; 8: the 256-bit paths, half a block). mk(block's pointers...) per token tile ->
// the units it computed.
template <int MODE>
inline size_t row_bytes(int Kp) {
  return MODE == Q8 ? size_t(Kp) : MODE == Q6K ? size_t(Kp) / 4 * 3 : MODE == Q5K ? size_t(Kp) / 8 * 5
       : MODE == Q3K ? size_t(Kp) / 8 * 3 : MODE == Q2K ? size_t(Kp) / 4 : size_t(Kp) / 2;
}
template <int MODE, int EXCESS, int LANES, int TBI, class MK>
inline void drive_blocked(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy, MK&& mk) {
  MOE_CHECK(r0 % BLK == 0 && (r1 % BLK == 0 || r1 == m.rows), "row-blocked formats' rows are cut on 16-row blocks");
  MOE_CHECK(m.Kp % (G * SPG<MODE>) == 0, "the super-blocked formats' rows are padded to a multiple of 256");
  const int ng = m.Kp / (G * SPG<MODE>);  // scale groups a row
  const size_t ldw = row_bytes<MODE>(m.Kp);
  const size_t pf = tuning().pf_bytes;
  const uint8_t* We = static_cast<const uint8_t*>(m.w) + size_t(e) * m.rows * ldw;
  const size_t moff = MODE == ASYM ? size_t(m.rows) * ng : 0;  // an expert's mins after its scales
  const ScaleT<MODE>* Se =
      reinterpret_cast<const ScaleT<MODE>*>(m.scale) + size_t(e) * (size_t(m.rows) * ng * SGE<MODE> + moff);
  Prepared& p = thread_scratch<Prepared>();
  // the activations' sums per scale group times the excess; q4k's and q5k's mins: their sums per 32; q6k's excess per 16
  const int per = k_mins(MODE) || MODE == IQXS ? G : sub16(MODE) ? Q6_SUB : G * SPG<MODE>;
  prepare(reinterpret_cast<const uint8_t* const*>(x.rows), ns, m.Kp, per, EXCESS, has_mins<MODE>, p);
  for (int r = r0; r < r1; r += BLK) {
    const int n = std::min(BLK, m.rows - r);
    const uint8_t* wb = We + size_t(r) * ldw;
    const ScaleT<MODE>* sb = Se + size_t(r) * ng * SGE<MODE>;
    for (int s = 0; s < ns; s += TBI) {
      const int nt = std::min(TBI, ns - s);
      float C[TBI * BLK];
      const int units = mk(wb, sb, moff, n, p.xp.data() + s, p.cp.data() + s, p.sp.data() + s, ng, pf, nt, C);
      const int rows = std::min(units * LANES, r1 - r);
      for (int t = 0; t < nt; ++t)
        for (int j = 0; j < rows; ++j) Y[size_t(s + t) * ldy + r + j] = C[t * units * LANES + j] * x.scale[s + t];
    }
  }
}

// AVX-512 at one token: a block's whole stream at a time, without software prefetch (the hardware prefetcher
// follows one sequential stream a task best; two blocks side by side, prefetching 32 KiB ahead, were 4-17% slower),
// except q5k's and q6k's (their bit vectors make more work a byte: prefetching is 3-4% faster there, docs/performance/kernels.md)
template <int MODE>
constexpr bool decode_prefetch = MODE == Q5K || MODE == Q6K;
// AVX-512's unit is one block -> 1, C [nt, 16]
template <int MODE>
inline int units512(const uint8_t* wb, const ScaleT<MODE>* sb, size_t moff, int n, const int8_t* const* X,
                    const int32_t* const* XC, const float* const* XS, int ng, size_t pf, int nt, float* C) {
  if (n < BLK)
    with_tokens<4>(nt, [&](auto NT) { mk512<decltype(NT)::value, MODE, false>(wb, sb, moff, n, X, XC, XS, ng, pf, C); });
  else if (nt == 1)
    mk512<1, MODE, true, decode_prefetch<MODE>>(wb, sb, moff, BLK, X, XC, XS, ng, pf, C);
  else
    with_tokens<4>(nt, [&](auto NT) { mk512<decltype(NT)::value, MODE, true>(wb, sb, moff, BLK, X, XC, XS, ng, pf, C); });
  return 1;
}

template <int MODE>
void blocked_avx512(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy) {
  drive_blocked<MODE, excess<MODE, false>, BLK, 4>(m, e, r0, r1, x, ns, Y, ldy,
                                     [&](const uint8_t* wb, const ScaleT<MODE>* sb, size_t moff, int n,
                                         const int8_t* const* X, const int32_t* const* XC, const float* const* XS,
                                         int ng, size_t pf, int nt, float* C) {
                                       return units512<MODE>(wb, sb, moff, n, X, XC, XS, ng, pf, nt, C);
                                     });
}

// ---- AMX (prefill): the signed formats' whole blocks on tiles, the tokens the A operand ----
// A block's 16 rows x one scale group (int4: 64 weights; int4g32, iq4nl, mxfp4, int8g32: 32) are exactly one B
// tile of TDPBSSD: tile row c holds, for each of the 16 rows, its 4 weights of chunk c, which is the layout's
// chunk vector with its nibbles decoded (int8g32: as stored). So a block is decoded once into s8 tiles (q - 8, or
// the grid's signed value: no excess to take out) and serves every 16-token tile of the call; the tokens' s8 rows
// are the A operand as they are (16 rows, Kp apart). Each group's 16 x 16 int32 product leaves its tile for the group's scale: the
// same cvt and FMA per group, in the same order, as the AVX-512 kernel, so the results are its own bit for bit.
// q6k: its 16s (each with its sc) are the products, K = 16: a 32's decoded chunks 0-3 are one B tile, 4-7 the next;
// each 16 x 16 int32 product times its sc is summed in int32 over the 256 and applied with d: the AVX-512 kernel's
// integers (its dot products less the excess are these exact signed sums) and its one FMA per 256.
template <int MODE>
constexpr bool amx_tiled = MODE == INT4 || MODE == G32 || MODE == IQ || MODE == MX || MODE == Q8 || MODE == Q6K ||
                          MODE == IQXS;
template <int MODE>
constexpr int TK = MODE == Q6K ? Q6_SUB : MODE == IQXS ? G : G * SPG<MODE>;  // the K of one tile product: a scale
                                                                               // group's; q6k's 16, iq4xs's 32
template <int MODE>
constexpr size_t row_scales(int Kp) { return size_t(Kp) / (G * SPG<MODE>) * SGE<MODE>; }  // scale elements a row

// nibbles -> their signed values: q - 8, or the grid's
template <int MODE>
__attribute__((target("avx512f,avx512bw"))) inline __m512i nibble_value(__m512i q, __m512i lut) {
  if constexpr (looked_up(MODE)) return _mm512_shuffle_epi8(lut, q);
  else return _mm512_sub_epi8(q, _mm512_set1_epi8(8));
}
// the block's scale group g as a B tile (TK / 4 rows of 64 s8); int8g32's bytes already are one, copied; q6k: g is a
// layout group, its two tiles (u - 32)
template <int MODE>
__attribute__((target("avx512f,avx512bw"))) inline void unpack_tile(const uint8_t* wb, int g, int8_t* tile, size_t pf) {
  if constexpr (MODE == Q6K) {
    const uint8_t* p = wb + size_t(g) * 6 * 64;
    MOE_UNROLL for (int v = 0; v < 6; ++v) _mm_prefetch(reinterpret_cast<const char*>(p + pf + 64 * v), _MM_HINT_T0);
    const __m512i lo4 = _mm512_set1_epi8(0x0f), h0 = _mm512_loadu_si512(p + 256), h1 = _mm512_loadu_si512(p + 320);
    MOE_UNROLL for (int v = 0; v < 4; ++v) {
      const __m512i q = _mm512_loadu_si512(p + 64 * v);
      const __m512i lo = _mm512_and_si512(q, lo4), hi = _mm512_and_si512(_mm512_srli_epi16(q, 4), lo4);
      _mm512_store_si512(tile + v * 64, _mm512_sub_epi8(q6_value512(lo, h0, v), _mm512_set1_epi8(32)));
      _mm512_store_si512(tile + (v + 4) * 64, _mm512_sub_epi8(q6_value512(hi, h1, v), _mm512_set1_epi8(32)));
    }
    return;
  }
  if constexpr (MODE == Q8) {
    MOE_UNROLL for (int v = 0; v < 8; ++v) {
      const uint8_t* p = wb + size_t(g) * 8 * 64 + 64 * v;
      _mm_prefetch(reinterpret_cast<const char*>(p + pf), _MM_HINT_T0);
      _mm512_store_si512(tile + v * 64, _mm512_loadu_si512(p));
    }
    return;
  }
  const __m512i lo4 = _mm512_set1_epi8(0x0f);
  const __m512i lut = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(lut_s8<MODE>())));
  constexpr int lgs = TK<MODE> / G;  // layout groups a tile
  MOE_UNROLL for (int h = 0; h < lgs; ++h)
    MOE_UNROLL for (int v = 0; v < 4; ++v) {
      const uint8_t* p = wb + size_t(lgs * g + h) * 4 * 64 + 64 * v;
      _mm_prefetch(reinterpret_cast<const char*>(p + pf), _MM_HINT_T0);
      const __m512i q = _mm512_loadu_si512(p);
      _mm512_store_si512(tile + (8 * h + v) * 64, nibble_value<MODE>(_mm512_and_si512(q, lo4), lut));
      _mm512_store_si512(tile + (8 * h + v + 4) * 64,
                         nibble_value<MODE>(_mm512_and_si512(_mm512_srli_epi16(q, 4), lo4), lut));
    }
}

// C tile c = A x B, TDPBSSD: C[t][j] = sum over k < K of A[t][k] * B[k / 4][4 j + k % 4], K the configured
// width of A (amx_tiles_begin; tiles c, 4 + c, 6 + c; GCC's tile intrinsics paste their tile numbers into the
// assembly: literals only)
#define MOE_TILE_ISSUE_S8(c, a, b, A, lda, B) \
  do {                                        \
    _tile_zero(c);                            \
    _tile_loadd(a, A, lda);                   \
    _tile_loadd(b, B, 64);                    \
    _tile_dpbssd(c, a, b);                    \
  } while (0)
__attribute__((target("amx-tile,amx-int8"), always_inline)) inline void tile_issue_s8_0(const int8_t* A, size_t lda, const int8_t* B) {
  MOE_TILE_ISSUE_S8(0, 4, 6, A, lda, B);
}
__attribute__((target("amx-tile,amx-int8"), always_inline)) inline void tile_issue_s8_1(const int8_t* A, size_t lda, const int8_t* B) {
  MOE_TILE_ISSUE_S8(1, 5, 7, A, lda, B);
}
#undef MOE_TILE_ISSUE_S8
__attribute__((target("amx-tile"), always_inline)) inline void tile_store_0(int32_t* C) { _tile_stored(0, C, 64); }
__attribute__((target("amx-tile"), always_inline)) inline void tile_store_1(int32_t* C) { _tile_stored(1, C, 64); }
// the same by the instruction's definition (tests on machines without AMX)
inline void tile_dot_s8_emulated(const int8_t* A, size_t lda, const int8_t* B, int K, int32_t* C) {
  for (int t = 0; t < 16; ++t)
    for (int j = 0; j < 16; ++j) {
      int32_t acc = 0;
      for (int k = 0; k < K; ++k) acc += int32_t(A[size_t(t) * lda + k]) * int32_t(B[(k / 4) * 64 + 4 * j + k % 4]);
      C[t * 16 + j] = acc;
    }
}

template <int MODE, bool EMULATE>
__attribute__((target("avx512f,avx512bw,avx512dq,amx-tile,amx-int8"))) void blocked_tiles(
    const uint8_t* We, const ScaleT<MODE>* Se, int r0, int r1, const int8_t* X, int ns, int Kp, const float* xscale,
    float* Y, size_t ldy) {
  constexpr int K = TK<MODE>, TILE = 16 * K;  // bytes of a group's B tile
  const int ng = Kp / K;
  const size_t ldw = row_bytes<MODE>(Kp), lds = row_scales<MODE>(Kp);
  thread_local std::vector<int8_t> tiles_buf;
  int8_t* tiles = line_aligned(tiles_buf, size_t(ng) * TILE);
  alignas(64) int32_t C[2][16 * 16];
  for (int r = r0; r < r1; r += BLK) {
    const uint8_t* wb = We + size_t(r) * ldw;
    const ScaleT<MODE>* sb = Se + size_t(r) * lds;
    if constexpr (MODE == Q6K)  // a layout group's two tiles at once
      for (int lg = 0; lg < Kp / G; ++lg) unpack_tile<MODE>(wb, lg, tiles + size_t(2 * lg) * TILE, BLK * ldw);
    else
      for (int g = 0; g < ng; ++g) unpack_tile<MODE>(wb, g, tiles + size_t(g) * TILE, BLK * ldw);
    for (int s = 0; s < ns; s += 16) {
      const int8_t* A = X + size_t(s) * Kp;
      __m512 acc[16];
      MOE_UNROLL for (int t = 0; t < 16; ++t) acc[t] = _mm512_setzero_ps();
      __m512i qi[16];  // q6k, iq4xs: the 256's int32 sums of sc x dot
      if constexpr (int_scaled<MODE>)
        MOE_UNROLL for (int t = 0; t < 16; ++t) qi[t] = _mm512_setzero_si512();
// group g's product into C tile g % 2
#define MOE_ISSUE(g)                                                                           \
  do {                                                                                         \
    const int8_t* a = A + (g) * K;                                                             \
    const int8_t* b = tiles + size_t(g) * TILE;                                                \
    if constexpr (EMULATE) tile_dot_s8_emulated(a, Kp, b, K, C[(g) & 1]);                      \
    else if ((g) & 1) tile_issue_s8_1(a, Kp, b);                                               \
    else tile_issue_s8_0(a, Kp, b);                                                            \
  } while (0)
      MOE_ISSUE(0);
      for (int g = 0; g < ng; ++g) {
        // g's product out of its tile, then g + 1's multiply in flight while g's is scaled (the tile unit runs
        // its instructions in order: a store issued after the next multiply would wait for that one too)
        if constexpr (!EMULATE) {
          if (g & 1) tile_store_1(C[1]);
          else tile_store_0(C[0]);
        }
        if (g + 1 < ng) MOE_ISSUE(g + 1);
        if ((g + 3) * K % 64 == 0 && g + 3 < ng)  // the tokens' rows 3 groups on (from L2), a line each
          MOE_UNROLL for (int t = 0; t < 16; ++t)
            _mm_prefetch(reinterpret_cast<const char*>(A + size_t(t) * Kp + (g + 3) * K), _MM_HINT_T0);
        const int32_t* Cg = C[g & 1];
        if constexpr (int_scaled<MODE>) {
          constexpr int subs = G * SPG<MODE> / K;  // products a 256
          const uint8_t* sg = sb + size_t(g / subs) * BLK * SGE<MODE>;  // this 256's d, then its sc
          const __m512i sc =
              _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sg + 4 * BLK + (g % subs) * BLK)));
          MOE_UNROLL for (int t = 0; t < 16; ++t)
            qi[t] = _mm512_add_epi32(qi[t], _mm512_mullo_epi32(_mm512_load_si512(Cg + 16 * t), sc));
          if (g % subs == subs - 1) {
            const __m512 dv = _mm512_loadu_ps(sg);
            MOE_UNROLL for (int t = 0; t < 16; ++t) {
              acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(qi[t]), dv, acc[t]);
              qi[t] = _mm512_setzero_si512();
            }
          }
          continue;
        }
        const __m512 sv = scales512<MODE>(sb + size_t(g) * BLK, __mmask16(0xFFFF));
        MOE_UNROLL for (int t = 0; t < 16; ++t)
          acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(Cg + 16 * t)), sv, acc[t]);
      }
#undef MOE_ISSUE
      const int nt = std::min(16, ns - s);
      for (int t = 0; t < nt; ++t) _mm512_storeu_ps(Y + size_t(s + t) * ldy + r, _mm512_mul_ps(acc[t], _mm512_set1_ps(xscale[s + t])));
    }
  }
}

// the callers' u8 activations (q + 128) as s8 rows of Kp, then zero rows up to a whole 16-token tile
__attribute__((target("avx512f,avx512bw"))) void flip_rows(const Acts& x, int ns, int Kp, int8_t* dst) {
  const __m512i flip = _mm512_set1_epi8(char(0x80));
  for (int s = 0; s < ns; ++s) {
    const uint8_t* src = static_cast<const uint8_t*>(x.rows[s]);
    int8_t* d = dst + size_t(s) * Kp;
    for (int i = 0; i < Kp; i += 64) _mm512_storeu_si512(d + i, _mm512_xor_si512(_mm512_loadu_si512(src + i), flip));
  }
  std::memset(dst + size_t(ns) * Kp, 0, size_t((ns + 15) / 16 * 16 - ns) * Kp);
}

// whole blocks of AMX_MIN_SLOTS tokens or more on tiles; the rest (decode, a shorter last block) on AVX-512
template <int MODE>
void blocked_amx(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy) {
  static_assert(amx_tiled<MODE>);
  const int whole = std::min(r1, m.rows / BLK * BLK);  // rows of whole blocks
  if (ns < AMX_MIN_SLOTS || whole <= r0) return blocked_avx512<MODE>(m, e, r0, r1, x, ns, Y, ldy);
  const size_t ldw = row_bytes<MODE>(m.Kp);
  const uint8_t* We = static_cast<const uint8_t*>(m.w) + size_t(e) * m.rows * ldw;
  const ScaleT<MODE>* Se = reinterpret_cast<const ScaleT<MODE>*>(m.scale) + size_t(e) * m.rows * row_scales<MODE>(m.Kp);
  // the tokens as s8 rows, padded to whole 16-token tiles with zeros
  thread_local std::vector<int8_t> xs;
  xs.resize(size_t((ns + 15) / 16 * 16) * m.Kp);
  flip_rows(x, ns, m.Kp, xs.data());
  if (amx_emulation()) {
    blocked_tiles<MODE, true>(We, Se, r0, whole, xs.data(), ns, m.Kp, x.scale, Y, ldy);
  } else {
    amx_tiles_begin(TK<MODE>);
    blocked_tiles<MODE, false>(We, Se, r0, whole, xs.data(), ns, m.Kp, x.scale, Y, ldy);
    amx_tiles_end();
  }
  if (whole < r1) blocked_avx512<MODE>(m, e, whole, r1, x, ns, Y, ldy);
}

// the 256-bit paths: a block's halves (lanes 0-7, 8-15) in turn, each its 8 rows' column of C
template <class Dot, int MODE>
inline int units256(const uint8_t* wb, const ScaleT<MODE>* sb, size_t moff, int n, const int8_t* const* X,
                    const int32_t* const* XC, const float* const* XS, int ng, size_t pf, int nt, float* C) {
  if constexpr (paired256<Dot, MODE>) {
    if (n == BLK && nt == 1 && !pair_off()) {
      mk256_pair<Dot, MODE>(wb, sb, moff, X[0], XC[0], XS[0], ng, pf, C);
      return 2;
    }
  }
  const int halves = (n + 7) / 8;
  for (int h = 0; h < halves; ++h) {
    const int m = std::min(8, n - 8 * h);
    float Ch[4 * 8];
    with_tokens<4>(nt, [&](auto NT) {
      if (n == BLK)
        mk256<Dot, decltype(NT)::value, MODE, true>(wb + 32 * h, sb, 8 * h, moff, n, m, X, XC, XS, ng, pf, Ch);
      else
        mk256<Dot, decltype(NT)::value, MODE, false>(wb + 32 * h, sb, 8 * h, moff, n, m, X, XC, XS, ng, pf, Ch);
    });
    for (int t = 0; t < nt; ++t)
      for (int j = 0; j < 8; ++j) C[(t * halves + h) * 8 + j] = Ch[t * 8 + j];
  }
  return halves;
}

#define MOE_BLOCKED_YMM(NAME, TARGET, DOT)                                                                          \
  template <int MODE>                                                                                               \
  MOE_YMM_ENTRY(TARGET) void NAME(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y,         \
                                  size_t ldy) {                                                                     \
    drive_blocked<MODE, excess256<DOT, MODE>, 8, 4>(                                                                 \
        m, e, r0, r1, x, ns, Y, ldy,                                                                                \
        [&](const uint8_t* wb, const ScaleT<MODE>* sb, size_t moff, int n, const int8_t* const* X,                 \
            const int32_t* const* XC, const float* const* XS, int ng, size_t pf, int nt, float* C) {               \
          return units256<DOT, MODE>(wb, sb, moff, n, X, XC, XS, ng, pf, nt, C);                                   \
        });                                                                                                         \
  }
MOE_BLOCKED_YMM(blocked_avx2, "avx2,fma", Avx2Dot)
MOE_BLOCKED_YMM(blocked_avxvnni, "avx2,fma,avxvnni", VnniDot)
#undef MOE_BLOCKED_YMM

// The reference: each weight read from the layout one at a time, the same sums in the same numbers.
template <int MODE>
void ref_blocked(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy) {
  const int ng = m.Kp / (G * SPG<MODE>), nlg = m.Kp / G;
  const size_t ldw = row_bytes<MODE>(m.Kp);
  const uint8_t* We = static_cast<const uint8_t*>(m.w) + size_t(e) * m.rows * ldw;
  const size_t moff = MODE == ASYM ? size_t(m.rows) * ng : 0;
  const ScaleT<MODE>* Se =
      reinterpret_cast<const ScaleT<MODE>*>(m.scale) + size_t(e) * (size_t(m.rows) * ng * SGE<MODE> + moff);
  auto X = reinterpret_cast<const uint8_t* const*>(x.rows);
  for (int r = r0; r < r1; ++r) {
    const int b0 = r / BLK * BLK, n = std::min(BLK, m.rows - b0), j = r - b0;
    const uint8_t* wb = We + size_t(b0) * ldw;
    const ScaleT<MODE>* sb = Se + size_t(b0) * ng * SGE<MODE>;
    for (int s = 0; s < ns; ++s) {
      float acc = 0.f, qs = 0.f, qm = 0.f;  // q4k, q5k: the 256's sums of sc x dot and m x activation sum
      int32_t dot = 0, xsum = 0, qi = 0, qn = 0, x16 = 0;  // q6k: the 256's sum of sc x dot; q2k: and of m x x16
      for (int lg = 0; lg < nlg; ++lg) {
        for (int i = 0; i < G; ++i) {
          const int c = i / 4, k = i % 4;  // chunk, byte of the lane
          int32_t w;
          if constexpr (MODE == Q8) {
            w = int8_t(wb[size_t(lg) * 32 * n + size_t(c) * 4 * n + 4 * j + k]);
          } else if constexpr (MODE == Q6K) {  // the nibble, and the high 2 bits from the 32's last two vectors
            const uint8_t* gb = wb + size_t(lg) * 24 * n;
            const uint8_t byte = gb[size_t(c % 4) * 4 * n + 4 * j + k], hb = gb[size_t(4 + c / 4) * 4 * n + 4 * j + k];
            w = ((c < 4 ? byte & 15 : byte >> 4) | (((hb >> (2 * (c % 4))) & 3) << 4)) - 32;
          } else if constexpr (MODE == Q3K) {  // the low bit pair from vector c / 4, the high bit from the last
            const uint8_t* gb = wb + size_t(lg) * 12 * n;
            const uint8_t lb = gb[size_t(c / 4) * 4 * n + 4 * j + k], hb = gb[size_t(2) * 4 * n + 4 * j + k];
            w = (((lb >> (2 * (c % 4))) & 3) | (((hb >> c) & 1) << 2)) - 4;
          } else if constexpr (MODE == Q2K) {  // the bit pair from vector c / 4
            w = (wb[size_t(lg) * 8 * n + size_t(c / 4) * 4 * n + 4 * j + k] >> (2 * (c % 4))) & 3;
          } else if constexpr (MODE == Q5K) {  // the nibble, and the high bit from the 32's last vector
            const uint8_t* gb = wb + size_t(lg) * 20 * n;
            const uint8_t byte = gb[size_t(c % 4) * 4 * n + 4 * j + k], hb = gb[size_t(4) * 4 * n + 4 * j + k];
            w = (c < 4 ? byte & 15 : byte >> 4) | (((hb >> c) & 1) << 4);
          } else {
            const uint8_t byte = wb[size_t(lg) * 16 * n + size_t(c % 4) * 4 * n + 4 * j + k];
            const int q = c < 4 ? byte & 15 : byte >> 4;
            w = looked_up(MODE) ? lut_s8<MODE>()[q] : has_mins<MODE> ? q : q - 8;
          }
          const int32_t xv = int32_t(X[s][lg * G + i]) - 128;
          dot += w * xv;
          xsum += xv;
          x16 += xv;
          if constexpr (sub16(MODE))
            if (i % Q6_SUB == Q6_SUB - 1) {  // the 16's sc (q2k: and m)
              const size_t h = lg % SPG<MODE>, half = i / Q6_SUB;
              const uint8_t* sg = sb + size_t(lg / SPG<MODE>) * n * SGE<MODE> + sc_at<MODE> * n;
              if constexpr (MODE == Q2K) {  // a 32's byte pairs, row by row
                const uint8_t byte = sg[2 * h * n + 2 * j + half];
                qi += dot * (byte & 15);
                qn += x16 * (byte >> 4);
              } else {
                qi += dot * int8_t(sg[(2 * h + half) * n + j]);
              }
              dot = x16 = 0;
            }
        }
        const int g = lg / SPG<MODE>;
        if constexpr (MODE == IQXS) {
          qi += dot * int8_t(sb[size_t(g) * n * SGE<MODE> + 4 * n + size_t(lg % SPG<MODE>) * n + j]);
          dot = 0;
        }
        if constexpr (int_scaled<MODE>) {  // per 256: d (q2k: and dmin)
          if ((lg + 1) % SPG<MODE> == 0) {
            float d;
            std::memcpy(&d, sb + size_t(g) * n * SGE<MODE> + 4 * j, 4);
            acc = std::fma(float(qi), d, acc);
            if constexpr (MODE == Q2K) {
              float dmin;
              std::memcpy(&dmin, sb + size_t(g) * n * SGE<MODE> + 4 * n + 4 * j, 4);
              acc = std::fma(-float(qn), dmin, acc);
            }
            qi = qn = xsum = 0;
          }
        } else if constexpr (k_mins(MODE)) {  // per 32: sc and m; per 256: d and dmin
          const uint8_t* sg = sb + size_t(g) * n * 24;
          const int h = lg % SPG<MODE>;
          qs += float(dot) * float(sg[8 * n + h * n + j]);
          qm += float(sg[16 * n + h * n + j]) * float(xsum);
          dot = xsum = 0;
          if (h == SPG<MODE> - 1) {
            float d, dmin;
            std::memcpy(&d, sg + 4 * j, 4);
            std::memcpy(&dmin, sg + 4 * n + 4 * j, 4);
            acc = acc + qs * d - qm * dmin;
            qs = qm = 0.f;
          }
        } else if ((lg + 1) % SPG<MODE> == 0) {  // the end of a scale group
          acc += float(dot) * scale_of<MODE>(sb[size_t(g) * n + j]);
          if constexpr (MODE == ASYM) acc -= sb[moff + size_t(g) * n + j] * float(xsum);
          dot = xsum = 0;
        }
      }
      Y[size_t(s) * ldy + r] = acc * x.scale[s];
    }
  }
}

}  // namespace

// a format's entry points (kernels.h), one line each in the two files
#define MOE_BLOCKED_ENTRIES(NAME, MODE)                                                                            \
  void ref_gemm_rows_##NAME(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy) {  \
    ref_blocked<MODE>(m, e, r0, r1, x, ns, Y, ldy);                                                               \
  }                                                                                                                \
  void gemm_rows_##NAME##_avx2(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy) { \
    blocked_avx2<MODE>(m, e, r0, r1, x, ns, Y, ldy);                                                              \
  }                                                                                                                \
  void gemm_rows_##NAME##_avxvnni(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y,         \
                                  size_t ldy) {                                                                    \
    blocked_avxvnni<MODE>(m, e, r0, r1, x, ns, Y, ldy);                                                           \
  }                                                                                                                \
  void gemm_rows_##NAME##_avx512(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y,          \
                                 size_t ldy) {                                                                     \
    blocked_avx512<MODE>(m, e, r0, r1, x, ns, Y, ldy);                                                            \
  }
#define MOE_BLOCKED_AMX(NAME, MODE)                                                                               \
  void gemm_rows_##NAME##_amx(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy) { \
    blocked_amx<MODE>(m, e, r0, r1, x, ns, Y, ldy);                                                               \
  }

}  // namespace moe
