// int8 weights (per-row scales) x int8 activations (per-row scales): AVX-512 VNNI (vpdpbusd, u8 x s8),
// AVX-VNNI, AVX2 and portable. Activations arrive as u8 = q + 128, so dot = sum(u8 * w) - 128 * rowsum(w).
// AVX2 has no 4-way u8 x s8 dot product; vpmaddubsw adds pairs of products into int16 and saturates
// for u8 = q + 128 (255 * 127 * 2 > 32767), so it takes |w| x (q with w's sign), both within 127,
// and sums sum(q * w) directly (ggml's mul_sum_i8_pairs). AVX-VNNI has the AVX-512 path's vpdpbusd on ymm.
#include <immintrin.h>

#include "common.h"
#include "moe.h"
#include "reduce4.h"

namespace moe {

namespace {

constexpr int RB = 4, TB = 6;

template <int NT>
__attribute__((target("avx512f,avx512bw,avx512dq,avx512vnni"))) inline void mk(const int8_t* W, size_t ldw, size_t pf, int nr,
                                                                       const uint8_t* const* X, int K, int32_t* C) {
  __m512i acc[RB][NT];
  MOE_UNROLL for (int r = 0; r < RB; ++r)
    MOE_UNROLL for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_setzero_si512();
  const int8_t* w[RB];
  row_streams(W, ldw, nr, w);
  for (int i = 0; i < K; i += 64) {
    __m512i a[RB];
    MOE_UNROLL for (int r = 0; r < RB; ++r) {
      // rows about tuning().pf_bytes further on, same offset: in L2 by the time they are read
      _mm_prefetch(reinterpret_cast<const char*>(w[r] + i + pf), _MM_HINT_T1);
      a[r] = _mm512_loadu_si512(w[r] + i);
    }
    MOE_UNROLL for (int t = 0; t < NT; ++t) {
      __m512i xv = _mm512_loadu_si512(X[t] + i);
      MOE_UNROLL for (int r = 0; r < RB; ++r) acc[r][t] = _mm512_dpbusd_epi32(acc[r][t], xv, a[r]);
    }
  }
  // park the tile, then reduce: reducing straight from the registers makes GCC 12 spill and copy
  // the accumulators inside the K loop
  alignas(64) int32_t tile[NT][RB][16];
  MOE_UNROLL for (int t = 0; t < NT; ++t)
    MOE_UNROLL for (int r = 0; r < RB; ++r) _mm512_store_si512(tile[t][r], acc[r][t]);
  static_assert(RB == 4, "reduce4 sums 4 rows at a time");
  for (int t = 0; t < NT; ++t) {
    alignas(16) int32_t out[4];
    _mm_store_si128(reinterpret_cast<__m128i*>(out),
                    reduce4_epi32(_mm512_load_si512(tile[t][0]), _mm512_load_si512(tile[t][1]),
                                  _mm512_load_si512(tile[t][2]), _mm512_load_si512(tile[t][3])));
    for (int r = 0; r < nr; ++r) C[t * RB + r] = out[r];
  }
}

void mk_dispatch(const int8_t* W, size_t ldw, size_t pf, int nr, const uint8_t* const* X, int nt, int K, int32_t* C) {
  switch (nt) {
    case 6: return mk<6>(W, ldw, pf, nr, X, K, C);
    case 5: return mk<5>(W, ldw, pf, nr, X, K, C);
    case 4: return mk<4>(W, ldw, pf, nr, X, K, C);
    case 3: return mk<3>(W, ldw, pf, nr, X, K, C);
    case 2: return mk<2>(W, ldw, pf, nr, X, K, C);
    default: return mk<1>(W, ldw, pf, nr, X, K, C);
  }
}

// ---- AVX2 ----
constexpr int TB2 = 4;  // 4 x 4 int32 tiles spill a little, and still beat 4 x 2 and 4 x 3 (prefill +8%)

template <int NT>
__attribute__((target("avx2"))) inline void mk_avx2(const int8_t* W, size_t ldw, size_t pf, int nr,
                                                   const uint8_t* const* X, int K, int32_t* C) {
  __m256i acc[RB][NT];
  MOE_UNROLL for (int r = 0; r < RB; ++r)
    MOE_UNROLL for (int t = 0; t < NT; ++t) acc[r][t] = _mm256_setzero_si256();
  const int8_t* w[RB];
  row_streams(W, ldw, nr, w);
  const __m256i flip = _mm256_set1_epi8(char(0x80)), ones = _mm256_set1_epi16(1);
  for (int i = 0; i < K; i += 32) {
    __m256i q[NT];  // u8 q + 128 -> s8 q
    MOE_UNROLL for (int t = 0; t < NT; ++t)
      q[t] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(X[t] + i)), flip);
    MOE_UNROLL for (int r = 0; r < RB; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(w[r] + i + pf), _MM_HINT_T1);
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[r] + i));
      const __m256i aw = _mm256_abs_epi8(wv);
      MOE_UNROLL for (int t = 0; t < NT; ++t)
        acc[r][t] = _mm256_add_epi32(
            acc[r][t], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(q[t], wv)), ones));
    }
  }
  reduce_tile4(acc, nr, C);
}

void mk_avx2_dispatch(const int8_t* W, size_t ldw, size_t pf, int nr, const uint8_t* const* X, int nt, int K,
                      int32_t* C) {
  switch (nt) {
    case 4: return mk_avx2<4>(W, ldw, pf, nr, X, K, C);
    case 3: return mk_avx2<3>(W, ldw, pf, nr, X, K, C);
    case 2: return mk_avx2<2>(W, ldw, pf, nr, X, K, C);
    default: return mk_avx2<1>(W, ldw, pf, nr, X, K, C);
  }
}

// ---- AVX-VNNI: vpdpbusd on ymm, (q + 128) x w as on AVX-512 (one instruction per 32 products
// against AVX2's four) ----
constexpr int TBV = 3;  // 4 x 3 accumulators + 3 activation vectors + 1 weight row: the 16 ymm registers

template <int NT>
__attribute__((target("avx2,avxvnni"))) inline void mk_vnni(const int8_t* W, size_t ldw, size_t pf, int nr,
                                                           const uint8_t* const* X, int K, int32_t* C) {
  __m256i acc[RB][NT];
  MOE_UNROLL for (int r = 0; r < RB; ++r)
    MOE_UNROLL for (int t = 0; t < NT; ++t) acc[r][t] = _mm256_setzero_si256();
  const int8_t* w[RB];
  row_streams(W, ldw, nr, w);
  for (int i = 0; i < K; i += 32) {
    __m256i xv[NT];
    MOE_UNROLL for (int t = 0; t < NT; ++t) xv[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(X[t] + i));
    MOE_UNROLL for (int r = 0; r < RB; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(w[r] + i + pf), _MM_HINT_T1);
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[r] + i));
      MOE_UNROLL for (int t = 0; t < NT; ++t) acc[r][t] = _mm256_dpbusd_avx_epi32(acc[r][t], xv[t], wv);
    }
  }
  reduce_tile4(acc, nr, C);
}

void mk_vnni_dispatch(const int8_t* W, size_t ldw, size_t pf, int nr, const uint8_t* const* X, int nt, int K,
                      int32_t* C) {
  switch (nt) {
    case 3: return mk_vnni<3>(W, ldw, pf, nr, X, K, C);
    case 2: return mk_vnni<2>(W, ldw, pf, nr, X, K, C);
    default: return mk_vnni<1>(W, ldw, pf, nr, X, K, C);
  }
}

}  // namespace

void gemm_rows_int8(Isa isa, const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy) {
  const int8_t* We = static_cast<const int8_t*>(m.w) + size_t(e) * m.rows * m.Kp;
  const size_t pf = prefetch_rows(weight_row_bytes(Fmt::Int8, m.Kp), RB) * m.Kp;  // bytes ahead
  const float* sw = m.scale + size_t(e) * m.rows;
  const int32_t* rs = m.rowsum + size_t(e) * m.rows;
  auto X = reinterpret_cast<const uint8_t* const*>(x.rows);
  const int tb = isa == Isa::Avx2 ? TB2 : isa == Isa::AvxVnni ? TBV : TB;
  for (int r = r0; r < r1; r += RB) {
    const int nr = std::min(RB, r1 - r);
    for (int s = 0; s < ns; s += tb) {
      const int nt = std::min(tb, ns - s);
      int32_t C[TB * RB];
      if (isa == Isa::Portable) {
        for (int t = 0; t < nt; ++t)
          for (int j = 0; j < nr; ++j) {
            int32_t acc = 0;
            const int8_t* wr = We + size_t(r + j) * m.Kp;
            for (int i = 0; i < m.Kp; ++i) acc += int32_t(X[s + t][i]) * wr[i];
            C[t * RB + j] = acc;
          }
      } else if (isa == Isa::Avx2) {
        mk_avx2_dispatch(We + size_t(r) * m.Kp, m.Kp, pf, nr, X + s, nt, m.Kp, C);
      } else if (isa == Isa::AvxVnni) {
        mk_vnni_dispatch(We + size_t(r) * m.Kp, m.Kp, pf, nr, X + s, nt, m.Kp, C);
      } else {
        mk_dispatch(We + size_t(r) * m.Kp, m.Kp, pf, nr, X + s, nt, m.Kp, C);
      }
      const int off = isa == Isa::Avx2 ? 0 : 128;  // the AVX2 kernel sums q * w, the others (q + 128) * w
      for (int t = 0; t < nt; ++t)
        for (int j = 0; j < nr; ++j)
          Y[size_t(s + t) * ldy + r + j] = float(C[t * RB + j] - off * rs[r + j]) * sw[r + j] * x.scale[s + t];
    }
  }
}

}  // namespace moe
