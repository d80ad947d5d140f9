// The delta rule's recurrence (a linear-attention layer: GLM-5.3-Flash's KDA, Qwen3-Next's gated DeltaNet), a token
// at a time in one pass over the state (a prefill's tokens with each head's state kept in L2 between them): per head,
// with S [dk, dv] the old state and e [dk] the decay per key channel (gated DeltaNet's one a head spread over them),
// k^T (e S) and (q e)^T S from one read of S, delta = beta (v - k^T e S), o = (q e)^T S + (q . k) delta, and the
// new state e S + k delta^T written once (S's rows then from L2: a head's 64 KB).
// torch's ops for it (a batched product, a scale, an addbmm) read the 2-4 MB of a layer's state three times and wrote
// it twice. fp32 throughout; loops lane-wise over dv (vectorized, nothing reassociated within a lane).
#include <vector>

#include "kernels/vec_builds.h"
#include "moe.h"
#include "runtime/common.h"

namespace moe {

namespace {

__attribute__((always_inline, optimize("fp-contract=off"))) inline void delta_head(
    int dk, int dv, const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
    const float* __restrict__ e, float beta, const float* __restrict__ S, float* __restrict__ Sn,
    float* __restrict__ o, float* __restrict__ kS) {
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
  for (int c = 0; c < dv; ++c) {
    kS[c] = (v[c] - kS[c]) * beta;  // delta, in place
    o[c] += qk * kS[c];
  }
  for (int i = 0; i < dk; ++i) {
    const float* row = S + size_t(i) * dv;
    float* out = Sn + size_t(i) * dv;
    const float ei = e[i], ki = k[i];
    for (int c = 0; c < dv; ++c) out[c] = ei * row[c] + ki * kS[c];
  }
}
MOE_VEC_BUILDS(delta_head_any, delta_head)

}  // namespace

void delta_rule_step(Isa isa, int H, int t, int dk, int dv, const float* q, const float* k, const float* v,
                     const float* e, const float* beta, const float* S, float* S_new, float* o, bool per_head) {
  MOE_CHECK(H > 0 && t > 0 && dk > 0 && dv > 0, "delta rule step: bad shapes");
  const Vec w = vec_of(isa);
  // a head's tokens in turn, its state in this thread's L2 from the second on: two buffers in turn (the first token
  // reads S, the last writes S_new)
  auto head = [&](int h) {
    thread_local std::vector<float> kS, states, e_head;
    kS.resize(size_t(dv)), e_head.resize(size_t(dk));
    const size_t hs = size_t(h) * dk * dv, n = size_t(dk) * dv;
    if (t > 1) states.resize(2 * n);
    const float* from = S + hs;
    for (int i = 0; i < t; ++i) {
      const size_t hk = (size_t(i) * H + h) * dk, hv = (size_t(i) * H + h) * dv;
      float* to = i == t - 1 ? S_new + hs : states.data() + (i % 2) * n;
      const float* ei = e + hk;
      if (per_head) {  // (the head's one decay spread over its key channels here, not in a [t, H, dk] copy)
        for (int c = 0; c < dk; ++c) e_head[c] = e[size_t(i) * H + h];
        ei = e_head.data();
      }
      delta_head_any(w, dk, dv, q + hk, k + hk, v + hv, ei, beta[size_t(i) * H + h], from, to, o + hv, kS.data());
      from = to;
    }
  };
  if (size_t(H) * t * dk * dv < (size_t(1) << 15)) {  // (a small state: the pool's wake-up would cost more)
    for (int h = 0; h < H; ++h) head(h);
  } else {
    pool().parallel_for(H, head);
  }
}

}  // namespace moe
