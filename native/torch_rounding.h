// Elements of a bf16 (uint16_t bits) or fp32 array as fp32, and back, rounded as torch rounds: the helpers of the
// kernels that must give torch's results bit for bit (norm_rope.cpp, decode_step.cpp).
#pragma once

#include <cstdint>
#include <cstring>

#include "common.h"

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

}  // namespace rounding
}  // namespace moe
