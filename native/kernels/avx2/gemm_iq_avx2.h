// GGUF's grid types as stored (kernels/gemm_iq.h) on AVX2 and AVX-VNNI: gemm_iq_avx512.h's scheme on 4 rows at a time
// (qword r of a ymm: row r's 8 weights of a group of 8; IQ3: 8 dword halves), the signs expanded to byte masks
// (vpshufb, vpcmpeqb) and applied with vpsignb while biasing by 64. AVX2 multiplies with vpmaddubsw (64 +- 62 times an
// s8 activation: a pair's sum stays within int16) and vpmaddwd; AVX-VNNI with vpdpbusd. The micro-kernel is written
// once (gemm_iq_mk256.inc) and compiled for each target; the decoding helpers here are AVX2's.
#pragma once

#include "kernels/gemm_iq.h"

#define MOE_IQ256 __attribute__((target("avx2,fma,f16c")))

namespace moe {

namespace {

// up to 32 bytes from p (the rest zero); `full` the bytes of 4 rows
MOE_IQ256 inline __m256i iq_load256(const uint8_t* p, int bytes, int full) {
  if (bytes == full) {
    if (full == 32) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    if (full == 16) return _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    if (full == 8) return _mm256_zextsi128_si256(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }
  alignas(32) uint8_t b[32] = {};
  std::memcpy(b, p, bytes);
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(b));
}
template <int T>
MOE_IQ256 inline __m256i iq_field256(const uint8_t* wb, int n, int g, int h, int qb, int nq, int f) {
  const int B = iq_field(T, f);
  return iq_load256(wb + iq_field_off(T, n, g, f, h) + size_t(4 * qb) * B, nq * B, 4 * B);
}
MOE_IQ256 inline __m128i iq_lo(__m256i v) { return _mm256_castsi256_si128(v); }
// 4 rows' dwords -> 8 lanes, each row's twice
MOE_IQ256 inline __m256i iq_pairs256(__m128i v) {
  return _mm256_permutevar8x32_epi32(_mm256_zextsi128_si256(v), _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
}
MOE_IQ256 inline __m128i iq_odd128(__m128i ls) { return _mm_add_epi32(_mm_add_epi32(ls, ls), _mm_set1_epi32(1)); }
MOE_IQ256 inline __m128i iq_parity128(__m128i b) {
  const __m128i par = _mm_setr_epi8(0, -128, -128, 0, -128, 0, 0, -128, -128, 0, 0, -128, 0, -128, -128, 0);
  const __m128i lo = _mm_shuffle_epi8(par, _mm_and_si128(b, _mm_set1_epi8(15)));
  const __m128i hi = _mm_shuffle_epi8(par, _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(15)));
  return _mm_or_si128(b, _mm_xor_si128(lo, hi));
}
MOE_IQ256 inline __m128i iq_ksigns128(__m128i aux) {
  const __m128i b = _mm_or_si128(
      _mm_or_si128(_mm_and_si128(aux, _mm_set1_epi32(0x7F)), _mm_and_si128(_mm_slli_epi32(aux, 1), _mm_set1_epi32(0x7F00))),
      _mm_or_si128(_mm_and_si128(_mm_slli_epi32(aux, 2), _mm_set1_epi32(0x7F0000)),
                   _mm_and_si128(_mm_slli_epi32(aux, 3), _mm_set1_epi32(0x7F000000))));
  return iq_parity128(b);
}
// 4 rows' sign bytes (dword r, byte k) -> dword k: group k's 4 rows' bytes
MOE_IQ256 inline __m128i iq_sign_groups(__m128i s) {
  return _mm_shuffle_epi8(s, _mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15));
}
// grid values g with group k's signs (dword k of sg) -> 64 +- g
MOE_IQ256 inline __m256i iq_signed256(__m256i g, __m128i sg, int k) {
  const __m256i bc = _mm256_permutevar8x32_epi32(_mm256_zextsi128_si256(sg), _mm256_set1_epi32(k));
  const __m256i e = _mm256_shuffle_epi8(bc, _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                                             2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i bit = _mm256_set1_epi64x(int64_t(0x8040201008040201ull));
  const __m256i neg = _mm256_cmpeq_epi8(_mm256_and_si256(e, bit), bit);
  return _mm256_add_epi8(_mm256_set1_epi8(IQ_BIAS), _mm256_sign_epi8(g, _mm256_or_si256(neg, _mm256_set1_epi8(1))));
}
// IQ3: group k's two index bytes of each row's 8 -> 8 dword lanes (r, half)
MOE_IQ256 inline __m256i iq3_index256(__m256i idx, int k) {
  const char a = char(2 * k), b = char(2 * k + 1), c = char(8 + 2 * k), d = char(9 + 2 * k), z = char(0x80);
  return _mm256_shuffle_epi8(idx, _mm256_setr_epi8(a, z, z, z, b, z, z, z, c, z, z, z, d, z, z, z,
                                                   a, z, z, z, b, z, z, z, c, z, z, z, d, z, z, z));
}
// 4 grid entries (qword r: entry gi[r])
MOE_IQ256 inline __m256i iq_lookup256(const uint64_t* grid, __m128i gi) {
  return _mm256_set_m128i(iq_pair128(grid, uint64_t(_mm_extract_epi64(gi, 1))),
                          iq_pair128(grid, uint64_t(_mm_cvtsi128_si64(gi))));
}
// 4 grid entries by their indices (qword r: entry r's)
MOE_IQ256 inline __m256i iq_lookup4(const uint64_t* grid, uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
  return _mm256_set_m128i(_mm_set_epi64x(int64_t(grid[d]), int64_t(grid[c])),
                          _mm_set_epi64x(int64_t(grid[b]), int64_t(grid[a])));
}
MOE_IQ256 inline __m128i iq_byte_k(__m128i v, int k) {  // byte k of each dword
  return _mm_and_si128(_mm_srl_epi32(v, _mm_cvtsi32_si128(8 * k)), _mm_set1_epi32(255));
}
MOE_IQ256 inline __m128i iq_bits(__m128i v, int shift, int mask) {
  return _mm_and_si128(_mm_srl_epi32(v, _mm_cvtsi32_si128(shift)), _mm_set1_epi32(mask));
}
MOE_IQ256 inline __m256i iq1m_odd256(__m256i sc, int sh) {  // 2 ls + 1 of the 3 bits at sh of each qword, both dwords
  const __m256i ls = _mm256_and_si256(_mm256_srl_epi64(sc, _mm_cvtsi32_si128(sh)), _mm256_set1_epi64x(7));
  const __m256i v = _mm256_add_epi64(_mm256_add_epi64(ls, ls), _mm256_set1_epi64x(1));
  return _mm256_or_si256(v, _mm256_slli_epi64(v, 32));
}

// One 32 (group h of 256 g) of 4 rows (the block's rows 4 qb.., nq present): V[k] group k's biased weights, M0 / M1
// the two 16s' m in lane pairs. s: the rows' per-256 field 0 (IQ1_M's scales), s1: field 1 (IQ3_S's scales).
template <int T>
MOE_IQ256 inline void iq_decode256(const uint8_t* wb, int n, int g, int h, int qb, int nq, __m256i s, __m128i s1,
                                   __m256i* V, __m256i& M0, __m256i& M1) {
  if constexpr (T == IQ2XXS || T == IQ3XXS) {
    const __m128i aux = iq_lo(iq_field256<T>(wb, n, g, h, qb, nq, 1));
    const __m128i sg = iq_sign_groups(iq_ksigns128(aux));
    M0 = M1 = iq_pairs256(iq_odd128(_mm_srli_epi32(aux, 28)));
    if constexpr (T == IQ2XXS) {
      // the index bytes read as scalars where they lie (row r's k-th at 4 r + k): fewer instructions a lookup than
      // moving them out of a vector (docs/performance/kernels.md, 2026-12-07 Zen 3)
      const uint8_t* ip = wb + iq_field_off(T, n, g, 0, h) + size_t(16 * qb);
      alignas(16) uint8_t pad[16] = {};
      if (nq < 4) std::memcpy(pad, ip, size_t(4 * nq)), ip = pad;
      MOE_UNROLL for (int k = 0; k < 4; ++k)
        V[k] = iq_signed256(iq_lookup4(IQ2XXS_GRID, ip[k], ip[4 + k], ip[8 + k], ip[12 + k]), sg, k);
    } else {
      const __m256i idx = iq_field256<T>(wb, n, g, h, qb, nq, 0);
      MOE_UNROLL for (int k = 0; k < 4; ++k)
        V[k] = iq_signed256(_mm256_i32gather_epi32(reinterpret_cast<const int*>(IQ3XXS_GRID), iq3_index256(idx, k), 4),
                            sg, k);
    }
  } else if constexpr (T == IQ2XS) {
    const __m256i q = iq_field256<T>(wb, n, g, h, qb, nq, 0);
    const __m128i sc = _mm_cvtepu8_epi32(iq_lo(iq_field256<T>(wb, n, g, h, qb, nq, 1)));
    const __m256i s7 = _mm256_packus_epi16(_mm256_srli_epi16(q, 9), _mm256_srli_epi16(q, 9));
    const __m128i sg = iq_sign_groups(iq_parity128(iq_lo(_mm256_permute4x64_epi64(s7, 0x08))));
    M0 = iq_pairs256(iq_odd128(_mm_and_si128(sc, _mm_set1_epi32(15))));
    M1 = iq_pairs256(iq_odd128(_mm_srli_epi32(sc, 4)));
    MOE_UNROLL for (int k = 0; k < 4; ++k) {
      const __m256i w = _mm256_and_si256(_mm256_srl_epi64(q, _mm_cvtsi32_si128(16 * k)), _mm256_set1_epi64x(511));
      const __m128i gi = iq_lo(_mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 2, 4, 6, 0, 0, 0, 0)));
      V[k] = iq_signed256(iq_lookup256(IQ2XS_GRID, gi), sg, k);
    }
  } else if constexpr (T == IQ2S) {
    const __m128i idx = iq_lo(iq_field256<T>(wb, n, g, h, qb, nq, 0));
    const __m128i sg = iq_sign_groups(iq_lo(iq_field256<T>(wb, n, g, h, qb, nq, 1)));
    const __m128i qh = _mm_cvtepu8_epi32(iq_lo(iq_field256<T>(wb, n, g, h, qb, nq, 2)));
    const __m128i sc = _mm_cvtepu8_epi32(iq_lo(iq_field256<T>(wb, n, g, h, qb, nq, 3)));
    M0 = iq_pairs256(iq_odd128(_mm_and_si128(sc, _mm_set1_epi32(15))));
    M1 = iq_pairs256(iq_odd128(_mm_srli_epi32(sc, 4)));
    MOE_UNROLL for (int k = 0; k < 4; ++k) {
      const __m128i gi = _mm_or_si128(iq_byte_k(idx, k), _mm_slli_epi32(iq_bits(qh, 2 * k, 3), 8));
      V[k] = iq_signed256(iq_lookup256(IQ2S_GRID, gi), sg, k);
    }
  } else if constexpr (T == IQ3S) {
    const __m256i idx = iq_field256<T>(wb, n, g, h, qb, nq, 0);
    const __m128i qh4 = iq_lo(iq_field256<T>(wb, n, g, h, qb, nq, 1));
    const __m256i qh = _mm256_cvtepu8_epi32(_mm_unpacklo_epi8(qh4, qh4));  // lanes (r, half): row r's bits
    const __m128i sg = iq_sign_groups(iq_lo(iq_field256<T>(wb, n, g, h, qb, nq, 2)));
    M0 = M1 = iq_pairs256(iq_odd128(iq_bits(s1, 8 * (h / 2) + 4 * (h % 2), 15)));
    MOE_UNROLL for (int k = 0; k < 4; ++k) {
      const __m256i sh = _mm256_setr_epi32(8 - 2 * k, 7 - 2 * k, 8 - 2 * k, 7 - 2 * k, 8 - 2 * k, 7 - 2 * k, 8 - 2 * k,
                                           7 - 2 * k);
      const __m256i gi = _mm256_or_si256(iq3_index256(idx, k),
                                         _mm256_and_si256(_mm256_sllv_epi32(qh, sh), _mm256_set1_epi32(256)));
      V[k] = iq_signed256(_mm256_i32gather_epi32(reinterpret_cast<const int*>(IQ3S_GRID), gi, 4), sg, k);
    }
  } else {  // IQ1S, IQ1M: the biased grid plus the delta's +-1
    const __m128i idx = iq_lo(iq_field256<T>(wb, n, g, h, qb, nq, 0));
    const __m128i qh = _mm_cvtepu16_epi32(iq_lo(iq_field256<T>(wb, n, g, h, qb, nq, 1)));
    if constexpr (T == IQ1S) {
      M0 = M1 = iq_pairs256(iq_odd128(iq_bits(qh, 12, 7)));
    } else {
      const int at = 16 * (h / 2) + 6 * (h % 2);
      M0 = iq1m_odd256(s, at), M1 = iq1m_odd256(s, at + 3);
    }
    MOE_UNROLL for (int k = 0; k < 4; ++k) {
      const __m128i gi = _mm_or_si128(iq_byte_k(idx, k), _mm_slli_epi32(iq_bits(qh, T == IQ1S ? 3 * k : 4 * k, 7), 8));
      const __m128i bit = _mm_set1_epi32(T == IQ1S ? 0x8000 : 8 << (4 * k));
      const __m256i pos = _mm256_cvtepi32_epi64(_mm_cmpeq_epi32(_mm_and_si128(qh, bit), _mm_setzero_si128()));
      const __m256i delta = _mm256_blendv_epi8(_mm256_set1_epi8(-1), _mm256_set1_epi8(1), pos);
      V[k] = _mm256_add_epi8(iq_lookup256(IQ1S_GRID_BIASED, gi), delta);
    }
  }
}

// the rows' d unit in lane pairs from their per-256 field 0
template <int T>
MOE_IQ256 inline __m256 iq_d256(__m256i s) {
  __m128 d;
  if constexpr (T == IQ1M) {
    const __m256i dq = _mm256_or_si256(
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi64(s, 12), _mm256_set1_epi64x(0xF)),
                        _mm256_and_si256(_mm256_srli_epi64(s, 24), _mm256_set1_epi64x(0xF0))),
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi64(s, 36), _mm256_set1_epi64x(0xF00)),
                        _mm256_and_si256(_mm256_srli_epi64(s, 48), _mm256_set1_epi64x(0xF000))));
    const __m128i d4 = iq_lo(_mm256_permutevar8x32_epi32(dq, _mm256_setr_epi32(0, 2, 4, 6, 0, 0, 0, 0)));
    d = _mm_cvtph_ps(_mm_packus_epi32(d4, d4));
  } else {
    d = _mm_cvtph_ps(iq_lo(s));
  }
  return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_mul_ps(d, _mm_set1_ps(iq_unit(T)))),
                                  _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
}

}  // namespace

}  // namespace moe

// the micro-kernel for each target: AVX2's products, AVX-VNNI's
#define MOE_IQ_MK iq_mk256_avx2
#define MOE_IQ_PREFILL iq_prefill256_avx2
#define MOE_IQ_TARGET "avx2,fma,f16c"
#define MOE_IQ_VNNI 0
#include "kernels/avx2/gemm_iq_mk256.inc"
#undef MOE_IQ_MK
#undef MOE_IQ_PREFILL
#undef MOE_IQ_TARGET
#undef MOE_IQ_VNNI
#define MOE_IQ_MK iq_mk256_vnni
#define MOE_IQ_PREFILL iq_prefill256_vnni
#define MOE_IQ_TARGET "avx2,fma,f16c,avxvnni"
#define MOE_IQ_VNNI 1
#include "kernels/avx2/gemm_iq_mk256.inc"
#undef MOE_IQ_MK
#undef MOE_IQ_PREFILL
#undef MOE_IQ_TARGET
#undef MOE_IQ_VNNI

namespace moe {

namespace {

template <int T, bool VNNI>
void iq_avx2(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy) {
  if (ns < IQ_PREFILL_MIN) {
    drive_iq<T>(m, e, r0, r1, x, ns, Y, ldy,
                [&](const uint8_t* wb, const uint8_t* sb, int n, const int8_t* const* X, const int32_t* const* XC,
                    int nsb, int nt, float* C) {
                  with_tokens<4>(nt, [&](auto NT) {
                    constexpr int nt_ = decltype(NT)::value;
                    if constexpr (VNNI) {
                      if (n == BLK) iq_mk256_vnni<T, nt_, true>(wb, sb, n, X, XC, nsb, C);
                      else iq_mk256_vnni<T, nt_, false>(wb, sb, n, X, XC, nsb, C);
                    } else {
                      if (n == BLK) iq_mk256_avx2<T, nt_, true>(wb, sb, n, X, XC, nsb, C);
                      else iq_mk256_avx2<T, nt_, false>(wb, sb, n, X, XC, nsb, C);
                    }
                  });
                });
    return;
  }
  drive_iq_prefill<T, 1, 4, 8, 2>(m, e, r0, r1, x, ns, Y, ldy,
                               [&](const uint8_t* wb, const uint8_t* sb, int n, size_t, size_t, const uint8_t* const* A,
                                   int nsb, float* acc) {
                              if constexpr (VNNI) iq_prefill256_vnni<T>(wb, sb, n, A, nsb, ns, acc);
                              else iq_prefill256_avx2<T>(wb, sb, n, A, nsb, ns, acc);
                            });
}

}  // namespace

}  // namespace moe
