// Routed-expert SwiGLU over bf16 weights, fp32 activations and accumulation.
//   gate_up: [E, 2I, H] bf16 (rows 0..I-1 gate, I..2I-1 up; each row contiguous over H)
//   down:    [E, H, I]  bf16
// Per token: act_j = silu(gate_e x) * up_e x for each chosen expert e = ids[j] (rounded to bf16,
// as a bf16 model would), then out = sum_j w_j * down_e act_j. Work is split into tasks over
// (expert slot, row block) for the first matrix and (row block) for the second, so every thread
// streams weights at decode. Two row-dot implementations: portable C++ and AVX-512 BF16.
#include <immintrin.h>

#include <cmath>

#include "common.h"
#include "moe.h"

namespace moe {

static float dot_portable(const uint16_t* w, const uint16_t* x, int n) {
  float acc = 0.f;
  for (int i = 0; i < n; ++i) acc += bf16_to_f32(w[i]) * bf16_to_f32(x[i]);
  return acc;
}

__attribute__((target("avx512f,avx512bw,avx512bf16"))) static float dot_avx512bf16(const uint16_t* w,
                                                                                    const uint16_t* x, int n) {
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  int i = 0;
  for (; i + 64 <= n; i += 64) {
    acc0 = _mm512_dpbf16_ps(acc0, (__m512bh)_mm512_loadu_si512(w + i), (__m512bh)_mm512_loadu_si512(x + i));
    acc1 = _mm512_dpbf16_ps(acc1, (__m512bh)_mm512_loadu_si512(w + i + 32),
                            (__m512bh)_mm512_loadu_si512(x + i + 32));
  }
  for (; i + 32 <= n; i += 32)
    acc0 = _mm512_dpbf16_ps(acc0, (__m512bh)_mm512_loadu_si512(w + i), (__m512bh)_mm512_loadu_si512(x + i));
  if (i < n) {  // masked tail: zeros contribute nothing
    __mmask32 m = (__mmask32)((1ull << (n - i)) - 1);
    acc1 = _mm512_dpbf16_ps(acc1, (__m512bh)_mm512_maskz_loadu_epi16(m, w + i),
                            (__m512bh)_mm512_maskz_loadu_epi16(m, x + i));
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}

using DotFn = float (*)(const uint16_t*, const uint16_t*, int);

static DotFn dot_for(Isa isa) { return isa == Isa::Avx512Bf16 ? dot_avx512bf16 : dot_portable; }

void moe_forward_bf16(Isa isa, const MoEShape& s, const uint16_t* gate_up, const uint16_t* down,
                      const float* hidden, const int32_t* ids, const float* weights, float* out, int T, int k) {
  MOE_CHECK(T >= 0 && k >= 1, "bad token count or k");
  for (int i = 0; i < T * k; ++i)
    MOE_CHECK(ids[i] >= 0 && ids[i] < s.E, "expert id out of range");
  const int H = s.H, I = s.I;
  const DotFn dot = dot_for(isa);
  constexpr int ROWS = 16;  // rows per task: enough work to amortize, enough tasks to balance
  std::vector<uint16_t> xb(H), act(size_t(k) * I);
  std::vector<float> gu(size_t(k) * 2 * I);
  ThreadPool& tp = pool();
  for (int t = 0; t < T; ++t) {
    for (int h = 0; h < H; ++h) xb[h] = f32_to_bf16(hidden[size_t(t) * H + h]);
    const int32_t* tid = ids + size_t(t) * k;
    const float* tw = weights + size_t(t) * k;
    const int blocks1 = (2 * I + ROWS - 1) / ROWS;
    tp.parallel_for(k * blocks1, [&](int task) {
      int j = task / blocks1, r0 = (task % blocks1) * ROWS, r1 = std::min(2 * I, r0 + ROWS);
      const uint16_t* W = gate_up + size_t(tid[j]) * 2 * I * H;
      for (int r = r0; r < r1; ++r) gu[size_t(j) * 2 * I + r] = dot(W + size_t(r) * H, xb.data(), H);
    });
    for (int j = 0; j < k; ++j)
      for (int i = 0; i < I; ++i) {
        // round like a bf16 model: gate and up outputs, silu, and the product are bf16
        float g = bf16_to_f32(f32_to_bf16(gu[size_t(j) * 2 * I + i]));
        float u = bf16_to_f32(f32_to_bf16(gu[size_t(j) * 2 * I + I + i]));
        float sg = bf16_to_f32(f32_to_bf16(g / (1.f + std::exp(-g))));
        act[size_t(j) * I + i] = f32_to_bf16(sg * u);
      }
    const int blocks2 = (H + ROWS - 1) / ROWS;
    float* o = out + size_t(t) * H;
    tp.parallel_for(blocks2, [&](int task) {
      int r0 = task * ROWS, r1 = std::min(H, r0 + ROWS);
      for (int r = r0; r < r1; ++r) {
        float acc = 0.f;
        for (int j = 0; j < k; ++j)
          acc += tw[j] * dot(down + (size_t(tid[j]) * H + r) * I, act.data() + size_t(j) * I, I);
        o[r] = acc;
      }
    });
  }
}

}  // namespace moe
