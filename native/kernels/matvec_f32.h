// y [B, E] = x [B, H] W^T, W [E, H] fp32, for a few rows (a router's logits, a hyper-connection's mixing logits):
// each row of W read once for the B rows. Sixteen partial sums a row (lanes the compiler vectorizes without
// reassociating), added pairwise at the end; the few MB of W a token are read at DRAM speed either way. always_inline
// with fp-contract off: built for each vector width inside its caller (vec_builds.h), the same bits in each.
#pragma once

#include <cstddef>

namespace moe {

__attribute__((always_inline, optimize("fp-contract=off"))) inline void matvec_f32(
    const float* W, const float* x, int B, int E, int H, float* y) {
  constexpr int LANES = 16;
  const int body = H - H % LANES;
  for (int e = 0; e < E; ++e) {
    const float* w = W + size_t(e) * H;
    for (int t = 0; t < B; ++t) {
      const float* xt = x + size_t(t) * H;
      float acc[LANES] = {};
      for (int j = 0; j < body; j += LANES)
        for (int l = 0; l < LANES; ++l) acc[l] += w[j + l] * xt[j + l];
      for (int j = body; j < H; ++j) acc[j - body] += w[j] * xt[j];
      for (int n = LANES / 2; n > 0; n /= 2)
        for (int l = 0; l < n; ++l) acc[l] += acc[l + n];
      y[size_t(t) * E + e] = acc[0];
    }
  }
}

}  // namespace moe
