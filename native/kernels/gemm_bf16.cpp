// bf16 weights x bf16 activations, fp32 accumulation: AVX-512 BF16 (vdpbf16ps), AVX2 + FMA, and portable.
// AVX2 has no bf16 arithmetic: a 256-bit load of 16 bf16 weights becomes two fp32 vectors with one
// instruction each (<< 16: the even elements; & 0xffff0000: the odd ones), and the activations are
// converted once per call into the same [even 8 | odd 8] order, so each FMA pairs matching elements.
#include <immintrin.h>

#include <type_traits>

#include "kernels/kernels.h"
#include "kernels/reduce4.h"
#include "moe.h"
#include "runtime/common.h"

namespace moe {

namespace {

constexpr int RB = 4;          // weight rows per micro-kernel call
constexpr int TB = 6;          // tokens per call: RB*TB accumulators + RB + 1 of the 32 zmm
// K chunk (partial sums parked in acc_mem between chunks). Rows up to 16 KiB go whole: re-reading a
// row block from L2 for each token block costs less than parking the accumulators per chunk
// (alternating builds: docs/performance/kernels.md, "Measured choices").
constexpr int KC = 8192;

template <int NT, bool PF>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) inline void mk(const uint16_t* W, size_t ldw, size_t pf, int nr,
                                                                       const uint16_t* const* X, int k0, int k1,
                                                                       float* acc_mem, bool first) {
  // partial sums stay 16-lane vectors in acc_mem ([NT][RB] zmm) across K chunks; reduced once at the end
  __m512 acc[RB][NT];
  MOE_UNROLL for (int r = 0; r < RB; ++r)
    MOE_UNROLL for (int t = 0; t < NT; ++t)
      acc[r][t] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(acc_mem + (t * RB + r) * 16);
  const uint16_t* w[RB];
  MOE_UNROLL for (int r = 0; r < RB; ++r) w[r] = W + (r < nr ? r : 0) * ldw;  // missing rows recompute row 0
  for (int i = k0; i < k1; i += 32) {
    __m512bh a[RB];
    MOE_UNROLL for (int r = 0; r < RB; ++r) {
      // rows about tuning().pf_bytes further on, same offset: in L2 by the time they are read
      if constexpr (PF) _mm_prefetch(reinterpret_cast<const char*>(w[r] + i + pf), _MM_HINT_T1);
      a[r] = (__m512bh)_mm512_loadu_si512(w[r] + i);
    }
    MOE_UNROLL for (int t = 0; t < NT; ++t) {
      __m512bh x = (__m512bh)_mm512_loadu_si512(X[t] + i);
      MOE_UNROLL for (int r = 0; r < RB; ++r) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], a[r], x);
    }
  }
  MOE_UNROLL for (int r = 0; r < RB; ++r)
    MOE_UNROLL for (int t = 0; t < NT; ++t) _mm512_storeu_ps(acc_mem + (t * RB + r) * 16, acc[r][t]);
}

void mk_dispatch(const uint16_t* W, size_t ldw, size_t pf, int nr, const uint16_t* const* X, int nt, int k0, int k1, float* acc,
                 bool first, bool prefetch) {
  auto run = [&](auto prefetching) {
    constexpr bool PF = decltype(prefetching)::value;
    switch (nt) {
      case 6: return mk<6, PF>(W, ldw, pf, nr, X, k0, k1, acc, first);
      case 5: return mk<5, PF>(W, ldw, pf, nr, X, k0, k1, acc, first);
      case 4: return mk<4, PF>(W, ldw, pf, nr, X, k0, k1, acc, first);
      case 3: return mk<3, PF>(W, ldw, pf, nr, X, k0, k1, acc, first);
      case 2: return mk<2, PF>(W, ldw, pf, nr, X, k0, k1, acc, first);
      default: return mk<1, PF>(W, ldw, pf, nr, X, k0, k1, acc, first);
    }
  };
  if (prefetch) run(std::true_type{});
  else run(std::false_type{});
}

__attribute__((target("avx512f,avx512dq"))) void reduce(const float* acc, int nt, int nr, float* C, size_t ldc) {
  static_assert(RB == 4, "reduce4 sums 4 rows at a time");
  for (int t = 0; t < nt; ++t) {
    const float* a = acc + t * RB * 16;
    alignas(16) float out[4];
    _mm_store_ps(out, reduce4_ps(_mm512_loadu_ps(a), _mm512_loadu_ps(a + 16), _mm512_loadu_ps(a + 32),
                                 _mm512_loadu_ps(a + 48)));
    for (int r = 0; r < nr; ++r) C[t * ldc + r] = out[r];
  }
}

// ---- AVX2 ----
// Tried and dropped: widening each block of weight rows once per K chunk into an L1 buffer so the
// prefill inner loop is loads and FMAs only: slower (docs/performance/kernels.md, "Measured choices").
constexpr int TB2 = 2;  // RB*TB2 accumulators + 2*TB2 activations + the converted row: 15 of the 16 ymm

template <int NT, bool PF>
__attribute__((target("avx2,fma"))) inline void mk_avx2(const uint16_t* W, size_t ldw, size_t pf, int nr,
                                                       const float* const* X, int k0, int k1, float* acc_mem,
                                                       bool first) {
  __m256 acc[RB][NT];
  MOE_UNROLL for (int r = 0; r < RB; ++r)
    MOE_UNROLL for (int t = 0; t < NT; ++t)
      acc[r][t] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(acc_mem + (t * RB + r) * 8);
  const uint16_t* w[RB];
  MOE_UNROLL for (int r = 0; r < RB; ++r) w[r] = W + (r < nr ? r : 0) * ldw;
  const __m256i odd = _mm256_set1_epi32(int(0xffff0000u));
  for (int i = k0; i < k1; i += 16) {
    __m256 xe[NT], xo[NT];
    MOE_UNROLL for (int t = 0; t < NT; ++t) {
      xe[t] = _mm256_loadu_ps(X[t] + i);
      xo[t] = _mm256_loadu_ps(X[t] + i + 8);
    }
    MOE_UNROLL for (int r = 0; r < RB; ++r) {
      if constexpr (PF) _mm_prefetch(reinterpret_cast<const char*>(w[r] + i + pf), _MM_HINT_T1);
      const __m256i p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[r] + i));
      const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(p, 16)), wo = _mm256_castsi256_ps(_mm256_and_si256(p, odd));
      MOE_UNROLL for (int t = 0; t < NT; ++t) acc[r][t] = _mm256_fmadd_ps(wo, xo[t], _mm256_fmadd_ps(we, xe[t], acc[r][t]));
    }
  }
  MOE_UNROLL for (int r = 0; r < RB; ++r)
    MOE_UNROLL for (int t = 0; t < NT; ++t) _mm256_storeu_ps(acc_mem + (t * RB + r) * 8, acc[r][t]);
}

void mk_avx2_dispatch(const uint16_t* W, size_t ldw, size_t pf, int nr, const float* const* X, int nt, int k0, int k1,
                      float* acc, bool first, bool prefetch) {
  auto run = [&](auto prefetching) {
    constexpr bool PF = decltype(prefetching)::value;
    if (nt == 2) return mk_avx2<2, PF>(W, ldw, pf, nr, X, k0, k1, acc, first);
    return mk_avx2<1, PF>(W, ldw, pf, nr, X, k0, k1, acc, first);
  };
  if (prefetch) run(std::true_type{});
  else run(std::false_type{});
}

__attribute__((target("avx2"))) void reduce_avx2(const float* acc, int nt, int nr, float* C, size_t ldc) {
  for (int t = 0; t < nt; ++t) {
    const float* a = acc + t * RB * 8;
    alignas(16) float out[4];
    _mm_store_ps(out, reduce4_ps(_mm256_loadu_ps(a), _mm256_loadu_ps(a + 8), _mm256_loadu_ps(a + 16),
                                 _mm256_loadu_ps(a + 24)));
    for (int r = 0; r < nr; ++r) C[t * ldc + r] = out[r];
  }
}

// bf16 row -> fp32 in the kernel's [even 8 | odd 8] order per 16 elements
__attribute__((target("avx2"))) void widen_row(const uint16_t* x, int Kp, float* dst) {
  const __m256i odd = _mm256_set1_epi32(int(0xffff0000u));
  for (int i = 0; i < Kp; i += 16) {
    const __m256i p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), _mm256_slli_epi32(p, 16));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i + 8), _mm256_and_si256(p, odd));
  }
}

// One token on AVX2: the task's rows cut into RB runs, one row of each in flight, no software prefetch. A row alone
// is latency-bound (two dependent FMAs a 16 weights); the tile's RB neighbouring rows are four streams that hop a
// row block at a time and need prefetching; RB runs are four sequential streams the hardware prefetcher follows
// (docs/performance/kernels.md, "AVX2 bf16 at one token: four runs"). The tile itself with its rows a run apart: the same bits.
void rows1_avx2(int Kp, const uint16_t* We, int r0, int r1, const float* x, float* Y) {
  const int m = (r1 - r0) / RB;
  alignas(32) float acc[RB * 8];
  float out[RB];
  for (int i = 0; i < m; ++i) {
    mk_avx2<1, false>(We + size_t(r0 + i) * Kp, size_t(m) * Kp, 0, RB, &x, 0, Kp, acc, true);
    reduce_avx2(acc, 1, RB, out, 0);
    for (int j = 0; j < RB; ++j) Y[r0 + j * m + i] = out[j];
  }
  const int t0 = r0 + RB * m;  // the last rows (fewer than RB), neighbours
  if (t0 == r1) return;
  mk_avx2<1, false>(We + size_t(t0) * Kp, Kp, 0, r1 - t0, &x, 0, Kp, acc, true);
  reduce_avx2(acc, 1, r1 - t0, Y + t0, 0);
}

// rows over activations already widened (xr: fp32 rows in widen_row's order)
void rows_avx2_widened(int Kp, const uint16_t* We, size_t pf, int r0, int r1, const float* const* xr, int ns, float* Y,
                       size_t ldy, bool prefetch) {
  if (ns == 1) return rows1_avx2(Kp, We, r0, r1, xr[0], Y);
  thread_local std::vector<float> acc;
  const bool prefetch_all = prefetch && ns < 8 * TB2;
  acc.resize(size_t(ns) * RB * 8);
  for (int r = r0; r < r1; r += RB) {
    const int nr = std::min(RB, r1 - r);
    for (int k0 = 0; k0 < Kp; k0 += KC)
      for (int s = 0; s < ns; s += TB2)
        mk_avx2_dispatch(We + size_t(r) * Kp, Kp, pf, nr, xr + s, std::min(TB2, ns - s), k0,
                         std::min(Kp, k0 + KC), acc.data() + size_t(s) * RB * 8, k0 == 0,
                         prefetch && (prefetch_all || s < 2 * TB2));
    for (int s = 0; s < ns; s += TB2)
      reduce_avx2(acc.data() + size_t(s) * RB * 8, std::min(TB2, ns - s), nr, Y + size_t(s) * ldy + r, ldy);
  }
}

void rows_avx2(int Kp, const uint16_t* We, size_t pf, int r0, int r1, const uint16_t* const* X, int ns, float* Y,
               size_t ldy) {  // pf 0: no prefetching
  // the activations widened once per call (a task's rows reuse them); a few KB per token
  thread_local std::vector<float> xf;
  thread_local std::vector<const float*> xr;
  xf.resize(size_t(ns) * Kp);
  xr.resize(ns);
  for (int s = 0; s < ns; ++s) {
    widen_row(X[s], Kp, xf.data() + size_t(s) * Kp);
    xr[s] = xf.data() + size_t(s) * Kp;
  }
  rows_avx2_widened(Kp, We, pf, r0, r1, xr.data(), ns, Y, ldy, pf != 0);
}

// One token: the task's rows cut into RB runs, one row of each in flight (the tile with its rows a run apart), no
// software prefetch, as the AVX2 path does: a row at a time (one stream, one chain of vdpbf16ps) was latency-bound
// on Zen 5 (docs/performance/kernels.md, "AVX-512 bf16 at one token on Zen 5"); RB runs are four sequential streams
// the hardware prefetcher follows and four chains. Each row's one chain of K and the 4 rows' reduce4 are the tile's,
// so one token's sums are bit for bit those of a token among several.
__attribute__((target("avx512f,avx512bw,avx512dq,avx512bf16"))) void rows1_bf16_avx512(const uint16_t* We, int Kp, int r0,
                                                                                        int r1, const uint16_t* X,
                                                                                        float* Y) {
  const int m = (r1 - r0) / RB;
  alignas(64) float acc[RB * 16];
  float out[RB];
  const uint16_t* const xs[1] = {X};
  for (int i = 0; i < m; ++i) {
    mk<1, false>(We + size_t(r0 + i) * Kp, size_t(m) * Kp, 0, RB, xs, 0, Kp, acc, true);
    reduce(acc, 1, RB, out, 0);
    for (int j = 0; j < RB; ++j) Y[r0 + j * m + i] = out[j];
  }
  const int t0 = r0 + RB * m;  // the last rows (fewer than RB), neighbours
  if (t0 == r1) return;
  mk<1, false>(We + size_t(t0) * Kp, Kp, 0, r1 - t0, xs, 0, Kp, acc, true);
  reduce(acc, 1, r1 - t0, Y + t0, 0);
}

}  // namespace

void bf16_rows_avx2(const uint16_t* We, int Kp, int r0, int r1, const uint16_t* const* X, int ns, float* Y, size_t ldy,
                    size_t pf) {
  rows_avx2(Kp, We, pf, r0, r1, X, ns, Y, ldy);
}

void bf16_rows_avx2_widened(const uint16_t* We, int Kp, int r0, int r1, const float* const* X, int ns, float* Y,
                            size_t ldy) {
  rows_avx2_widened(Kp, We, 0, r0, r1, X, ns, Y, ldy, false);
}

// 16 partial sums, so the compiler vectorizes it (SSE2, NEON) without -ffast-math
void ref_gemm_rows_bf16(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy) {
  const uint16_t* We = static_cast<const uint16_t*>(m.w) + size_t(e) * m.rows * m.Kp;
  auto X = reinterpret_cast<const uint16_t* const*>(x.rows);
  for (int r = r0; r < r1; ++r)
    for (int s = 0; s < ns; ++s) {
      const uint16_t *w = We + size_t(r) * m.Kp, *xs = X[s];
      float a[16] = {};
      for (int i = 0; i < m.Kp; i += 16)
        for (int j = 0; j < 16; ++j) a[j] += bf16_to_f32(w[i + j]) * bf16_to_f32(xs[i + j]);
      float acc = 0.f;
      for (float v : a) acc += v;
      Y[size_t(s) * ldy + r] = acc;
    }
}

void gemm_rows_bf16_avx2(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy) {
  const uint16_t* We = static_cast<const uint16_t*>(m.w) + size_t(e) * m.rows * m.Kp;
  const size_t pf = prefetch_rows(weight_row_bytes(Fmt::Bf16, m.Kp), RB) * m.Kp;  // elements ahead
  rows_avx2(m.Kp, We, pf, r0, r1, reinterpret_cast<const uint16_t* const*>(x.rows), ns, Y, ldy);
}

void gemm_rows_bf16_avx512(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy) {
  const uint16_t* We = static_cast<const uint16_t*>(m.w) + size_t(e) * m.rows * m.Kp;
  const size_t pf = prefetch_rows(weight_row_bytes(Fmt::Bf16, m.Kp), RB) * m.Kp;  // elements ahead
  bf16_rows_avx512(We, m.Kp, r0, r1, reinterpret_cast<const uint16_t* const*>(x.rows), ns, Y, ldy, pf);
}

void bf16_rows_avx512(const uint16_t* We, int Kp, int r0, int r1, const uint16_t* const* X, int ns, float* Y,
                      size_t ldy, size_t pf) {
  if (ns == 1) return rows1_bf16_avx512(We, Kp, r0, r1, X[0], Y);
  // With many token blocks the kernel is compute-bound and the prefetches of the later blocks only
  // take load slots; with few (Qwen3 prefill, ~6 per expert), every block prefetches
  const bool prefetch_all = pf && ns < 8 * TB;
  thread_local std::vector<float> acc;
  acc.resize(size_t(ns) * RB * 16);
  for (int r = r0; r < r1; r += RB) {
    const int nr = std::min(RB, r1 - r);
    for (int k0 = 0; k0 < Kp; k0 += KC)
      for (int s = 0; s < ns; s += TB)
        mk_dispatch(We + size_t(r) * Kp, Kp, pf, nr, X + s, std::min(TB, ns - s), k0, std::min(Kp, k0 + KC),
                    acc.data() + size_t(s) * RB * 16, k0 == 0, pf && (prefetch_all || s < 2 * TB));
    for (int s = 0; s < ns; s += TB)
      reduce(acc.data() + size_t(s) * RB * 16, std::min(TB, ns - s), nr, Y + size_t(s) * ldy + r, ldy);
  }
}

}  // namespace moe
