// What the expert driver does to activations between the matrix products, per ISA: the experts' activation
// (SwiGLU, or gpt-oss's clamped variant), rounded to bf16 at each step as a bf16 model's would be, and the
// activations put in a weight format's input form (bf16 rows, or u8 q + 128 with one scale per row).
#include <immintrin.h>

#include <algorithm>
#include <cmath>

#include "kernels/kernels.h"
#include "kernels/vmath.h"
#include "moe.h"
#include "runtime/common.h"

namespace moe {

namespace {

// The int formats' activation quantizer, 8 lanes at a time where the CPU has AVX2 (every path but
// portable): the same bytes as the scalar loops (max is exact; x * inv rounds to nearest even in
// both, as nearbyint does in the default rounding mode).
__attribute__((target("avx2"))) float absmax_avx2(const float* x, int n) {
  const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 m = _mm256_setzero_ps();
  int i = 0;
  for (; i + 8 <= n; i += 8) m = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(x + i), abs), m);  // NaN: keeps m
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  float amax = 0.f;
  for (float v : lanes) amax = std::max(amax, v);
  for (; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  return amax;
}

// dst[i] = round(x[i] * inv) + 128 for whole 32-element blocks; returns the elements done
__attribute__((target("avx2"))) int quantize_u8_avx2(const float* x, int n, float inv, uint8_t* dst) {
  const __m256 s = _mm256_set1_ps(inv);
  const __m256i off = _mm256_set1_epi32(128), order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  int i = 0;
  for (; i + 32 <= n; i += 32) {
    __m256i q[4];
    for (int j = 0; j < 4; ++j)
      q[j] = _mm256_add_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8 * j), s)), off);
    // packs work within 128-bit halves: the bytes come out as 4-element runs, put back in order
    __m256i b = _mm256_packus_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), _mm256_permutevar8x32_epi32(b, order));
  }
  return i;
}

// SwiGLU activation of one slot: a = silu(gate) * up, each step rounded to bf16 as a bf16 model's
// would be.
void act_row(const float* gate, const float* up, float* a, int I) {
  for (int i = 0; i < I; ++i) {
    float gv = bf16_to_f32(f32_to_bf16(gate[i])), uv = bf16_to_f32(f32_to_bf16(up[i]));
    float sv = bf16_to_f32(f32_to_bf16(gv / (1.f + std::exp(-gv))));
    a[i] = bf16_to_f32(f32_to_bf16(sv * uv));
  }
}

// Round to bf16 (nearest even, like f32_to_bf16 for finite values) and back, 16 lanes.
__attribute__((target("avx512f,avx512bw"))) inline __m512 round_bf16(__m512 v) {
  __m512i u = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  u = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  return _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32(int(0xffff0000u))));
}

__attribute__((target("avx512f,avx512bw"))) void act_row_avx512(const float* gate, const float* up, float* a, int I) {
  const __m512 one = _mm512_set1_ps(1.f);
  for (int i = 0; i < I; i += 16) {
    const __mmask16 k = I - i >= 16 ? __mmask16(0xffff) : __mmask16((1u << (I - i)) - 1);
    __m512 gv = round_bf16(_mm512_maskz_loadu_ps(k, gate + i)), uv = round_bf16(_mm512_maskz_loadu_ps(k, up + i));
    __m512 sv = round_bf16(_mm512_div_ps(gv, _mm512_add_ps(one, exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), gv)))));
    _mm512_mask_storeu_ps(a + i, k, round_bf16(_mm512_mul_ps(sv, uv)));
  }
}

// The same on AVX2 (8 lanes; 2^n built in the exponent bits; a scalar tail).
__attribute__((target("avx2,fma"))) inline __m256 round_bf16(__m256 v) {
  __m256i u = _mm256_castps_si256(v);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  u = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  return _mm256_castsi256_ps(_mm256_and_si256(u, _mm256_set1_epi32(int(0xffff0000u))));
}

__attribute__((target("avx2,fma"))) void act_row_avx2(const float* gate, const float* up, float* a, int I) {
  const __m256 one = _mm256_set1_ps(1.f);
  int i = 0;
  for (; i + 8 <= I; i += 8) {
    __m256 gv = round_bf16(_mm256_loadu_ps(gate + i)), uv = round_bf16(_mm256_loadu_ps(up + i));
    __m256 sv = round_bf16(_mm256_div_ps(gv, _mm256_add_ps(one, exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), gv)))));
    _mm256_storeu_ps(a + i, round_bf16(_mm256_mul_ps(sv, uv)));
  }
  act_row(gate + i, up + i, a + i, I - i);
}

// gpt-oss's clamped SwiGLU of one slot, each step rounded to bf16 as transformers' bf16 model's is.
void act_row_clamped(const float* gate, const float* up, float* a, int I, float alpha, float limit) {
  auto r = [](float v) { return bf16_to_f32(f32_to_bf16(v)); };
  for (int i = 0; i < I; ++i) {
    const float g = std::min(r(gate[i]), limit), u = std::clamp(r(up[i]), -limit, limit);
    const float s = r(1.f / (1.f + std::exp(-r(g * alpha))));
    a[i] = r(r(u + 1.f) * r(g * s));
  }
}

// The same, 16 and 8 lanes (exp_ps within 2 ulp of std::exp before the bf16 rounding; scalar tail on AVX2)
__attribute__((target("avx512f,avx512bw"))) void act_row_clamped_avx512(const float* gate, const float* up, float* a,
                                                                        int I, float alpha, float limit) {
  const __m512 one = _mm512_set1_ps(1.f), lim = _mm512_set1_ps(limit), nlim = _mm512_set1_ps(-limit),
               al = _mm512_set1_ps(alpha);
  for (int i = 0; i < I; i += 16) {
    const __mmask16 k = I - i >= 16 ? __mmask16(0xffff) : __mmask16((1u << (I - i)) - 1);
    const __m512 g = _mm512_min_ps(round_bf16(_mm512_maskz_loadu_ps(k, gate + i)), lim);
    const __m512 u = _mm512_min_ps(_mm512_max_ps(round_bf16(_mm512_maskz_loadu_ps(k, up + i)), nlim), lim);
    const __m512 t = round_bf16(_mm512_mul_ps(g, al));
    const __m512 sg = round_bf16(_mm512_div_ps(one, _mm512_add_ps(one, exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), t)))));
    const __m512 glu = round_bf16(_mm512_mul_ps(g, sg));
    _mm512_mask_storeu_ps(a + i, k, round_bf16(_mm512_mul_ps(round_bf16(_mm512_add_ps(u, one)), glu)));
  }
}

__attribute__((target("avx2,fma"))) void act_row_clamped_avx2(const float* gate, const float* up, float* a, int I,
                                                              float alpha, float limit) {
  const __m256 one = _mm256_set1_ps(1.f), lim = _mm256_set1_ps(limit), nlim = _mm256_set1_ps(-limit),
               al = _mm256_set1_ps(alpha);
  int i = 0;
  for (; i + 8 <= I; i += 8) {
    const __m256 g = _mm256_min_ps(round_bf16(_mm256_loadu_ps(gate + i)), lim);
    const __m256 u = _mm256_min_ps(_mm256_max_ps(round_bf16(_mm256_loadu_ps(up + i)), nlim), lim);
    const __m256 t = round_bf16(_mm256_mul_ps(g, al));
    const __m256 sg = round_bf16(_mm256_div_ps(one, _mm256_add_ps(one, exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), t)))));
    const __m256 glu = round_bf16(_mm256_mul_ps(g, sg));
    _mm256_storeu_ps(a + i, round_bf16(_mm256_mul_ps(round_bf16(_mm256_add_ps(u, one)), glu)));
  }
  act_row_clamped(gate + i, up + i, a + i, I - i, alpha, limit);
}

}  // namespace

// ActRowFn: the table's entries for the two activations
void silu_ref(const float* gate, const float* up, float* a, int I, float, float) { act_row(gate, up, a, I); }
void silu_avx2(const float* gate, const float* up, float* a, int I, float, float) { act_row_avx2(gate, up, a, I); }
void silu_avx512(const float* gate, const float* up, float* a, int I, float, float) { act_row_avx512(gate, up, a, I); }
void clamped_swiglu_ref(const float* gate, const float* up, float* a, int I, float alpha, float limit) {
  act_row_clamped(gate, up, a, I, alpha, limit);
}
void clamped_swiglu_avx2(const float* gate, const float* up, float* a, int I, float alpha, float limit) {
  act_row_clamped_avx2(gate, up, a, I, alpha, limit);
}
void clamped_swiglu_avx512(const float* gate, const float* up, float* a, int I, float alpha, float limit) {
  act_row_clamped_avx512(gate, up, a, I, alpha, limit);
}

// QuantizeRowFn: the portable loops and the AVX2 ones (every SIMD ISA has AVX2; the same bytes either way)
template <bool SIMD>
void quantize_row(Fmt fmt, const float* x, int n, ActBuf& b, int r) {
  uint8_t* dst = b.data.data() + size_t(r) * b.row_bytes;
  if (fmt == Fmt::Bf16) {
    auto* d = reinterpret_cast<uint16_t*>(dst);
    for (int i = 0; i < n; ++i) d[i] = f32_to_bf16(x[i]);
    return;
  }
  if (fmt == Fmt::Fp8) {  // fp32 as is (scaled and rounded per weight block by its kernels), then its bf16 rounding
    std::memcpy(dst, x, size_t(n) * sizeof(float));  // (read where the kernels fold the scales into the weights)
    auto* d = reinterpret_cast<uint16_t*>(dst + (b.row_bytes / 6) * 4);
    for (int i = 0; i < n; ++i) d[i] = f32_to_bf16(x[i]);
    return;
  }
  float amax = 0.f;
  if constexpr (SIMD) amax = absmax_avx2(x, n);
  else
    for (int i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float scale = amax > 0 ? amax / 127.f : 1.f, inv = 1.f / scale;
  b.scale[r] = scale;
  // u8 = q + 128: VNNI multiplies unsigned activations by signed weights
  int i = 0;
  if constexpr (SIMD) i = quantize_u8_avx2(x, n, inv, dst);
  for (; i < n; ++i) dst[i] = uint8_t(int(std::nearbyint(x[i] * inv)) + 128);
  for (size_t j = n; j < b.row_bytes; ++j) dst[j] = 128;  // padding is q = 0
}
template void quantize_row<false>(Fmt, const float*, int, ActBuf&, int);
template void quantize_row<true>(Fmt, const float*, int, ActBuf&, int);

}  // namespace moe
