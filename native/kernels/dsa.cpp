// DeepSeek Sparse Attention's lightning indexer at decode (DeepSeek-V3.2, GLM-5): each cached position's score
// sum over heads of w[h] * relu(scale * q[h] . k), then the top k positions, which MLA's latent attention reads
// (mla_decode_attention with a selection). At 32k positions the scores are 64 heads x 128 dims a position, 0.27 GMAC
// against 8 MB of bf16 keys: compute decides. So 16 keys at a time are widened to fp32 and laid out dim-major (one
// vector of 16 keys a dim), and every head's query runs down them as broadcasts: no horizontal sums, and the vector
// paths keep 8 (AVX-512) or 4 (AVX2) heads' sums in flight. Every path sums each key's dims in order, mul then add,
// and the heads in order: the same bits on every path (a prompt picks the same keys on any CPU). Threads over
// chunks of positions. Without weights (w null: MiniMax-M3's block indexer) each head's scale * q[h] . k is kept instead
// of the sum, [H, L].
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "kernels/kv_codes.h"
#include "kernels/reduce4.h"
#include "kernels/torch_rounding.h"
#include "moe.h"
#include "runtime/common.h"

namespace moe {

namespace {

using namespace rounding;

constexpr int TK = 16;          // keys a tile
constexpr int MAX_DIM = 512;    // the indexer's head dim (128 as published)
constexpr int MAX_RAW_HEADS = 64;  // heads whose scores are kept one by one (w null; MiniMax-M3's: 4)
constexpr int CHUNK = 256;      // positions a task
constexpr size_t SERIAL_MACS = size_t(1) << 18;

using rounding::get;
inline float get(const I8* p, size_t i) { return code_value(p + i); }
inline float get(const F8* p, size_t i) { return code_value(p + i); }

// keys j.. (n of them, the tile's rest repeating the last) widened into kt [D][TK]; an 8-bit key's codes, its scale
// into ks[i] (the scores times it after: relu commutes with a positive power of two, the same bits as its values')
template <class T, class At>
inline void pack_tile(const T* k, At at, int j, int n, int D, float* kt, float* ks) {
  for (int i = 0; i < TK; ++i) {
    const T* key = k + at(j + std::min(i, n - 1));
    for (int d = 0; d < D; ++d) kt[d * TK + i] = get(key, d);
    if constexpr (quantized<T>) ks[i] = row_scale<T>(reinterpret_cast<const uint8_t*>(key)[D]);
  }
}

// each tile: the 16 keys' sum over heads into tot, or (w null) each head's scores into hs [H][TK]
__attribute__((optimize("fp-contract=off"))) void tile_portable(const float* q, const float* w, int H, int D,
                                                                 float scale, const float* kt, float* tot, float* hs) {
  for (int i = 0; i < TK; ++i) tot[i] = 0.f;
  for (int h = 0; h < H; ++h) {
    float acc[TK] = {};
    const float* qh = q + size_t(h) * D;
    for (int d = 0; d < D; ++d)
      for (int i = 0; i < TK; ++i) acc[i] += qh[d] * kt[d * TK + i];
    for (int i = 0; i < TK; ++i) {
      const float s = acc[i] * scale;
      if (!w)
        hs[h * TK + i] = s;
      else if (s > 0.f)
        tot[i] += w[h] * s;
    }
  }
}

__attribute__((target("avx512f"), optimize("fp-contract=off"))) void tile_avx512(const float* q, const float* w,
                                                                                int H, int D, float scale,
                                                                                const float* kt, float* tot,
                                                                                float* hs) {
  const __m512 sc = _mm512_set1_ps(scale), zero = _mm512_setzero_ps();
  __m512 t = zero;
  auto add = [&](__m512 a, int h) {
    const __m512 s = _mm512_mul_ps(a, sc);
    if (!w) return _mm512_storeu_ps(hs + h * TK, s);
    t = _mm512_mask_add_ps(t, _mm512_cmp_ps_mask(s, zero, _CMP_GT_OQ), t, _mm512_mul_ps(_mm512_set1_ps(w[h]), s));
  };
  int h = 0;
  for (; h + 8 <= H; h += 8) {
    const float* qh = q + size_t(h) * D;
    __m512 a0 = zero, a1 = zero, a2 = zero, a3 = zero, a4 = zero, a5 = zero, a6 = zero, a7 = zero;
    for (int d = 0; d < D; ++d) {
      const __m512 k = _mm512_load_ps(kt + d * TK);
      a0 = _mm512_add_ps(a0, _mm512_mul_ps(_mm512_set1_ps(qh[d]), k));
      a1 = _mm512_add_ps(a1, _mm512_mul_ps(_mm512_set1_ps(qh[D + d]), k));
      a2 = _mm512_add_ps(a2, _mm512_mul_ps(_mm512_set1_ps(qh[2 * D + d]), k));
      a3 = _mm512_add_ps(a3, _mm512_mul_ps(_mm512_set1_ps(qh[3 * D + d]), k));
      a4 = _mm512_add_ps(a4, _mm512_mul_ps(_mm512_set1_ps(qh[4 * D + d]), k));
      a5 = _mm512_add_ps(a5, _mm512_mul_ps(_mm512_set1_ps(qh[5 * D + d]), k));
      a6 = _mm512_add_ps(a6, _mm512_mul_ps(_mm512_set1_ps(qh[6 * D + d]), k));
      a7 = _mm512_add_ps(a7, _mm512_mul_ps(_mm512_set1_ps(qh[7 * D + d]), k));
    }
    add(a0, h), add(a1, h + 1), add(a2, h + 2), add(a3, h + 3), add(a4, h + 4), add(a5, h + 5), add(a6, h + 6);
    add(a7, h + 7);
  }
  for (; h < H; ++h) {
    const float* qh = q + size_t(h) * D;
    __m512 a = zero;
    for (int d = 0; d < D; ++d) a = _mm512_add_ps(a, _mm512_mul_ps(_mm512_set1_ps(qh[d]), _mm512_load_ps(kt + d * TK)));
    add(a, h);
  }
  _mm512_storeu_ps(tot, t);
}

__attribute__((target("avx2"), optimize("fp-contract=off"))) void tile_avx2(const float* q, const float* w, int H,
                                                                           int D, float scale, const float* kt,
                                                                           float* tot, float* hs) {
  const __m256 sc = _mm256_set1_ps(scale), zero = _mm256_setzero_ps();
  __m256 t0 = zero, t1 = zero;  // keys 0-7, 8-15
  auto add = [&](__m256 a, __m256 b, int h) {
    const __m256 sa = _mm256_mul_ps(a, sc), sb = _mm256_mul_ps(b, sc);
    if (!w) return _mm256_storeu_ps(hs + h * TK, sa), _mm256_storeu_ps(hs + h * TK + 8, sb);
    const __m256 wh = _mm256_set1_ps(w[h]);
    t0 = _mm256_blendv_ps(t0, _mm256_add_ps(t0, _mm256_mul_ps(wh, sa)), _mm256_cmp_ps(sa, zero, _CMP_GT_OQ));
    t1 = _mm256_blendv_ps(t1, _mm256_add_ps(t1, _mm256_mul_ps(wh, sb)), _mm256_cmp_ps(sb, zero, _CMP_GT_OQ));
  };
  int h = 0;
  for (; h + 4 <= H; h += 4) {
    const float* qh = q + size_t(h) * D;
    __m256 a0 = zero, b0 = zero, a1 = zero, b1 = zero, a2 = zero, b2 = zero, a3 = zero, b3 = zero;
    for (int d = 0; d < D; ++d) {
      const __m256 k = _mm256_load_ps(kt + d * TK), l = _mm256_load_ps(kt + d * TK + 8);
      __m256 x = _mm256_broadcast_ss(qh + d);
      a0 = _mm256_add_ps(a0, _mm256_mul_ps(x, k)), b0 = _mm256_add_ps(b0, _mm256_mul_ps(x, l));
      x = _mm256_broadcast_ss(qh + D + d);
      a1 = _mm256_add_ps(a1, _mm256_mul_ps(x, k)), b1 = _mm256_add_ps(b1, _mm256_mul_ps(x, l));
      x = _mm256_broadcast_ss(qh + 2 * D + d);
      a2 = _mm256_add_ps(a2, _mm256_mul_ps(x, k)), b2 = _mm256_add_ps(b2, _mm256_mul_ps(x, l));
      x = _mm256_broadcast_ss(qh + 3 * D + d);
      a3 = _mm256_add_ps(a3, _mm256_mul_ps(x, k)), b3 = _mm256_add_ps(b3, _mm256_mul_ps(x, l));
    }
    add(a0, b0, h), add(a1, b1, h + 1), add(a2, b2, h + 2), add(a3, b3, h + 3);
  }
  for (; h < H; ++h) {
    const float* qh = q + size_t(h) * D;
    __m256 a = zero, b = zero;
    for (int d = 0; d < D; ++d) {
      const __m256 x = _mm256_broadcast_ss(qh + d);
      a = _mm256_add_ps(a, _mm256_mul_ps(x, _mm256_load_ps(kt + d * TK)));
      b = _mm256_add_ps(b, _mm256_mul_ps(x, _mm256_load_ps(kt + d * TK + 8)));
    }
    add(a, b, h);
  }
  _mm256_storeu_ps(tot, t0);
  _mm256_storeu_ps(tot + 8, t1);
}

// positions [j0, j1): out[j] = sum_h w[h] * max(0, scale * q[h] . k[at(j)]), or (w null) out[h * L + j] = scale *
// q[h] . k[at(j)]; at(j) where position j's key is in k
template <class T, class At>
void scores(Isa isa, const float* q, const float* w, int H, int D, float scale, const T* k, At at, int j0, int j1,
            int L, float* out) {
  alignas(64) float kt[MAX_DIM * TK];
  float tot[TK], ks[TK], hs[MAX_RAW_HEADS * TK];
  const bool v512 = isa == Isa::Avx512 || isa == Isa::Amx, v256 = ymm_path(isa);
  for (int j = j0; j < j1; j += TK) {
    const int n = std::min(TK, j1 - j);
    pack_tile(k, at, j, n, D, kt, ks);
    if (v512)
      tile_avx512(q, w, H, D, scale, kt, tot, hs);
    else if (v256)
      tile_avx2(q, w, H, D, scale, kt, tot, hs);
    else
      tile_portable(q, w, H, D, scale, kt, tot, hs);
    if (!w) {  // (an 8-bit key's scale after: a power of two, the same bits as its values')
      for (int h = 0; h < H; ++h)
        for (int i = 0; i < n; ++i) out[size_t(h) * L + j + i] = quantized<T> ? hs[h * TK + i] * ks[i] : hs[h * TK + i];
      continue;
    }
    if constexpr (quantized<T>)
      for (int i = 0; i < n; ++i) tot[i] *= ks[i];
    std::copy(tot, tot + n, out + j);
  }
}

// Few heads' own scores (w null, H <= 8: MiniMax-M3's block indexer has 4), on the vector paths: key-major instead, each key's dims read
// once, widened in registers, against every head's query, 4 heads a pass and their 4 sums by one shuffle tree
// (reduce4.h). Widening 16 keys dim-major costs a key's D loads and stores whatever the heads: with 4 heads that
// was most of the time (docs/performance/decode_step.md, "MiniMax-M3's block-sparse attention at depth").
__attribute__((target("avx512f,avx512bw"))) inline __m512 widen16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
__attribute__((target("avx512f"))) inline __m512 widen16(const float* p) { return _mm512_loadu_ps(p); }
__attribute__((target("avx512f,avx512bw"))) inline __m512 widen16(const I8* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

template <class T>
constexpr bool few_heads_type = std::is_same<T, uint16_t>::value || std::is_same<T, float>::value ||
                                std::is_same<T, I8>::value;

template <class T, class At>
__attribute__((target("avx512f,avx512bw,avx512dq,avx2,fma"))) void few_heads_avx512(const float* q, int H, int D,
                                                                                   float scale, const T* k, At at,
                                                                                   int j0, int j1, int L, float* out) {
  for (int j = j0; j < j1; ++j) {
    const T* key = k + at(j);
    float ks = scale;
    if constexpr (quantized<T>) ks *= row_scale<T>(reinterpret_cast<const uint8_t*>(key)[D]);
    for (int h = 0; h < H; h += 4) {
      const int n = std::min(4, H - h);
      // (a pass past the last head repeats the first's query; its sums are dropped)
      const float *q0 = q + size_t(h) * D, *q1 = n > 1 ? q0 + D : q0, *q2 = n > 2 ? q0 + 2 * D : q0,
                  *q3 = n > 3 ? q0 + 3 * D : q0;
      __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int d = 0; d < D; d += 16) {
        const __m512 x = widen16(key + d);
        a0 = _mm512_fmadd_ps(_mm512_loadu_ps(q0 + d), x, a0);
        a1 = _mm512_fmadd_ps(_mm512_loadu_ps(q1 + d), x, a1);
        a2 = _mm512_fmadd_ps(_mm512_loadu_ps(q2 + d), x, a2);
        a3 = _mm512_fmadd_ps(_mm512_loadu_ps(q3 + d), x, a3);
      }
      alignas(16) float r[4];
      _mm_store_ps(r, _mm_mul_ps(reduce4_ps(a0, a1, a2, a3), _mm_set1_ps(ks)));
      for (int i = 0; i < n; ++i) out[size_t(h + i) * L + j] = r[i];
    }
  }
}

// The same on AVX2 (8 lanes a vector, the 8-lane reduce4)
__attribute__((target("avx2"))) inline __m256 widen8(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
__attribute__((target("avx2"))) inline __m256 widen8(const float* p) { return _mm256_loadu_ps(p); }
__attribute__((target("avx2"))) inline __m256 widen8(const I8* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

template <class T, class At>
__attribute__((target("avx2,fma"))) void few_heads_avx2(const float* q, int H, int D, float scale, const T* k, At at,
                                                        int j0, int j1, int L, float* out) {
  for (int j = j0; j < j1; ++j) {
    const T* key = k + at(j);
    float ks = scale;
    if constexpr (quantized<T>) ks *= row_scale<T>(reinterpret_cast<const uint8_t*>(key)[D]);
    for (int h = 0; h < H; h += 4) {
      const int n = std::min(4, H - h);
      const float *q0 = q + size_t(h) * D, *q1 = n > 1 ? q0 + D : q0, *q2 = n > 2 ? q0 + 2 * D : q0,
                  *q3 = n > 3 ? q0 + 3 * D : q0;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int d = 0; d < D; d += 8) {
        const __m256 x = widen8(key + d);
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + d), x, a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q1 + d), x, a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(q2 + d), x, a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(q3 + d), x, a3);
      }
      alignas(16) float r[4];
      _mm_store_ps(r, _mm_mul_ps(reduce4_ps(a0, a1, a2, a3), _mm_set1_ps(ks)));
      for (int i = 0; i < n; ++i) out[size_t(h + i) * L + j] = r[i];
    }
  }
}

}  // namespace

void dsa_index_scores(Isa isa, const float* q, const float* w, int H, int D, float scale, const void* K, KvType kv,
                      size_t k_row, int L, float* out, const int32_t* table, int block_shift, size_t k_block) {
  MOE_CHECK(H > 0 && D > 0 && D <= MAX_DIM && L >= 0 && (w || H <= MAX_RAW_HEADS), "dsa_index_scores: bad shapes");
  MOE_CHECK(kv != KvType::F16, "dsa_index_scores: keys must be fp32, bf16, int8 or fp8");
  MOE_CHECK(!table || (block_shift >= 0 && block_shift < 16), "dsa_index_scores: bad block size");
  auto run = [&](auto* k, int j0, int j1) {
    const int mask = (1 << block_shift) - 1;
    using T = std::remove_const_t<std::remove_pointer_t<decltype(k)>>;
    if constexpr (few_heads_type<T>)
      if (!w && H <= 8 && D % 16 == 0 && isa != Isa::Portable) {
        auto paged = [&](int j) { return size_t(table[j >> block_shift]) * k_block + size_t(j & mask) * k_row; };
        auto flat = [&](int j) { return size_t(j) * k_row; };
        if (isa == Isa::Avx512 || isa == Isa::Amx)
          table ? few_heads_avx512(q, H, D, scale, k, paged, j0, j1, L, out)
                : few_heads_avx512(q, H, D, scale, k, flat, j0, j1, L, out);
        else
          table ? few_heads_avx2(q, H, D, scale, k, paged, j0, j1, L, out)
                : few_heads_avx2(q, H, D, scale, k, flat, j0, j1, L, out);
        return;
      }
    if (table)
      scores(isa, q, w, H, D, scale, k, [&](int j) {
        return size_t(table[j >> block_shift]) * k_block + size_t(j & mask) * k_row; }, j0, j1, L, out);
    else
      scores(isa, q, w, H, D, scale, k, [&](int j) { return size_t(j) * k_row; }, j0, j1, L, out);
  };
  auto chunk = [&](int c) {
    const int j0 = c * CHUNK, j1 = std::min(L, j0 + CHUNK);
    if (kv == KvType::BF16)
      run(static_cast<const uint16_t*>(K), j0, j1);
    else if (kv == KvType::I8)
      run(static_cast<const I8*>(K), j0, j1);
    else if (kv == KvType::F8)
      run(static_cast<const F8*>(K), j0, j1);
    else
      run(static_cast<const float*>(K), j0, j1);
  };
  const int chunks = (L + CHUNK - 1) / CHUNK;
  if (size_t(L) * H * D < SERIAL_MACS) {
    for (int c = 0; c < chunks; ++c) chunk(c);
  } else {
    pool().parallel_for(chunks, chunk);
  }
}

int dsa_top_k(const float* scores, int L, int k, int32_t* out) {
  MOE_CHECK(L >= 0 && k > 0, "dsa_top_k: bad sizes");
  if (L <= k) {  // every position
    for (int j = 0; j < L; ++j) out[j] = j;
    return L;
  }
  // the k first in (score descending, position ascending): ties go to the earlier position, as the torch path's
  // stable sort gives them (a query picks the same keys whether its prompt was prefilled whole or in chunks)
  thread_local std::vector<int32_t> idx;
  idx.resize(L);
  for (int j = 0; j < L; ++j) idx[j] = j;
  auto before = [scores](int32_t a, int32_t b) { return scores[a] > scores[b] || (scores[a] == scores[b] && a < b); };
  std::nth_element(idx.begin(), idx.begin() + (k - 1), idx.end(), before);
  std::sort(idx.begin(), idx.begin() + k);  // by position: the attention then reads the pool's blocks in order
  std::copy(idx.begin(), idx.begin() + k, out);
  return k;
}

}  // namespace moe
