// MLA's absorbed kv_b_proj at decode (DeepSeek V2/V3): the latent query q_lat[h] = q_nope[h] W_uk[h] and the
// heads' output o[h] = o_lat[h] W_uv[h]^T, per head a small matrix-vector product over kv_b_proj's weight
// ([nh * (dn + dv), r], bf16 or fp32, read where it lies). torch runs these as batched matmuls ("einsum") whose
// per-head setup and, for a bf16 weight, its upcast cost several times reading the 16-32 MB a layer
// (docs/performance/decode_step.md, "MLA"). fp32 sums; plain loops the compiler vectorizes per width (vec_builds.h),
// lane-wise (each output its own fixed order), so every build gives the same bits. Threads over heads.
#include <algorithm>
#include <cstdint>

#include "kernels/torch_rounding.h"
#include "kernels/vec_builds.h"
#include "moe.h"
#include "runtime/common.h"

namespace moe {

namespace {

using namespace rounding;

constexpr size_t SERIAL_MACS = size_t(1) << 18;  // below this many multiply-adds a call: no threads
constexpr int LANES = 16;                       // partial sums of a dot product (lanes, not reassociated)

// heads [h0, h1): y[h, t, :r] = sum over d < dn of x[t, h, d] * W[h, d, :]; W rows r apart, heads (dn + dv) rows
template <class W>
__attribute__((always_inline, optimize("fp-contract=off"))) inline void absorb_q_t(const W* w, int h0, int h1, int dn,
                                                                                  int dv, int r, const float* x,
                                                                                  size_t x_tok, int t, float* y) {
  for (int h = h0; h < h1; ++h) {
    const W* wh = w + size_t(h) * (dn + dv) * r;
    for (int s = 0; s < t; ++s) {
      float* yr = y + (size_t(h) * t + s) * r;
      const float* xr = x + s * x_tok + size_t(h) * dn;
      for (int j = 0; j < r; ++j) yr[j] = 0.f;
      for (int d = 0; d < dn; ++d) {
        const float a = xr[d];
        const W* row = wh + size_t(d) * r;
        for (int j = 0; j < r; ++j) yr[j] += a * get(row, j);
      }
    }
  }
}

// heads [h0, h1): y[t, h, v] = sum over j < r of x[h, t, j] * W[h, dn + v, j]
template <class W>
__attribute__((always_inline, optimize("fp-contract=off"))) inline void absorb_o_t(const W* w, int h0, int h1, int dn,
                                                                                  int dv, int r, const float* x, int t,
                                                                                  int nh, float* y) {
  const int body = r - r % LANES;
  for (int h = h0; h < h1; ++h) {
    const W* wh = w + (size_t(h) * (dn + dv) + dn) * r;
    for (int s = 0; s < t; ++s) {
      const float* xr = x + (size_t(h) * t + s) * r;
      float* yr = y + (size_t(s) * nh + h) * dv;
      for (int v = 0; v < dv; ++v) {
        const W* row = wh + size_t(v) * r;
        float acc[LANES] = {};
        for (int j = 0; j < body; j += LANES)
          for (int l = 0; l < LANES; ++l) acc[l] += xr[j + l] * get(row, j + l);
        for (int j = body; j < r; ++j) acc[j - body] += xr[j] * get(row, j);
        for (int n = LANES / 2; n > 0; n /= 2)
          for (int l = 0; l < n; ++l) acc[l] += acc[l + n];
        yr[v] = acc[0];
      }
    }
  }
}

MOE_VEC_BUILDS(absorb_q_any, absorb_q_t)
MOE_VEC_BUILDS(absorb_o_any, absorb_o_t)

// f(h0, h1) over the heads: in a few chunks on the pool, or here when the call is small
template <class F>
void over_heads(int nh, size_t macs, F&& f) {
  if (macs < SERIAL_MACS) return f(0, nh);
  const int chunks = std::min(nh, 4 * pool().size()), per = (nh + chunks - 1) / chunks;
  pool().parallel_for((nh + per - 1) / per, [&](int c) { f(c * per, std::min(nh, (c + 1) * per)); });
}

}  // namespace

void mla_absorb_q(Isa isa, const void* w, bool w_bf16, int nh, int dn, int dv, int r, const float* q_nope, size_t q_tok,
                  int t, float* q_lat) {
  MOE_CHECK(nh > 0 && dn > 0 && dv > 0 && r > 0 && t > 0 && q_tok >= size_t(nh) * dn, "mla_absorb_q: bad shapes");
  const Vec v = vec_of(isa);
  over_heads(nh, size_t(nh) * dn * r * t, [&](int h0, int h1) {
    if (w_bf16)
      absorb_q_any(v, static_cast<const uint16_t*>(w), h0, h1, dn, dv, r, q_nope, q_tok, t, q_lat);
    else
      absorb_q_any(v, static_cast<const float*>(w), h0, h1, dn, dv, r, q_nope, q_tok, t, q_lat);
  });
}

void mla_absorb_o(Isa isa, const void* w, bool w_bf16, int nh, int dn, int dv, int r, const float* o_lat, int t, float* o) {
  MOE_CHECK(nh > 0 && dn > 0 && dv > 0 && r > 0 && t > 0, "mla_absorb_o: bad shapes");
  const Vec v = vec_of(isa);
  over_heads(nh, size_t(nh) * dv * r * t, [&](int h0, int h1) {
    if (w_bf16)
      absorb_o_any(v, static_cast<const uint16_t*>(w), h0, h1, dn, dv, r, o_lat, t, nh, o);
    else
      absorb_o_any(v, static_cast<const float*>(w), h0, h1, dn, dv, r, o_lat, t, nh, o);
  });
}

}  // namespace moe
