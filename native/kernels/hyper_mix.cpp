// A hyper-connection's mix (DeepSeek-V4, GLM-5.3-Flash; gpu_service/model/hyper_connections.py mix, the reference): per
// row, its hc streams [hc, H] RMS-normed as one vector, the mixing logits m = fn . that (hc pre, hc post, hc x hc comb),
// pre = sigmoid(.) + eps, post = 2 sigmoid(.), comb a softmax per row + eps made near doubly stochastic by Sinkhorn's
// alternating normalisations, and the block's input sum_s pre_s h_s. On torch's ops that is ~120 tiny ops a mix (the
// Sinkhorn loop), two mixes a layer: ~0.3 ms each at decode against ~20 us of arithmetic. fp32 throughout; the
// streams bf16 or fp32, the input rounded to theirs.
#include <cmath>
#include <type_traits>
#include <vector>

#include "kernels/matvec_f32.h"
#include "kernels/vec_builds.h"
#include "moe.h"
#include "runtime/common.h"

namespace moe {

namespace {

template <class T>
__attribute__((always_inline, optimize("fp-contract=off"))) inline void widen(const T* h, int n, float* out) {
  for (int i = 0; i < n; ++i) {
    if constexpr (std::is_same<T, uint16_t>::value)
      out[i] = bf16_to_f32(h[i]);
    else
      out[i] = h[i];
  }
}
MOE_VEC_BUILDS(widen_any, widen)

MOE_VEC_BUILDS(matvec_any, matvec_f32)

inline float sigmoid(float x) { return 1.f / (1.f + std::exp(-x)); }

}  // namespace

void hyper_mix(Isa isa, int n, int hc, int H, const void* h, bool bf16, const float* fn, const float* base,
               const float* scale, float eps, float norm_eps, int iters, float* post, float* comb, void* x) {
  MOE_CHECK(n > 0 && hc > 0 && H > 0 && iters >= 1, "hyper-connection mix: bad shapes");
  const Vec w = vec_of(isa);
  const int N = hc * H, M = hc * (2 + hc);
  auto row = [&](int r) {
    thread_local std::vector<float> flat, m, pre;
    flat.resize(size_t(N)), m.resize(size_t(M)), pre.resize(size_t(hc));
    if (bf16)
      widen_any(w, static_cast<const uint16_t*>(h) + size_t(r) * N, N, flat.data());
    else
      widen_any(w, static_cast<const float*>(h) + size_t(r) * N, N, flat.data());
    double ss = 0.0;
    for (int i = 0; i < N; ++i) ss += double(flat[i]) * flat[i];
    const float inv = 1.f / std::sqrt(float(ss / N) + norm_eps);
    matvec_any(w, fn, flat.data(), 1, M, N, m.data());  // fn . flat, then the norm's factor (a scalar: it commutes)
    for (int j = 0; j < M; ++j) m[j] *= inv;
    float* po = post + size_t(r) * hc;
    float* c = comb + size_t(r) * hc * hc;
    for (int s = 0; s < hc; ++s) {
      pre[s] = sigmoid(m[s] * scale[0] + base[s]) + eps;
      po[s] = 2.f * sigmoid(m[hc + s] * scale[1] + base[hc + s]);
    }
    for (int i = 0; i < hc; ++i) {  // a softmax per row, + eps
      float* ci = c + size_t(i) * hc;
      float mx = -INFINITY;
      for (int j = 0; j < hc; ++j) mx = std::max(mx, ci[j] = m[2 * hc + i * hc + j] * scale[2] + base[2 * hc + i * hc + j]);
      float sum = 0.f;
      for (int j = 0; j < hc; ++j) sum += (ci[j] = std::exp(ci[j] - mx));
      for (int j = 0; j < hc; ++j) ci[j] = ci[j] / sum + eps;
    }
    auto columns = [&] {
      for (int j = 0; j < hc; ++j) {
        float sum = 0.f;
        for (int i = 0; i < hc; ++i) sum += c[i * hc + j];
        for (int i = 0; i < hc; ++i) c[i * hc + j] /= sum + eps;
      }
    };
    columns();
    for (int it = 1; it < iters; ++it) {  // Sinkhorn: rows, then columns
      for (int i = 0; i < hc; ++i) {
        float sum = 0.f;
        for (int j = 0; j < hc; ++j) sum += c[i * hc + j];
        for (int j = 0; j < hc; ++j) c[i * hc + j] /= sum + eps;
      }
      columns();
    }
    // the block's input: sum_s pre_s h_s, in order, rounded to the streams' type
    for (int k = 0; k < H; ++k) {
      float acc = pre[0] * flat[k];
      for (int s = 1; s < hc; ++s) acc += pre[s] * flat[size_t(s) * H + k];
      if (bf16)
        static_cast<uint16_t*>(x)[size_t(r) * H + k] = f32_to_bf16(acc);
      else
        static_cast<float*>(x)[size_t(r) * H + k] = acc;
    }
  };
  if (n == 1) {
    row(0);
  } else {
    pool().parallel_for(n, row);
  }
}

}  // namespace moe
