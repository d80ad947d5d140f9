// Machine probes for the kernel benchmark: DRAM read bandwidth and BF16 dot-product peak,
// measured with the same thread pool the kernels use.
#include <immintrin.h>

#include <chrono>

#include "common.h"
#include "probes.h"

namespace moe {

__attribute__((target("avx512f"))) static float sum_block(const float* p, size_t n) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  // prefetched like the kernels' weight streams (tuning().pf_bytes ahead), so the roofline is the
  // best streaming read we know of, not one the kernels can beat by prefetching further
  const size_t pf = tuning().pf_bytes / sizeof(float);
  for (size_t i = 0; i + 64 <= n; i += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(p + i + pf), _MM_HINT_T1);
    _mm_prefetch(reinterpret_cast<const char*>(p + i + pf + 16), _MM_HINT_T1);
    _mm_prefetch(reinterpret_cast<const char*>(p + i + pf + 32), _MM_HINT_T1);
    _mm_prefetch(reinterpret_cast<const char*>(p + i + pf + 48), _MM_HINT_T1);
    a0 = _mm512_add_ps(a0, _mm512_loadu_ps(p + i));
    a1 = _mm512_add_ps(a1, _mm512_loadu_ps(p + i + 16));
    a2 = _mm512_add_ps(a2, _mm512_loadu_ps(p + i + 32));
    a3 = _mm512_add_ps(a3, _mm512_loadu_ps(p + i + 48));
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}

double read_bandwidth(const float* buf, size_t n_floats) {
  ThreadPool& tp = pool();
  const int tasks = tp.size() * 16;
  const size_t chunk = (n_floats / tasks) & ~size_t(63);
  std::vector<float> sink(tasks);
  auto t0 = std::chrono::steady_clock::now();
  tp.parallel_for(tasks, [&](int i) { sink[i] = sum_block(buf + i * chunk, chunk); });
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  volatile float keep = sink[0];
  (void)keep;
  return double(chunk) * tasks * 4 / s;
}

__attribute__((target("avx512f,avx512bw,avx512bf16"))) static float bf16_loop(long iters) {
  __m512 acc[24];
  for (auto& a : acc) a = _mm512_setzero_ps();
  __m512bh x = (__m512bh)_mm512_set1_epi16(0x3f80), y = (__m512bh)_mm512_set1_epi16(0x3c00);
  for (long i = 0; i < iters; ++i)
    for (auto& a : acc) a = _mm512_dpbf16_ps(a, x, y);
  __m512 s = acc[0];
  for (int j = 1; j < 24; ++j) s = _mm512_add_ps(s, acc[j]);
  return _mm512_reduce_add_ps(s);
}

// Seconds for every pool thread to run `loop` once (results kept alive so nothing is optimized out).
template <class Loop>
static double time_on_all_threads(Loop loop) {
  ThreadPool& tp = pool();
  std::vector<double> sink(tp.size());
  auto t0 = std::chrono::steady_clock::now();
  tp.parallel_for(tp.size(), [&](int i) { sink[i] = loop(); });
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  volatile double keep = sink[0];
  (void)keep;
  return s;
}

double bf16_peak_flops(long iters) {
  double s = time_on_all_threads([&] { return double(bf16_loop(iters)); });
  return double(iters) * 24 * 32 * 2 * pool().size() / s;  // 32 bf16 multiply-adds per instruction
}

__attribute__((target("avx512f,avx512vnni"))) static int vnni_loop(long iters) {
  __m512i acc[24];
  for (auto& a : acc) a = _mm512_setzero_si512();
  const __m512i x = _mm512_set1_epi8(1), y = _mm512_set1_epi8(2);
  for (long i = 0; i < iters; ++i)
    for (auto& a : acc) a = _mm512_dpbusd_epi32(a, x, y);
  __m512i s = acc[0];
  for (int j = 1; j < 24; ++j) s = _mm512_add_epi32(s, acc[j]);
  return _mm512_reduce_add_epi32(s);
}

double vnni_peak_ops(long iters) {
  double s = time_on_all_threads([&] { return double(vnni_loop(iters)); });
  return double(iters) * 24 * 64 * 2 * pool().size() / s;  // 64 int8 multiply-adds per instruction
}

}  // namespace moe
