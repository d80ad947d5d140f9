// Decode attention on the CPU: one new query per head against a sequence's cached keys and values
// (bf16 or fp32, [kv heads, positions, dim] with any head and position strides, or paged: positions in
// blocks of a pool, found through the sequence's block table; gpu_service/kv_pool.py), grouped-query: the
// query heads of a kv head share each pass over its keys and values. fp32 scores, softmax and sums;
// tasks over kv heads. torch's matmuls for this (two strided bmm, a softmax, casts) take several times what
// its bytes need (docs/kernels.md, "Measured choices").
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "common.h"
#include "moe.h"
#include "vmath.h"

namespace moe {

namespace {

// 16 / 8 elements -> fp32 lanes (bf16 is the high half of an fp32)
__attribute__((target("avx512f"))) inline __m512 ld16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
__attribute__((target("avx512f"))) inline __m512 ld16(const float* p) { return _mm512_loadu_ps(p); }
__attribute__((target("avx2"))) inline __m256 ld8(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
__attribute__((target("avx2"))) inline __m256 ld8(const float* p) { return _mm256_loadu_ps(p); }
inline float ld1(const uint16_t* p) { return bf16_to_f32(*p); }
inline float ld1(const float* p) { return *p; }

__attribute__((target("avx2,fma"))) inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// Where position j's row of one kv head lies: base + j * row, or paged, block table[j >> shift] of the pool
// (each `block` elements apart), row j & mask within it. One table read per row against d multiply-adds.
// P (paged) is a template flag: the contiguous kernel has no per-row test.
template <class T, bool P>
struct Rows {
  const T* base;
  size_t row, block;
  const int32_t* table;  // P: the block table
  int shift;
  const T* operator()(int j) const {
    if (!P) return base + size_t(j) * row;
    return base + size_t(table[j >> shift]) * block + size_t(j & ((1 << shift) - 1)) * row;
  }
  // Paged: the rows of a block are contiguous but the blocks are anywhere, where the hardware prefetcher does not
  // follow (measured 1.7x the contiguous time at 6000 scattered positions): fetch the row one block ahead.
  void prefetch_ahead(int j, int L, int d) const {
    if (!P || j + (1 << shift) >= L) return;
    const char* p = reinterpret_cast<const char*>((*this)(j + (1 << shift)));
    for (size_t o = 0; o < d * sizeof(T); o += 64) _mm_prefetch(p + o, _MM_HINT_T0);
  }
};

// The tile's row addresses, found once rather than once per slice of dims
template <class T, bool P>
inline void tile_rows(const Rows<T, P>& R, int j0, int j1, const T** out) {
  for (int j = j0; j < j1; ++j) out[j - j0] = R(j);
}

constexpr int QG = 8;     // query heads summed together in one pass over V (accumulators)
// positions of V per tile: the sums walk a tile once per slice of dims, so it must stay in cache (untiled,
// each of d/8 slices streams all of V from memory again)
constexpr int TILE = 64;
constexpr size_t SERIAL_MACS = size_t(1) << 19;  // below this many multiply-adds per call: no threads

// In place: each of the g rows of s (L scores) -> its softmax. Plain loops around the vector exp.
template <class ExpRow>
void softmax_rows(float* s, int g, int L, ExpRow exp_row) {
  for (int i = 0; i < g; ++i) {
    float* r = s + size_t(i) * L;
    const float mx = *std::max_element(r, r + L);
    const float inv = 1.f / exp_row(r, L, mx);
    for (int j = 0; j < L; ++j) r[j] *= inv;
  }
}

// r[j] = e^(r[j] - mx); returns their sum
__attribute__((target("avx512f"))) float exp_row_avx512(float* r, int L, float mx) {
  __m512 sum = _mm512_setzero_ps();
  for (int j = 0; j < L; j += 16) {
    const __mmask16 k = L - j >= 16 ? __mmask16(0xffff) : __mmask16((1u << (L - j)) - 1);
    const __m512 e = _mm512_maskz_mov_ps(k, exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, r + j), _mm512_set1_ps(mx))));
    _mm512_mask_storeu_ps(r + j, k, e);
    sum = _mm512_add_ps(sum, e);
  }
  return _mm512_reduce_add_ps(sum);
}
__attribute__((target("avx2,fma"))) float exp_row_avx2(float* r, int L, float mx) {
  __m256 sum = _mm256_setzero_ps();
  int j = 0;
  for (; j + 8 <= L; j += 8) {
    const __m256 e = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(r + j), _mm256_set1_ps(mx)));
    _mm256_storeu_ps(r + j, e);
    sum = _mm256_add_ps(sum, e);
  }
  float tail = 0.f;
  for (; j < L; ++j) tail += (r[j] = std::exp(r[j] - mx));
  return hsum8(sum) + tail;
}

// One kv head, d = 16 * DC: scores of the g queries (a key row's DC vectors kept in registers for all
// of them), softmax, then per 16-dim slice of V the weighted sums of up to QG queries at once.
template <int DC, class T, bool P>
__attribute__((target("avx512f,avx512bw"))) void head_avx512(const float* q, int g, Rows<T, P> K, Rows<T, P> V, int L, float scale, float* s,
                                                              float* out) {
  constexpr int d = 16 * DC;
  for (int j = 0; j < L; ++j) {
    K.prefetch_ahead(j, L, d);
    __m512 k[DC];
    MOE_UNROLL for (int c = 0; c < DC; ++c) k[c] = ld16(K(j) + 16 * c);
    for (int i = 0; i < g; ++i) {
      __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(q + i * d), k[0]);
      MOE_UNROLL for (int c = 1; c < DC; ++c) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + i * d + 16 * c), k[c], acc);
      s[size_t(i) * L + j] = _mm512_reduce_add_ps(acc) * scale;
    }
  }
  softmax_rows(s, g, L, exp_row_avx512);
  std::fill(out, out + size_t(g) * d, 0.f);
  const T* vr[TILE];
  for (int j0 = 0; j0 < L; j0 += TILE) {  // V a tile of positions at a time: read from memory once
    const int j1 = std::min(L, j0 + TILE);
    tile_rows(V, j0, j1, vr);
    for (int j = j0; j < j1; ++j) V.prefetch_ahead(j + TILE - (1 << V.shift), L, d);  // the next tile's
    for (int c = 0; c < DC; ++c)
      for (int i0 = 0; i0 < g; i0 += QG) {
        const int nb = std::min(QG, g - i0);
        __m512 acc[QG];
        MOE_UNROLL for (int b = 0; b < QG; ++b)
          acc[b] = b < nb ? _mm512_loadu_ps(out + size_t(i0 + b) * d + 16 * c) : _mm512_setzero_ps();
        for (int j = j0; j < j1; ++j) {
          const __m512 v = ld16(vr[j - j0] + 16 * c);
          MOE_UNROLL for (int b = 0; b < QG; ++b)
            if (b < nb) acc[b] = _mm512_fmadd_ps(_mm512_set1_ps(s[size_t(i0 + b) * L + j]), v, acc[b]);
        }
        for (int b = 0; b < nb; ++b) _mm512_storeu_ps(out + size_t(i0 + b) * d + 16 * c, acc[b]);
      }
  }
}

// The same on AVX2 (8 lanes; a key row is read from L1 for each query instead of kept in registers)
template <int DC, class T, bool P>
__attribute__((target("avx2,fma"))) void head_avx2(const float* q, int g, Rows<T, P> K, Rows<T, P> V, int L, float scale, float* s, float* out) {
  constexpr int d = 8 * DC;
  for (int j = 0; j < L; ++j) {
    K.prefetch_ahead(j, L, d);
    for (int i = 0; i < g; ++i) {
      __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();  // two chains: FMA latency
      MOE_UNROLL for (int c = 0; c < DC; c += 2) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i * d + 8 * c), ld8(K(j) + 8 * c), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i * d + 8 * c + 8), ld8(K(j) + 8 * c + 8), a1);
      }
      s[size_t(i) * L + j] = hsum8(_mm256_add_ps(a0, a1)) * scale;
    }
  }
  softmax_rows(s, g, L, exp_row_avx2);
  std::fill(out, out + size_t(g) * d, 0.f);
  const T* vr[TILE];
  for (int j0 = 0; j0 < L; j0 += TILE) {
    const int j1 = std::min(L, j0 + TILE);
    tile_rows(V, j0, j1, vr);
    for (int j = j0; j < j1; ++j) V.prefetch_ahead(j + TILE - (1 << V.shift), L, d);
    for (int c = 0; c < DC; ++c)
      for (int i0 = 0; i0 < g; i0 += QG) {
        const int nb = std::min(QG, g - i0);
        __m256 acc[QG];
        MOE_UNROLL for (int b = 0; b < QG; ++b)
          acc[b] = b < nb ? _mm256_loadu_ps(out + size_t(i0 + b) * d + 8 * c) : _mm256_setzero_ps();
        for (int j = j0; j < j1; ++j) {
          const __m256 v = ld8(vr[j - j0] + 8 * c);
          MOE_UNROLL for (int b = 0; b < QG; ++b)
            if (b < nb) acc[b] = _mm256_fmadd_ps(_mm256_set1_ps(s[size_t(i0 + b) * L + j]), v, acc[b]);
        }
        for (int b = 0; b < nb; ++b) _mm256_storeu_ps(out + size_t(i0 + b) * d + 8 * c, acc[b]);
      }
  }
}

// The plain loops: the portable path, any head dim, and the reference the vector versions are tested against.
template <class T, bool P>
void head_portable(const float* q, int g, int d, Rows<T, P> K, Rows<T, P> V, int L, float scale, float* s, float* out) {
  for (int i = 0; i < g; ++i)
    for (int j = 0; j < L; ++j) {
      float acc = 0.f;
      for (int c = 0; c < d; ++c) acc += q[i * d + c] * ld1(K(j) + c);
      s[size_t(i) * L + j] = acc * scale;
    }
  softmax_rows(s, g, L, [](float* r, int n, float mx) {
    float sum = 0.f;
    for (int j = 0; j < n; ++j) sum += (r[j] = std::exp(r[j] - mx));
    return sum;
  });
  for (int i = 0; i < g; ++i)
    for (int c = 0; c < d; ++c) {
      float acc = 0.f;
      for (int j = 0; j < L; ++j) acc += s[size_t(i) * L + j] * ld1(V(j) + c);
      out[i * d + c] = acc;
    }
}

template <class T, bool P>
void one_head(Isa isa, const float* q, int g, int d, Rows<T, P> K, Rows<T, P> V, int L, float scale, float* s, float* out) {
  const bool v512 = isa == Isa::Avx512 || isa == Isa::Amx, v256 = ymm_path(isa);
  if (v512 && d == 64) return head_avx512<4, T, P>(q, g, K, V, L, scale, s, out);
  if (v512 && d == 128) return head_avx512<8, T, P>(q, g, K, V, L, scale, s, out);
  if (v512 && d == 256) return head_avx512<16, T, P>(q, g, K, V, L, scale, s, out);
  if (v256 && d == 64) return head_avx2<8, T, P>(q, g, K, V, L, scale, s, out);
  if (v256 && d == 128) return head_avx2<16, T, P>(q, g, K, V, L, scale, s, out);
  if (v256 && d == 256) return head_avx2<32, T, P>(q, g, K, V, L, scale, s, out);
  head_portable(q, g, d, K, V, L, scale, s, out);
}

}  // namespace

void decode_attention(Isa isa, const float* q, int nh, int nkv, int d, const void* K, bool bf16, size_t k_head,
                      size_t k_row, const void* V, size_t v_head, size_t v_row, int L, float scale, float* out,
                      const int32_t* table, int block_shift, size_t k_block, size_t v_block) {
  MOE_CHECK(nh > 0 && nkv > 0 && nh % nkv == 0 && d > 0 && L > 0, "decode attention: bad shapes");
  MOE_CHECK(!table || (block_shift >= 0 && block_shift < 16), "decode attention: bad block size");
  const int g = nh / nkv;
  auto run = [&](auto* k, auto* v, int h, float* s, const float* qh, float* oh) {  // T: bf16 bits or float
    using T = std::remove_const_t<std::remove_pointer_t<decltype(k)>>;
    k += h * k_head;
    v += h * v_head;
    if (table)
      one_head(isa, qh, g, d, Rows<T, true>{k, k_row, k_block, table, block_shift},
               Rows<T, true>{v, v_row, v_block, table, block_shift}, L, scale, s, oh);
    else
      one_head(isa, qh, g, d, Rows<T, false>{k, k_row, 0, nullptr, 0}, Rows<T, false>{v, v_row, 0, nullptr, 0}, L,
               scale, s, oh);
  };
  auto head = [&](int h) {
    std::vector<float> s(size_t(g) * L);
    const float* qh = q + size_t(h) * g * d;
    float* oh = out + size_t(h) * g * d;
    if (bf16)
      run(static_cast<const uint16_t*>(K), static_cast<const uint16_t*>(V), h, s.data(), qh, oh);
    else
      run(static_cast<const float*>(K), static_cast<const float*>(V), h, s.data(), qh, oh);
  };
  // a short context is a few microseconds of work: waking the pool's threads would cost more (they
  // sleep when the machine is busy), so it runs here
  if (size_t(L) * nh * d < SERIAL_MACS) {
    for (int h = 0; h < nkv; ++h) head(h);
  } else {
    pool().parallel_for(nkv, head);
  }
}

}  // namespace moe
