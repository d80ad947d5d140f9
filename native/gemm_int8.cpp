// int8 weights (per-row scales) x int8 activations (per-row scales): AVX-512 VNNI (vpdpbusd, u8 x s8)
// and portable. Activations arrive as u8 = q + 128, so dot = sum(u8 * w) - 128 * rowsum(w).
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
  MOE_UNROLL for (int r = 0; r < RB; ++r) w[r] = W + (r < nr ? r : 0) * ldw;
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

}  // namespace

void gemm_rows_int8(Isa isa, const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy) {
  const int8_t* We = static_cast<const int8_t*>(m.w) + size_t(e) * m.rows * m.Kp;
  const size_t pf = prefetch_rows(weight_row_bytes(Fmt::Int8, m.Kp), RB) * m.Kp;  // bytes ahead
  const float* sw = m.scale + size_t(e) * m.rows;
  const int32_t* rs = m.rowsum + size_t(e) * m.rows;
  auto X = reinterpret_cast<const uint8_t* const*>(x.rows);
  for (int r = r0; r < r1; r += RB) {
    const int nr = std::min(RB, r1 - r);
    for (int s = 0; s < ns; s += TB) {
      const int nt = std::min(TB, ns - s);
      int32_t C[TB * RB];
      if (isa == Isa::Portable) {
        for (int t = 0; t < nt; ++t)
          for (int j = 0; j < nr; ++j) {
            int32_t acc = 0;
            const int8_t* wr = We + size_t(r + j) * m.Kp;
            for (int i = 0; i < m.Kp; ++i) acc += int32_t(X[s + t][i]) * wr[i];
            C[t * RB + j] = acc;
          }
      } else {
        mk_dispatch(We + size_t(r) * m.Kp, m.Kp, pf, nr, X + s, nt, m.Kp, C);
      }
      for (int t = 0; t < nt; ++t)
        for (int j = 0; j < nr; ++j)
          Y[size_t(s + t) * ldy + r + j] = float(C[t * RB + j] - 128 * rs[r + j]) * sw[r + j] * x.scale[s + t];
    }
  }
}

}  // namespace moe
