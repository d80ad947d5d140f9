// int8 weights (per-row scales) x int8 activations (per-row scales). Activations arrive as u8 = q + 128, so
// dot = sum(u8 * w) - 128 * rowsum(w). AVX-512 VNNI (vpdpbusd on zmm); one 256-bit micro-kernel for AVX2 and
// AVX-VNNI, their dot products apart (ymm.h); the portable loops as the reference.
#include <immintrin.h>

#include <algorithm>

#include "kernels/avx2/ymm.h"
#include "kernels/kernels.h"
#include "kernels/reduce4.h"
#include "moe.h"
#include "runtime/common.h"

namespace moe {

namespace {

constexpr int RB = 4;

// ---- AVX-512 VNNI ----
constexpr int TB = 6;

template <int NT>
__attribute__((target("avx512f,avx512bw,avx512dq,avx512vnni"))) inline void mk512(const int8_t* W, size_t ldw, size_t pf, int nr,
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
  reduce_tile16(acc, nr, C);
}

// ---- 256-bit: AVX2 and AVX-VNNI ----
// tokens per tile: AVX2's 4 x 4 int32 tiles spill a little and still beat 4 x 2 and 4 x 3 (prefill);
// AVX-VNNI: 4 x 3 accumulators + 3 activation vectors + 1 weight row fill the 16 ymm registers
template <class Dot>
constexpr int tb256() { return Dot::offset == 0 ? 4 : 3; }

template <class Dot, int NT>
inline void mk256(const int8_t* W, size_t ldw, size_t pf, int nr, const uint8_t* const* X, int K, int32_t* C) {
  __m256i acc[RB][NT];
  MOE_UNROLL for (int r = 0; r < RB; ++r)
    MOE_UNROLL for (int t = 0; t < NT; ++t) acc[r][t] = Ymm::zero_si();
  const int8_t* w[RB];
  row_streams(W, ldw, nr, w);
  for (int i = 0; i < K; i += 32) {
    __m256i x[NT];
    MOE_UNROLL for (int t = 0; t < NT; ++t) x[t] = Dot::act(Ymm::load(X[t] + i));
    MOE_UNROLL for (int r = 0; r < RB; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(w[r] + i + pf), _MM_HINT_T1);
      const __m256i wv = Ymm::load(w[r] + i);
      MOE_UNROLL for (int t = 0; t < NT; ++t) acc[r][t] = Dot::dot(acc[r][t], x[t], wv);
    }
  }
  Ymm::reduce(acc, nr, C);
}

// rows [r0, r1) of expert e on one ISA's micro-kernel MK(NT); the AVX2 dot sums q * w, the others (q + 128) * w
template <int TBI, int OFFSET, class MK>
inline void drive_int8(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy, MK&& mk) {
  const int8_t* We = static_cast<const int8_t*>(m.w) + size_t(e) * m.rows * m.Kp;
  const size_t pf = prefetch_rows(weight_row_bytes(Fmt::Int8, m.Kp), RB) * m.Kp;  // bytes ahead
  const float* sw = m.scale + size_t(e) * m.rows;
  const int32_t* rs = m.rowsum + size_t(e) * m.rows;
  auto X = reinterpret_cast<const uint8_t* const*>(x.rows);
  drive_rows<RB, TBI, int32_t>(
      r0, r1, ns, TBI, [&](int r, int nr, int s, int nt, int32_t* C) { mk(We + size_t(r) * m.Kp, m.Kp, pf, nr, X + s, nt, m.Kp, C); },
      [&](int r, int nr, int s, int nt, const int32_t* C) {
        for (int t = 0; t < nt; ++t)
          for (int j = 0; j < nr; ++j)
            Y[size_t(s + t) * ldy + r + j] = float(C[t * RB + j] - OFFSET * rs[r + j]) * sw[r + j] * x.scale[s + t];
      });
}

#define MOE_INT8_YMM(NAME, TARGET, DOT)                                                                          \
  MOE_YMM_ENTRY(TARGET) void NAME(const int8_t* W, size_t ldw, size_t pf, int nr, const uint8_t* const* X, int nt, \
                                  int K, int32_t* C) {                                                          \
    with_tokens<tb256<DOT>()>(nt, [&](auto NT) { mk256<DOT, decltype(NT)::value>(W, ldw, pf, nr, X, K, C); });                  \
  }
MOE_INT8_YMM(mk_avx2, "avx2,fma", Avx2Dot)
MOE_INT8_YMM(mk_avxvnni, "avx2,fma,avxvnni", VnniDot)
#undef MOE_INT8_YMM

// One token (decode): a row at a time, so that a task's rows are one sequential stream (the 4-row tile reads
// four streams 2 KB apart, which the hardware prefetcher follows less well: 87% of the DRAM probe against 97% for
// the row-interleaved int8g32 on a Zen 3). Four accumulators over K; the row's sum is the tile's q * w sum.
MOE_YMM_ENTRY("avx2,fma") void rows1_avx2(const Matrix& m, int e, int r0, int r1, const Acts& x, float* Y) {
  const int8_t* We = static_cast<const int8_t*>(m.w) + size_t(e) * m.rows * m.Kp;
  const float* sw = m.scale + size_t(e) * m.rows;
  const uint8_t* X = static_cast<const uint8_t*>(x.rows[0]);
  const int K = m.Kp;
  for (int r = r0; r < r1; ++r) {
    const int8_t* w = We + size_t(r) * K;
    __m256i acc[4] = {Ymm::zero_si(), Ymm::zero_si(), Ymm::zero_si(), Ymm::zero_si()};
    int i = 0;
    for (; i + 128 <= K; i += 128)
      MOE_UNROLL for (int u = 0; u < 4; ++u)
        acc[u] = Avx2Dot::dot(acc[u], Avx2Dot::act(Ymm::load(X + i + 32 * u)), Ymm::load(w + i + 32 * u));
    for (; i < K; i += 32) acc[0] = Avx2Dot::dot(acc[0], Avx2Dot::act(Ymm::load(X + i)), Ymm::load(w + i));
    const int32_t dot = sum8(_mm256_add_epi32(_mm256_add_epi32(acc[0], acc[1]), _mm256_add_epi32(acc[2], acc[3])));
    Y[r] = float(dot) * sw[r] * x.scale[0];
  }
}

// the same on zmm (AVX-512 VNNI; also AMX's decode): activations u8 = q + 128, so the row's rowsum comes off as in
// the tiles (the same integers, the same bits); measured in docs/performance/kernels.md
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void rows1_avx512(const Matrix& m, int e, int r0, int r1,
                                                                        const Acts& x, float* Y) {
  const int8_t* We = static_cast<const int8_t*>(m.w) + size_t(e) * m.rows * m.Kp;
  const float* sw = m.scale + size_t(e) * m.rows;
  const int32_t* rs = m.rowsum + size_t(e) * m.rows;
  const uint8_t* X = static_cast<const uint8_t*>(x.rows[0]);
  const int K = m.Kp;
  for (int r = r0; r < r1; ++r) {
    const int8_t* w = We + size_t(r) * K;
    __m512i acc[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
    int i = 0;
    for (; i + 256 <= K; i += 256)
      MOE_UNROLL for (int u = 0; u < 4; ++u)
        acc[u] = _mm512_dpbusd_epi32(acc[u], _mm512_loadu_si512(X + i + 64 * u), _mm512_loadu_si512(w + i + 64 * u));
    for (; i < K; i += 64) acc[0] = _mm512_dpbusd_epi32(acc[0], _mm512_loadu_si512(X + i), _mm512_loadu_si512(w + i));
    const int32_t dot = _mm512_reduce_add_epi32(
        _mm512_add_epi32(_mm512_add_epi32(acc[0], acc[1]), _mm512_add_epi32(acc[2], acc[3])));
    Y[r] = float(dot - 128 * rs[r]) * sw[r] * x.scale[0];
  }
}

void mk_avx512(const int8_t* W, size_t ldw, size_t pf, int nr, const uint8_t* const* X, int nt, int K, int32_t* C) {
  with_tokens<TB>(nt, [&](auto NT) { mk512<decltype(NT)::value>(W, ldw, pf, nr, X, K, C); });
}

}  // namespace

void ref_gemm_rows_int8(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy) {
  auto X = reinterpret_cast<const uint8_t* const*>(x.rows);
  for (int r = r0; r < r1; ++r) {
    const int8_t* wr = static_cast<const int8_t*>(m.w) + (size_t(e) * m.rows + r) * m.Kp;
    const size_t i = size_t(e) * m.rows + r;
    for (int s = 0; s < ns; ++s) {
      int32_t acc = 0;
      for (int k = 0; k < m.Kp; ++k) acc += int32_t(X[s][k]) * wr[k];
      Y[size_t(s) * ldy + r] = float(acc - 128 * m.rowsum[i]) * m.scale[i] * x.scale[s];
    }
  }
}

void gemm_rows_int8_avx2(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy) {
  if (ns == 1) return rows1_avx2(m, e, r0, r1, x, Y);
  drive_int8<tb256<Avx2Dot>(), Avx2Dot::offset>(m, e, r0, r1, x, ns, Y, ldy, mk_avx2);
}

void gemm_rows_int8_avxvnni(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy) {
  drive_int8<tb256<VnniDot>(), VnniDot::offset>(m, e, r0, r1, x, ns, Y, ldy, mk_avxvnni);
}

void gemm_rows_int8_avx512(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy) {
  if (ns == 1) return rows1_avx512(m, e, r0, r1, x, Y);
  drive_int8<TB, 128>(m, e, r0, r1, x, ns, Y, ldy, mk_avx512);
}

}  // namespace moe
