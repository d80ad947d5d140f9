// Decode attention on the CPU: one new query per head against a sequence's cached keys and values
// (bf16, [kv heads, positions, dim] with any head and position strides), grouped-query: the query
// heads of a kv head share one pass over its keys. fp32 scores, softmax and sums; tasks over kv heads.
// torch's bf16 matmuls for this (two strided bmm, a softmax, casts) took ~1 ms a layer at 300
// positions on 2 Zen 4 cores; the bytes are ~300 KB.
#include <immintrin.h>

#include <cmath>
#include <vector>

#include "common.h"
#include "moe.h"
#include "vmath.h"

namespace moe {

namespace {

// 16 bf16 -> 16 fp32 (bf16 is the high half of an fp32)
__attribute__((target("avx512f"))) inline __m512 load_bf16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// One kv head, DC chunks of 16 dims: scores of the g queries, softmax, then their weighted sums of V.
template <int DC>
__attribute__((target("avx512f,avx512bw"))) void head_avx512(const float* q, int g, const uint16_t* K, size_t ks,
                                                              const uint16_t* V, size_t vs, int L, float scale,
                                                              float* s, float* out) {
  for (int j = 0; j < L; ++j) {  // a key row is read once for all g queries
    __m512 k[DC];
    MOE_UNROLL for (int c = 0; c < DC; ++c) k[c] = load_bf16(K + j * ks + 16 * c);
    for (int i = 0; i < g; ++i) {
      __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(q + i * 16 * DC), k[0]);
      MOE_UNROLL for (int c = 1; c < DC; ++c) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + i * 16 * DC + 16 * c), k[c], acc);
      s[size_t(i) * L + j] = _mm512_reduce_add_ps(acc) * scale;
    }
  }
  for (int i = 0; i < g; ++i) {  // softmax of each query's scores
    float* r = s + size_t(i) * L;
    __m512 m = _mm512_set1_ps(-INFINITY);
    int j = 0;
    for (; j + 16 <= L; j += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(r + j));
    float mx = _mm512_reduce_max_ps(m);
    for (; j < L; ++j) mx = std::max(mx, r[j]);
    __m512 sum = _mm512_setzero_ps();
    for (j = 0; j < L; j += 16) {
      const __mmask16 km = L - j >= 16 ? __mmask16(0xffff) : __mmask16((1u << (L - j)) - 1);
      const __m512 e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(km, r + j), _mm512_set1_ps(mx)));
      _mm512_mask_storeu_ps(r + j, km, e);
      sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(km, e));
    }
    const float inv = 1.f / _mm512_reduce_add_ps(sum);
    for (j = 0; j < L; ++j) r[j] *= inv;
  }
  // out[i] = sum_j p[i][j] V[j]: two queries a pass over V where the registers allow
  constexpr int QB = DC <= 8 ? 2 : 1;
  for (int i0 = 0; i0 < g; i0 += QB) {
    const int nb = std::min(QB, g - i0);
    __m512 acc[QB][DC];
    MOE_UNROLL for (int b = 0; b < QB; ++b) MOE_UNROLL for (int c = 0; c < DC; ++c) acc[b][c] = _mm512_setzero_ps();
    for (int j = 0; j < L; ++j) {
      MOE_UNROLL for (int c = 0; c < DC; ++c) {
        const __m512 v = load_bf16(V + j * vs + 16 * c);
        MOE_UNROLL for (int b = 0; b < QB; ++b)
          if (b < nb) acc[b][c] = _mm512_fmadd_ps(_mm512_set1_ps(s[size_t(i0 + b) * L + j]), v, acc[b][c]);
      }
    }
    for (int b = 0; b < nb; ++b)
      MOE_UNROLL for (int c = 0; c < DC; ++c) _mm512_storeu_ps(out + size_t(i0 + b) * 16 * DC + 16 * c, acc[b][c]);
  }
}

// The plain loops: the reference the vector version is tested against, and every other dim / path.
void head_portable(const float* q, int g, int d, const uint16_t* K, size_t ks, const uint16_t* V, size_t vs, int L,
                   float scale, float* s, float* out) {
  for (int i = 0; i < g; ++i) {
    float* r = s + size_t(i) * L;
    float mx = -INFINITY;
    for (int j = 0; j < L; ++j) {
      float acc = 0.f;
      for (int c = 0; c < d; ++c) acc += q[i * d + c] * bf16_to_f32(K[j * ks + c]);
      r[j] = acc * scale;
      mx = std::max(mx, r[j]);
    }
    float sum = 0.f;
    for (int j = 0; j < L; ++j) sum += (r[j] = std::exp(r[j] - mx));
    for (int c = 0; c < d; ++c) out[i * d + c] = 0.f;
    for (int j = 0; j < L; ++j)
      for (int c = 0; c < d; ++c) out[i * d + c] += r[j] / sum * bf16_to_f32(V[j * vs + c]);
  }
}

}  // namespace

void decode_attention(Isa isa, const float* q, int nh, int nkv, int d, const uint16_t* K, size_t k_head, size_t k_row,
                      const uint16_t* V, size_t v_head, size_t v_row, int L, float scale, float* out) {
  MOE_CHECK(nh > 0 && nkv > 0 && nh % nkv == 0 && d > 0 && L > 0, "decode attention: bad shapes");
  const int g = nh / nkv;
  const bool simd = isa == Isa::Avx512 || isa == Isa::Amx;
  pool().parallel_for(nkv, [&](int h) {
    std::vector<float> s(size_t(g) * L);
    const float* qh = q + size_t(h) * g * d;
    const uint16_t *Kh = K + h * k_head, *Vh = V + h * v_head;
    float* oh = out + size_t(h) * g * d;
    if (simd && d == 64) head_avx512<4>(qh, g, Kh, k_row, Vh, v_row, L, scale, s.data(), oh);
    else if (simd && d == 128) head_avx512<8>(qh, g, Kh, k_row, Vh, v_row, L, scale, s.data(), oh);
    else if (simd && d == 256) head_avx512<16>(qh, g, Kh, k_row, Vh, v_row, L, scale, s.data(), oh);
    else head_portable(qh, g, d, Kh, k_row, Vh, v_row, L, scale, s.data(), oh);
  });
}

}  // namespace moe
