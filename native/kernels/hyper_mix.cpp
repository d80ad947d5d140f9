// A hyper-connection's mix (DeepSeek-V4, GLM-5.3-Flash; gpu_service/model/hyper_connections.py mix, the reference): per
// row, its hc streams [hc, H] RMS-normed as one vector, the mixing logits m = fn . that (hc pre, hc post, hc x hc comb),
// pre = sigmoid(.) + eps, post = 2 sigmoid(.), comb a softmax per row + eps made near doubly stochastic by Sinkhorn's
// alternating normalisations, and the block's input sum_s pre_s h_s. On torch's ops that is ~120 tiny ops a mix (the
// Sinkhorn loop), two mixes a layer: ~0.3 ms each at decode against ~20 us of arithmetic. fp32 throughout; the
// streams bf16 or fp32, the input rounded to theirs. And the expand after the block (its output spread by post, the
// old streams mixed by comb) in one pass instead of four torch ops.
#include <cmath>
#include <type_traits>
#include <vector>

#include "kernels/matvec_f32.h"
#include "kernels/torch_rounding.h"
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

// One row of the expand: out_j = post_j y + sum_i comb_ij h_i, rounded where torch's form (post.to(T) * y) +
// (comb.to(T)^T @ h) rounds: the weights to T, the product to T, the mixed sum (fp32, i in order) to T, their sum
// to T. Each pass a plain loop over the row (mixed: fp32 scratch of H), so that it vectorizes.
template <class T>
__attribute__((always_inline, optimize("fp-contract=off"))) inline void expand_row(
    int hc, int H, const T* __restrict__ h, const T* __restrict__ y, const float* __restrict__ post,
    const float* __restrict__ comb, T* __restrict__ out, float* __restrict__ mixed) {
  using namespace rounding;
  for (int j = 0; j < hc; ++j) {
    const float c0 = held<T>(comb[j]);
    for (int c = 0; c < H; ++c) mixed[c] = c0 * get(h, size_t(c));
    for (int i = 1; i < hc; ++i) {
      const float ci = held<T>(comb[i * hc + j]);
      const T* hi = h + size_t(i) * H;
      for (int c = 0; c < H; ++c) mixed[c] += ci * get(hi, size_t(c));
    }
    const float pj = held<T>(post[j]);
    T* o = out + size_t(j) * H;
    for (int c = 0; c < H; ++c) put(o, size_t(c), held<T>(pj * get(y, size_t(c))) + held<T>(mixed[c]));
  }
}
MOE_VEC_BUILDS(expand_row_any, expand_row)

}  // namespace

void hyper_expand(Isa isa, int n, int hc, int H, const void* h, bool bf16, const void* y, const float* post,
                  const float* comb, void* out) {
  MOE_CHECK(n > 0 && hc > 0 && H > 0, "hyper-connection expand: bad shapes");
  const Vec w = vec_of(isa);
  const size_t N = size_t(hc) * H;
  auto row = [&](int r) {
    thread_local std::vector<float> mixed;
    mixed.resize(size_t(H));
    if (bf16)
      expand_row_any(w, hc, H, static_cast<const uint16_t*>(h) + r * N, static_cast<const uint16_t*>(y) + size_t(r) * H,
                     post + size_t(r) * hc, comb + size_t(r) * hc * hc, static_cast<uint16_t*>(out) + r * N,
                     mixed.data());
    else
      expand_row_any(w, hc, H, static_cast<const float*>(h) + r * N, static_cast<const float*>(y) + size_t(r) * H,
                     post + size_t(r) * hc, comb + size_t(r) * hc * hc, static_cast<float*>(out) + r * N,
                     mixed.data());
  };
  if (n == 1) {
    row(0);
  } else {
    pool().parallel_for(n, row);
  }
}

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
