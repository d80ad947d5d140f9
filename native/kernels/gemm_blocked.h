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
// Where each part lives (kernels/, as kt-kernel's operators/<isa>/ split): this header holds what every ISA's
// kernels share (the modes and their layout constants, the activations' preparation, the row driver) and the entry
// macros; each ISA's kernels are in its folder: avx512/gemm_blocked_avx512.h (AVX-512 VNNI),
// avx2/gemm_blocked_avx2.h (one 256-bit kernel for AVX2 and AVX-VNNI), amx/gemm_blocked_amx.h (AMX tiles, prefill;
// the rest on AVX-512) and portable/gemm_blocked_ref.h (the reference loops).
//
// The templates of every format, private to the files that instantiate them (gemm_blocked_g32.cpp: the formats of
// 32-weight groups; gemm_blocked_k.cpp: GGUF's super-blocked ones with mins; gemm_blocked_s.cpp: those with signed
// sub-scales), each of which includes the ISA headers its entries need: one file took as long to compile as all
// the others together, and the build compiles one file per CPU. An unnamed namespace keeps each file's
// instantiations its own.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kernels/kernels.h"
#include "moe.h"
#include "runtime/common.h"

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
    for (int i = 0; i < Kp; i += 8) {  // 8 bytes at a time (Kp: whole groups; GCC kept the byte loop scalar)
      uint64_t w;
      std::memcpy(&w, X[s] + i, 8);
      w ^= 0x8080808080808080ull;
      std::memcpy(x + i, &w, 8);
    }
    for (int g = 0; g < ng; ++g) {
      int32_t t = 0;
      for (int i = 0; i < gs; ++i) t += x[g * gs + i];
      p.corr[size_t(s) * ng + g] = exc * t;
      if (sums) p.sum[size_t(s) * ng + g] = float(t);
    }
    p.xp[s] = x, p.cp[s] = &p.corr[size_t(s) * ng], p.sp[s] = sums ? &p.sum[size_t(s) * ng] : nullptr;
  }
}

// rows [r0, r1) of expert e: r0 on a block start, r1 on one or the matrix's end. LANES: rows a micro-kernel
// unit (16: AVX-512, a block; 8: the 256-bit paths, half a block). NB: blocks a step (AVX-512's prefill: 2, each
// broadcast activation chunk serving both). mk(first block's pointers, rows n (<= NB x 16), ..., C, the bytes from
// one block's weights and scales to the next's) per token tile -> the units it computed.
template <int MODE>
inline size_t row_bytes(int Kp) {
  return MODE == Q8 ? size_t(Kp) : MODE == Q6K ? size_t(Kp) / 4 * 3 : MODE == Q5K ? size_t(Kp) / 8 * 5
       : MODE == Q3K ? size_t(Kp) / 8 * 3 : MODE == Q2K ? size_t(Kp) / 4 : size_t(Kp) / 2;
}
template <int MODE, int EXCESS, int LANES, int TBI, int NB = 1, class MK>
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
  for (int r = r0; r < r1; r += NB * BLK) {
    const int n = std::min(NB * BLK, r1 - r);  // (r1: a block's start or the matrix's end)
    const uint8_t* wb = We + size_t(r) * ldw;
    const ScaleT<MODE>* sb = Se + size_t(r) * ng * SGE<MODE>;
    for (int s = 0; s < ns; s += TBI) {
      const int nt = std::min(TBI, ns - s);
      float C[TBI * NB * BLK];
      const int units = mk(wb, sb, moff, n, p.xp.data() + s, p.cp.data() + s, p.sp.data() + s, ng, pf, nt, C,
                           BLK * ldw, size_t(BLK) * ng * SGE<MODE>);
      const int rows = std::min(units * LANES, n);
      for (int t = 0; t < nt; ++t) {
        float* y = Y + size_t(s + t) * ldy + r;
        const float* c = C + t * units * LANES;
        const float sc = x.scale[s + t];
        for (int j = 0; j < rows; ++j) y[j] = c[j] * sc;
      }
    }
  }
}

}  // namespace

// a format's entry points (kernels.h), one line each in the files that include the ISA headers they name
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
