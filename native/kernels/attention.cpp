// Decode attention on the CPU: one new query per head against a sequence's cached keys and values
// (bf16, fp16 or fp32, or 8-bit rows of codes and a power-of-two scale (kv_codes.h) whose scale multiplies a
// position's score and its weight: [kv heads, positions, dim] with any head and position strides, or paged: positions in
// blocks of a pool, found through the sequence's block table; gpu_service/kv_pool.py), grouped-query: up to 8
// query heads of a kv head share each pass over its keys and values, their 8 scores of a position one vector.
// fp32 scores, softmax and sums; tasks over kv heads. torch's matmuls for this (two strided bmm, a softmax,
// casts) take several times what its bytes need (docs/performance/kernels.md, "Measured choices").
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kernels/kv_codes.h"
#include "kernels/vmath.h"
#include "moe.h"
#include "runtime/common.h"

namespace moe {

namespace {

// An IEEE half of the cache (a tag type: bf16 is uint16_t here)
struct Half {
  uint16_t bits;
};

// 16 / 8 elements -> fp32 lanes (bf16 is the high half of an fp32; a half widens exactly by F16C, which every
// vector path's CPU has: isa_supported)
__attribute__((target("avx512f"))) inline __m512 ld16(const Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
__attribute__((target("avx2,f16c"))) inline __m256 ld8(const Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline float ld1(const Half* p) { return f16_to_f32(p->bits); }
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

// An 8-bit row's codes (kv_codes.h), widened: fp8 through F16C as kv_codes.h reads them
__attribute__((target("avx512f,avx512bw"))) inline __m512 ld16(const I8* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
// (kv_codes.h's half: the code sign-extended and shifted left 7 puts its sign at bit 15 and a copy at bit 14,
// which the mask clears)
__attribute__((target("avx512f,avx512bw,avx2"))) inline __m512 ld16(const F8* p) {
  const __m256i b = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(b, 7), _mm256_set1_epi16(int16_t(0xbfff))));
}
__attribute__((target("avx2"))) inline __m256 ld8(const I8* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
__attribute__((target("avx2,f16c"))) inline __m256 ld8(const F8* p) {
  const __m128i b = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(b, 7), _mm_set1_epi16(int16_t(0xbfff))));
}
inline float ld1(const I8* p) { return code_value(p); }
inline float ld1(const F8* p) { return code_value(p); }

// Where position j's row of one kv head lies: base + j * row, or paged, block table[j >> shift] of the pool
// (each `block` elements apart), row j & mask within it. One table read per row against d multiply-adds.
// P (paged) is a template flag: the contiguous kernel has no per-row test.
template <class T, bool P>
struct Rows {
  const T* base;
  size_t row, block;
  const int32_t* table;  // P: the block table
  int shift;
  const int32_t* sel = nullptr;  // P: the positions read, in order (DeepSeek Sparse Attention's), or all of them
  int dim = 0;  // values a row (an 8-bit row's scale byte follows them)
  const T* operator()(int j) const {
    if (!P) return base + size_t(j) * row;
    if (sel) j = sel[j];
    return base + size_t(table[j >> shift]) * block + size_t(j & ((1 << shift) - 1)) * row;
  }
  // Row j's scale: its values are codes times this (1 for a plain row). A power of two, so a score or weight
  // times it is exactly what the row's values themselves would give: the same bits as a cache holding them.
  float scale(int j) const {
    if constexpr (quantized<T>)
      return row_scale<T>(reinterpret_cast<const uint8_t*>((*this)(j))[dim]);
    else
      return 1.f;
  }
  // Row j's lines into L2 (V's, while the scores read K: docs/performance/kernels.md, "Decode attention: V into L2 during the
  // scores").
  void prefetch_l2(int j, int d) const {
    const char* p = reinterpret_cast<const char*>((*this)(j));
    for (size_t o = 0; o < d * sizeof(T) + quantized<T>; o += 64) prefetch_t1(p + o);
  }
  // Paged: the rows of a block are contiguous but the blocks are anywhere, where the hardware prefetcher does not
  // follow (measured 1.7x the contiguous time at 6000 scattered positions): fetch the row one block ahead.
  void prefetch_ahead(int j, int L, int d) const {
    if (!P || j + (1 << shift) >= L) return;
    const char* p = reinterpret_cast<const char*>((*this)(j + (1 << shift)));
    for (size_t o = 0; o < d * sizeof(T) + quantized<T>; o += 64) prefetch_t0(p + o);
  }
};

// The tile's row addresses, found once rather than once per slice of dims
template <class T, bool P>
inline void tile_rows(const Rows<T, P>& R, int j0, int j1, const T** out) {
  for (int j = j0; j < j1; ++j) out[j - j0] = R(j);
}

// Positions of V per tile: the sums walk a tile once per slice of dims, so it must stay in L1 (untiled, each of
// d/8 slices streams all of V from memory again): 16 KB of rows, half of a 32 KB L1 beside the scores, the
// output and the query (64 fp32 rows of 128, 32 KB, missed L1 on every slice's pass: docs/performance/decode_step.md).
constexpr int TILE = 64;  // the most
template <class T>
constexpr int tile_rows_for(int d) {
  return std::max(8, std::min(TILE, int(16384 / (d * sizeof(T)))));
}
constexpr size_t SERIAL_MACS = size_t(1) << 19;  // below this many multiply-adds per call: no threads

// A head's first positions of V fetched into L2 while its scores read K, so that the weighted sums find them there
// rather than in DRAM (a layer's cache is cold at decode: the weights read since its last token swept every cache);
// up to tuning().v_prefetch_bytes (common.h). No second stream where V is K (MLA's latent: the scores read those).
template <class T, bool P>
int v_prefetch_rows(const Rows<T, P>& K, const Rows<T, P>& V, int L, int dv) {
  return V.base == K.base ? 0 : int(std::min<size_t>(L, tuning().v_prefetch_bytes / (dv * sizeof(T))));
}

// The 8 sums of a[0..7]'s lanes, as lanes 0..7: halves, then quarters added pairwise across accumulators
// (3 shuffle-adds of 512 bits), then the 4 partials within each 128 bits. ~3 operations a sum where a
// reduce_add per accumulator takes ~8 (and stalls on its chain).
__attribute__((target("avx512f"))) inline __m256 sums8(const __m512* a) {
  __m512 u[4], w[2];
  MOE_UNROLL for (int p = 0; p < 4; ++p)  // [a_2p's 8 | a_2p+1's 8]
    u[p] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], 0x44), _mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], 0xee));
  MOE_UNROLL for (int p = 0; p < 2; ++p)  // four 128-bit lanes: a_4p, a_4p+1, a_4p+2, a_4p+3's 4 partials each
    w[p] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * p], u[2 * p + 1], 0x88), _mm512_shuffle_f32x4(u[2 * p], u[2 * p + 1], 0xdd));
  // 128-bit lane l: [x0 x1 x2 x3] of a_l (from w[0]) and [y0..y3] of a_l+4 (w[1]) -> [X Y X Y]
  __m512 z = _mm512_add_ps(_mm512_unpacklo_ps(w[0], w[1]), _mm512_unpackhi_ps(w[0], w[1]));  // x0+x2 y0+y2 x1+x3 y1+y3
  z = _mm512_add_ps(z, _mm512_permute_ps(z, 0x4e));
  return _mm512_castps512_ps256(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0), z));
}

// The same sums of int32 lanes (the int8 scores' dot products), exact
__attribute__((target("avx512f"))) inline __m256i sums8(const __m512i* a) {
  __m512i u[4], w[2];
  MOE_UNROLL for (int p = 0; p < 4; ++p)
    u[p] = _mm512_add_epi32(_mm512_shuffle_i32x4(a[2 * p], a[2 * p + 1], 0x44), _mm512_shuffle_i32x4(a[2 * p], a[2 * p + 1], 0xee));
  MOE_UNROLL for (int p = 0; p < 2; ++p)
    w[p] = _mm512_add_epi32(_mm512_shuffle_i32x4(u[2 * p], u[2 * p + 1], 0x88), _mm512_shuffle_i32x4(u[2 * p], u[2 * p + 1], 0xdd));
  __m512i z = _mm512_add_epi32(_mm512_unpacklo_epi32(w[0], w[1]), _mm512_unpackhi_epi32(w[0], w[1]));
  z = _mm512_add_epi32(z, _mm512_shuffle_epi32(z, _MM_PERM_BADC));
  return _mm512_castsi512_si256(_mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0), z));
}

// An int8 cache's scores by AVX-512 VNNI (I8Query): each query head rounded to int8 codes at a scale of its own
// (amax / 127, as llama.cpp's q8_0 query against a q8_0 cache), and a key's codes offset to unsigned (k + 128) so that
// vpdpbusd multiplies them 4 a lane; sum (k + 128) q = k . q + 128 sum q, the second term taken away once per query.
// A quarter of the fp32 path's multiply instructions and no widening of the key: the scores were the arithmetic
// bound of a long context (docs/performance/kv_cache.md). The query's rounding changes the scores (by ~1e-3 of
// their spread), so these are not the fp32 path's bits.
template <int G, int DB>
struct I8Query {
  alignas(64) int8_t codes[G][64 * DB];
  float scale[8] = {};  // per query: its codes' scale times the softmax scale
  int sum[8] = {};      // per query: its codes' sum
};

template <int G, int DB>
__attribute__((target("avx512f,avx512bw"))) inline void quantize_query(const float* q, float scale, I8Query<G, DB>& out) {
  constexpr int d = 64 * DB;
  for (int b = 0; b < G; ++b) {
    __m512 mx = _mm512_setzero_ps();
    for (int c = 0; c < d; c += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_loadu_ps(q + b * d + c)));
    const float amax = _mm512_reduce_max_ps(mx), qs = amax > 0.f ? amax / 127.f : 1.f;
    const __m512 inv = _mm512_set1_ps(1.f / qs);
    __m512i total = _mm512_setzero_si512();
    for (int c = 0; c < d; c += 16) {
      const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(q + b * d + c), inv));  // to nearest
      const __m512i cl = _mm512_max_epi32(_mm512_min_epi32(v, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out.codes[b] + c), _mm512_cvtepi32_epi8(cl));
      total = _mm512_add_epi32(total, cl);
    }
    out.scale[b] = qs * scale;
    out.sum[b] = _mm512_reduce_add_epi32(total);
  }
}

// The 8 scores of position j's int8 key row (its codes; the row's own scale applied by the caller)
template <int G, int DB>
__attribute__((target("avx512f,avx512bw,avx512vnni,avx2"))) inline __m256 scores_i8(const int8_t* key, const I8Query<G, DB>& q) {
  const __m512i flip = _mm512_set1_epi8(char(0x80));
  __m512i k[DB], acc[8];
  MOE_UNROLL for (int c = 0; c < DB; ++c) k[c] = _mm512_xor_si512(_mm512_loadu_si512(key + 64 * c), flip);  // k + 128
  MOE_UNROLL for (int b = 0; b < 8; ++b) {
    acc[b] = _mm512_setzero_si512();
    if (b >= G) continue;
    MOE_UNROLL for (int c = 0; c < DB; ++c)
      acc[b] = _mm512_dpbusd_epi32(acc[b], k[c], _mm512_load_si512(q.codes[b] + 64 * c));
  }
  const __m256i dot = _mm256_sub_epi32(sums8(acc), _mm256_slli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q.sum)), 7));
  return _mm256_mul_ps(_mm256_cvtepi32_ps(dot), _mm256_loadu_ps(q.scale));
}

// 8-bit rows: each position's 8 weights (s[8 j..], after the softmax's sums) times its value row's scale, so that the
// weighted sums read the codes; a tile's rows (vr) at a time, as the sums are about to read them (a pass of its own
// over every row of V took a DRAM latency a row)
template <class T>
inline void value_scales(const T* const* vr, int n, int dim, float* s) {
  if constexpr (quantized<T>)
    for (int j = 0; j < n; ++j) {
      const float v = row_scale<T>(reinterpret_cast<const uint8_t*>(vr[j])[dim]);
      for (int b = 0; b < 8; ++b) s[8 * size_t(j) + b] *= v;
    }
}

// The softmax's 1 / sum of G (<= 8) queries from their sums of e^(s - max) (in inv, replaced) and their maxima (mx's
// lanes); sink (null: none): each query's attention sink, one more logit whose share is dropped (gpt-oss, MiMo,
// DeepSeek-V4: transformers' eager attention with s_aux), e^(sink - max) added to its sum.
template <int G>
__attribute__((target("avx2,fma"))) inline void normalizers(float* inv, __m256 mx, const float* sink) {
  if (sink) {
    alignas(32) float m[8];
    _mm256_store_ps(m, mx);
    for (int b = 0; b < G; ++b) inv[b] += std::exp(sink[b] - m[b]);
  }
  for (int b = 0; b < 8; ++b) inv[b] = 1.f / inv[b];
}

// G (<= 8) queries of one kv head, d = 16 * DC (dv = 16 * DCV: V's rows and the outputs), the scores position-major (s[8 j + b]: query b at position j, as
// the 8 sums of a position come out): per position a key row's DC vectors stay in registers for all G queries;
// the softmax runs on 8 queries' lanes at once; then per 16-dim slice of V, a tile of positions at a time, the
// weighted sums (the 1 / sum of the softmax applied to the sums at the end). Lanes of queries >= G compute
// nothing; no run-time test inside a loop.
template <int G, int DC, int DCV, class T, bool P>
__attribute__((target("avx512f,avx512bw,avx512vnni,avx2,fma"))) void group_avx512(const float* q, Rows<T, P> K, Rows<T, P> V, int L,
                                                                                 float scale, float* s, float* out,
                                                                                 const float* sink = nullptr) {
  constexpr int d = 16 * DC, dv = 16 * DCV;
  static_assert(DCV % 2 == 0, "V's slices go two a pass");
  constexpr bool i8 = std::is_same<T, I8>::value;  // int8 rows: their scores by VNNI (I8Query)
  const __m256 sc = _mm256_set1_ps(scale);
  __m256 mx = _mm256_set1_ps(-INFINITY);
  const int pv = v_prefetch_rows(K, V, L, dv);
  I8Query<G, i8 ? DC / 4 : 1> q8;
  if constexpr (i8) quantize_query(q, scale, q8);
  for (int j = 0; j < L; ++j) {
    K.prefetch_ahead(j, L, d);
    if (j < pv) V.prefetch_l2(j, dv);
    if constexpr (i8) {
      const __m256 r = _mm256_mul_ps(scores_i8(reinterpret_cast<const int8_t*>(K(j)), q8), _mm256_set1_ps(K.scale(j)));
      _mm256_storeu_ps(s + 8 * size_t(j), r);
      mx = _mm256_max_ps(mx, r);
      continue;
    }
    __m512 k[DC], acc[8];
    MOE_UNROLL for (int c = 0; c < DC; ++c) k[c] = ld16(K(j) + 16 * c);
    MOE_UNROLL for (int b = 0; b < 8; ++b) {
      if (b >= G) {
        acc[b] = _mm512_setzero_ps();
        continue;
      }
      acc[b] = _mm512_mul_ps(_mm512_loadu_ps(q + b * d), k[0]);
      MOE_UNROLL for (int c = 1; c < DC; ++c) acc[b] = _mm512_fmadd_ps(_mm512_loadu_ps(q + b * d + 16 * c), k[c], acc[b]);
    }
    __m256 r = _mm256_mul_ps(sums8(acc), sc);
    if constexpr (quantized<T>) r = _mm256_mul_ps(r, _mm256_set1_ps(K.scale(j)));
    _mm256_storeu_ps(s + 8 * size_t(j), r);
    mx = _mm256_max_ps(mx, r);
  }
  // e^(s - max) in place, two positions a vector; their sums per query
  const __m512 m2 = _mm512_shuffle_f32x4(_mm512_zextps256_ps512(mx), _mm512_zextps256_ps512(mx), 0x44);
  __m512 sum2 = _mm512_setzero_ps();
  for (int j = 0; j < L; j += 2) {
    const __mmask16 m = L - j >= 2 ? __mmask16(0xffff) : __mmask16(0x00ff);
    const __m512 e = _mm512_maskz_mov_ps(m, exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + 8 * size_t(j)), m2)));
    _mm512_mask_storeu_ps(s + 8 * size_t(j), m, e);
    sum2 = _mm512_add_ps(sum2, e);
  }
  alignas(32) float inv[8];
  _mm256_store_ps(inv, _mm256_add_ps(_mm512_castps512_ps256(sum2), _mm512_castps512_ps256(_mm512_shuffle_f32x4(sum2, sum2, 0xee))));
  normalizers<G>(inv, mx, sink);
  constexpr int tile = tile_rows_for<T>(dv);
  const T* vr[TILE];
  for (int j0 = 0; j0 < L; j0 += tile) {  // V a tile of positions at a time: read from memory once
    const int j1 = std::min(L, j0 + tile);
    tile_rows(V, j0, j1, vr);
    value_scales(vr, j1 - j0, V.dim, s + 8 * size_t(j0));
    for (int j = j0; j < j1; ++j) V.prefetch_ahead(j + tile - (1 << V.shift), L, dv);  // the next tile's
    for (int c = 0; c < DCV; c += 2) {  // two slices a pass: half the passes over the tile
      __m512 acc[2][G];
      MOE_UNROLL for (int h = 0; h < 2; ++h)
        MOE_UNROLL for (int b = 0; b < G; ++b)
          acc[h][b] = j0 ? _mm512_loadu_ps(out + size_t(b) * dv + 16 * (c + h)) : _mm512_setzero_ps();
      for (int j = j0; j < j1; ++j) {
        const __m512 v0 = ld16(vr[j - j0] + 16 * c), v1 = ld16(vr[j - j0] + 16 * c + 16);
        const float* sj = s + 8 * size_t(j);
        MOE_UNROLL for (int b = 0; b < G; ++b) {
          const __m512 p = _mm512_set1_ps(sj[b]);
          acc[0][b] = _mm512_fmadd_ps(p, v0, acc[0][b]);
          acc[1][b] = _mm512_fmadd_ps(p, v1, acc[1][b]);
        }
      }
      MOE_UNROLL for (int h = 0; h < 2; ++h)
        MOE_UNROLL for (int b = 0; b < G; ++b)
          _mm512_storeu_ps(out + size_t(b) * dv + 16 * (c + h),
                           j1 == L ? _mm512_mul_ps(acc[h][b], _mm512_set1_ps(inv[b])) : acc[h][b]);
    }
  }
}

// The 8 sums of a[0..7]'s lanes, as lanes 0..7 (hadd pairs, then the two 128-bit halves)
__attribute__((target("avx2,fma"))) inline __m256 sums8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // [a0 a1 a2 a3 | a0 a1 a2 a3] partials
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// The scores of two positions j, j + 1 for 4 queries (q0 = the first of them, up to Q of them real) as one vector
// [j's 4 | j + 1's 4]: eight accumulators, each chunk of 8 dims loaded once per pair of rows and per query (6 loads
// for 8 multiply-adds; one position at a time took 2 loads a multiply-add, and was bound by them). A key may lie in
// two rows (MLA: the latent's DC chunks in k0/k1, the rotary key's DC2 in k0b/k1b; a query is both, DC + DC2
// chunks); their chunks go into the same accumulators, the second row's after the first's.
// 8-bit rows: the second row's values times m0 / m1 (its scale over the first's, a power of two), the sums then
// the first row's scale short, as the caller applies it: the same bits as rows holding the values.
template <int Q, int DC, int DC2 = 0, class T>
__attribute__((target("avx2,fma,f16c"))) inline __m256 pair_scores(const float* q0, const T* k0, const T* k1,
                                                                   const T* k0b = nullptr, const T* k1b = nullptr,
                                                                   float m0 = 1.f, float m1 = 1.f) {
  constexpr int d = 8 * (DC + DC2);
  __m256 acc[8];
  MOE_UNROLL for (int b = 0; b < 8; ++b) acc[b] = _mm256_setzero_ps();
#pragma GCC unroll 2  // unrolled fully, GCC hoists loads of later chunks and spills the accumulators
  for (int c = 0; c < DC; ++c) {
    const __m256 x0 = ld8(k0 + 8 * c), x1 = ld8(k1 + 8 * c);
    MOE_UNROLL for (int b = 0; b < Q; ++b) {
      const __m256 qv = _mm256_loadu_ps(q0 + b * d + 8 * c);
      acc[b] = _mm256_fmadd_ps(qv, x0, acc[b]);
      acc[4 + b] = _mm256_fmadd_ps(qv, x1, acc[4 + b]);
    }
  }
#pragma GCC unroll 2
  for (int c = 0; c < DC2; ++c) {
    __m256 x0 = ld8(k0b + 8 * c), x1 = ld8(k1b + 8 * c);
    if constexpr (quantized<T>) x0 = _mm256_mul_ps(x0, _mm256_set1_ps(m0)), x1 = _mm256_mul_ps(x1, _mm256_set1_ps(m1));
    MOE_UNROLL for (int b = 0; b < Q; ++b) {
      const __m256 qv = _mm256_loadu_ps(q0 + b * d + 8 * (DC + c));
      acc[b] = _mm256_fmadd_ps(qv, x0, acc[b]);
      acc[4 + b] = _mm256_fmadd_ps(qv, x1, acc[4 + b]);
    }
  }
  return sums8(acc);
}

// Q (<= 4) queries' sums over n positions of two 8-dim slices of V, from their rows' element `at` on: per position
// two loads of V and Q broadcasts of its scores (sj[8 j + b]) for 2 Q multiply-adds (one slice of 8 queries a pass
// took 9 loads for 8 and was bound by them). out: query b's sums at out + b * dv, added to (more) or, with inv,
// the last tile's, scaled by the softmax's 1 / sum.
template <int Q, class T>
__attribute__((target("avx2,fma,f16c"))) inline void weighted_sums(const T* const* vr, int n, int at, const float* s,
                                                                  float* out, int dv, bool more, const float* inv) {
  __m256 acc[Q][2];
  MOE_UNROLL for (int b = 0; b < Q; ++b)
    MOE_UNROLL for (int h = 0; h < 2; ++h)
      acc[b][h] = more ? _mm256_loadu_ps(out + size_t(b) * dv + 8 * h) : _mm256_setzero_ps();
  for (int j = 0; j < n; ++j) {
    const __m256 v0 = ld8(vr[j] + at), v1 = ld8(vr[j] + at + 8);
    MOE_UNROLL for (int b = 0; b < Q; ++b) {
      const __m256 p = _mm256_broadcast_ss(s + 8 * size_t(j) + b);
      acc[b][0] = _mm256_fmadd_ps(p, v0, acc[b][0]);
      acc[b][1] = _mm256_fmadd_ps(p, v1, acc[b][1]);
    }
  }
  MOE_UNROLL for (int b = 0; b < Q; ++b)
    MOE_UNROLL for (int h = 0; h < 2; ++h)
      _mm256_storeu_ps(out + size_t(b) * dv + 8 * h, inv ? _mm256_mul_ps(acc[b][h], _mm256_set1_ps(inv[b])) : acc[b][h]);
}

// The same on AVX2 (8 lanes, 16 registers): the scores two positions at a time (pair_scores, for queries 0-3 then
// 4-7), each row of 8 scores one vector as on AVX-512; two 8-dim slices of V a pass (weighted_sums). A query is DC + DC2 chunks
// against a key in K's row and (DC2 > 0, MLA) K2's; V's rows and the outputs are DCV chunks.
template <int G, int DC, int DC2, int DCV, class T, bool P>
__attribute__((target("avx2,fma,f16c"))) void group_avx2(const float* q, Rows<T, P> K, Rows<T, P> K2, Rows<T, P> V,
                                                        int L, float scale, float* s, float* out,
                                                        const float* sink = nullptr) {
  constexpr int d = 8 * (DC + DC2), dv = 8 * DCV;
  static_assert(DCV % 2 == 0, "V's slices go two a pass");
  const __m256 sc = _mm256_set1_ps(scale);
  __m256 mx = _mm256_set1_ps(-INFINITY);
  const int pv = v_prefetch_rows(K, V, L, dv);
  for (int j = 0; j < L; j += 2) {
    const bool two = j + 1 < L;  // an odd last position pairs with itself; its copy is dropped
    K.prefetch_ahead(j, L, 8 * DC);
    if (two) K.prefetch_ahead(j + 1, L, 8 * DC);
    if (j < pv) V.prefetch_l2(j, dv);
    if (j + 1 < pv) V.prefetch_l2(j + 1, dv);
    const T* k0 = K(j);
    const T* k1 = two ? K(j + 1) : k0;
    const T *k0b = nullptr, *k1b = nullptr;
    const float s0 = K.scale(j), s1 = two ? K.scale(j + 1) : s0;  // (1: plain rows)
    float m0 = 1.f, m1 = 1.f;
    if (DC2) {
      K2.prefetch_ahead(j, L, 8 * DC2);
      if (two) K2.prefetch_ahead(j + 1, L, 8 * DC2);
      k0b = K2(j);
      k1b = two ? K2(j + 1) : k0b;
      if constexpr (quantized<T>) m0 = K2.scale(j) / s0, m1 = K2.scale(two ? j + 1 : j) / s1;
    }
    const __m256 lo = pair_scores<(G < 4 ? G : 4), DC, DC2>(q, k0, k1, k0b, k1b, m0, m1);
    const __m256 hi = G > 4 ? pair_scores<(G > 4 ? G - 4 : 1), DC, DC2>(q + 4 * d, k0, k1, k0b, k1b, m0, m1)
                            : _mm256_setzero_ps();
    __m256 r0 = _mm256_mul_ps(_mm256_permute2f128_ps(lo, hi, 0x20), sc);  // j: queries 0-3 | 4-7
    if constexpr (quantized<T>) r0 = _mm256_mul_ps(r0, _mm256_set1_ps(s0));
    _mm256_storeu_ps(s + 8 * size_t(j), r0);
    mx = _mm256_max_ps(mx, r0);
    if (two) {
      __m256 r1 = _mm256_mul_ps(_mm256_permute2f128_ps(lo, hi, 0x31), sc);
      if constexpr (quantized<T>) r1 = _mm256_mul_ps(r1, _mm256_set1_ps(s1));
      _mm256_storeu_ps(s + 8 * size_t(j + 1), r1);
      mx = _mm256_max_ps(mx, r1);
    }
  }
  __m256 sum = _mm256_setzero_ps();
  for (int j = 0; j < L; ++j) {
    const __m256 e = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(s + 8 * size_t(j)), mx));
    _mm256_storeu_ps(s + 8 * size_t(j), e);
    sum = _mm256_add_ps(sum, e);
  }
  alignas(32) float inv[8];
  _mm256_store_ps(inv, sum);
  normalizers<G>(inv, mx, sink);
  constexpr int tile = tile_rows_for<T>(dv);
  const T* vr[TILE];
  for (int j0 = 0; j0 < L; j0 += tile) {
    const int j1 = std::min(L, j0 + tile);
    tile_rows(V, j0, j1, vr);
    value_scales(vr, j1 - j0, V.dim, s + 8 * size_t(j0));
    for (int j = j0; j < j1; ++j) V.prefetch_ahead(j + tile - (1 << V.shift), L, dv);
    for (int c = 0; c < DCV; c += 2) {  // two slices a pass (DCV is even), queries 0-3 then 4-7
      weighted_sums<(G < 4 ? G : 4)>(vr, j1 - j0, 8 * c, s + 8 * size_t(j0), out + 8 * c, dv, j0 > 0,
                                     j1 == L ? inv : nullptr);
      if (G > 4)
        weighted_sums<(G > 4 ? G - 4 : 1)>(vr, j1 - j0, 8 * c, s + 8 * size_t(j0) + 4, out + 4 * size_t(dv) + 8 * c,
                                           dv, j0 > 0, j1 == L ? inv + 4 : nullptr);
    }
  }
}

// One kv head's g queries, 8 at a time (then the rest), each group through group(G, its q, its out); queries dq
// floats apart, outputs dout; s: 8 L floats
template <class Group>
void by_groups(const float* q, int g, int dq, float* out, int dout, Group group) {
  for (int i = 0; i < g; i += 8) {
    const float* qi = q + size_t(i) * dq;
    float* oi = out + size_t(i) * dout;
    switch (std::min(8, g - i)) {
      case 8: group(std::integral_constant<int, 8>(), qi, oi); break;
      case 7: group(std::integral_constant<int, 7>(), qi, oi); break;
      case 6: group(std::integral_constant<int, 6>(), qi, oi); break;
      case 5: group(std::integral_constant<int, 5>(), qi, oi); break;
      case 4: group(std::integral_constant<int, 4>(), qi, oi); break;
      case 3: group(std::integral_constant<int, 3>(), qi, oi); break;
      case 2: group(std::integral_constant<int, 2>(), qi, oi); break;
      default: group(std::integral_constant<int, 1>(), qi, oi); break;
    }
  }
}

// (sink: the g queries' sinks, or null; a group's are its queries'. Keys of 16 DC / 8 DC dims, values of DCV chunks)
template <int DC, int DCV, class T, bool P>
void head_avx512(const float* q, int g, Rows<T, P> K, Rows<T, P> V, int L, float scale, float* s, float* out,
                 const float* sink) {
  by_groups(q, g, 16 * DC, out, 16 * DCV, [&](auto G, const float* qi, float* oi) {
    group_avx512<decltype(G)::value, DC, DCV>(qi, K, V, L, scale, s, oi, sink ? sink + (qi - q) / (16 * DC) : nullptr);
  });
}

template <int DC, int DCV, class T, bool P>
void head_avx2(const float* q, int g, Rows<T, P> K, Rows<T, P> V, int L, float scale, float* s, float* out,
               const float* sink) {
  by_groups(q, g, 8 * DC, out, 8 * DCV, [&](auto G, const float* qi, float* oi) {
    group_avx2<decltype(G)::value, DC, 0, DCV>(qi, K, K, V, L, scale, s, oi, sink ? sink + (qi - q) / (8 * DC) : nullptr);
  });
}

// The plain loops: the portable path, any head dims, and the reference the vector versions are tested against.
// A query is d + d2 floats against a key in K's row (d) and K2's (d2 > 0: MLA's rotary key); V's rows are dv.
template <class T, bool P>
void head_portable(const float* q, int g, int d, int d2, int dv, Rows<T, P> K, Rows<T, P> K2, Rows<T, P> V, int L,
                   float scale, float* s, float* out, const float* sink = nullptr) {
  const int dq = d + d2;
  for (int i = 0; i < g; ++i)
    for (int j = 0; j < L; ++j) {
      float acc = 0.f;
      const float ks = K.scale(j), m = d2 ? K2.scale(j) / ks : 1.f;  // 8-bit rows (as pair_scores)
      for (int c = 0; c < d; ++c) acc += q[i * dq + c] * ld1(K(j) + c);
      for (int c = 0; c < d2; ++c) acc += q[i * dq + d + c] * (quantized<T> ? ld1(K2(j) + c) * m : ld1(K2(j) + c));
      s[size_t(i) * L + j] = quantized<T> ? acc * ks * scale : acc * scale;
    }
  for (int i = 0; i < g; ++i) {  // each row of scores -> its softmax
    float* r = s + size_t(i) * L;
    const float mx = *std::max_element(r, r + L);
    float sum = 0.f;
    for (int j = 0; j < L; ++j) sum += (r[j] = std::exp(r[j] - mx));
    if (sink) sum += std::exp(sink[i] - mx);
    const float inv = 1.f / sum;
    for (int j = 0; j < L; ++j) r[j] *= inv;
    if constexpr (quantized<T>)
      for (int j = 0; j < L; ++j) r[j] *= V.scale(j);
  }
  for (int i = 0; i < g; ++i)
    for (int c = 0; c < dv; ++c) {
      float acc = 0.f;
      for (int j = 0; j < L; ++j) acc += s[size_t(i) * L + j] * ld1(V(j) + c);
      out[i * dv + c] = acc;
    }
}

// (dv: V's row width; MiMo-V2-Flash's values are 128 beside keys of 192)
template <class T, bool P>
void one_head(Isa isa, const float* q, int g, int d, int dv, Rows<T, P> K, Rows<T, P> V, int L, float scale, float* s,
              float* out, const float* sink) {
  const bool v512 = isa == Isa::Avx512 || isa == Isa::Amx, v256 = ymm_path(isa);
  if (v512 && d == 64 && dv == 64) return head_avx512<4, 4, T, P>(q, g, K, V, L, scale, s, out, sink);
  if (v512 && d == 128 && dv == 128) return head_avx512<8, 8, T, P>(q, g, K, V, L, scale, s, out, sink);
  if (v512 && d == 192 && dv == 128) return head_avx512<12, 8, T, P>(q, g, K, V, L, scale, s, out, sink);
  if (v512 && d == 256 && dv == 256) return head_avx512<16, 16, T, P>(q, g, K, V, L, scale, s, out, sink);
  if (v256 && d == 64 && dv == 64) return head_avx2<8, 8, T, P>(q, g, K, V, L, scale, s, out, sink);
  if (v256 && d == 128 && dv == 128) return head_avx2<16, 16, T, P>(q, g, K, V, L, scale, s, out, sink);
  if (v256 && d == 192 && dv == 128) return head_avx2<24, 16, T, P>(q, g, K, V, L, scale, s, out, sink);
  if (v256 && d == 256 && dv == 256) return head_avx2<32, 32, T, P>(q, g, K, V, L, scale, s, out, sink);
  // DeepSeek-V4's one 512-wide head: MLA's AVX2 kernel shape without its rotary part, on every vector path
  if ((v512 || v256) && d == 512 && dv == 512) return head_avx2<64, 64, T, P>(q, g, K, V, L, scale, s, out, sink);
  head_portable(q, g, d, 0, dv, K, K, V, L, scale, s, out, sink);
}

// MLA's G (<= 8) heads: DeepSeek's latent 512 and rotary 64 on the AVX2 kernel on every vector path (AVX-512
// CPUs run it too: no AVX-512 version was written without such a CPU to measure one on), any other dims (the
// small test and default models) on the plain loops.
template <class T, bool P>
void mla_group(Isa isa, const float* q, int g, int r, int dr, Rows<T, P> C, Rows<T, P> KPE, int L, float scale,
               float* s, float* out) {
  const bool simd = isa == Isa::Avx512 || isa == Isa::Amx || ymm_path(isa);
  if (simd && r == 512 && dr == 64)
    return by_groups(q, g, r + dr, out, r, [&](auto G, const float* qi, float* oi) {
      group_avx2<decltype(G)::value, 64, 8, 64>(qi, C, KPE, C, L, scale, s, oi);
    });
  if (simd && r == 512 && dr == 0)  // a NoPE latent (GLM-5.3-Flash): one KV head of 512, its own value
    return by_groups(q, g, r, out, r, [&](auto G, const float* qi, float* oi) {
      group_avx2<decltype(G)::value, 64, 0, 64>(qi, C, C, C, L, scale, s, oi);
    });
  head_portable(q, g, r, dr, r, C, KPE, C, L, scale, s, out);
}

}  // namespace

void decode_attention(Isa isa, const float* q, int nh, int nkv, int d, int dv, const void* K, KvType kv,
                      size_t k_head, size_t k_row, const void* V, size_t v_head, size_t v_row, int L, float scale,
                      float* out, const int32_t* table, int block_shift, size_t k_block, size_t v_block,
                      const int32_t* sel, const int32_t* sel_len, size_t sel_stride, const float* sinks) {
  MOE_CHECK(nh > 0 && nkv > 0 && nh % nkv == 0 && d > 0 && dv > 0 && L > 0, "decode attention: bad shapes");
  MOE_CHECK(!table || (block_shift >= 0 && block_shift < 16), "decode attention: bad block size");
  MOE_CHECK(!sel || (table && sel_len), "decode attention: a selection reads through a block table");
  for (int h = 0; sel && h < nkv; ++h)
    MOE_CHECK(sel_len[h] > 0 && sel_len[h] <= L, "decode attention: a kv head's selection is empty or past L");
  const int g = nh / nkv;
  // a task: one kv head's queries 8 at a time (the vector kernels' group), so one KV head of many queries
  // (DeepSeek-V4's 64 over one) spreads over the threads as MLA's heads do; each task reads its head's keys once
  const int chunks = (g + 7) / 8;
  auto run = [&](auto* k, auto* v, int h, int c, float* s) {  // T: bf16 bits, Half or float
    using T = std::remove_const_t<std::remove_pointer_t<decltype(k)>>;
    k += h * k_head;
    v += h * v_head;
    const int first = h * g + 8 * c, gc = std::min(8, g - 8 * c);  // the task's first query head, its count
    const float* qh = q + size_t(first) * d;
    float* oh = out + size_t(first) * dv;
    const int32_t* hs = sel ? sel + h * sel_stride : nullptr;
    const float* sk = sinks ? sinks + first : nullptr;
    if (table)
      one_head(isa, qh, gc, d, dv, Rows<T, true>{k, k_row, k_block, table, block_shift, hs, d},
               Rows<T, true>{v, v_row, v_block, table, block_shift, hs, dv}, sel ? sel_len[h] : L, scale, s, oh, sk);
    else
      one_head(isa, qh, gc, d, dv, Rows<T, false>{k, k_row, 0, nullptr, 0, nullptr, d},
               Rows<T, false>{v, v_row, 0, nullptr, 0, nullptr, dv}, L, scale, s, oh, sk);
  };
  auto task = [&](int i) {
    thread_local std::vector<float> s;  // the scores (kept: a fresh one a call is a 128 KB memset at 4k positions)
    if (s.size() < size_t(8) * L) s.resize(size_t(8) * L);
    const int h = i / chunks, c = i % chunks;
    if (kv == KvType::BF16)
      run(static_cast<const uint16_t*>(K), static_cast<const uint16_t*>(V), h, c, s.data());
    else if (kv == KvType::F16)
      run(static_cast<const Half*>(K), static_cast<const Half*>(V), h, c, s.data());
    else if (kv == KvType::I8)
      run(static_cast<const I8*>(K), static_cast<const I8*>(V), h, c, s.data());
    else if (kv == KvType::F8)
      run(static_cast<const F8*>(K), static_cast<const F8*>(V), h, c, s.data());
    else
      run(static_cast<const float*>(K), static_cast<const float*>(V), h, c, s.data());
  };
  // a short context is a few microseconds of work: waking the pool's threads would cost more (they
  // sleep when the machine is busy), so it runs here
  if (size_t(L) * nh * (d + dv) / 2 < SERIAL_MACS) {
    for (int i = 0; i < nkv * chunks; ++i) task(i);
  } else {
    pool().parallel_for(nkv * chunks, task);
  }
}

void mla_decode_attention(Isa isa, const float* q, int nh, int r, int dr, const void* C, const void* KPE, KvType kv,
                          size_t c_row, size_t kpe_row, int L, float scale, float* out, const int32_t* table,
                          int block_shift, size_t c_block, size_t kpe_block, const int32_t* sel) {
  MOE_CHECK(nh > 0 && r > 0 && dr >= 0 && L > 0, "MLA decode attention: bad shapes");
  if (dr == 0) KPE = C, kpe_row = c_row, kpe_block = c_block;  // no rotary key (a NoPE latent): never read
  MOE_CHECK(!table || (block_shift >= 0 && block_shift < 16), "MLA decode attention: bad block size");
  MOE_CHECK(!sel || table, "MLA decode attention: a selection reads through a block table");
  constexpr int G = 8;  // heads a task: every head reads every position's latent, so tasks split the heads
  const int groups = (nh + G - 1) / G;
  auto run = [&](auto* c, auto* kpe, int i, float* s) {  // T: bf16 bits, Half or float
    using T = std::remove_const_t<std::remove_pointer_t<decltype(c)>>;
    const int g = std::min(G, nh - i * G);
    const float* qi = q + size_t(i) * G * (r + dr);
    float* oi = out + size_t(i) * G * r;
    if (table)
      mla_group(isa, qi, g, r, dr, Rows<T, true>{c, c_row, c_block, table, block_shift, sel, r},
                Rows<T, true>{kpe, kpe_row, kpe_block, table, block_shift, sel, dr}, L, scale, s, oi);
    else
      mla_group(isa, qi, g, r, dr, Rows<T, false>{c, c_row, 0, nullptr, 0, nullptr, r},
                Rows<T, false>{kpe, kpe_row, 0, nullptr, 0, nullptr, dr}, L, scale, s, oi);
  };
  auto group = [&](int i) {
    thread_local std::vector<float> s;
    if (s.size() < size_t(G) * L) s.resize(size_t(G) * L);
    if (kv == KvType::BF16)
      run(static_cast<const uint16_t*>(C), static_cast<const uint16_t*>(KPE), i, s.data());
    else if (kv == KvType::F16)
      run(static_cast<const Half*>(C), static_cast<const Half*>(KPE), i, s.data());
    else if (kv == KvType::I8)
      run(static_cast<const I8*>(C), static_cast<const I8*>(KPE), i, s.data());
    else if (kv == KvType::F8)
      run(static_cast<const F8*>(C), static_cast<const F8*>(KPE), i, s.data());
    else
      run(static_cast<const float*>(C), static_cast<const float*>(KPE), i, s.data());
  };
  if (size_t(L) * nh * (2 * r + dr) < SERIAL_MACS) {
    for (int i = 0; i < groups; ++i) group(i);
  } else {
    pool().parallel_for(groups, group);
  }
}

namespace {

__attribute__((target("avx2,f16c"))) void f32_to_f16_f16c(const float* x, uint16_t* y, int n) {
  int i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(y + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  for (; i < n; ++i) y[i] = f32_to_f16(x[i]);
}

// fp32 -> fp8 e4m3 (finite, no NaN code), rounded to nearest even: c10's fp8e4m3fn_from_fp32_value, which torch's
// .to(torch.float8_e4m3fn) runs (the value is within +-448 here: no saturation case)
inline uint8_t to_e4m3(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint32_t sign = bits & 0x80000000u;
  bits ^= sign;
  uint8_t out;
  if (bits >= (1087u << 20)) {  // >= 480: not reached (|f| <= 448)
    out = 0x7f;
  } else if (bits < (121u << 23)) {  // below 2^-6: a subnormal, rounded by adding 0.5 (2^-1 aligns its bits)
    float a, denorm;
    const uint32_t dm = 141u << 23;
    std::memcpy(&a, &bits, 4);
    std::memcpy(&denorm, &dm, 4);
    a += denorm;
    uint32_t ab;
    std::memcpy(&ab, &a, 4);
    out = uint8_t(ab - dm);
  } else {
    const uint32_t odd = (bits >> 20) & 1;
    bits += (uint32_t(7 - 127) << 23) + 0x7ffff + odd;
    out = uint8_t(bits >> 20);
  }
  return out | uint8_t(sign >> 24);
}

// One row as moe_kernels/kv_quant.py's quantize: the scale the least power of two with amax / scale <= the codes'
// largest (127, 448), from the fp32 amax / that as frexp sees it; codes x / scale (exact) rounded to nearest even
void quantize_row(KvType kv, const void* src, bool src_bf16, uint8_t* dst, int n) {
  const float top = kv == KvType::I8 ? 127.f : 448.f;
  auto at = [&](int i) {
    return src_bf16 ? bf16_to_f32(static_cast<const uint16_t*>(src)[i]) : static_cast<const float*>(src)[i];
  };
  float amax = 0.f;
  for (int i = 0; i < n; ++i) amax = std::max(amax, std::fabs(at(i)));
  int e;
  const float m = std::frexp(amax / top, &e);  // amax / top = m 2^e, m in [0.5, 1) (0: m = 0, e = 0)
  if (m == 0.5f) --e;
  e = std::min(118, std::max(-126, e));  // (kv_codes.h's bytes; no real row is near either end)
  const float inv = std::ldexp(1.f, -e);
  for (int i = 0; i < n; ++i) {
    const float x = at(i) * inv;
    if (kv == KvType::I8)
      dst[i] = uint8_t(int8_t(std::min(127.f, std::max(-127.f, std::nearbyint(x)))));
    else
      dst[i] = to_e4m3(std::min(448.f, std::max(-448.f, x)));
  }
  dst[n] = uint8_t(e + 127);
}

}  // namespace

void store_kv(KvType kv, const void* src, bool src_bf16, void* dst, int n) {
  if (kv_quantized(kv)) return quantize_row(kv, src, src_bf16, static_cast<uint8_t*>(dst), n);
  if (kv == (src_bf16 ? KvType::BF16 : KvType::F32)) {
    std::memcpy(dst, src, size_t(n) * (src_bf16 ? 2 : 4));
    return;
  }
  // through fp32, as torch's conversions between them go (a bf16 value is exact in fp32); 64 values at a time
  const CpuFeatures cpu = detect_cpu();
  const bool f16c = cpu.f16c && cpu.os_avx;  // the instruction rounds as f32_to_f16 (NaN aside)
  float wide[64];
  for (int i0 = 0; i0 < n; i0 += 64) {
    const int m = std::min(64, n - i0);
    const float* x = static_cast<const float*>(src) + i0;
    if (src_bf16) {
      for (int i = 0; i < m; ++i) wide[i] = bf16_to_f32(static_cast<const uint16_t*>(src)[i0 + i]);
      x = wide;
    }
    uint16_t* y = static_cast<uint16_t*>(dst) + i0;
    if (kv == KvType::F32)
      std::memcpy(static_cast<float*>(dst) + i0, x, size_t(m) * 4);
    else if (kv == KvType::BF16)
      for (int i = 0; i < m; ++i) y[i] = f32_to_bf16(x[i]);
    else if (f16c)
      f32_to_f16_f16c(x, y, m);
    else
      for (int i = 0; i < m; ++i) y[i] = f32_to_f16(x[i]);
  }
}

}  // namespace moe
