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

// a row's sum of squares in fp32, in LANES partial sums folded pairwise at the end
template <class X>
__attribute__((always_inline, optimize("fp-contract=off"))) inline float sum_squares(const X* xr, int n) {
  float acc[LANES] = {};
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
  return acc[0];
}

template <class X, class W, class O>
__attribute__((always_inline, optimize("fp-contract=off"))) inline void rms_norm_t(const X* x, const W* w, O* out,
                                                                                  int rows, int n, float eps,
                                                                                  bool wide) {
  for (int r = 0; r < rows; ++r) {
    const X* xr = x + size_t(r) * n;
    O* orow = out + size_t(r) * n;
    const float inv = 1.f / std::sqrt(sum_squares(xr, n) / float(n) + eps);
    if (wide)  // (w * xf).to(out's dtype): fp32 weights multiply in fp32 (DeepSeek-V4)
      for (int i = 0; i < n; ++i) put(orow, i, get(w, i) * (get(xr, i) * inv));
    else
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

// DeepSeek-V4's heads (gpu_service/model/compressed_attention.py unweighted_norm, rope_tail): each row of D, first
// (norm) divided by its RMS without a weight -- the factor rounded to x's dtype, then the product, as
// x * rsqrt(mean(x.float() ^ 2) + eps).to(x.dtype) -- then its trailing 2 pairs dims turned in interleaved pairs in
// fp32 (complex products, each product rounded before the sum as torch's complex kernels do), rounded back to x's
// dtype. cos/sin [T, pairs] fp32, row r at token r / heads. out may be x (each row read before it is written).
template <class X>
__attribute__((always_inline, optimize("fp-contract=off"))) inline void head_rope_t(
    const X* x, X* out, int T, int heads, int D, int pairs, const float* cos, const float* sin, float eps, bool norm) {
  const int r0 = D - 2 * pairs;
  for (int row = 0; row < T * heads; ++row) {
    const X* xr = x + size_t(row) * D;
    X* orow = out + size_t(row) * D;
    float f = 1.f;
    if (norm) {
      f = held(1.f / std::sqrt(sum_squares(xr, D) / float(D) + eps), xr);
    }
    if (norm)
      for (int i = 0; i < r0; ++i) put(orow, i, get(xr, i) * f);
    else if (orow != xr)  // (in place: the leading dims stay)
      std::memcpy(orow, xr, size_t(r0) * sizeof(X));
    const float* c = cos + size_t(row / heads) * pairs;
    const float* s = sin + size_t(row / heads) * pairs;
    for (int p = 0; p < pairs; ++p) {
      const int i = r0 + 2 * p;
      const float a = norm ? held(get(xr, i) * f, xr) : get(xr, i);
      const float b = norm ? held(get(xr, i + 1) * f, xr) : get(xr, i + 1);
      put(orow, i, a * c[p] - b * s[p]);
      put(orow, i + 1, a * s[p] + b * c[p]);
    }
  }
}

MOE_VEC_BUILDS(rms_norm_any, rms_norm_t)
MOE_VEC_BUILDS(rope_any, rope_t)
MOE_VEC_BUILDS(head_rope_any, head_rope_t)

template <class X, class W>
void rms_norm_out(const X* x, const W* w, void* out, bool out_bf16, int rows, int n, float eps, bool wide) {
  if (out_bf16)
    rms_norm_any(vec_level(), x, w, static_cast<uint16_t*>(out), rows, n, eps, wide);
  else
    rms_norm_any(vec_level(), x, w, static_cast<float*>(out), rows, n, eps, wide);
}

template <class X>
void rms_norm_w(const X* x, const void* w, bool w_bf16, void* out, bool out_bf16, int rows, int n, float eps,
                bool wide) {
  if (w_bf16)
    rms_norm_out(x, static_cast<const uint16_t*>(w), out, out_bf16, rows, n, eps, wide);
  else
    rms_norm_out(x, static_cast<const float*>(w), out, out_bf16, rows, n, eps, wide);
}

}  // namespace

void rms_norm_rows(const void* x, bool x_bf16, const void* w, bool w_bf16, void* out, bool out_bf16, int rows, int n,
                   float eps, bool wide) {
  if (x_bf16)
    rms_norm_w(static_cast<const uint16_t*>(x), w, w_bf16, out, out_bf16, rows, n, eps, wide);
  else
    rms_norm_w(static_cast<const float*>(x), w, w_bf16, out, out_bf16, rows, n, eps, wide);
}

void rope_rows(const void* x, void* out, bool bf16, int T, int heads, int dim, const void* cos, const void* sin) {
  if (bf16)
    rope_any(vec_level(), static_cast<const uint16_t*>(x), static_cast<uint16_t*>(out), T, heads, dim,
             static_cast<const uint16_t*>(cos), static_cast<const uint16_t*>(sin));
  else
    rope_any(vec_level(), static_cast<const float*>(x), static_cast<float*>(out), T, heads, dim,
             static_cast<const float*>(cos), static_cast<const float*>(sin));
}

void head_rope_rows(const void* x, void* out, bool bf16, int T, int heads, int D, int pairs, const float* cos,
                    const float* sin, float eps, bool norm) {
  if (bf16)
    head_rope_any(vec_level(), static_cast<const uint16_t*>(x), static_cast<uint16_t*>(out), T, heads, D, pairs, cos,
                  sin, eps, norm);
  else
    head_rope_any(vec_level(), static_cast<const float*>(x), static_cast<float*>(out), T, heads, D, pairs, cos, sin,
                  eps, norm);
}

}  // namespace moe
