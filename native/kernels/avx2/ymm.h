// The 256-bit kernels' vector operations, for micro-kernels written once and run on AVX2 and on AVX-VNNI.
// A GCC function takes one target; a template cannot vary it by its arguments. So a shared micro-kernel is a
// template with no target that does every vector operation through these functions (target avx2,fma, not
// always_inline) and through its dot-product policy's (target avx2 or avx2,avxvnni); each ISA's entry point
// carries its target and `flatten` (MOE_YMM_ENTRY), which inlines the whole tree into it. The generated code
// is what hand-inlined intrinsics give; the dot product's instructions are the ISA's alone.
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "kernels/reduce4.h"

namespace moe {

#define MOE_YMM __attribute__((target("avx2,fma"))) static inline

struct Ymm {
  MOE_YMM __m256i zero_si() { return _mm256_setzero_si256(); }
  // v as it is, in a register, opaque to the optimizer: a running sum kept a chain (GCC's reassociation turned an
  // int16 sum of products into a tree of all of them, live at once: more than 16 registers, spilled)
  MOE_YMM __m256i chain(__m256i v) {
    asm("" : "+x"(v));
    return v;
  }
  MOE_YMM __m256 zero_ps() { return _mm256_setzero_ps(); }
  MOE_YMM __m256i load(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
  MOE_YMM __m256i bytes16(const int8_t* p) {  // 16 bytes in both 128-bit halves (a vpshufb table)
    return _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  MOE_YMM __m256 set1(float v) { return _mm256_set1_ps(v); }
  MOE_YMM __m256 loadu_ps(const float* p) { return _mm256_loadu_ps(p); }
  MOE_YMM __m256 loadu_first_ps(const float* p, int n) {  // p[0..n), zeros after: no read past n
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(n), lane));
  }
  MOE_YMM __m256i set1_epi32(int v) { return _mm256_set1_epi32(v); }
  MOE_YMM __m256i sub_epi32(__m256i a, __m256i b) { return _mm256_sub_epi32(a, b); }
  MOE_YMM __m256 to_ps(__m256i v) { return _mm256_cvtepi32_ps(v); }
  MOE_YMM __m256 fmadd(__m256 a, __m256 b, __m256 c) { return _mm256_fmadd_ps(a, b, c); }
  MOE_YMM __m256 fnmadd(__m256 a, __m256 b, __m256 c) { return _mm256_fnmadd_ps(a, b, c); }  // c - a * b
  MOE_YMM void split_nibbles(__m256i p, __m256i& lo, __m256i& hi) {  // a vector's low nibbles, its high ones
    const __m256i lo4 = _mm256_set1_epi8(0x0f);
    lo = _mm256_and_si256(p, lo4);
    hi = _mm256_and_si256(_mm256_srli_epi16(p, 4), lo4);
  }
  MOE_YMM __m256i load_first_epi32(const void* p, int n) {  // int32 lanes p[0..n), zeros after: no read past n
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_maskload_epi32(static_cast<const int*>(p), _mm256_cmpgt_epi32(_mm256_set1_epi32(n), lane));
  }
  MOE_YMM void storeu_ps(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
  MOE_YMM __m256i u8_to_epi32(const uint8_t* p, int m) {  // m (<= 8) bytes widened; zeros after m, no read past
    uint64_t v = 0;
    std::memcpy(&v, p, size_t(m));
    return _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(int64_t(v)));
  }
  MOE_YMM __m256 u8_to_ps(const uint8_t* p, int m) { return _mm256_cvtepi32_ps(u8_to_epi32(p, m)); }
  MOE_YMM __m256i s8_to_epi32(const uint8_t* p, int m) {  // m (<= 8) int8 bytes sign-widened; zeros after m
    uint64_t v = 0;
    std::memcpy(&v, p, size_t(m));
    return _mm256_cvtepi8_epi32(_mm_cvtsi64_si128(int64_t(v)));
  }
  MOE_YMM __m256i mullo_epi32(__m256i a, __m256i b) { return _mm256_mullo_epi32(a, b); }
  // q2k: a half block's pairs of sc | m << 4 bytes (2m bytes, m <= 8; zeros after, no read past) as int16 pairs, sc
  // and m apart
  MOE_YMM void q2_scales(const uint8_t* p, int m, __m256i& sc, __m256i& mn) {
    alignas(16) uint8_t b[16] = {};
    std::memcpy(b, p, size_t(2 * m));
    const __m256i w = _mm256_cvtepu8_epi16(_mm_load_si128(reinterpret_cast<const __m128i*>(b)));
    sc = _mm256_and_si256(w, _mm256_set1_epi16(15)), mn = _mm256_srli_epi16(w, 4);
  }
  // q3k: a half block's two 16s' int8 sc (m <= 8 rows each; zeros after, no read past) as int16 pairs
  MOE_YMM __m256i s8_pairs(const uint8_t* p0, const uint8_t* p1, int m) {
    uint64_t a = 0, b = 0;
    std::memcpy(&a, p0, size_t(m)), std::memcpy(&b, p1, size_t(m));
    return _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(_mm_cvtsi64_si128(int64_t(a)), _mm_cvtsi64_si128(int64_t(b))));
  }
  // int32 lanes lo, hi (each within int16) as int16 pairs (lo, hi), for vpmaddwd
  MOE_YMM __m256i pair16(__m256i lo, __m256i hi) { return _mm256_blend_epi16(lo, _mm256_slli_epi32(hi, 16), 0xAA); }
  MOE_YMM __m256i madd_epi16(__m256i a, __m256i b) { return _mm256_madd_epi16(a, b); }
  // q6k: chunk c's (c < 4) high 2 bits, bits 2c and 2c + 1 of each byte of hv, above its nibble (gemm_blocked.h)
  MOE_YMM __m256i q6_value(__m256i nib, __m256i hv, int c) {
    const __m256i h = c == 0 ? _mm256_slli_epi16(hv, 4) : c == 1 ? _mm256_slli_epi16(hv, 2) : c == 2 ? hv
                                                                                 : _mm256_srli_epi16(hv, 2);
    return _mm256_or_si256(nib, _mm256_and_si256(h, _mm256_set1_epi8(0x30)));
  }
  // q3k: chunk c's 2 low bits from lv, its high bit (bit c) from hb (gemm_blocked.h)
  MOE_YMM __m256i q3_value(__m256i lv, __m256i hb, int c) {
    const int k = c % 4;
    const __m256i l = k ? _mm256_srli_epi16(lv, 2 * k) : lv;
    const __m256i h = c < 2 ? _mm256_slli_epi16(hb, 2 - c) : c == 2 ? hb : _mm256_srli_epi16(hb, c - 2);
    return _mm256_or_si256(_mm256_and_si256(l, _mm256_set1_epi8(0x03)), _mm256_and_si256(h, _mm256_set1_epi8(0x04)));
  }
  // q2k: chunk c's 2 bits from lv (gemm_blocked.h)
  MOE_YMM __m256i q2_value(__m256i lv, int c) {
    const int k = c % 4;
    return _mm256_and_si256(k ? _mm256_srli_epi16(lv, 2 * k) : lv, _mm256_set1_epi8(0x03));
  }
  // q5k: chunk c's (c < 8) high bit, bit c of each byte of hv, above its nibble (gemm_blocked.h)
  MOE_YMM __m256i q5_value(__m256i nib, __m256i hv, int c) {
    const __m256i h = c < 4 ? _mm256_slli_epi16(hv, 4 - c) : c == 4 ? hv : _mm256_srli_epi16(hv, c - 4);
    return _mm256_or_si256(nib, _mm256_and_si256(h, _mm256_set1_epi8(0x10)));
  }
  // m (<= 8) mxfp4 exponent bytes e -> their scales, the floats of exponent field e - 1 (0 for e <= 1); zeros after m
  MOE_YMM __m256 mx_scales8(const uint8_t* p, int m) {
    const __m256i e = u8_to_epi32(p, m);
    const __m256i one = _mm256_set1_epi32(1);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_sub_epi32(_mm256_max_epi32(e, one), one), 23));
  }
  MOE_YMM __m256i add_epi32(__m256i a, __m256i b) { return _mm256_add_epi32(a, b); }
  MOE_YMM __m256i add_epi16(__m256i a, __m256i b) { return _mm256_add_epi16(a, b); }
  MOE_YMM __m256i xor80(__m256i q) { return _mm256_xor_si256(q, _mm256_set1_epi8(char(0x80))); }  // s8 <-> u8 + 128
  MOE_YMM __m256i lookup(__m256i table, __m256i q) { return _mm256_shuffle_epi8(table, q); }
  // a 4-row x NT-token tile of partial sums -> C[t * 4 + r] (reduce4.h)
  template <int NT, class V, class S>
  MOE_YMM void reduce(const V (&acc)[4][NT], int nr, S* C) { reduce_tile4(acc, nr, C); }
};

// u8 activations (q + 128) times s8 weights, 32 products summed in groups of 4 into 8 int32 lanes.
// AVX2 has no such instruction: vpmaddubsw adds pairs into int16 and would saturate on (q + 128) * w,
// so it multiplies |w| by q with w's sign (q = u8 - 128), both within 127, and sums q * w (ggml's
// mul_sum_i8_pairs); `offset` says which sum a policy gives: 0 (q * w) or 128 ((q + 128) * w).
struct Avx2Dot {
  static constexpr int offset = 0;
  __attribute__((target("avx2"))) static inline __m256i act(__m256i x) {  // u8 -> s8 q, once per load
    return _mm256_xor_si256(x, _mm256_set1_epi8(char(0x80)));
  }
  __attribute__((target("avx2"))) static inline __m256i dot(__m256i acc, __m256i q, __m256i w) {
    return _mm256_add_epi32(
        acc, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(q, w)), _mm256_set1_epi16(1)));
  }
  // small weights (nibbles, <= 15): vpmaddubsw (u8 weights x s8 activations) cannot saturate, pairs are summed in
  // int16 (gemm_blocked_avx2.h: 8 of them) before one widening
  __attribute__((target("avx2"))) static inline __m256i pairs(__m256i u, __m256i x) { return _mm256_maddubs_epi16(u, x); }
  __attribute__((target("avx2"))) static inline __m256i widen(__m256i p) { return _mm256_madd_epi16(p, _mm256_set1_epi16(1)); }
};

// AVX-VNNI: vpdpbusd on ymm, (q + 128) x w in one instruction.
struct VnniDot {
  static constexpr int offset = 128;
  __attribute__((target("avx2"))) static inline __m256i act(__m256i x) { return x; }
  __attribute__((target("avx2,avxvnni"))) static inline __m256i dot(__m256i acc, __m256i x, __m256i w) {
    return _mm256_dpbusd_avx_epi32(acc, x, w);
  }
};

// An ISA's entry into a shared 256-bit micro-kernel: its target, and everything inlined into it.
#define MOE_YMM_ENTRY(TARGET) __attribute__((target(TARGET), flatten))

#undef MOE_YMM

}  // namespace moe
