// One part of a layer request as the exchange ring hands it over: hidden in bf16 or fp32 straight
// from shared memory, the deferral split done here (the same rule as moe_core/routing.py:
// per token, experts by weight descending, ties keep slot order; the first k - defer are
// IMMEDIATE, the rest DEFERRED), output written in the caller's dtype where the caller wants it.
// Saves the Python side a dozen small torch ops per layer (each costs microseconds).
#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>

#include "moe.h"
#include "runtime/common.h"

namespace moe {

void moe_forward_part(const MoELayer& l, const void* hidden, bool hidden_bf16, const int32_t* ids,
                      const float* weights, void* out, bool out_bf16, int T, int k, int defer, int part) {
  const MoEWeights& m = l.w;
  MOE_CHECK(T >= 0 && k >= 1 && defer >= 0 && defer < k && (part == 0 || part == 1), "bad T, k, defer or part");
  MOE_CHECK(part == 0 || defer > 0, "no deferred part when defer = 0");
  const int H = m.H;
  const size_t n = size_t(T) * H, nk = size_t(T) * k;
  // `hidden`, `ids` and `weights` may sit in memory another process can still write (the shared
  // ring): copy what is indexed with or sorted by into private memory once, check the copy, and
  // use only the copy. Hidden values are only read (a change mid-call garbles this result, no more).
  Scratch& sc = pool().scratch;  // the caller holds compute_mutex()
  sc.ids.assign(ids, ids + nk);
  sc.wts.assign(weights, weights + nk);
  ids = sc.ids.data();
  weights = sc.wts.data();
  for (size_t i = 0; i < nk; ++i) {
    MOE_CHECK(ids[i] >= -1 && ids[i] < m.E, "topk_ids: expert ids must be in [0, " + std::to_string(m.E) +
                                                ") or -1 (none), got " + std::to_string(ids[i]));
    MOE_CHECK(std::isfinite(weights[i]), "topk_weights: non-finite values");
  }
  std::vector<float>& x32 = sc.x32;
  const float* x;
  bool bad = false;  // inf/nan: all exponent bits set; OR-reduced so the loop vectorizes
  if (hidden_bf16) {
    x32.resize(n);
    auto* h = static_cast<const uint16_t*>(hidden);
    for (size_t i = 0; i < n; ++i) {
      bad |= (h[i] & 0x7f80) == 0x7f80;
      x32[i] = bf16_to_f32(h[i]);
    }
    x = x32.data();
  } else {
    x = static_cast<const float*>(hidden);
    auto* u = static_cast<const uint32_t*>(hidden);
    for (size_t i = 0; i < n; ++i) bad |= (u[i] & 0x7f800000u) == 0x7f800000u;
  }
  MOE_CHECK(!bad, "hidden: non-finite values");

  const int kp = defer == 0 ? k : part == 0 ? k - defer : defer;
  const int32_t* pid = ids;
  const float* pw = weights;
  if (defer > 0) {
    std::vector<int32_t>& isel = sc.isel;
    std::vector<float>& wsel = sc.wsel;
    isel.resize(size_t(T) * kp);
    wsel.resize(size_t(T) * kp);
    int order[MAX_K];
    MOE_CHECK(k <= MAX_K, "k above " + std::to_string(MAX_K));
    for (int t = 0; t < T; ++t) {
      const float* wt = weights + size_t(t) * k;
      std::iota(order, order + k, 0);
      std::stable_sort(order, order + k, [wt](int a, int b) { return wt[a] > wt[b]; });
      const int first = part == 0 ? 0 : k - defer;
      for (int j = 0; j < kp; ++j) {
        isel[size_t(t) * kp + j] = ids[size_t(t) * k + order[first + j]];
        wsel[size_t(t) * kp + j] = wt[order[first + j]];
      }
    }
    pid = isel.data();
    pw = wsel.data();
  }
  std::vector<float>& y32 = sc.y32;
  float* y = out_bf16 ? (y32.resize(n), y32.data()) : static_cast<float*>(out);
  if (T)
    moe_forward(l, x, pid, pw, y, T, kp);
  if (out_bf16) {
    auto* o = static_cast<uint16_t*>(out);
    for (size_t i = 0; i < n; ++i) o[i] = f32_to_bf16(y[i]);
  }
}

}  // namespace moe
