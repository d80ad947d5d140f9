// GGUF's grid types as stored (moe_kernels/iq_formats.py): IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M. A
// matrix's rows in blocks of 16 (the last may be shorter), per 256 weights its per-32 fields (each 8 chunks: one a 32,
// the block's rows' bytes side by side) in the data, its per-256 fields (d, IQ3_S's scales, IQ1_M's scales holding d)
// apart in the scale bytes: the file's bytes, moved.
//
// Each 8 weights are one grid entry (IQ2_*, IQ1_*: 8 bytes; IQ3_*: two of 4) with 8 signs (IQ2_XXS, IQ2_XS, IQ3_XXS: 7
// bits and their parity, ggml's ksigns; IQ2_S, IQ3_S: a byte) or a delta of +-1/8 (IQ1_*), under an odd integer
// sub-scale per 16 or 32 (2 ls + 1) and the 256's fp16 d times a power of two (unit below). So a weight is d unit m v
// with an integer v (+-grid value, or IQ1's 8 g +- 1, |v| <= 62) and the dot products are exact in int32: per 16 the
// products' sum times m, summed per 256 (|sum| < 16 x 16 x 62 x 128 x 31 < 2^27), then one FMA with d unit, as the
// K-quants' int-scaled formats (gemm_blocked.h) and ggml's vec_dot do.
//
// The SIMD kernels lay 8 rows (AVX2: 4) out as 8 grid entries: one lookup of 8 entries (IQ3: 16 half entries) a group
// of 8 weights of 8 rows, lanes 2r and 2r + 1 of the int32 sums row r's two halves (added before d). Decode (fewer
// than IQ_PREFILL_MIN tokens) multiplies v + 64 (u8) by the s8 activations, the excess (64 x each 16's activation
// sum) off before m; prefill decodes a row block's 256 once for all tokens and multiplies the u8 activations (x + 128)
// by v (s8), the excess (128 x each 16's weight sum, times m) the block's own, off once a token.
#pragma once

#include "kernels/gemm_blocked.h"
#include "kernels/iq_grids.h"

namespace moe {

namespace {

enum IqType { IQ2XXS, IQ2XS, IQ2S, IQ3XXS, IQ3S, IQ1S, IQ1M };
constexpr int IQ_QK = 256, IQ_SUB = 16, IQ_BIAS = 64;
// the SIMD kernels prefetch the 256 this many ahead into L2: a 256's fields are read out of order (idx, signs, scales
// of each 32 in turn) and without it the prefetchers lagged, decode from DRAM at a third of the cache-resident rate
constexpr int IQ_PF = 2;

// per-32 fields' bytes a row (iq_formats.SPECS' per32, in order), per-256 fields' (per256); the offsets before each
constexpr int IQ_FIELD[7][4] = {{4, 4, 0, 0}, {8, 1, 0, 0}, {4, 4, 1, 1}, {8, 4, 0, 0}, {8, 1, 4, 0}, {4, 2, 0, 0}, {4, 2, 0, 0}};
constexpr int IQ_SFIELD[7][2] = {{2, 0}, {2, 0}, {2, 0}, {2, 0}, {2, 4}, {2, 0}, {8, 0}};
#define MOE_IQ_INLINE __attribute__((always_inline)) inline constexpr  // (into every target's kernels)
MOE_IQ_INLINE int iq_field(int t, int f) { return IQ_FIELD[t][f]; }
MOE_IQ_INLINE int iq_sfield(int t, int f) { return IQ_SFIELD[t][f]; }
MOE_IQ_INLINE int iq_field_at(int t, int f) {
  return (f > 0 ? IQ_FIELD[t][0] : 0) + (f > 1 ? IQ_FIELD[t][1] : 0) + (f > 2 ? IQ_FIELD[t][2] : 0) +
         (f > 3 ? IQ_FIELD[t][3] : 0);
}
MOE_IQ_INLINE int iq_sfield_at(int t, int f) { return f > 0 ? IQ_SFIELD[t][0] : 0; }
MOE_IQ_INLINE int iq_data_bytes(int t) { return 8 * iq_field_at(t, 4); }  // a row's 256
MOE_IQ_INLINE int iq_scale_bytes(int t) { return IQ_SFIELD[t][0] + IQ_SFIELD[t][1]; }
// d's power of two: IQ2_*: d (ls + 1/2) / 4 = d (2 ls + 1) / 8; IQ3_XXS: / 4; IQ3_S: d (2 ls + 1); IQ1_*: the delta 1/8
MOE_IQ_INLINE float iq_unit(int t) { return t == IQ3XXS ? 0.25f : t == IQ3S ? 1.f : 0.125f; }
MOE_IQ_INLINE bool iq_m32(int t) { return t == IQ2XXS || t == IQ3XXS || t == IQ3S || t == IQ1S; }  // one m a 32
// two grid entries (IQ2_*, IQ1_*: 8 bytes each) by scalar loads, at the low and the high dword of v: the SIMD kernels
// look their 8 (AVX2: 4) entries up this way, a vpgatherdq being slower (docs/performance/kernels.md, 2026-12-07)
__attribute__((always_inline)) inline __m128i iq_pair128(const uint64_t* grid, uint64_t v) {
  return _mm_set_epi64x(int64_t(grid[v >> 32]), int64_t(grid[uint32_t(v)]));
}

// where a block of n rows keeps a 256's field f of its 32-group h (the block's rows side by side from there)
__attribute__((always_inline)) inline size_t iq_field_off(int t, int n, int g, int f, int h) {
  return (size_t(g) * iq_data_bytes(t) + 8 * iq_field_at(t, f) + h * iq_field(t, f)) * n;
}
__attribute__((always_inline)) inline size_t iq_sfield_off(int t, int n, int g, int f) {
  return (size_t(g) * iq_scale_bytes(t) + iq_sfield_at(t, f)) * n;
}

inline int iq_signs(int s7) { return s7 | (__builtin_popcount(unsigned(s7)) & 1) << 7; }  // ggml's ksigns_iq2xs
inline uint32_t iq_u16(const uint8_t* p, int i) { return uint32_t(p[2 * i]) | uint32_t(p[2 * i + 1]) << 8; }
inline uint32_t iq_u32(const uint8_t* p) {
  uint32_t a;
  std::memcpy(&a, p, 4);
  return a;
}
// IQ1_M's d: the top nibbles of its 4 uint16 scales
inline uint16_t iq1m_d(uint64_t sc) {
  return uint16_t(((sc >> 12) & 0xF) | ((sc >> 24) & 0xF0) | ((sc >> 36) & 0xF00) | ((sc >> 48) & 0xF000));
}

// One row's 32 weights of group h: v (the integers a weight is d unit m v of) and the two 16s' m. F: the row's bytes
// of each per-32 field of this 32; S: of each per-256 field of its 256.
template <int T>
inline void iq_decode32(const uint8_t* const* F, const uint8_t* const* S, int h, int* v, int* m) {
  auto put = [&](int l, uint64_t grid, int signs, int delta) {
    for (int j = 0; j < 8; ++j) {
      const int g = int((grid >> (8 * j)) & 255);
      v[8 * l + j] = T == IQ1S || T == IQ1M ? g - IQ_BIAS + delta : (signs >> j & 1) ? -g : g;
    }
  };
  if constexpr (T == IQ2XXS || T == IQ3XXS) {
    const uint32_t aux = iq_u32(F[1]);
    m[0] = m[1] = 2 * int(aux >> 28) + 1;
    for (int l = 0; l < 4; ++l) {
      const int s = iq_signs((aux >> (7 * l)) & 127);
      if constexpr (T == IQ2XXS) put(l, IQ2XXS_GRID[F[0][l]], s, 0);
      else put(l, IQ3XXS_GRID[F[0][2 * l]] | uint64_t(IQ3XXS_GRID[F[0][2 * l + 1]]) << 32, s, 0);
    }
  } else if constexpr (T == IQ2XS || T == IQ2S) {
    const int sc = F[T == IQ2XS ? 1 : 3][0];
    m[0] = 2 * (sc & 15) + 1, m[1] = 2 * (sc >> 4) + 1;
    for (int l = 0; l < 4; ++l) {
      if constexpr (T == IQ2XS) {
        const uint32_t q = iq_u16(F[0], l);
        put(l, IQ2XS_GRID[q & 511], iq_signs(int(q >> 9)), 0);
      } else {
        put(l, IQ2S_GRID[F[0][l] | ((F[2][0] >> (2 * l)) & 3) << 8], F[1][l], 0);
      }
    }
  } else if constexpr (T == IQ3S) {
    const int qh = F[1][0];
    m[0] = m[1] = 2 * ((S[1][h / 2] >> (4 * (h % 2))) & 15) + 1;
    for (int l = 0; l < 4; ++l) {
      const int i0 = F[0][2 * l] | ((qh >> (2 * l)) & 1) << 8, i1 = F[0][2 * l + 1] | ((qh >> (2 * l + 1)) & 1) << 8;
      put(l, IQ3S_GRID[i0] | uint64_t(IQ3S_GRID[i1]) << 32, F[2][l], 0);
    }
  } else if constexpr (T == IQ1S) {
    const uint32_t qh = iq_u16(F[1], 0);
    m[0] = m[1] = 2 * int((qh >> 12) & 7) + 1;
    for (int l = 0; l < 4; ++l) put(l, IQ1S_GRID_BIASED[F[0][l] | ((qh >> (3 * l)) & 7) << 8], 0, qh & 0x8000 ? -1 : 1);
  } else {  // IQ1M: a nibble an 8 (3 high index bits, the delta's sign); per 16 a 3-bit scale
    const uint32_t qh = iq_u16(F[1], 0), sc = iq_u16(S[0], h / 2);
    for (int k = 0; k < 2; ++k) m[k] = 2 * int((sc >> (6 * (h % 2) + 3 * k)) & 7) + 1;
    for (int l = 0; l < 4; ++l) {
      const uint32_t nib = (qh >> (4 * l)) & 15;
      put(l, IQ1S_GRID_BIASED[F[0][l] | (nib & 7) << 8], 0, nib & 8 ? -1 : 1);
    }
  }
}

// a 256's d unit from the row's per-256 fields
template <int T>
inline float iq_d(const uint8_t* const* S) {
  if constexpr (T == IQ1M) {
    uint64_t sc;
    std::memcpy(&sc, S[0], 8);
    return f16_to_f32(iq1m_d(sc)) * iq_unit(T);
  } else {
    return f16_to_f32(uint16_t(iq_u16(S[0], 0))) * iq_unit(T);
  }
}

// an expert's packed rows: its 256s a row, row strides of data and scales, and where its rows start
struct IqRows {
  int nsb;
  size_t ldw, lds;
  const uint8_t* We;
  const uint8_t* Se;
};
template <int T>
inline IqRows iq_rows(const Matrix& m, int e) {
  const int nsb = m.Kp / IQ_QK;
  const size_t ldw = size_t(nsb) * iq_data_bytes(T), lds = size_t(nsb) * iq_scale_bytes(T);
  return {nsb, ldw, lds, static_cast<const uint8_t*>(m.w) + size_t(e) * m.rows * ldw,
          reinterpret_cast<const uint8_t*>(m.scale) + size_t(e) * m.rows * lds};
}
inline void iq_check_rows(const Matrix& m, int r0, int r1) {
  MOE_CHECK(r0 % BLK == 0 && (r1 % BLK == 0 || r1 == m.rows), "row-blocked formats' rows are cut on 16-row blocks");
  MOE_CHECK(m.Kp % IQ_QK == 0, "the IQ formats' rows are whole blocks of 256");
}
// the SIMD kernels, at the start of 256 g of a block: its 256 IQ_PF ahead into L2 (sb_bytes: a 256 of the block's rows)
inline void iq_prefetch_ahead(const uint8_t* wb, int g, size_t sb_bytes) {
  const char* next = reinterpret_cast<const char*>(wb + (g + IQ_PF) * sb_bytes);
  for (size_t o = 0; o < sb_bytes; o += 64) _mm_prefetch(next + o, _MM_HINT_T1);
}

// rows [r0, r1) of expert e (whole 16-row blocks, or to the matrix's end), tokens in tiles of 4: mk(block data, block
// scales, rows n, activations, their excess per 16, 256s, tokens nt, C [nt][16])
template <int T, class MK>
inline void drive_iq(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy, MK&& mk) {
  iq_check_rows(m, r0, r1);
  const auto [nsb, ldw, lds, We, Se] = iq_rows<T>(m, e);
  Prepared& p = thread_scratch<Prepared>();
  prepare(reinterpret_cast<const uint8_t* const*>(x.rows), ns, m.Kp, IQ_SUB, IQ_BIAS, false, p);
  for (int r = r0; r < r1; r += BLK) {
    const int n = std::min(BLK, m.rows - r);
    for (int s = 0; s < ns; s += 4) {
      const int nt = std::min(4, ns - s);
      float C[4 * BLK];
      mk(We + size_t(r) * ldw, Se + size_t(r) * lds, n, p.xp.data() + s, p.cp.data() + s, nsb, nt, C);
      for (int t = 0; t < nt; ++t)
        for (int j = 0; j < std::min(n, r1 - r); ++j) Y[size_t(s + t) * ldy + r + j] = C[t * BLK + j] * x.scale[s + t];
    }
  }
}

constexpr int IQ_PREFILL_MIN = 8;  // tokens from which a block is decoded once for all of them (the prefill kernels)
struct IqAcc {  // a thread's prefill accumulators (its own type: thread_scratch is one object per type)
  std::vector<float> v;
};

// The prefill kernels' driver: per NB row blocks, pf(first block's data, its scales, rows n (<= NB x 16), the bytes from
// one block's data and scales to the next's, the u8 activations, 256s, acc) accumulates every token into acc
// [ns][PARTS][LANES] (row j: part j / (16 NB / PARTS), lane STRIDE (j % (16 NB / PARTS)))
template <int T, int NB, int PARTS, int LANES, int STRIDE, class PF>
inline void drive_iq_prefill(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy,
                             PF&& pf) {
  iq_check_rows(m, r0, r1);
  const auto [nsb, ldw, lds, We, Se] = iq_rows<T>(m, e);
  const int per = NB * BLK / PARTS;
  auto A = reinterpret_cast<const uint8_t* const*>(x.rows);
  std::vector<float>& acc = thread_scratch<IqAcc>().v;
  acc.resize(size_t(ns) * PARTS * LANES);
  for (int r = r0; r < r1; r += NB * BLK) {
    const int n = std::min(NB * BLK, r1 - r);  // (r1: a block's start or the matrix's end)
    std::fill(acc.begin(), acc.end(), 0.f);
    pf(We + size_t(r) * ldw, Se + size_t(r) * lds, n, BLK * ldw, BLK * lds, A, nsb, acc.data());
    for (int t = 0; t < ns; ++t) {
      float* y = Y + size_t(t) * ldy + r;
      const float s = x.scale[t];
      if constexpr (STRIDE == 1 && PARTS * LANES == NB * BLK) {  // a token's rows side by side (vectorized)
        const float* a = &acc[size_t(t) * NB * BLK];
        for (int j = 0; j < n; ++j) y[j] = a[j] * s;
      } else {
        for (int j = 0; j < n; ++j) y[j] = acc[(size_t(t) * PARTS + j / per) * LANES + STRIDE * (j % per)] * s;
      }
    }
  }
}

}  // namespace

#define MOE_IQ_ENTRIES(NAME, T)                                                                                      \
  void ref_gemm_rows_##NAME(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy) {  \
    ref_iq<T>(m, e, r0, r1, x, ns, Y, ldy);                                                                       \
  }                                                                                                                \
  void gemm_rows_##NAME##_avx2(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy) { \
    iq_avx2<T, false>(m, e, r0, r1, x, ns, Y, ldy);                                                               \
  }                                                                                                                \
  void gemm_rows_##NAME##_avxvnni(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y,         \
                                  size_t ldy) {                                                                    \
    iq_avx2<T, true>(m, e, r0, r1, x, ns, Y, ldy);                                                                \
  }                                                                                                                \
  void gemm_rows_##NAME##_avx512(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y,          \
                                 size_t ldy) {                                                                     \
    iq_avx512<T>(m, e, r0, r1, x, ns, Y, ldy);                                                                    \
  }

}  // namespace moe
