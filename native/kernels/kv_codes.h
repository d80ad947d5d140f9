// The 8-bit KV cache rows' codes (KvType I8 / F8; moe_kernels/kv_quant.py): a row of n values is n codes and one
// byte more, its scale 2^(byte - 127). Tag types for the kernels' templates, and their scalar reads.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "runtime/common.h"

namespace moe {

struct I8 {  // int8 codes
  int8_t v;
};
struct F8 {  // fp8 e4m3 codes
  uint8_t v;
};
template <class T>
constexpr bool quantized = std::is_same<T, I8>::value || std::is_same<T, F8>::value;

// fp8 is read as the IEEE half of the same sign, exponent and mantissa bits (sign << 15 | bits << 7): exact, the
// value 2^-8 of the code's (e4m3's exponent bias is 8 less than a half's), and what F16C widens 8 or 16 at a time;
// its row's scale carries the 2^8 (row_scale). No NaN code is ever stored.
inline uint16_t f8_as_half(uint8_t b) { return uint16_t(((b & 0x80) << 8) | ((b & 0x7f) << 7)); }
inline float code_value(const I8* p) { return float(p->v); }
inline float code_value(const F8* p) { return f16_to_f32(f8_as_half(p->v)); }

// A row's scale from its byte e (1..246: kv_quant.py keeps it there): 2^(e - 127), times 2^8 for fp8's codes as
// read above. A power of two: a sum of products times it is, bit for bit, that of the values themselves.
template <class T>
inline float row_scale(uint8_t e) {
  const uint32_t bits = uint32_t(e + (std::is_same<T, F8>::value ? 8 : 0)) << 23;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

}  // namespace moe
