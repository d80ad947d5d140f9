// GGUF's grid types as stored (kernels/gemm_iq.h) on AVX-512 VNNI: 8 rows at a time, each group of 8 weights one
// lookup of the 8 rows' grid entries (qword r: row r's 8 weights; IQ3: a gather of 16 dword halves), its signs a
// 64-bit mask (byte r: row r's 8 signs) applied while biasing by 64, then one vpdpbusd a token against the 8
// activations broadcast to every qword. Lanes 2r and 2r + 1 hold row r's two halves of each 8 until the 256's sum,
// where they are added in int32 before d: the same integers as the reference.
#pragma once

#include "kernels/gemm_iq.h"

#define MOE_IQ512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,f16c,fma")))

namespace moe {

namespace {

// up to 64 bytes from p (the rest zero): a field's bytes of the rows present
MOE_IQ512 inline __m512i iq_load512(const uint8_t* p, int bytes) {
  return bytes >= 64 ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi8((__mmask64(1) << bytes) - 1, p);
}
// 8 rows' dwords -> 16 lanes, each row's twice (lanes 2r, 2r + 1)
MOE_IQ512 inline __m512i iq_pairs512(__m256i v) {
  return _mm512_permutexvar_epi32(_mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0),
                                  _mm512_castsi256_si512(v));
}
// bytes b <= 127 -> b with its parity in bit 7 (ggml's ksigns_iq2xs)
MOE_IQ512 inline __m256i iq_parity256(__m256i b) {
  const __m256i par = _mm256_setr_epi8(0, -128, -128, 0, -128, 0, 0, -128, -128, 0, 0, -128, 0, -128, -128, 0,
                                       0, -128, -128, 0, -128, 0, 0, -128, -128, 0, 0, -128, 0, -128, -128, 0);
  const __m256i lo = _mm256_shuffle_epi8(par, _mm256_and_si256(b, _mm256_set1_epi8(15)));
  const __m256i hi = _mm256_shuffle_epi8(par, _mm256_and_si256(_mm256_srli_epi16(b, 4), _mm256_set1_epi8(15)));
  return _mm256_or_si256(b, _mm256_xor_si256(lo, hi));
}
// a uint32 per row of 4 x 7 sign bits (bits 7k..7k+6) -> a byte per 8 (byte k), with parity
MOE_IQ512 inline __m256i iq_ksigns256(__m256i aux) {
  const __m256i b = _mm256_or_si256(
      _mm256_or_si256(_mm256_and_si256(aux, _mm256_set1_epi32(0x7F)),
                      _mm256_and_si256(_mm256_slli_epi32(aux, 1), _mm256_set1_epi32(0x7F00))),
      _mm256_or_si256(_mm256_and_si256(_mm256_slli_epi32(aux, 2), _mm256_set1_epi32(0x7F0000)),
                      _mm256_and_si256(_mm256_slli_epi32(aux, 3), _mm256_set1_epi32(0x7F000000))));
  return iq_parity256(b);
}
// 8 rows' sign bytes (dword r, byte k: group k) -> qword r: row r's 4 bytes (what iq_sign_mask reads)
MOE_IQ512 inline __m512i iq_sign_rows(__m256i s) { return _mm512_cvtepu32_epi64(s); }
// group k's 64 signs as a mask (bit 8 r + j: weight j of row r): each row's byte k spread over its qword, tested bit by
// bit (no trip through a general register)
MOE_IQ512 inline __mmask64 iq_sign_mask(__m512i rows, int k) {
  const char a = char(k), b = char(8 + k);
  const __m128i spread = _mm_setr_epi8(a, a, a, a, a, a, a, a, b, b, b, b, b, b, b, b);
  return _mm512_test_epi8_mask(_mm512_shuffle_epi8(rows, _mm512_broadcast_i32x4(spread)),
                               _mm512_set1_epi64(int64_t(0x8040201008040201ull)));
}
// grid values g (u8) with their signs -> 64 +- g
MOE_IQ512 inline __m512i iq_signed512(__m512i g, __mmask64 s) {
  const __m512i b = _mm512_set1_epi8(IQ_BIAS);
  return _mm512_mask_sub_epi8(_mm512_add_epi8(g, b), s, b, g);
}
// IQ3: group k's two index bytes (2k, 2k + 1) of each row's 8 -> 16 dword lanes (r, half)
MOE_IQ512 inline __m512i iq3_index512(__m512i idx, int k) {
  const char a = char(2 * k), b = char(2 * k + 1), c = char(8 + 2 * k), d = char(9 + 2 * k), z = char(0x80);
  const __m128i p = _mm_setr_epi8(a, z, z, z, b, z, z, z, c, z, z, z, d, z, z, z);
  return _mm512_shuffle_epi8(idx, _mm512_broadcast_i32x4(p));
}

// field f of group h (256 g) of the 8 rows from 8 hb (nh present) of a block of n
template <int T>
MOE_IQ512 inline __m512i iq_field512(const uint8_t* wb, int n, int g, int h, int hb, int nh, int f) {
  return iq_load512(wb + iq_field_off(T, n, g, f, h) + size_t(8 * hb) * iq_field(T, f), nh * iq_field(T, f));
}
MOE_IQ512 inline __m256i iq_odd256(__m256i ls) {  // 2 ls + 1
  return _mm256_add_epi32(_mm256_add_epi32(ls, ls), _mm256_set1_epi32(1));
}
// 8 grid entries (qword r: entry gi[r])
MOE_IQ512 inline __m512i iq_lookup512(const uint64_t* grid, __m256i gi) {
  const __m128i lo = _mm256_castsi256_si128(gi), hi = _mm256_extracti128_si256(gi, 1);
  const __m256i a = _mm256_set_m128i(iq_pair128(grid, uint64_t(_mm_extract_epi64(lo, 1))),
                                     iq_pair128(grid, uint64_t(_mm_cvtsi128_si64(lo))));
  const __m256i b = _mm256_set_m128i(iq_pair128(grid, uint64_t(_mm_extract_epi64(hi, 1))),
                                     iq_pair128(grid, uint64_t(_mm_cvtsi128_si64(hi))));
  return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
}

// One 32 (group h of 256 g) of 8 rows (the block's rows 8 hb.. , nh of them present): V[k] the biased weights of
// group k, M0 / M1 the two 16s' m in lane pairs
template <int T>
MOE_IQ512 inline void iq_decode512(const uint8_t* wb, int n, int g, int h, int hb, int nh, const __m256i& s256,
                                   __m512i* V, __m512i& M0, __m512i& M1) {
  if constexpr (T == IQ2XXS || T == IQ3XXS) {
    const __m512i idx = iq_field512<T>(wb, n, g, h, hb, nh, 0);
    const __m256i aux = _mm512_castsi512_si256(iq_field512<T>(wb, n, g, h, hb, nh, 1));
    const __m512i S = iq_sign_rows(iq_ksigns256(aux));
    M0 = M1 = iq_pairs512(iq_odd256(_mm256_srli_epi32(aux, 28)));
    MOE_UNROLL for (int k = 0; k < 4; ++k) {
      __m512i gv;
      if constexpr (T == IQ2XXS) {
        const __m256i gi = _mm256_and_si256(_mm256_srli_epi32(_mm512_castsi512_si256(idx), 8 * k), _mm256_set1_epi32(255));
        gv = iq_lookup512(IQ2XXS_GRID, gi);
      } else {
        gv = _mm512_i32gather_epi32(iq3_index512(idx, k), reinterpret_cast<const int*>(IQ3XXS_GRID), 4);
      }
      V[k] = iq_signed512(gv, iq_sign_mask(S, k));
    }
  } else if constexpr (T == IQ2XS) {
    const __m512i q = iq_field512<T>(wb, n, g, h, hb, nh, 0);
    const __m256i sc = _mm512_castsi512_si256(_mm512_cvtepu8_epi32(_mm512_castsi512_si128(iq_field512<T>(wb, n, g, h, hb, nh, 1))));
    const __m512i S = iq_sign_rows(iq_parity256(_mm512_cvtepi16_epi8(_mm512_srli_epi16(q, 9))));
    M0 = iq_pairs512(iq_odd256(_mm256_and_si256(sc, _mm256_set1_epi32(15))));
    M1 = iq_pairs512(iq_odd256(_mm256_srli_epi32(sc, 4)));
    MOE_UNROLL for (int k = 0; k < 4; ++k) {
      const __m256i gi = _mm512_cvtepi64_epi32(_mm512_and_si512(_mm512_srli_epi64(q, 16 * k), _mm512_set1_epi64(511)));
      V[k] = iq_signed512(iq_lookup512(IQ2XS_GRID, gi), iq_sign_mask(S, k));
    }
  } else if constexpr (T == IQ2S) {
    const __m256i idx = _mm512_castsi512_si256(iq_field512<T>(wb, n, g, h, hb, nh, 0));
    const __m256i qh = _mm512_castsi512_si256(_mm512_cvtepu8_epi32(_mm512_castsi512_si128(iq_field512<T>(wb, n, g, h, hb, nh, 2))));
    const __m256i sc = _mm512_castsi512_si256(_mm512_cvtepu8_epi32(_mm512_castsi512_si128(iq_field512<T>(wb, n, g, h, hb, nh, 3))));
    const __m512i S = iq_sign_rows(_mm512_castsi512_si256(iq_field512<T>(wb, n, g, h, hb, nh, 1)));
    M0 = iq_pairs512(iq_odd256(_mm256_and_si256(sc, _mm256_set1_epi32(15))));
    M1 = iq_pairs512(iq_odd256(_mm256_srli_epi32(sc, 4)));
    MOE_UNROLL for (int k = 0; k < 4; ++k) {
      const __m256i gi = _mm256_or_si256(
          _mm256_and_si256(_mm256_srli_epi32(idx, 8 * k), _mm256_set1_epi32(255)),
          _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(qh, 2 * k), _mm256_set1_epi32(3)), 8));
      V[k] = iq_signed512(iq_lookup512(IQ2S_GRID, gi), iq_sign_mask(S, k));
    }
  } else if constexpr (T == IQ3S) {
    const __m512i idx = iq_field512<T>(wb, n, g, h, hb, nh, 0);
    const __m128i qh8 = _mm512_castsi512_si128(iq_field512<T>(wb, n, g, h, hb, nh, 1));
    const __m512i qh = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(qh8, qh8));  // lanes (r, half): row r's bits
    const __m512i S = iq_sign_rows(_mm512_castsi512_si256(iq_field512<T>(wb, n, g, h, hb, nh, 2)));
    M0 = M1 = iq_pairs512(iq_odd256(_mm256_and_si256(_mm256_srli_epi32(s256, 8 * (h / 2) + 4 * (h % 2)), _mm256_set1_epi32(15))));
    MOE_UNROLL for (int k = 0; k < 4; ++k) {  // index bit 8 of lane (r, e): bit 2k + e of row r's qh
      const __m512i sh = _mm512_set_epi32(7 - 2 * k, 8 - 2 * k, 7 - 2 * k, 8 - 2 * k, 7 - 2 * k, 8 - 2 * k, 7 - 2 * k,
                                          8 - 2 * k, 7 - 2 * k, 8 - 2 * k, 7 - 2 * k, 8 - 2 * k, 7 - 2 * k, 8 - 2 * k,
                                          7 - 2 * k, 8 - 2 * k);
      const __m512i gi = _mm512_or_si512(iq3_index512(idx, k),
                                         _mm512_and_si512(_mm512_sllv_epi32(qh, sh), _mm512_set1_epi32(256)));
      V[k] = iq_signed512(_mm512_i32gather_epi32(gi, reinterpret_cast<const int*>(IQ3S_GRID), 4), iq_sign_mask(S, k));
    }
  } else {  // IQ1S, IQ1M: no signs; the biased grid plus the delta's +-1
    const __m256i idx = _mm512_castsi512_si256(iq_field512<T>(wb, n, g, h, hb, nh, 0));
    const __m256i qh = _mm512_castsi512_si256(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(iq_field512<T>(wb, n, g, h, hb, nh, 1))));
    if constexpr (T == IQ1S) {
      M0 = M1 = iq_pairs512(iq_odd256(_mm256_and_si256(_mm256_srli_epi32(qh, 12), _mm256_set1_epi32(7))));
    }  // IQ1_M: its m from the 256's scales (iq1m_m512)
    MOE_UNROLL for (int k = 0; k < 4; ++k) {
      const int hs = T == IQ1S ? 3 * k : 4 * k;
      const __m256i gi = _mm256_or_si256(
          _mm256_and_si256(_mm256_srli_epi32(idx, 8 * k), _mm256_set1_epi32(255)),
          _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(qh, hs), _mm256_set1_epi32(7)), 8));
      const __mmask8 neg = _mm256_test_epi32_mask(qh, _mm256_set1_epi32(T == IQ1S ? 0x8000 : 8 << (4 * k)));
      const __m512i delta = _mm512_mask_blend_epi64(neg, _mm512_set1_epi8(1), _mm512_set1_epi8(-1));
      V[k] = _mm512_add_epi8(iq_lookup512(IQ1S_GRID_BIASED, gi), delta);
    }
  }
}

// IQ1_M's m for group h from the rows' 256 scales (qword r: row r's 4 uint16)
MOE_IQ512 inline __m512i iq1m_odd512(__m512i sc, int sh) {  // 2 ls + 1 of the 3 bits at sh, in both dwords
  const __m512i ls = _mm512_and_si512(_mm512_srli_epi64(sc, sh), _mm512_set1_epi64(7));
  const __m512i v = _mm512_add_epi64(_mm512_add_epi64(ls, ls), _mm512_set1_epi64(1));
  return _mm512_or_si512(v, _mm512_slli_epi64(v, 32));
}
// IQ1_M's m for group h from the rows' 256 scales (qword r: row r's 4 uint16)
MOE_IQ512 inline void iq1m_m512(__m512i sc, int h, __m512i& M0, __m512i& M1) {
  const int at = 6 * (h % 2) + 16 * (h / 2);
  M0 = iq1m_odd512(sc, at), M1 = iq1m_odd512(sc, at + 3);
}

// the 8 rows' d unit in lane pairs, from their per-256 field 0 (IQ1_M: d in its scales' top nibbles)
template <int T>
MOE_IQ512 inline __m512 iq_dv512(__m512i s0) {
  __m256 d;
  if constexpr (T == IQ1M) {
    const __m512i dq = _mm512_or_si512(
        _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi64(s0, 12), _mm512_set1_epi64(0xF)),
                        _mm512_and_si512(_mm512_srli_epi64(s0, 24), _mm512_set1_epi64(0xF0))),
        _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi64(s0, 36), _mm512_set1_epi64(0xF00)),
                        _mm512_and_si512(_mm512_srli_epi64(s0, 48), _mm512_set1_epi64(0xF000))));
    d = _mm256_cvtph_ps(_mm512_cvtepi64_epi16(dq));
  } else {
    d = _mm256_cvtph_ps(_mm512_castsi512_si128(s0));
  }
  return _mm512_permutexvar_ps(_mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0),
                               _mm512_castps256_ps512(_mm256_mul_ps(d, _mm256_set1_ps(iq_unit(T)))));
}

template <int T, int NT>
MOE_IQ512 void iq_mk512(const uint8_t* wb, const uint8_t* sb, int n, const int8_t* const* X, const int32_t* const* XC,
                        int nsb, float* C) {
  const __m512i evens = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 14, 12, 10, 8, 6, 4, 2, 0);
  const int halves = (n + 7) / 8;
  __m512 acc[2][NT];
  MOE_UNROLL for (int t = 0; t < NT; ++t) acc[0][t] = acc[1][t] = _mm512_setzero_ps();
  const size_t sb_bytes = size_t(n) * iq_data_bytes(T);  // a 256 of the block's rows
  for (int g = 0; g < nsb; ++g) {  // each 256's bytes once, both halves of the block (one stream)
    iq_prefetch_ahead(wb, g, sb_bytes);
    for (int hb = 0; hb < halves; ++hb) {
      const int nh = std::min(8, n - 8 * hb);
      // the 256's per-256 fields of the 8 rows: d (IQ1_M: in its scales), IQ3_S's scales
      const __m512i s0 = iq_load512(sb + iq_sfield_off(T, n, g, 0) + size_t(8 * hb) * iq_sfield(T, 0), nh * iq_sfield(T, 0));
      __m256i s256 = _mm256_setzero_si256();
      if constexpr (T == IQ3S)
        s256 = _mm512_castsi512_si256(iq_load512(sb + iq_sfield_off(T, n, g, 1) + size_t(8 * hb) * 4, nh * 4));
      __m512i qi[NT];
      MOE_UNROLL for (int t = 0; t < NT; ++t) qi[t] = _mm512_setzero_si512();
      MOE_UNROLL for (int h = 0; h < 8; ++h) {
        __m512i V[4], M0, M1;
        iq_decode512<T>(wb, n, g, h, hb, nh, s256, V, M0, M1);
        if constexpr (T == IQ1M) iq1m_m512(s0, h, M0, M1);
        MOE_UNROLL for (int t = 0; t < NT; ++t) {
          const int8_t* xg = X[t] + g * IQ_QK + h * 32;
          int64_t xv[4];
          std::memcpy(xv, xg, 32);
          __m512i d0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), V[0], _mm512_set1_epi64(xv[0]));
          __m512i d1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), V[2], _mm512_set1_epi64(xv[2]));
          d0 = _mm512_dpbusd_epi32(d0, V[1], _mm512_set1_epi64(xv[1]));
          d1 = _mm512_dpbusd_epi32(d1, V[3], _mm512_set1_epi64(xv[3]));
          const int32_t* xc = XC[t] + g * (IQ_QK / IQ_SUB) + 2 * h;  // 64 x each 16's activation sum, on even lanes
          d0 = _mm512_sub_epi32(d0, _mm512_set1_epi64(int64_t(uint32_t(xc[0]))));
          d1 = _mm512_sub_epi32(d1, _mm512_set1_epi64(int64_t(uint32_t(xc[1]))));
          qi[t] = _mm512_add_epi32(qi[t], _mm512_add_epi32(_mm512_mullo_epi32(d0, M0), _mm512_mullo_epi32(d1, M1)));
        }
      }
      const __m512 dv = iq_dv512<T>(s0);
      MOE_UNROLL for (int t = 0; t < NT; ++t) {  // row r's two lanes added, then d
        const __m512i q = _mm512_add_epi32(qi[t], _mm512_shuffle_epi32(qi[t], _MM_PERM_CDAB));
        acc[hb][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), dv, acc[hb][t]);
      }
    }
  }
  for (int hb = 0; hb < halves; ++hb)
    MOE_UNROLL for (int t = 0; t < NT; ++t)
      _mm256_storeu_ps(C + t * BLK + 8 * hb, _mm512_castps512_ps256(_mm512_permutexvar_ps(evens, acc[hb][t])));
}

// Prefill (many tokens): a row block's 256 decoded once (the grid lookups paid once a block, not once per 4 tokens),
// then every token against it. The weights stay signed (v, s8) and the activations go in as u8 (x + 128): the excess,
// 128 x each 16's weight sum times m, is the block's own, taken once for all tokens (W) instead of per 16 and token.
// Decoded, the block is re-laid with its 16 rows in the 16 dword lanes (Wd: each lane 4 weights of one row; M16, W16,
// d16 a lane a row), so one vpmulld applies the 16 rows' m to a 16's dot product (the 8-row qword lanes needed two
// and twice the adds), and each token's activation dwords are broadcast from its own row (no repacking). The same
// integers (int32 sums, exact in any order) and the same FMA per 256 and token as iq_mk512: bit for bit the reference.
struct alignas(64) IqBlock512 {
  __m512i Wd[8][4][2];  // group h (32), its 8 k (8 weights), half e: rows in lanes, weights 8k + 4e .. + 3
  __m512i M16[8][2];    // each 16's m
  __m512i W16;          // -128 x the 256's sum over 16s of m x the 16's weight sum
  __m512 d16;           // d x the type's unit
};
// the block's 256 g decoded into B (rows n <= 16)
template <int T>
MOE_IQ512 inline void iq_block512(const uint8_t* wb, const uint8_t* sb, int n, int g, IqBlock512& B) {
  const __m512i lo = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(1));
  const __m512i ones = _mm512_set1_epi8(1), bias = _mm512_set1_epi8(IQ_BIAS);
  __m512i V[2][8][4], M[2][8][2], Wx[2];
  __m512 dv[2];
  const int halves = (n + 7) / 8;
  for (int hb = 0; hb < 2; ++hb) {
    if (hb >= halves) {  // a short block: its missing rows zero
      MOE_UNROLL for (int h = 0; h < 8; ++h) {
        MOE_UNROLL for (int k = 0; k < 4; ++k) V[hb][h][k] = _mm512_setzero_si512();
        M[hb][h][0] = M[hb][h][1] = _mm512_setzero_si512();
      }
      Wx[hb] = _mm512_setzero_si512(), dv[hb] = _mm512_setzero_ps();
      continue;
    }
    const int nh = std::min(8, n - 8 * hb);
    const __m512i s0 = iq_load512(sb + iq_sfield_off(T, n, g, 0) + size_t(8 * hb) * iq_sfield(T, 0), nh * iq_sfield(T, 0));
    __m256i s256 = _mm256_setzero_si256();
    if constexpr (T == IQ3S)
      s256 = _mm512_castsi512_si256(iq_load512(sb + iq_sfield_off(T, n, g, 1) + size_t(8 * hb) * 4, nh * 4));
    __m512i w = _mm512_setzero_si512();
    MOE_UNROLL for (int h = 0; h < 8; ++h) {
      iq_decode512<T>(wb, n, g, h, hb, nh, s256, V[hb][h], M[hb][h][0], M[hb][h][1]);
      if constexpr (T == IQ1M) iq1m_m512(s0, h, M[hb][h][0], M[hb][h][1]);
      MOE_UNROLL for (int k = 0; k < 4; ++k) V[hb][h][k] = _mm512_sub_epi8(V[hb][h][k], bias);  // v, signed
      const __m512i e0 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, V[hb][h][0]), ones, V[hb][h][1]);
      const __m512i e1 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, V[hb][h][2]), ones, V[hb][h][3]);
      w = _mm512_add_epi32(w, _mm512_add_epi32(_mm512_mullo_epi32(e0, M[hb][h][0]), _mm512_mullo_epi32(e1, M[hb][h][1])));
    }
    Wx[hb] = _mm512_mullo_epi32(w, _mm512_set1_epi32(-128));
    dv[hb] = iq_dv512<T>(s0);
  }
  // qword lanes (8 rows x 2 dwords, two halves) -> 16 rows in dword lanes: the even dwords, the odd ones
  MOE_UNROLL for (int h = 0; h < 8; ++h) {
    MOE_UNROLL for (int k = 0; k < 4; ++k) {
      B.Wd[h][k][0] = _mm512_permutex2var_epi32(V[0][h][k], lo, V[1][h][k]);
      B.Wd[h][k][1] = _mm512_permutex2var_epi32(V[0][h][k], hi, V[1][h][k]);
    }
    MOE_UNROLL for (int s = 0; s < 2; ++s) B.M16[h][s] = _mm512_permutex2var_epi32(M[0][h][s], lo, M[1][h][s]);
  }
  B.W16 = _mm512_add_epi32(_mm512_permutex2var_epi32(Wx[0], lo, Wx[1]), _mm512_permutex2var_epi32(Wx[0], hi, Wx[1]));
  B.d16 = _mm512_permutex2var_ps(dv[0], lo, dv[1]);
}
// NT tokens (their u8 rows A) against R decoded blocks' 256 g: acc [NT][2][16] += their 16 R rows' results. Each
// broadcast activation dword serves the R blocks (broadcasts, not the dot products, bound a single block's rate).
// M32: the type's m is one a 32 (IQ2_XXS, IQ3_XXS, IQ3_S, IQ1_S: M16[h][0] == M16[h][1]), so a 32's two 16s share
// one product by m (vpmulld competes with the dot products for their pipes; the same int32 sums)
template <int NT, int R, bool M32>
MOE_IQ512 inline void iq_tokens512(const IqBlock512* B, const uint8_t* const* A, int g, float* acc) {
  __m512i qi[R][NT];
  const int32_t* a[NT];
  MOE_UNROLL for (int t = 0; t < NT; ++t) a[t] = reinterpret_cast<const int32_t*>(A[t] + g * IQ_QK);
  MOE_UNROLL for (int b = 0; b < R; ++b) MOE_UNROLL for (int t = 0; t < NT; ++t) qi[b][t] = B[b].W16;
  _Pragma("GCC unroll 1") for (int h = 0; h < 8; ++h) {  // (unrolled, GCC spills the accumulators)
    __m512i d[R][NT];
    MOE_UNROLL for (int s = 0; s < 2; ++s) {  // a 16: groups k = 2s, 2s + 1, the activations' dwords 8h + 4s ..
      if (!M32 || s == 0)
        MOE_UNROLL for (int b = 0; b < R; ++b) MOE_UNROLL for (int t = 0; t < NT; ++t) d[b][t] = _mm512_setzero_si512();
      MOE_UNROLL for (int j = 0; j < 4; ++j)
        MOE_UNROLL for (int t = 0; t < NT; ++t) {
          const __m512i x = _mm512_set1_epi32(a[t][8 * h + 4 * s + j]);
          MOE_UNROLL for (int b = 0; b < R; ++b) d[b][t] = _mm512_dpbusd_epi32(d[b][t], x, B[b].Wd[h][2 * s + j / 2][j % 2]);
        }
      if (!M32 || s == 1)
        MOE_UNROLL for (int b = 0; b < R; ++b)
          MOE_UNROLL for (int t = 0; t < NT; ++t) qi[b][t] = _mm512_add_epi32(qi[b][t], _mm512_mullo_epi32(d[b][t], B[b].M16[h][s]));
    }
  }
  MOE_UNROLL for (int b = 0; b < R; ++b)
    MOE_UNROLL for (int t = 0; t < NT; ++t) {
      float* o = acc + 32 * t + 16 * b;
      _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_cvtepi32_ps(qi[b][t]), B[b].d16, _mm512_loadu_ps(o)));
    }
}
// rows n <= 32: one or two 16-row blocks (the second bw / bs bytes after the first)
template <int T>
MOE_IQ512 void iq_prefill512(const uint8_t* wb, const uint8_t* sb, int n, size_t bw, size_t bs, const uint8_t* const* A,
                             int nsb, int ns, float* acc) {
  IqBlock512 B[2];
  const int n0 = std::min(n, BLK), n1 = n - n0;
  const size_t sb0 = size_t(n0) * iq_data_bytes(T), sb1 = size_t(n1) * iq_data_bytes(T);
  for (int g = 0; g < nsb; ++g) {
    iq_prefetch_ahead(wb, g, sb0);
    iq_block512<T>(wb, sb, n0, g, B[0]);
    if (n1 > 0) {
      iq_prefetch_ahead(wb + bw, g, sb1);
      iq_block512<T>(wb + bw, sb + bs, n1, g, B[1]);
    }
    for (int t = 0; t < ns; t += 4)
      with_tokens<4>(ns - t, [&](auto NT) {
        if (n1 > 0) iq_tokens512<decltype(NT)::value, 2, iq_m32(T)>(B, A + t, g, acc + size_t(t) * 32);
        else iq_tokens512<decltype(NT)::value, 1, iq_m32(T)>(B, A + t, g, acc + size_t(t) * 32);
      });
  }
}

template <int T>
void iq_avx512(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy) {
  if (ns < IQ_PREFILL_MIN) {
    drive_iq<T>(m, e, r0, r1, x, ns, Y, ldy,
                [&](const uint8_t* wb, const uint8_t* sb, int n, const int8_t* const* X, const int32_t* const* XC,
                    int nsb, int nt, float* C) {
                  with_tokens<4>(nt, [&](auto NT) { iq_mk512<T, decltype(NT)::value>(wb, sb, n, X, XC, nsb, C); });
                });
    return;
  }
  drive_iq_prefill<T, 2, 2, 16, 1>(m, e, r0, r1, x, ns, Y, ldy,
                                   [&](const uint8_t* wb, const uint8_t* sb, int n, size_t bw, size_t bs,
                                       const uint8_t* const* A, int nsb, float* acc) {
                                     iq_prefill512<T>(wb, sb, n, bw, bs, A, nsb, ns, acc);
                                   });
}

}  // namespace

}  // namespace moe
