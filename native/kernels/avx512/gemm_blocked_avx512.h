// The row-blocked int formats (kernels/gemm_blocked.h) on AVX-512 VNNI: a micro-kernel unit of one 16-row block
// x up to 4 tokens, each row's result in its own lane. Also the AMX path's fallback for decode and short blocks
// (amx/gemm_blocked_amx.h).
#pragma once

#include "kernels/gemm_blocked.h"

namespace moe {

namespace {

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

// Prefill of the formats with a scale per group (not the super-blocked ones): two whole blocks (32 rows) x NT tokens,
// each broadcast activation chunk serving both blocks' dot products. A vpdpbusd per broadcast bound one block's rate
// (the broadcasts issue at about 1.2 a cycle where the dot products issue at 2: Zen 5); the same integers and FMAs
// as mk512, per block, in the same order. Weights a chunk at a time (the 8 of a group do not fit the registers twice).
template <int MODE>
constexpr bool paired_blocks = !fielded(MODE);
template <int NT, int MODE>
__attribute__((target("avx512f,avx512bw,avx512dq,avx512vnni"))) inline void mk512x2(
    const uint8_t* W, const ScaleT<MODE>* S, size_t moff, const int8_t* const* X, const int32_t* const* XC,
    const float* const* XS, int ng, size_t pf, float* C, size_t bw, size_t bs) {
  constexpr int gs = stride_vectors<MODE> * 64;  // bytes of a layout group
  const __m512i lo4 = _mm512_set1_epi8(0x0f);
  __m512 acc[2][NT];
  MOE_UNROLL for (int b = 0; b < 2; ++b) MOE_UNROLL for (int t = 0; t < NT; ++t) acc[b][t] = _mm512_setzero_ps();
  for (int g = 0; g < ng; ++g) {
    __m512i d[2][NT];
    MOE_UNROLL for (int b = 0; b < 2; ++b) MOE_UNROLL for (int t = 0; t < NT; ++t) d[b][t] = _mm512_setzero_si512();
    MOE_UNROLL for (int h = 0; h < SPG<MODE>; ++h) {
      const int lg = g * SPG<MODE> + h;
      const uint8_t* p = W + size_t(lg) * gs;
      MOE_UNROLL for (int v = 0; v < vectors<MODE>; ++v) {
        _mm_prefetch(reinterpret_cast<const char*>(p + pf + 64 * v), _MM_HINT_T1);  // (as mk512: each stream ahead)
        _mm_prefetch(reinterpret_cast<const char*>(p + bw + pf + 64 * v), _MM_HINT_T1);
        const __m512i q0 = _mm512_loadu_si512(p + 64 * v), q1 = _mm512_loadu_si512(p + bw + 64 * v);
        if constexpr (nibble<MODE>) {  // chunks v (low nibbles) and v + 4 (high)
          const __m512i u0 = decode512<MODE>(_mm512_and_si512(q0, lo4));
          const __m512i u1 = decode512<MODE>(_mm512_and_si512(q1, lo4));
          const __m512i h0 = decode512<MODE>(_mm512_and_si512(_mm512_srli_epi16(q0, 4), lo4));
          const __m512i h1 = decode512<MODE>(_mm512_and_si512(_mm512_srli_epi16(q1, 4), lo4));
          MOE_UNROLL for (int t = 0; t < NT; ++t) {
            const int32_t* xg = reinterpret_cast<const int32_t*>(X[t] + lg * G);
            const __m512i xa = _mm512_set1_epi32(xg[v]), xb = _mm512_set1_epi32(xg[v + 4]);
            d[0][t] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(d[0][t], u0, xa), h0, xb);
            d[1][t] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(d[1][t], u1, xa), h1, xb);
          }
        } else {
          const __m512i u0 = decode512<MODE>(q0), u1 = decode512<MODE>(q1);
          MOE_UNROLL for (int t = 0; t < NT; ++t) {
            const __m512i xa = _mm512_set1_epi32(reinterpret_cast<const int32_t*>(X[t] + lg * G)[v]);
            d[0][t] = _mm512_dpbusd_epi32(d[0][t], u0, xa);
            d[1][t] = _mm512_dpbusd_epi32(d[1][t], u1, xa);
          }
        }
      }
    }
    MOE_UNROLL for (int b = 0; b < 2; ++b) {
      const ScaleT<MODE>* sb = S + b * bs;
      const __m512 sv = scales512<MODE>(sb + size_t(g) * BLK, __mmask16(0xFFFF));
      __m512 mv = sv;
      if constexpr (MODE == ASYM) mv = _mm512_loadu_ps(sb + moff + size_t(g) * BLK);
      MOE_UNROLL for (int t = 0; t < NT; ++t) {
        __m512i dd = d[b][t];
        if constexpr (excess<MODE, false> != 0) dd = _mm512_sub_epi32(dd, _mm512_set1_epi32(XC[t][g]));
        acc[b][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dd), sv, acc[b][t]);
        if constexpr (MODE == ASYM) acc[b][t] = _mm512_fnmadd_ps(mv, _mm512_set1_ps(XS[t][g]), acc[b][t]);
      }
    }
  }
  MOE_UNROLL for (int t = 0; t < NT; ++t) MOE_UNROLL for (int b = 0; b < 2; ++b) _mm512_storeu_ps(C + t * 2 * BLK + b * BLK, acc[b][t]);
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
  auto one = [&](const uint8_t* wb, const ScaleT<MODE>* sb, size_t moff, int n, const int8_t* const* X,
                 const int32_t* const* XC, const float* const* XS, int ng, size_t pf, int nt, float* C, size_t,
                 size_t) { return units512<MODE>(wb, sb, moff, n, X, XC, XS, ng, pf, nt, C); };
  if constexpr (paired_blocks<MODE>) {
    // prefill: two blocks a step where both are whole (decode streams one block at a time); from tuning's tokens on
    if (const int from = tuning().pair_from_tokens; from > 0 && ns >= from) {
      drive_blocked<MODE, excess<MODE, false>, BLK, 4, 2>(
          m, e, r0, r1, x, ns, Y, ldy,
          [&](const uint8_t* wb, const ScaleT<MODE>* sb, size_t moff, int n, const int8_t* const* X,
              const int32_t* const* XC, const float* const* XS, int ng, size_t pf, int nt, float* C, size_t bw,
              size_t bs) {
            if (n <= BLK) return one(wb, sb, moff, n, X, XC, XS, ng, pf, nt, C, bw, bs);
            if (n < 2 * BLK) {  // a whole block and a short one (the matrix's end): each alone, into C's two halves
              float C0[4 * BLK], C1[4 * BLK];
              one(wb, sb, moff, BLK, X, XC, XS, ng, pf, nt, C0, bw, bs);
              one(wb + bw, sb + bs, moff, n - BLK, X, XC, XS, ng, pf, nt, C1, bw, bs);
              for (int t = 0; t < nt; ++t) {
                std::memcpy(C + t * 2 * BLK, C0 + t * BLK, BLK * sizeof(float));
                std::memcpy(C + t * 2 * BLK + BLK, C1 + t * BLK, BLK * sizeof(float));
              }
              return 2;
            }
            with_tokens<4>(nt, [&](auto NT) { mk512x2<decltype(NT)::value, MODE>(wb, sb, moff, X, XC, XS, ng, pf, C, bw, bs); });
            return 2;
          });
      return;
    }
  }
  drive_blocked<MODE, excess<MODE, false>, BLK, 4>(m, e, r0, r1, x, ns, Y, ldy, one);
}

}  // namespace

}  // namespace moe
