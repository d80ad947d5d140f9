// Machine probes for the kernel benchmark: DRAM read bandwidth and the arithmetic peaks each kernel
// path is held to (AVX-512: vdpbf16ps, vpdpbusd; AVX2: fp32 FMA, the vpmaddubsw chain), measured
// with the same thread pool the kernels use.
#include <immintrin.h>

#include <chrono>

#include "runtime/common.h"
#include "runtime/probes.h"

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

__attribute__((target("avx2"))) static float sum_block_avx2(const float* p, size_t n) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  const size_t pf = tuning().pf_bytes / sizeof(float);
  for (size_t i = 0; i + 64 <= n; i += 64) {
    for (int j = 0; j < 64; j += 16) _mm_prefetch(reinterpret_cast<const char*>(p + i + pf + j), _MM_HINT_T1);
    for (int j = 0; j < 64; j += 32) {
      a0 = _mm256_add_ps(a0, _mm256_loadu_ps(p + i + j));
      a1 = _mm256_add_ps(a1, _mm256_loadu_ps(p + i + j + 8));
      a2 = _mm256_add_ps(a2, _mm256_loadu_ps(p + i + j + 16));
      a3 = _mm256_add_ps(a3, _mm256_loadu_ps(p + i + j + 24));
    }
  }
  alignas(32) float out[8];
  _mm256_store_ps(out, _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  return out[0] + out[1] + out[2] + out[3] + out[4] + out[5] + out[6] + out[7];
}

static float sum_block_scalar(const float* p, size_t n) {  // 8 independent sums: the compiler vectorizes
  float a[8] = {};
  for (size_t i = 0; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) a[j] += p[i + j];
  return a[0] + a[1] + a[2] + a[3] + a[4] + a[5] + a[6] + a[7];
}

double read_bandwidth(const float* buf, size_t n_floats, const std::string& variant) {
  const CpuFeatures f = detect_cpu();
  const bool has512 = f.os_avx512 && f.avx512f, has2 = f.os_avx && f.avx2;
  const std::string v = variant != "auto" ? variant : has512 ? "avx512" : has2 ? "avx2" : "scalar";
  MOE_CHECK(v == "scalar" || (v == "avx2" && has2) || (v == "avx512" && has512),
            "read_bandwidth: variant " + v + " is not available on this CPU (auto picks one that is)");
  float (*sum)(const float*, size_t) = v == "avx512" ? sum_block : v == "avx2" ? sum_block_avx2 : sum_block_scalar;
  ThreadPool& tp = pool();
  const int tasks = tp.size() * 16;
  const size_t chunk = (n_floats / tasks) & ~size_t(63);
  std::vector<float> sink(tasks);
  auto t0 = std::chrono::steady_clock::now();
  tp.parallel_for(tasks, [&](int i) { sink[i] = sum(buf + i * chunk, chunk); });
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

__attribute__((target("avx2,fma"))) static float fma_loop(long iters) {
  __m256 acc[12];  // 12 chains: two FMA pipes x 4-5 cycles latency, with room
  for (auto& a : acc) a = _mm256_setzero_ps();
  const __m256 x = _mm256_set1_ps(1.f), y = _mm256_set1_ps(1e-9f);
  for (long i = 0; i < iters; ++i)
    for (auto& a : acc) a = _mm256_fmadd_ps(x, y, a);
  __m256 s = acc[0];
  for (int j = 1; j < 12; ++j) s = _mm256_add_ps(s, acc[j]);
  alignas(32) float out[8];
  _mm256_store_ps(out, s);
  return out[0];
}

double fma_peak_flops(long iters) {
  double s = time_on_all_threads([&] { return double(fma_loop(iters)); });
  return double(iters) * 12 * 8 * 2 * pool().size() / s;  // 8 fp32 multiply-adds per instruction
}

// The int8 dot product AVX2 has: vpmaddubsw (32 u8 x s8 products, pairs summed to int16), vpmaddwd
// by ones (to int32), vpaddd; without the operand sign fix-up the kernels need on top.
__attribute__((target("avx2"))) static int avx2_int8_loop(long iters) {
  __m256i acc[8];
  for (auto& a : acc) a = _mm256_setzero_si256();
  const __m256i x = _mm256_set1_epi8(1), y = _mm256_set1_epi8(2), ones = _mm256_set1_epi16(1);
  for (long i = 0; i < iters; ++i)
    for (auto& a : acc) {
      __m256i xi = x;
      __asm__ volatile("" : "+x"(xi));  // opaque to the compiler: otherwise the invariant products leave the loop
      a = _mm256_add_epi32(a, _mm256_madd_epi16(_mm256_maddubs_epi16(xi, y), ones));
    }
  __m256i s = acc[0];
  for (int j = 1; j < 8; ++j) s = _mm256_add_epi32(s, acc[j]);
  return _mm256_extract_epi32(s, 0);
}

double avx2_int8_peak_ops(long iters) {
  double s = time_on_all_threads([&] { return double(avx2_int8_loop(iters)); });
  return double(iters) * 8 * 32 * 2 * pool().size() / s;  // 32 int8 multiply-adds per vpmaddubsw
}

// AVX-VNNI's vpdpbusd on ymm (VEX): 32 u8 x s8 multiply-adds, summed into int32 in one instruction
__attribute__((target("avx2,avxvnni"))) static int avxvnni_loop(long iters) {
  __m256i acc[12];  // two pipes x 5 cycles latency, with room (the 16 ymm registers)
  for (auto& a : acc) a = _mm256_setzero_si256();
  const __m256i x = _mm256_set1_epi8(1), y = _mm256_set1_epi8(2);
  for (long i = 0; i < iters; ++i)
    for (auto& a : acc) a = _mm256_dpbusd_avx_epi32(a, x, y);
  __m256i s = acc[0];
  for (int j = 1; j < 12; ++j) s = _mm256_add_epi32(s, acc[j]);
  return _mm256_extract_epi32(s, 0);
}

double avxvnni_peak_ops(long iters) {
  double s = time_on_all_threads([&] { return double(avxvnni_loop(iters)); });
  return double(iters) * 12 * 32 * 2 * pool().size() / s;
}

// A tile multiply is a 16 x 16 block of dot products of length 32 (bf16) or 64 (int8).
double amx_bf16_peak_flops(long iters) {
  double s = time_on_all_threads([&] { return double(amx_peak_loop(true, iters)); });
  return double(iters) * 4 * 16 * 16 * 32 * 2 * pool().size() / s;
}

double amx_int8_peak_ops(long iters) {
  double s = time_on_all_threads([&] { return double(amx_peak_loop(false, iters)); });
  return double(iters) * 4 * 16 * 16 * 64 * 2 * pool().size() / s;
}

}  // namespace moe
