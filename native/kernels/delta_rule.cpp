// The delta rule's one-token step (a decode's linear-attention layer: GLM-5.3-Flash's KDA, Qwen3-Next's gated
// DeltaNet) in one pass over the state: per head, with S [dk, dv] the old state and e [dk] the decay per key channel
// (one value repeated for gated DeltaNet), k^T (e S) and (q e)^T S from one read of S, delta = beta (v - k^T e S),
// o = (q e)^T S + (q . k) delta, and the new state e S + k delta^T written once (S's rows then from L2: a head's 64 KB).
// torch's ops for it (a batched product, a scale, an addbmm) read the 2-4 MB of a layer's state three times and wrote
// it twice. fp32 throughout; loops lane-wise over dv (vectorized, nothing reassociated within a lane).
#include <vector>

#include "kernels/vec_builds.h"
#include "moe.h"
#include "runtime/common.h"

namespace moe {

namespace {

__attribute__((always_inline, optimize("fp-contract=off"))) inline void delta_head(
    int dk, int dv, const float* q, const float* k, const float* v, const float* e, float beta, const float* S,
    float* Sn, float* o, float* kS) {
  for (int c = 0; c < dv; ++c) o[c] = 0.f, kS[c] = 0.f;
  float qk = 0.f;
  for (int i = 0; i < dk; ++i) {
    const float a = q[i] * e[i], b = k[i] * e[i];
    const float* row = S + size_t(i) * dv;
    for (int c = 0; c < dv; ++c) {
      o[c] += a * row[c];
      kS[c] += b * row[c];
    }
    qk += q[i] * k[i];
  }
  float* delta = kS;  // (in place)
  for (int c = 0; c < dv; ++c) {
    delta[c] = (v[c] - kS[c]) * beta;
    o[c] += qk * delta[c];
  }
  for (int i = 0; i < dk; ++i) {
    const float* row = S + size_t(i) * dv;
    float* out = Sn + size_t(i) * dv;
    const float ei = e[i], ki = k[i];
    for (int c = 0; c < dv; ++c) out[c] = ei * row[c] + ki * delta[c];
  }
}
MOE_VEC_BUILDS(delta_head_any, delta_head)

}  // namespace

void delta_rule_step(Isa isa, int H, int dk, int dv, const float* q, const float* k, const float* v, const float* e,
                     const float* beta, const float* S, float* S_new, float* o) {
  MOE_CHECK(H > 0 && dk > 0 && dv > 0, "delta rule step: bad shapes");
  const Vec w = vec_of(isa);
  auto head = [&](int h) {
    thread_local std::vector<float> kS;
    kS.resize(size_t(dv));
    const size_t hk = size_t(h) * dk, hv = size_t(h) * dv, hs = size_t(h) * dk * dv;
    delta_head_any(w, dk, dv, q + hk, k + hk, v + hv, e + hk, beta[h], S + hs, S_new + hs, o + hv, kS.data());
  };
  if (size_t(H) * dk * dv < (size_t(1) << 15)) {  // (a small state: the pool's wake-up would cost more)
    for (int h = 0; h < H; ++h) head(h);
  } else {
    pool().parallel_for(H, head);
  }
}

}  // namespace moe
