// The row-blocked signed int formats (kernels/gemm_blocked.h) at prefill on AMX tiles (TDPBSSD), the rest of a
// call (decode, a shorter last block) on the AVX-512 kernels.
#pragma once

#include "kernels/avx512/gemm_blocked_avx512.h"
#include "kernels/gemm_blocked.h"

namespace moe {

namespace {

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

}  // namespace

}  // namespace moe
