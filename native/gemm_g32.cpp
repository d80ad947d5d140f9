// The formats with a scale per 32 weights, in row-interleaved blocks: int4g32 (q - 8), uint4g32 (scale * q - min),
// iq4nl (ggml's IQ4_NL grid) and int8g32 (int8). Layout (moe.h): a matrix's rows in blocks of 16 (the last may
// be shorter), a block holding, group by group, chunk vectors whose lane j is row j's 4 weights of one chunk
// of 4 (a group's 8 chunks: nibble formats pack chunk v in the low nibbles and chunk v + 4 in the high ones of
// one vector), then the block's scales group by group, 16 rows each. So one vpdpbusd multiplies 16 rows by one
// broadcast 4-byte chunk of the activations, a group's 8 of them sum in int32 per row, and one FMA applies the
// 16 rows' scales (a vector load): about half the instructions per weight byte of the row-major layout
// (per 64 weights: two dot products each widened and scaled apart, the scales permuted into lanes), which on
// 2 cores was compute-bound (docs/kernels.md). Each row's result ends in its own lane: no reduction.
//
// Weights enter the dot products as u8 and activations as s8 (the callers' u8 = x + 128, flipped once per
// call): nibbles as they are, iq4nl's grid values + 128, int8g32's bytes + 128. What the u8 weights carry in
// excess (8 for int4g32's q - 8, 128) times the group's activation sum comes out in int32 before the scale.
// uint4g32's mins multiply that activation sum in fp32. AVX2 (no u8 x s8 dot product that cannot saturate on
// 255 x 127) multiplies iq4nl and int8g32 as signed bytes with the int8 kernels' sign trick; nibbles (<= 15)
// go through vpmaddubsw directly, a group's 8 chunks summed in int16 (<= 8 x 2 x 15 x 127) before one widening.
#include <immintrin.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "common.h"
#include "kernels.h"
#include "moe.h"
#include "ymm.h"

namespace moe {

namespace {

enum Mode { G32, IQ, ASYM, Q8 };
constexpr int BLK = 16;  // rows a block
constexpr int G = 32;    // weights a group (one scale)
template <int MODE>
constexpr bool nibble = MODE != Q8;
template <int MODE>
constexpr int vectors = nibble<MODE> ? 4 : 8;  // chunk vectors a group loads
// ggml's kvalues_iq4nl: the IQ4_NL / IQ4_XS code -> its value; and + 128 as u8
constexpr int8_t IQ4NL_LUT[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
constexpr uint8_t IQ4NL_U8[16] = {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241};
// what a group's dot product of u8 weights carries in excess, per unit of its activation sum (SIGNED: AVX2's sign
// trick on the signed values)
template <int MODE, bool SIGNED>
constexpr int excess = MODE == G32 ? 8 : MODE == ASYM || SIGNED ? 0 : 128;

// A slot's activations as the kernels take them: s8, and per group its sum times the mode's excess (int32) and
// (uint4g32) the sum as a float. Per call of a driver (one task): the rows are K bytes, this is cheap next to them.
struct Prepared {
  std::vector<int8_t> x;
  std::vector<int32_t> corr;
  std::vector<float> sum;
  std::vector<const int8_t*> xp;
  std::vector<const int32_t*> cp;
  std::vector<const float*> sp;
};
inline void prepare(const uint8_t* const* X, int ns, int Kp, int exc, bool sums, Prepared& p) {
  const int ng = Kp / G;
  p.x.resize(size_t(ns) * Kp);
  p.corr.resize(size_t(ns) * ng);
  p.sum.resize(sums ? size_t(ns) * ng : 0);
  p.xp.resize(ns), p.cp.resize(ns), p.sp.resize(ns);
  for (int s = 0; s < ns; ++s) {
    int8_t* x = &p.x[size_t(s) * Kp];
    for (int i = 0; i < Kp; ++i) x[i] = int8_t(X[s][i] ^ 0x80);
    for (int g = 0; g < ng; ++g) {
      int32_t t = 0;
      for (int i = 0; i < G; ++i) t += x[g * G + i];
      p.corr[size_t(s) * ng + g] = exc * t;
      if (sums) p.sum[size_t(s) * ng + g] = float(t);
    }
    p.xp[s] = x, p.cp[s] = &p.corr[size_t(s) * ng], p.sp[s] = sums ? &p.sum[size_t(s) * ng] : nullptr;
  }
}

// ---- AVX-512: NB units of 16 rows (whole blocks, or one shorter one: n lanes, FULL false) x NT tokens ----
template <int MODE>
__attribute__((target("avx512f,avx512bw"))) inline __m512i decode512(__m512i q) {  // u8 weights
  if constexpr (MODE == IQ)
    return _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(IQ4NL_U8))), q);
  else if constexpr (MODE == Q8) return _mm512_xor_si512(q, _mm512_set1_epi8(char(0x80)));
  else return q;
}
template <int NT, int NB, int MODE, bool FULL>
__attribute__((target("avx512f,avx512bw,avx512dq,avx512vnni"))) inline void mk512(
    const uint8_t* const* W, const float* const* S, size_t moff, int n, const int8_t* const* X,
    const int32_t* const* XC, const float* const* XS, int ng, size_t pf, float* C) {
  const int vs = FULL ? 64 : 4 * n, gs = vectors<MODE> * vs;
  const __mmask16 lanes = FULL ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
  const __m512i lo4 = _mm512_set1_epi8(0x0f);
  __m512 acc[NB][NT];
  MOE_UNROLL for (int b = 0; b < NB; ++b)
    MOE_UNROLL for (int t = 0; t < NT; ++t) acc[b][t] = _mm512_setzero_ps();
  for (int g = 0; g < ng; ++g) {
    __m512i u[NB][8];
    __m512 sv[NB], mv[NB];
    MOE_UNROLL for (int b = 0; b < NB; ++b) {
      const uint8_t* p = W[b] + size_t(g) * gs;
      MOE_UNROLL for (int v = 0; v < vectors<MODE>; ++v) {
        __m512i q;
        if constexpr (FULL) {
          _mm_prefetch(reinterpret_cast<const char*>(p + pf + 64 * v), _MM_HINT_T1);
          q = _mm512_loadu_si512(p + 64 * v);
        } else {
          q = _mm512_maskz_loadu_epi32(lanes, p + vs * v);
        }
        if constexpr (nibble<MODE>) {
          u[b][v] = decode512<MODE>(_mm512_and_si512(q, lo4));
          u[b][v + 4] = decode512<MODE>(_mm512_and_si512(_mm512_srli_epi16(q, 4), lo4));
        } else {
          u[b][v] = decode512<MODE>(q);
        }
      }
      sv[b] = _mm512_maskz_loadu_ps(lanes, S[b] + size_t(g) * n);
      if constexpr (MODE == ASYM) mv[b] = _mm512_maskz_loadu_ps(lanes, S[b] + moff + size_t(g) * n);
    }
    MOE_UNROLL for (int t = 0; t < NT; ++t) {
      const int32_t* xg = reinterpret_cast<const int32_t*>(X[t] + g * G);
      MOE_UNROLL for (int b = 0; b < NB; ++b) {
        __m512i d0 = _mm512_setzero_si512(), d1 = _mm512_setzero_si512();  // two chains: half the latency
        MOE_UNROLL for (int c = 0; c < 4; ++c) {
          d0 = _mm512_dpbusd_epi32(d0, u[b][c], _mm512_set1_epi32(xg[c]));
          d1 = _mm512_dpbusd_epi32(d1, u[b][c + 4], _mm512_set1_epi32(xg[c + 4]));
        }
        __m512i d = _mm512_add_epi32(d0, d1);
        if constexpr (excess<MODE, false> != 0) d = _mm512_sub_epi32(d, _mm512_set1_epi32(XC[t][g]));
        acc[b][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), sv[b], acc[b][t]);
        if constexpr (MODE == ASYM) acc[b][t] = _mm512_fnmadd_ps(mv[b], _mm512_set1_ps(XS[t][g]), acc[b][t]);
      }
    }
  }
  MOE_UNROLL for (int t = 0; t < NT; ++t)
    MOE_UNROLL for (int b = 0; b < NB; ++b) _mm512_storeu_ps(C + (t * NB + b) * BLK, acc[b][t]);
}

// ---- 256-bit (AVX2, AVX-VNNI): a unit is half a block, 8 rows (its lanes of each chunk vector) ----
template <class Dot>
constexpr bool is_vnni = std::is_same_v<Dot, VnniDot>;
template <class Dot, int MODE>
constexpr bool signed_w = !is_vnni<Dot> && (MODE == IQ || MODE == Q8);  // AVX2: signed values, sign trick

// (void functions with out-parameters: these templates have no target of their own, and the entry's flatten
// inlines them)
template <class Dot, int MODE>
inline void decode256(__m256i& q, __m256i lut) {
  if constexpr (MODE == IQ) q = Ymm::lookup(lut, q);
  else if constexpr (MODE == Q8 && !signed_w<Dot, MODE>) q = Ymm::xor80(q);
}
// one group's dot product per lane: u[c] (weights) with chunk c of the activations broadcast
template <class Dot, int MODE>
inline void group_dot(const __m256i (&u)[8], const int32_t* xg, __m256i& d) {
  if constexpr (is_vnni<Dot>) {
    __m256i d0 = Ymm::zero_si(), d1 = Ymm::zero_si();
    MOE_UNROLL for (int c = 0; c < 4; ++c) {
      d0 = Dot::dot(d0, u[c], Ymm::set1_epi32(xg[c]));
      d1 = Dot::dot(d1, u[c + 4], Ymm::set1_epi32(xg[c + 4]));
    }
    d = Ymm::add_epi32(d0, d1);
  } else if constexpr (signed_w<Dot, MODE>) {  // Avx2Dot::dot(acc, q, w): q the activations, w signed weights
    __m256i d0 = Ymm::zero_si(), d1 = Ymm::zero_si();
    MOE_UNROLL for (int c = 0; c < 4; ++c) {
      d0 = Dot::dot(d0, Ymm::set1_epi32(xg[c]), u[c]);
      d1 = Dot::dot(d1, Ymm::set1_epi32(xg[c + 4]), u[c + 4]);
    }
    d = Ymm::add_epi32(d0, d1);
  } else {  // nibbles: u8 weights x s8 activations in int16 pairs, 8 chunks summed before one widening
    __m256i p = Dot::pairs(u[0], Ymm::set1_epi32(xg[0]));
    MOE_UNROLL for (int c = 1; c < 8; ++c) p = Ymm::add_epi16(p, Dot::pairs(u[c], Ymm::set1_epi32(xg[c])));
    d = Dot::widen(p);
  }
}
template <class Dot, int NT, int MODE, bool FULL>
inline void mk256(const uint8_t* W, const float* S, size_t moff, int n, int m, const int8_t* const* X,
                  const int32_t* const* XC, const float* const* XS, int ng, size_t pf, float* C) {
  const int vs = FULL ? 64 : 4 * n, gs = vectors<MODE> * vs;
  const __m256i lut = Ymm::bytes16(signed_w<Dot, MODE> ? IQ4NL_LUT : reinterpret_cast<const int8_t*>(IQ4NL_U8));
  __m256 acc[NT];
  MOE_UNROLL for (int t = 0; t < NT; ++t) acc[t] = Ymm::zero_ps();
  for (int g = 0; g < ng; ++g) {
    __m256i u[8];
    const uint8_t* p = W + size_t(g) * gs;
    MOE_UNROLL for (int v = 0; v < vectors<MODE>; ++v) {
      __m256i q;
      if constexpr (FULL) {
        _mm_prefetch(reinterpret_cast<const char*>(p + pf + 64 * v), _MM_HINT_T1);
        q = Ymm::load(p + 64 * v);
      } else {
        q = Ymm::load_first_epi32(p + vs * v, m);
      }
      if constexpr (nibble<MODE>) {
        Ymm::split_nibbles(q, u[v], u[v + 4]);
        decode256<Dot, MODE>(u[v], lut), decode256<Dot, MODE>(u[v + 4], lut);
      } else {
        u[v] = q;
        decode256<Dot, MODE>(u[v], lut);
      }
    }
    const __m256 sv = FULL ? Ymm::loadu_ps(S + size_t(g) * n) : Ymm::loadu_first_ps(S + size_t(g) * n, m);
    __m256 mv = sv;
    if constexpr (MODE == ASYM)
      mv = FULL ? Ymm::loadu_ps(S + moff + size_t(g) * n) : Ymm::loadu_first_ps(S + moff + size_t(g) * n, m);
    MOE_UNROLL for (int t = 0; t < NT; ++t) {
      __m256i d;
      group_dot<Dot, MODE>(u, reinterpret_cast<const int32_t*>(X[t] + g * G), d);
      if constexpr (excess<MODE, signed_w<Dot, MODE>> != 0) d = Ymm::sub_epi32(d, Ymm::set1_epi32(XC[t][g]));
      acc[t] = Ymm::fmadd(Ymm::to_ps(d), sv, acc[t]);
      if constexpr (MODE == ASYM) acc[t] = Ymm::fnmadd(mv, Ymm::set1(XS[t][g]), acc[t]);
    }
  }
  MOE_UNROLL for (int t = 0; t < NT; ++t) Ymm::storeu_ps(C + t * 8, acc[t]);
}

// rows [r0, r1) of expert e: r0 on a block start, r1 on one or the matrix's end. LANES: rows a micro-kernel
// unit (16: AVX-512, a block; 8: the 256-bit paths, half a block). mk(unit rows' pointers...) per token tile.
template <int MODE, bool SIGNED, int LANES, int TBI, class MK>
inline void drive_g32(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy, MK&& mk) {
  MOE_CHECK(r0 % BLK == 0 && (r1 % BLK == 0 || r1 == m.rows), "int4g32/iq4nl/uint4g32/int8g32 rows are cut on 16-row blocks");
  const int ng = m.Kp / G;
  const size_t ldw = weight_row_bytes(MODE == Q8 ? Fmt::Int8G32 : Fmt::Int4G32, m.Kp);
  const size_t pf = tuning().pf_bytes;
  const uint8_t* We = static_cast<const uint8_t*>(m.w) + size_t(e) * m.rows * ldw;
  const size_t moff = MODE == ASYM ? size_t(m.rows) * ng : 0;  // an expert's mins after its scales
  const float* Se = m.scale + size_t(e) * (size_t(m.rows) * ng + moff);
  thread_local Prepared p;
  prepare(reinterpret_cast<const uint8_t* const*>(x.rows), ns, m.Kp, excess<MODE, SIGNED>, MODE == ASYM, p);
  for (int r = r0; r < r1; r += BLK) {
    const int n = std::min(BLK, m.rows - r);
    const uint8_t* wb = We + size_t(r) * ldw;
    const float* sb = Se + size_t(r) * ng;
    // NB: decode (one token) takes two units at once, for more independent dot-product chains
    const bool pair = LANES == BLK ? n == BLK && r + 2 * BLK <= r1 && m.rows - r >= 2 * BLK : n == BLK;
    for (int s = 0; s < ns; s += TBI) {
      const int nt = std::min(TBI, ns - s);
      float C[TBI * 2 * BLK];
      const int units = mk(wb, sb, moff, n, pair, p.xp.data() + s, p.cp.data() + s, p.sp.data() + s, ng, pf, nt, C);
      const int rows = std::min(units * LANES, r1 - r);
      for (int t = 0; t < nt; ++t)
        for (int j = 0; j < rows; ++j) Y[size_t(s + t) * ldy + r + j] = C[t * units * LANES + j] * x.scale[s + t];
    }
    if (LANES == BLK && pair) r += BLK;  // the second block of the pair
  }
}

// AVX-512's unit calls for one block (or a pair of whole blocks) -> units computed
template <int MODE>
inline int units512(const uint8_t* wb, const float* sb, size_t moff, int n, bool pair, const int8_t* const* X,
                    const int32_t* const* XC, const float* const* XS, int ng, size_t pf, int nt, float* C,
                    size_t block_bytes, size_t block_scales) {
  if (n < BLK) {
    with_tokens<4>(nt, [&](auto NT) {
      const uint8_t* W[1] = {wb};
      const float* S[1] = {sb};
      mk512<decltype(NT)::value, 1, MODE, false>(W, S, moff, n, X, XC, XS, ng, pf, C);
    });
    return 1;
  }
  if (pair && nt == 1) {
    const uint8_t* W[2] = {wb, wb + block_bytes};
    const float* S[2] = {sb, sb + block_scales};
    mk512<1, 2, MODE, true>(W, S, moff, BLK, X, XC, XS, ng, pf, C);
    return 2;
  }
  const int blocks = pair ? 2 : 1;
  for (int b = 0; b < blocks; ++b) {
    const uint8_t* W[1] = {wb + b * block_bytes};
    const float* S[1] = {sb + b * block_scales};
    // tokens [nt, blocks * 16]: block b's rows at column b * 16
    float Cb[4 * BLK];
    with_tokens<4>(nt, [&](auto NT) { mk512<decltype(NT)::value, 1, MODE, true>(W, S, moff, BLK, X, XC, XS, ng, pf, Cb); });
    for (int t = 0; t < nt; ++t)
      for (int j = 0; j < BLK; ++j) C[(t * blocks + b) * BLK + j] = Cb[t * BLK + j];
  }
  return blocks;
}

template <int MODE>
void g32_avx512(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy) {
  const int ng = m.Kp / G;
  const size_t block_bytes = BLK * weight_row_bytes(MODE == Q8 ? Fmt::Int8G32 : Fmt::Int4G32, m.Kp);
  const size_t block_scales = size_t(BLK) * ng;
  drive_g32<MODE, false, BLK, 4>(m, e, r0, r1, x, ns, Y, ldy,
                                 [&](const uint8_t* wb, const float* sb, size_t moff, int n, bool pair,
                                     const int8_t* const* X, const int32_t* const* XC, const float* const* XS, int ng_,
                                     size_t pf, int nt, float* C) {
                                   return units512<MODE>(wb, sb, moff, n, pair, X, XC, XS, ng_, pf, nt, C, block_bytes,
                                                         block_scales);
                                 });
}

// the 256-bit paths: a block's halves (lanes 0-7, 8-15) in turn, each its 8 rows' column of C
template <class Dot, int MODE>
inline int units256(const uint8_t* wb, const float* sb, size_t moff, int n, const int8_t* const* X,
                    const int32_t* const* XC, const float* const* XS, int ng, size_t pf, int nt, float* C) {
  const int halves = (n + 7) / 8;
  for (int h = 0; h < halves; ++h) {
    const int m = std::min(8, n - 8 * h);
    float Ch[4 * 8];
    with_tokens<4>(nt, [&](auto NT) {
      if (n == BLK)
        mk256<Dot, decltype(NT)::value, MODE, true>(wb + 32 * h, sb + 8 * h, moff, n, m, X, XC, XS, ng, pf, Ch);
      else
        mk256<Dot, decltype(NT)::value, MODE, false>(wb + 32 * h, sb + 8 * h, moff, n, m, X, XC, XS, ng, pf, Ch);
    });
    for (int t = 0; t < nt; ++t)
      for (int j = 0; j < 8; ++j) C[(t * halves + h) * 8 + j] = Ch[t * 8 + j];
  }
  return halves;
}

#define MOE_G32_YMM(NAME, TARGET, DOT)                                                                              \
  template <int MODE>                                                                                               \
  MOE_YMM_ENTRY(TARGET) void NAME(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y,         \
                                  size_t ldy) {                                                                     \
    drive_g32<MODE, signed_w<DOT, MODE>, 8, 4>(                                                                     \
        m, e, r0, r1, x, ns, Y, ldy,                                                                                \
        [&](const uint8_t* wb, const float* sb, size_t moff, int n, bool, const int8_t* const* X,                  \
            const int32_t* const* XC, const float* const* XS, int ng, size_t pf, int nt, float* C) {               \
          return units256<DOT, MODE>(wb, sb, moff, n, X, XC, XS, ng, pf, nt, C);                                   \
        });                                                                                                         \
  }
MOE_G32_YMM(g32_avx2, "avx2,fma", Avx2Dot)
MOE_G32_YMM(g32_avxvnni, "avx2,fma,avxvnni", VnniDot)
#undef MOE_G32_YMM

// The reference: each weight read from the layout one at a time, the same sums in the same numbers.
template <int MODE>
void ref_g32(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy) {
  const int ng = m.Kp / G;
  const size_t ldw = MODE == Q8 ? size_t(m.Kp) : size_t(m.Kp) / 2;
  const uint8_t* We = static_cast<const uint8_t*>(m.w) + size_t(e) * m.rows * ldw;
  const size_t moff = MODE == ASYM ? size_t(m.rows) * ng : 0;
  const float* Se = m.scale + size_t(e) * (size_t(m.rows) * ng + moff);
  auto X = reinterpret_cast<const uint8_t* const*>(x.rows);
  for (int r = r0; r < r1; ++r) {
    const int b0 = r / BLK * BLK, n = std::min(BLK, m.rows - b0), j = r - b0;
    const uint8_t* wb = We + size_t(b0) * ldw;
    const float* sb = Se + size_t(b0) * ng;
    for (int s = 0; s < ns; ++s) {
      float acc = 0.f;
      for (int g = 0; g < ng; ++g) {
        int32_t dot = 0, xsum = 0;
        for (int i = 0; i < G; ++i) {
          const int c = i / 4, k = i % 4;  // chunk, byte of the lane
          int32_t w;
          if constexpr (MODE == Q8) {
            w = int8_t(wb[size_t(g) * 32 * n + size_t(c) * 4 * n + 4 * j + k]);
          } else {
            const uint8_t byte = wb[size_t(g) * 16 * n + size_t(c % 4) * 4 * n + 4 * j + k];
            const int q = c < 4 ? byte & 15 : byte >> 4;
            w = MODE == IQ ? IQ4NL_LUT[q] : MODE == G32 ? q - 8 : q;
          }
          const int32_t xv = int32_t(X[s][g * G + i]) - 128;
          dot += w * xv;
          xsum += xv;
        }
        acc += float(dot) * sb[size_t(g) * n + j];
        if constexpr (MODE == ASYM) acc -= sb[moff + size_t(g) * n + j] * float(xsum);
      }
      Y[size_t(s) * ldy + r] = acc * x.scale[s];
    }
  }
}

}  // namespace

void ref_gemm_rows_int4g32(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy) {
  ref_g32<G32>(m, e, r0, r1, x, ns, Y, ldy);
}
void gemm_rows_int4g32_avx2(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy) {
  g32_avx2<G32>(m, e, r0, r1, x, ns, Y, ldy);
}
void gemm_rows_int4g32_avxvnni(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy) {
  g32_avxvnni<G32>(m, e, r0, r1, x, ns, Y, ldy);
}
void gemm_rows_int4g32_avx512(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy) {
  g32_avx512<G32>(m, e, r0, r1, x, ns, Y, ldy);
}
void ref_gemm_rows_iq4nl(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy) {
  ref_g32<IQ>(m, e, r0, r1, x, ns, Y, ldy);
}
void gemm_rows_iq4nl_avx2(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy) {
  g32_avx2<IQ>(m, e, r0, r1, x, ns, Y, ldy);
}
void gemm_rows_iq4nl_avxvnni(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy) {
  g32_avxvnni<IQ>(m, e, r0, r1, x, ns, Y, ldy);
}
void gemm_rows_iq4nl_avx512(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy) {
  g32_avx512<IQ>(m, e, r0, r1, x, ns, Y, ldy);
}
void ref_gemm_rows_uint4g32(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy) {
  ref_g32<ASYM>(m, e, r0, r1, x, ns, Y, ldy);
}
void gemm_rows_uint4g32_avx2(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy) {
  g32_avx2<ASYM>(m, e, r0, r1, x, ns, Y, ldy);
}
void gemm_rows_uint4g32_avxvnni(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy) {
  g32_avxvnni<ASYM>(m, e, r0, r1, x, ns, Y, ldy);
}
void gemm_rows_uint4g32_avx512(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy) {
  g32_avx512<ASYM>(m, e, r0, r1, x, ns, Y, ldy);
}
void ref_gemm_rows_int8g32(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy) {
  ref_g32<Q8>(m, e, r0, r1, x, ns, Y, ldy);
}
void gemm_rows_int8g32_avx2(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy) {
  g32_avx2<Q8>(m, e, r0, r1, x, ns, Y, ldy);
}
void gemm_rows_int8g32_avxvnni(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy) {
  g32_avxvnni<Q8>(m, e, r0, r1, x, ns, Y, ldy);
}
void gemm_rows_int8g32_avx512(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy) {
  g32_avx512<Q8>(m, e, r0, r1, x, ns, Y, ldy);
}

}  // namespace moe
