// RMSNorm and rotary embeddings for a decode step's few rows, with torch's rounding: what the GPU
// service's layers do in torch (gpu_service/layers.py rms_norm, apply_rope) in one call each instead
// of 7-8 torch ops, whose dispatch costs far more than the arithmetic (docs/performance/decode_step.md). Plain
// loops the compiler vectorizes, built per vector width (vec_builds.h): a few thousand elements a call; no
// threads. fp-contract off: torch rounds each product before the sum.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels/torch_rounding.h"
#include "kernels/vec_builds.h"
#include "moe.h"
#include "runtime/common.h"

namespace moe {

namespace {

using namespace rounding;

constexpr int LANES = 16;  // partial sums of squares (as torch's vectorized reduction keeps several)

template <class X, class W, class O>
__attribute__((always_inline, optimize("fp-contract=off"))) inline void rms_norm_t(const X* x, const W* w, O* out,
                                                                                  int rows, int n, float eps) {
  for (int r = 0; r < rows; ++r) {
    const X* xr = x + size_t(r) * n;
    O* orow = out + size_t(r) * n;
    float acc[LANES] = {};  // fp32 statistics, as torch's
    int i = 0;
    for (; i + LANES <= n; i += LANES)
      for (int j = 0; j < LANES; ++j) {
        const float v = get(xr, i + j);
        acc[j] += v * v;
      }
    for (int j = 0; i < n; ++i, ++j) {
      const float v = get(xr, i);
      acc[j] += v * v;
    }
    for (int w2 = LANES / 2; w2 > 0; w2 /= 2)
      for (int j = 0; j < w2; ++j) acc[j] += acc[j + w2];
    const float inv = 1.f / std::sqrt(acc[0] / float(n) + eps);
    for (int i = 0; i < n; ++i) put(orow, i, get(w, i) * held(get(xr, i) * inv, xr));  // w * xf.to(x.dtype)
  }
}

template <class X>
__attribute__((always_inline, optimize("fp-contract=off"))) inline void rope_t(const X* x, X* out, int T, int heads,
                                                                              int dim, const X* cos, const X* sin) {
  const int half = dim / 2;
  for (int t = 0; t < T; ++t) {
    const X* c = cos + size_t(t) * half;
    const X* s = sin + size_t(t) * half;
    for (int h = 0; h < heads; ++h) {
      const size_t row = (size_t(t) * heads + h) * dim;
      const X* x1 = x + row;
      const X* x2 = x1 + half;
      for (int i = 0; i < half; ++i) {  // torch: each product rounded to the dtype, then the sum
        const float a = get(x1, i), b = get(x2, i), ci = get(c, i), si = get(s, i);
        put(out + row, i, held(a * ci, x) - held(b * si, x));
        put(out + row + half, i, held(b * ci, x) + held(a * si, x));
      }
    }
  }
}

MOE_VEC_BUILDS(rms_norm_any, rms_norm_t)
MOE_VEC_BUILDS(rope_any, rope_t)

template <class X, class W>
void rms_norm_out(const X* x, const W* w, void* out, bool out_bf16, int rows, int n, float eps) {
  if (out_bf16)
    rms_norm_any(vec_level(), x, w, static_cast<uint16_t*>(out), rows, n, eps);
  else
    rms_norm_any(vec_level(), x, w, static_cast<float*>(out), rows, n, eps);
}

template <class X>
void rms_norm_w(const X* x, const void* w, bool w_bf16, void* out, bool out_bf16, int rows, int n, float eps) {
  if (w_bf16)
    rms_norm_out(x, static_cast<const uint16_t*>(w), out, out_bf16, rows, n, eps);
  else
    rms_norm_out(x, static_cast<const float*>(w), out, out_bf16, rows, n, eps);
}

}  // namespace

void rms_norm_rows(const void* x, bool x_bf16, const void* w, bool w_bf16, void* out, bool out_bf16, int rows, int n,
                   float eps) {
  if (x_bf16)
    rms_norm_w(static_cast<const uint16_t*>(x), w, w_bf16, out, out_bf16, rows, n, eps);
  else
    rms_norm_w(static_cast<const float*>(x), w, w_bf16, out, out_bf16, rows, n, eps);
}

void rope_rows(const void* x, void* out, bool bf16, int T, int heads, int dim, const void* cos, const void* sin) {
  if (bf16)
    rope_any(vec_level(), static_cast<const uint16_t*>(x), static_cast<uint16_t*>(out), T, heads, dim,
             static_cast<const uint16_t*>(cos), static_cast<const uint16_t*>(sin));
  else
    rope_any(vec_level(), static_cast<const float*>(x), static_cast<float*>(out), T, heads, dim,
             static_cast<const float*>(cos), static_cast<const float*>(sin));
}

}  // namespace moe
