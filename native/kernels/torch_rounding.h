// Elements of a bf16 (uint16_t bits) or fp32 array as fp32, and back, rounded as torch rounds: the helpers of the
// kernels that must give torch's results bit for bit (norm_rope.cpp, decode_step.cpp).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "runtime/common.h"

namespace moe {
namespace rounding {

// f32_to_bf16 without a branch, so that loops over it vectorize
inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t rounded = (u + 0x7fff + ((u >> 16) & 1)) >> 16, nan = (u >> 16) | 0x40;
  return uint16_t((u & 0x7fffffff) > 0x7f800000 ? nan : rounded);
}

inline float get(const uint16_t* p, size_t i) { return bf16_to_f32(p[i]); }
inline float get(const float* p, size_t i) { return p[i]; }
inline void put(uint16_t* p, size_t i, float v) { p[i] = to_bf16(v); }
inline void put(float* p, size_t i, float v) { p[i] = v; }
// a value as torch holds it in the dtype of the array type given (held(v, x) for x an array of it, or held<T>(v))
inline float held(float v, const uint16_t*) { return bf16_to_f32(to_bf16(v)); }
inline float held(float v, const float*) { return v; }
template <class T>
inline float held(float v) {
  return held(v, static_cast<const T*>(nullptr));
}

// torch's vectorized expf on x86 (Sleef's expf_u10, which its CPU silu and sigmoid kernels use; not torch.exp's
// own), bit for bit (tests/model/test_decode_loop.py): a silu or sigmoid computed with it is torch's. std::fma is one
// instruction where the caller is compiled for FMA (decode_mlp.cpp dispatches on that), a libm call otherwise.
__attribute__((always_inline)) inline float torch_expf(float d) {
  const auto pow2 = [](int q) {
    const uint32_t u = uint32_t(q + 0x7f) << 23;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  };
  const int q = int(std::nearbyint(d * 1.442695040888963407359924681001892137426645954152985934135449406931f));
  float s = std::fma(float(q), -0.693145751953125f, d);
  s = std::fma(float(q), -1.428606765330187045e-06f, s);
  float u = 0.000198527617612853646278381f;
  u = std::fma(u, s, 0.00139304355252534151077271f);
  u = std::fma(u, s, 0.00833336077630519866943359f);
  u = std::fma(u, s, 0.0416664853692054748535156f);
  u = std::fma(u, s, 0.166666671633720397949219f);
  u = std::fma(u, s, 0.5f);
  u = 1.0f + std::fma(s * s, u, s);
  u = u * pow2(q >> 1) * pow2(q - (q >> 1));
  if (d < -104.f) u = 0.f;
  if (d > 100.f) u = INFINITY;
  return std::isnan(d) ? d : u;
}
// F.silu and torch.sigmoid of fp32 values as torch's vector kernels compute them (before rounding to T)
__attribute__((always_inline)) inline float torch_silu(float x) { return x / (1.f + torch_expf(-x)); }
__attribute__((always_inline)) inline float torch_sigmoid(float x) { return 1.f / (1.f + torch_expf(-x)); }

// torch's elementwise CPU loops (ATen/native/cpu/Loops.h vectorized_loop) take two vectors at a time and leave a
// contiguous run's last n % (2 * lanes) elements to the scalar function, whose exp is libm's expf; at its DEFAULT
// capability the vector exp is libm's too. torch_vector_bytes: 64 (AVX512), 32 (AVX2) or 0 (DEFAULT), from
// torch's own capability (gpu_service/decode_step.py sets it; this CPU's widest until then).
int torch_vector_bytes();
void set_torch_vector_bytes(int bytes);
// the first of a run of n elements of T that torch computes with the scalar function
template <class T>
inline size_t torch_scalar_from(size_t n, int vector_bytes) {
  if (vector_bytes <= 0) return 0;
  const size_t pair = 2 * size_t(vector_bytes) / sizeof(T);
  return n - n % pair;
}
// torch's vec::reduce_all of a sum of n fp32 values (ATen/cpu/vec/functional_base.h; its softmax's sum): V lanes
// summed lane-wise, a short tail into the first lanes, then the lanes pairwise (its AVX2 / AVX-512 shuffles: tree)
// or one after another (DEFAULT); fewer than V values one after another
inline float torch_sum(const float* x, size_t n, int V, bool tree) {
  if (n < size_t(V)) {
    float s = n ? x[0] : 0.f;
    for (size_t i = 1; i < n; ++i) s += x[i];
    return s;
  }
  float acc[16];
  for (int l = 0; l < V; ++l) acc[l] = x[l];
  size_t d = V;
  for (; d < n - n % V; d += V)
    for (int l = 0; l < V; ++l) acc[l] += x[d + l];
  for (size_t l = 0; d + l < n; ++l) acc[l] += x[d + l];
  if (!tree) {
    float s = acc[0];
    for (int l = 1; l < V; ++l) s += acc[l];
    return s;
  }
  for (int w = V / 2; w > 0; w /= 2)
    for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
  return acc[0];
}

// silu and sigmoid as torch's scalar functions compute them (a run's tail, or every element at DEFAULT)
inline float libm_silu(float x) { return x / (1.f + std::exp(-x)); }
inline float libm_sigmoid(float x) { return 1.f / (1.f + std::exp(-x)); }

}  // namespace rounding
}  // namespace moe
