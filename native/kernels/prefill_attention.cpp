// Causal prefill attention on the CPU (grouped-query): a chunk's queries against its sequence's keys and values, each
// query up to its own position (or the last `window` of them; attention sinks: a logit per head added to each
// softmax's sum, its share dropped: gpt-oss, MiMo), flash-style: key tiles of 64, a running max and sum per row, fp32 scores, softmax and
// sums. A task is one kv head's group of query heads for 4 queries (its rows share every tile of keys and values);
// each kv head's keys and values are packed once a call into the tiles' layouts (bf16: pairs for vdpbf16ps, the
// keys' along the head dim, the values' along positions; fp32: each tile's keys transposed). bf16 inputs: products of
// bf16 pairs summed in fp32, the softmax's weights rounded to bf16 for the weighted sums, as torch's CPU flash
// attention does (its exp values to bf16 before its bf16 gemm). torch's kernel runs its bf16 products through an fp32
// sgemm after widening; this one is several times faster (docs/performance/kernels.md).
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/vmath.h"
#include "moe.h"
#include "runtime/common.h"

namespace moe {

namespace {

constexpr int KT = 64;  // keys a tile
constexpr int QB = 4;   // queries a task

struct Call {
  const void* q;
  bool bf16;
  int t, nh, nkv, d, dv;
  size_t q_tok, q_head;
  const void* K;
  size_t k_head, k_row;
  const void* V;
  size_t v_head, v_row;
  int start;
  float scale;
  float* out;
  int lo;               // the position of K's and V's first row
  int window;           // keys a query sees, itself included (0: every earlier one)
  const float* sinks;   // per query head one more logit whose share is dropped, or null
  int L() const { return start + t - lo; }  // K's and V's rows
  int tiles() const { return (L() + KT - 1) / KT; }
  // a task's row r: its query's position among K's rows
  int row_at(int q0, int hg, int r) const { return start - lo + q0 + r / hg; }
  // the keys [a, b) of the tile from row j0 that row r sees (empty: b <= a)
  void seen(int q0, int hg, int r, int j0, int& a, int& b) const {
    const int p = row_at(q0, hg, r) - j0;
    b = std::min(KT, p + 1);
    a = window ? std::max(0, p - window + 1) : 0;
  }
  // the element offset of a task's row r (query q0 + r / hg, head g hg + r % hg) in q
  size_t q_at(int q0, int hg, int g, int r) const {
    return size_t(q0 + r / hg) * q_tok + (size_t(g) * hg + r % hg) * q_head;
  }
};

inline float ld(const void* p, bool bf16, size_t i) {
  return bf16 ? bf16_to_f32(static_cast<const uint16_t*>(p)[i]) : static_cast<const float*>(p)[i];
}

// ---- the tiles' layouts (a kv head's, in its own buffer) ----
// bf16 keys: tile, then d/2 pairs, then 64 keys, then the pair (a key's dims 2p, 2p + 1): 64 x d values a tile
void pack_k_bf16(const Call& c, int g, uint16_t* out) {
  const uint16_t* K = static_cast<const uint16_t*>(c.K) + size_t(g) * c.k_head;
  const int L = c.L(), d = c.d;
  for (int tile = 0; tile < c.tiles(); ++tile) {
    uint16_t* o = out + size_t(tile) * KT * d;
    for (int k = 0; k < KT; ++k) {
      const int j = tile * KT + k;
      for (int p = 0; p < d / 2; ++p) {
        uint16_t* e = o + (size_t(p) * KT + k) * 2;
        e[0] = j < L ? K[size_t(j) * c.k_row + 2 * p] : 0;
        e[1] = j < L ? K[size_t(j) * c.k_row + 2 * p + 1] : 0;
      }
    }
  }
}
// bf16 values: tile, then 32 pairs of positions, then dv, then the pair (positions 2k, 2k + 1 of the tile)
void pack_v_bf16(const Call& c, int g, uint16_t* out) {
  const uint16_t* V = static_cast<const uint16_t*>(c.V) + size_t(g) * c.v_head;
  const int L = c.L(), dv = c.dv;
  for (int tile = 0; tile < c.tiles(); ++tile) {
    uint16_t* o = out + size_t(tile) * KT * dv;
    for (int k = 0; k < KT; ++k) {
      const int j = tile * KT + k;
      const uint16_t* v = V + size_t(j) * c.v_row;
      uint16_t* e = o + size_t(k / 2) * dv * 2 + (k % 2);
      for (int i = 0; i < dv; ++i) e[2 * i] = j < L ? v[i] : 0;
    }
  }
}
// fp32 keys: tile, then d, then 64 keys (transposed)
void pack_k_f32(const Call& c, int g, float* out) {
  const float* K = static_cast<const float*>(c.K) + size_t(g) * c.k_head;
  const int L = c.L(), d = c.d;
  for (int tile = 0; tile < c.tiles(); ++tile) {
    float* o = out + size_t(tile) * KT * d;
    for (int k = 0; k < KT; ++k) {
      const int j = tile * KT + k;
      for (int i = 0; i < d; ++i) o[size_t(i) * KT + k] = j < L ? K[size_t(j) * c.k_row + i] : 0.f;
    }
  }
}

// fp32 keys and values for the AVX2 path, in the 16-column panels its micro-kernel streams: keys as tile, then 4
// panels of 16 keys, then d, then 16 keys; values as tile, then dv / 16 panels of 16 dims, then 64 positions, then 16
// dims (each call of the micro-kernel reads one panel front to back: the prefetchers keep up, where a 256- or
// 512-byte stride left its loads waiting on L2)
void pack_k_f32_panels(const Call& c, int g, float* out) {
  const float* K = static_cast<const float*>(c.K) + size_t(g) * c.k_head;
  const int L = c.L(), d = c.d;
  for (int j = 0; j < c.tiles() * KT; ++j) {
    float* o = out + size_t(j / KT) * KT * d + size_t(j % KT / 16) * 16 * d + j % 16;
    for (int i = 0; i < d; ++i) o[size_t(i) * 16] = j < L ? K[size_t(j) * c.k_row + i] : 0.f;
  }
}
void pack_v_f32_panels(const Call& c, int g, float* out) {
  const float* V = static_cast<const float*>(c.V) + size_t(g) * c.v_head;
  const int L = c.L(), dv = c.dv;
  for (int j = 0; j < c.tiles() * KT; ++j) {
    float* o = out + size_t(j / KT) * KT * dv + size_t(j % KT) * 16;
    for (int p = 0; p < dv / 16; ++p)
      for (int i = 0; i < 16; ++i) o[size_t(p) * KT * 16 + i] = j < L ? V[size_t(j) * c.v_row + 16 * p + i] : 0.f;
  }
}

// A task's rows (query i of the task's 4, head h of the group): their running max, sum and weighted sums
struct Rows {
  int n;                 // rows
  std::vector<float> S;  // [n][64] a tile's scores, then its weights (fp32)
  std::vector<uint16_t> Pb;  // [n][64] the weights in bf16 (bf16 inputs)
  std::vector<float> O;  // [n][dv]
  std::vector<float> m, l, corr;
  void reset(int rows, int dv) {
    n = rows;
    S.assign(size_t(rows) * KT, 0.f);
    Pb.assign(size_t(rows) * KT, 0);
    O.assign(size_t(rows) * dv, 0.f);
    m.assign(rows, -INFINITY), l.assign(rows, 0.f), corr.assign(rows, 1.f);
  }
};

// the keys [a, b) of the tile that row r sees; none (true): its weights zero and its sums kept as they are (the
// vector softmax steps' shared start)
inline bool unseen(const Call& c, Rows& R, int q0, int hg, int j0, int r, int& a, int& b) {
  c.seen(q0, hg, r, j0, a, b);
  if (b > a) return false;
  std::memset(&R.S[size_t(r) * KT], 0, KT * sizeof(float));
  std::memset(&R.Pb[size_t(r) * KT], 0, KT * sizeof(uint16_t));
  R.corr[r] = 1.f;
  return true;
}

// the softmax step of a tile for every row: S (raw products) -> the weights exp(s scale - m) of the visible keys,
// the running max and sum updated, corr the factor the row's earlier sums take (portable; the vector paths'
// versions below do the same per 16 keys)
void softmax_rows(const Call& c, Rows& R, int q0, int hg, int j0) {
  for (int r = 0; r < R.n; ++r) {
    int a, b;
    c.seen(q0, hg, r, j0, a, b);
    float* s = &R.S[size_t(r) * KT];
    float mx = R.m[r];
    for (int k = a; k < b; ++k) mx = std::max(mx, s[k] * c.scale);
    const float corr = b > a ? std::exp(R.m[r] - mx) : 1.f;  // (m = -inf before the first tile: 0)
    float sum = 0.f;
    for (int k = 0; k < KT; ++k) {
      const float p = k >= a && k < b ? std::exp(s[k] * c.scale - mx) : 0.f;
      s[k] = p, sum += p;
      R.Pb[size_t(r) * KT + k] = f32_to_bf16(p);
    }
    if (b > a) R.m[r] = mx;
    R.l[r] = R.l[r] * corr + sum;
    R.corr[r] = corr;
  }
}

__attribute__((target("avx512f,avx512bw,avx512bf16"))) void softmax_rows_512(const Call& c, Rows& R, int q0, int hg, int j0) {
  const __m512 sc = _mm512_set1_ps(c.scale);
  for (int r = 0; r < R.n; ++r) {
    int a, b;
    if (unseen(c, R, q0, hg, j0, r, a, b)) continue;
    float* s = &R.S[size_t(r) * KT];
    __m512 v[4];
    __mmask16 keep[4];
    __m512 mx = _mm512_set1_ps(R.m[r]);
    for (int i = 0; i < 4; ++i) {
      const int lo = std::clamp(a - 16 * i, 0, 16), hi = std::clamp(b - 16 * i, 0, 16);
      keep[i] = __mmask16(((1u << hi) - 1) & ~((1u << lo) - 1));  // keys [a, b) of these 16
      v[i] = _mm512_mul_ps(_mm512_loadu_ps(s + 16 * i), sc);
      mx = _mm512_mask_max_ps(mx, keep[i], mx, v[i]);
    }
    const float m_new = _mm512_reduce_max_ps(mx);
    const float corr = std::exp(R.m[r] - m_new);
    const __m512 mv = _mm512_set1_ps(m_new);
    __m512 sum = _mm512_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      const __m512 p = _mm512_maskz_mov_ps(keep[i], exp_ps(_mm512_sub_ps(v[i], mv)));
      _mm512_storeu_ps(s + 16 * i, p);
      sum = _mm512_add_ps(sum, p);
      if (c.bf16)  // (rounded to nearest even)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(&R.Pb[size_t(r) * KT + 16 * i]), (__m256i)_mm512_cvtneps_pbh(p));
    }
    R.m[r] = m_new;
    R.l[r] = R.l[r] * corr + _mm512_reduce_add_ps(sum);
    R.corr[r] = corr;
  }
}

// ---- scores and weighted sums of one tile ----
// portable: any layout read directly
void tile_portable(const Call& c, Rows& R, int q0, int hg, int g, int j0) {
  const int L = c.L();
  for (int r = 0; r < R.n; ++r) {
    const size_t qr = c.q_at(q0, hg, g, r);
    for (int k = 0; k < KT; ++k) {
      const int j = j0 + k;
      float s = 0.f;
      if (j < L)
        for (int i = 0; i < c.d; ++i)
          s += ld(c.q, c.bf16, qr + i) *
               ld(c.K, c.bf16, size_t(g) * c.k_head + size_t(j) * c.k_row + i);
      R.S[size_t(r) * KT + k] = s;
    }
  }
  softmax_rows(c, R, q0, hg, j0);
  for (int r = 0; r < R.n; ++r) {
    float* o = &R.O[size_t(r) * c.dv];
    for (int i = 0; i < c.dv; ++i) o[i] *= R.corr[r];
    for (int k = 0; k < KT && j0 + k < L; ++k) {
      const float p = c.bf16 ? bf16_to_f32(R.Pb[size_t(r) * KT + k]) : R.S[size_t(r) * KT + k];
      if (p == 0.f) continue;
      for (int i = 0; i < c.dv; ++i) o[i] += p * ld(c.V, c.bf16, size_t(g) * c.v_head + size_t(j0 + k) * c.v_row + i);
    }
  }
}

// AVX-512: rows r0, r0 + 1 (nr of them) of O, dims c0 .. c0 + 16 nc, into acc times each row's corr; and back
__attribute__((target("avx512f"))) inline void o_load512(const Rows& R, int r0, int nr, int dv, int c0, int nc,
                                                         __m512 (*acc)[8]) {
  for (int i = 0; i < 2; ++i) {
    const int r = r0 + std::min(i, nr - 1);
    const __m512 cr = _mm512_set1_ps(R.corr[r]);
    for (int k = 0; k < 8; ++k)
      acc[i][k] = k < nc ? _mm512_mul_ps(_mm512_loadu_ps(&R.O[size_t(r) * dv + c0 + 16 * k]), cr) : _mm512_setzero_ps();
  }
}
__attribute__((target("avx512f"))) inline void o_store512(Rows& R, int r0, int nr, int dv, int c0, int nc,
                                                          __m512 (*acc)[8]) {
  for (int i = 0; i < nr; ++i)
    for (int k = 0; k < nc; ++k) _mm512_storeu_ps(&R.O[size_t(r0 + i) * dv + c0 + 16 * k], acc[i][k]);
}

// AVX-512, bf16: scores 4 rows at a time (each broadcast query pair against 64 keys), weighted sums 2 rows at a time
// (each broadcast weight pair against 128 value dims)
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void tile_bf16_512(const Call& c, Rows& R, int q0, int hg,
                                                                          int g, const uint16_t* kt,
                                                                          const uint16_t* vt, int j0) {
  const uint16_t* Q = static_cast<const uint16_t*>(c.q);
  const int d = c.d, dv = c.dv;
  for (int r0 = 0; r0 < R.n; r0 += 4) {
    const int nr = std::min(4, R.n - r0);
    const uint16_t* qp[4];
    for (int i = 0; i < 4; ++i) qp[i] = Q + c.q_at(q0, hg, g, r0 + std::min(i, nr - 1));
    __m512 acc[4][4];
    for (int i = 0; i < 4; ++i)
      for (int k = 0; k < 4; ++k) acc[i][k] = _mm512_setzero_ps();
    for (int p = 0; p < d / 2; ++p) {
      __m512bh kv[4];
      for (int k = 0; k < 4; ++k) kv[k] = (__m512bh)_mm512_loadu_si512(kt + (size_t(p) * KT + 16 * k) * 2);
      for (int i = 0; i < 4; ++i) {
        int32_t pair;
        std::memcpy(&pair, qp[i] + 2 * p, 4);
        const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
        for (int k = 0; k < 4; ++k) acc[i][k] = _mm512_dpbf16_ps(acc[i][k], a, kv[k]);
      }
    }
    for (int i = 0; i < nr; ++i)
      for (int k = 0; k < 4; ++k) _mm512_storeu_ps(&R.S[size_t(r0 + i) * KT + 16 * k], acc[i][k]);
  }
  softmax_rows_512(c, R, q0, hg, j0);
  for (int r0 = 0; r0 < R.n; r0 += 2) {
    const int nr = std::min(2, R.n - r0);
    for (int c0 = 0; c0 < dv; c0 += 128) {
      const int nc = std::min(8, (dv - c0) / 16);
      __m512 acc[2][8];
      o_load512(R, r0, nr, dv, c0, nc, acc);
      const uint16_t* pr[2] = {&R.Pb[size_t(r0) * KT], &R.Pb[size_t(r0 + std::min(1, nr - 1)) * KT]};
      for (int kp = 0; kp < KT / 2; ++kp) {
        __m512bh a[2];
        for (int i = 0; i < 2; ++i) {
          int32_t pair;
          std::memcpy(&pair, pr[i] + 2 * kp, 4);
          a[i] = (__m512bh)_mm512_set1_epi32(pair);
        }
        const uint16_t* vp = vt + (size_t(kp) * dv + c0) * 2;
        for (int k = 0; k < 8; ++k) {
          if (k >= nc) break;
          const __m512bh vv = (__m512bh)_mm512_loadu_si512(vp + 32 * k);
          for (int i = 0; i < 2; ++i) acc[i][k] = _mm512_dpbf16_ps(acc[i][k], a[i], vv);
        }
      }
      o_store512(R, r0, nr, dv, c0, nc, acc);
    }
  }
}

// AVX-512, fp32: the same shapes with FMAs (the keys transposed a tile, the values read in place)
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void tile_f32_512(const Call& c, Rows& R, int q0, int hg, int g, const float* kt,
                                                     int j0) {
  const float* Q = static_cast<const float*>(c.q);
  const int d = c.d, dv = c.dv, L = c.L();
  for (int r0 = 0; r0 < R.n; r0 += 4) {
    const int nr = std::min(4, R.n - r0);
    const float* qp[4];
    for (int i = 0; i < 4; ++i) qp[i] = Q + c.q_at(q0, hg, g, r0 + std::min(i, nr - 1));
    __m512 acc[4][4];
    for (int i = 0; i < 4; ++i)
      for (int k = 0; k < 4; ++k) acc[i][k] = _mm512_setzero_ps();
    for (int p = 0; p < d; ++p) {
      __m512 kv[4];
      for (int k = 0; k < 4; ++k) kv[k] = _mm512_loadu_ps(kt + size_t(p) * KT + 16 * k);
      for (int i = 0; i < 4; ++i) {
        const __m512 a = _mm512_set1_ps(qp[i][p]);
        for (int k = 0; k < 4; ++k) acc[i][k] = _mm512_fmadd_ps(a, kv[k], acc[i][k]);
      }
    }
    for (int i = 0; i < nr; ++i)
      for (int k = 0; k < 4; ++k) _mm512_storeu_ps(&R.S[size_t(r0 + i) * KT + 16 * k], acc[i][k]);
  }
  softmax_rows_512(c, R, q0, hg, j0);
  const float* V = static_cast<const float*>(c.V) + size_t(g) * c.v_head;
  const int keys = std::min(KT, L - j0);
  for (int r0 = 0; r0 < R.n; r0 += 2) {
    const int nr = std::min(2, R.n - r0);
    for (int c0 = 0; c0 < dv; c0 += 128) {
      const int nc = std::min(8, (dv - c0) / 16);
      __m512 acc[2][8];
      o_load512(R, r0, nr, dv, c0, nc, acc);
      const float* pr[2] = {&R.S[size_t(r0) * KT], &R.S[size_t(r0 + std::min(1, nr - 1)) * KT]};
      for (int j = 0; j < keys; ++j) {
        const float* vr = V + size_t(j0 + j) * c.v_row + c0;
        const __m512 a0 = _mm512_set1_ps(pr[0][j]), a1 = _mm512_set1_ps(pr[1][j]);
        for (int k = 0; k < 8; ++k) {
          if (k >= nc) break;
          const __m512 vv = _mm512_loadu_ps(vr + 16 * k);
          acc[0][k] = _mm512_fmadd_ps(a0, vv, acc[0][k]);
          acc[1][k] = _mm512_fmadd_ps(a1, vv, acc[1][k]);
        }
      }
      o_store512(R, r0, nr, dv, c0, nc, acc);
    }
  }
}

// AVX2, fp32: an sgemm micro-kernel's shape for both products, 6 rows x 16 columns on 12 accumulators (each loaded
// pair of vectors feeds 6 rows, each broadcast 2 vectors: FMA-bound, where 2 rows x 64 keys and a row x 128 dims
// were bound by their loads from L2), and the softmax on 8 lanes
constexpr int RB = 6;  // rows a step
__attribute__((target("avx2,fma"))) inline float hmax256(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
__attribute__((target("avx2,fma"))) inline float hsum256(__m256 v) {
  __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_add_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_add_ss(m, _mm_movehdup_ps(m)));
}

__attribute__((target("avx2,fma"))) void softmax_rows_256(const Call& c, Rows& R, int q0, int hg, int j0) {
  const __m256 sc = _mm256_set1_ps(c.scale), ninf = _mm256_set1_ps(-INFINITY);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int r = 0; r < R.n; ++r) {
    int a, b;
    if (unseen(c, R, q0, hg, j0, r, a, b)) continue;
    float* s = &R.S[size_t(r) * KT];
    const __m256i va = _mm256_set1_epi32(a - 1), vb = _mm256_set1_epi32(b);
    __m256 v[KT / 8], keep[KT / 8];
    __m256 mx = _mm256_set1_ps(R.m[r]);
    for (int i = 0; i < KT / 8; ++i) {
      const __m256i k = _mm256_add_epi32(lane, _mm256_set1_epi32(8 * i));
      keep[i] = _mm256_castsi256_ps(_mm256_and_si256(_mm256_cmpgt_epi32(k, va), _mm256_cmpgt_epi32(vb, k)));  // [a, b)
      v[i] = _mm256_mul_ps(_mm256_loadu_ps(s + 8 * i), sc);
      mx = _mm256_max_ps(mx, _mm256_blendv_ps(ninf, v[i], keep[i]));
    }
    const float m_new = hmax256(mx), corr = std::exp(R.m[r] - m_new);  // (m = -inf before the first tile: 0)
    const __m256 mv = _mm256_set1_ps(m_new);
    __m256 sum = _mm256_setzero_ps();
    for (int i = 0; i < KT / 8; ++i) {
      const __m256 p = _mm256_and_ps(exp_ps(_mm256_sub_ps(v[i], mv)), keep[i]);
      _mm256_storeu_ps(s + 8 * i, p);
      sum = _mm256_add_ps(sum, p);
    }
    R.m[r] = m_new;
    R.l[r] = R.l[r] * corr + hsum256(sum);
    R.corr[r] = corr;
  }
}

// C[NR rows][16] (+)= sum over k < n of A[row][k] x B[k][16]; A's row r at a[r] (stride 1 in k), B's row k at
// b + 16 k (a panel); scale: C's rows loaded and scaled by scale[r] first (the weighted sums' running correction)
template <int NR>
__attribute__((target("avx2,fma"))) inline void mk16(const float* const* a, const float* b, int n, float* const* out,
                                                     const float* scale) {
  __m256 acc[NR][2];  // (every loop over it unrolled: a runtime index kept it in memory, stored each step)
  MOE_UNROLL for (int r = 0; r < NR; ++r) {
    const __m256 f = _mm256_set1_ps(scale ? scale[r] : 0.f);
    acc[r][0] = scale ? _mm256_mul_ps(_mm256_loadu_ps(out[r]), f) : _mm256_setzero_ps();
    acc[r][1] = scale ? _mm256_mul_ps(_mm256_loadu_ps(out[r] + 8), f) : _mm256_setzero_ps();
  }
  const float* ar[NR];
  MOE_UNROLL for (int r = 0; r < NR; ++r) ar[r] = a[r];
  for (int k = 0; k < n; ++k) {
    const __m256 b0 = _mm256_loadu_ps(b + size_t(k) * 16), b1 = _mm256_loadu_ps(b + size_t(k) * 16 + 8);
    MOE_UNROLL for (int r = 0; r < NR; ++r) {
      const __m256 x = _mm256_broadcast_ss(ar[r] + k);
      acc[r][0] = _mm256_fmadd_ps(x, b0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(x, b1, acc[r][1]);
    }
  }
  MOE_UNROLL for (int r = 0; r < NR; ++r) _mm256_storeu_ps(out[r], acc[r][0]), _mm256_storeu_ps(out[r] + 8, acc[r][1]);
}
// nr (1..RB) rows: a group's last rows on a kernel of their own count (not RB rows with some thrown away)
__attribute__((target("avx2,fma"))) inline void mk16_rows(int nr, const float* const* a, const float* b, int n,
                                                          float* const* out, const float* scale) {
  switch (nr) {
    case 6: return mk16<6>(a, b, n, out, scale);
    case 5: return mk16<5>(a, b, n, out, scale);
    case 4: return mk16<4>(a, b, n, out, scale);
    case 3: return mk16<3>(a, b, n, out, scale);
    case 2: return mk16<2>(a, b, n, out, scale);
    default: return mk16<1>(a, b, n, out, scale);
  }
}

__attribute__((target("avx2,fma"))) void tile_f32_256(const Call& c, Rows& R, int q0, int hg, int g, const float* kt,
                                                      const float* vt, int j0) {
  const float* Q = static_cast<const float*>(c.q);
  const int d = c.d, dv = c.dv, L = c.L();
  for (int r0 = 0; r0 < R.n; r0 += RB) {  // scores: the queries' rows against the tile's keys (panels of 16)
    const int nr = std::min(RB, R.n - r0);
    const float* qp[RB];
    for (int i = 0; i < nr; ++i) qp[i] = Q + c.q_at(q0, hg, g, r0 + i);
    for (int k0 = 0; k0 < KT; k0 += 16) {
      float* out[RB];
      for (int i = 0; i < nr; ++i) out[i] = &R.S[size_t(r0 + i) * KT + k0];
      mk16_rows(nr, qp, kt + size_t(k0) * d, d, out, nullptr);
    }
  }
  softmax_rows_256(c, R, q0, hg, j0);
  const int keys = std::min(KT, L - j0);
  for (int r0 = 0; r0 < R.n; r0 += RB) {  // weighted sums: the rows' weights against the tile's values
    const int nr = std::min(RB, R.n - r0);
    const float* pr[RB];
    for (int i = 0; i < nr; ++i) pr[i] = &R.S[size_t(r0 + i) * KT];
    for (int c0 = 0; c0 < dv; c0 += 16) {
      float* out[RB];
      for (int i = 0; i < nr; ++i) out[i] = &R.O[size_t(r0 + i) * dv + c0];
      mk16_rows(nr, pr, vt + size_t(c0) * KT, keys, out, &R.corr[r0]);
    }
  }
}

}  // namespace

void prefill_attention(Isa isa, const void* q, bool bf16, int t, int nh, int nkv, int d, int dv, size_t q_tok,
                       size_t q_head, const void* K, size_t k_head, size_t k_row, const void* V, size_t v_head,
                       size_t v_row, int start, float scale, float* out, int lo, int window, const float* sinks) {
  MOE_CHECK(t > 0 && nkv > 0 && nh % nkv == 0 && d > 0 && dv > 0 && start >= 0, "prefill attention: bad shapes");
  MOE_CHECK(window >= 0 && lo >= 0 && lo <= (window ? std::max(0, start - window + 1) : 0),
            "prefill attention: the keys start after a query's first visible one");
  const bool vec = isa != Isa::Portable && d % 16 == 0 && dv % 16 == 0;
  MOE_CHECK(!(vec && bf16 && (isa == Isa::Avx2 || isa == Isa::AvxVnni)),
            "prefill attention: bf16 inputs take the AVX-512 paths (the AVX2 ones compute in fp32)");
  const Call c{q,     bf16,   t,     nh,    nkv, d,  dv, q_tok, q_head, K,     k_head, k_row,
               V,     v_head, v_row, start, scale, out, lo, window, sinks};
  const int hg = nh / nkv, tiles = c.tiles(), blocks = (t + QB - 1) / QB;
  // each kv head's keys (and bf16 values) in the tiles' layouts, once a call
  std::vector<uint16_t> kb, vb;
  std::vector<float> kf, vf;
  const size_t kstride = size_t(tiles) * KT * d, vstride = size_t(tiles) * KT * dv;
  const bool avx2 = isa == Isa::Avx2 || isa == Isa::AvxVnni;
  if (vec) {
    if (bf16) kb.resize(kstride * nkv), vb.resize(vstride * nkv);
    else kf.resize(kstride * nkv);
    if (!bf16 && avx2) vf.resize(vstride * nkv);
    pool().parallel_for(nkv, [&](int g) {
      if (bf16) {
        pack_k_bf16(c, g, kb.data() + g * kstride);
        pack_v_bf16(c, g, vb.data() + g * vstride);
      } else if (avx2) {  // (fp32: the keys and values in the AVX2 micro-kernel's panels)
        pack_k_f32_panels(c, g, kf.data() + g * kstride);
        pack_v_f32_panels(c, g, vf.data() + g * vstride);
      } else {
        pack_k_f32(c, g, kf.data() + g * kstride);
      }
    });
  }
  // tasks latest queries first (the most tiles), each thread taking the next
  pool().parallel_for(blocks * nkv, [&](int task) {
    const int b = blocks - 1 - task / nkv, g = task % nkv;
    const int q0 = b * QB, nq = std::min(QB, t - q0);
    thread_local Rows R;
    R.reset(nq * hg, dv);
    const int last = std::min(tiles, c.row_at(q0, 1, nq - 1) / KT + 1);  // tiles any of the rows sees
    const int first = window ? std::max(0, c.row_at(q0, 1, 0) - window + 1) / KT : 0;
    for (int tile = first; tile < last; ++tile) {
      const int j0 = tile * KT;
      if (!vec) tile_portable(c, R, q0, hg, g, j0);
      else if (bf16) tile_bf16_512(c, R, q0, hg, g, kb.data() + g * kstride + size_t(tile) * KT * d,
                                   vb.data() + g * vstride + size_t(tile) * KT * dv, j0);
      else if (avx2) tile_f32_256(c, R, q0, hg, g, kf.data() + g * kstride + size_t(tile) * KT * d,
                                   vf.data() + g * vstride + size_t(tile) * KT * dv, j0);
      else tile_f32_512(c, R, q0, hg, g, kf.data() + g * kstride + size_t(tile) * KT * d, j0);
    }
    for (int r = 0; r < R.n; ++r) {
      const int h = g * hg + r % hg;
      float* o = out + (size_t(q0 + r / hg) * nh + h) * dv;  // ([t, nh, dv])
      const float inv = 1.f / (sinks ? R.l[r] + std::exp(sinks[h] - R.m[r]) : R.l[r]);
      for (int i = 0; i < dv; ++i) o[i] = R.O[size_t(r) * dv + i] * inv;
    }
  });
}

}  // namespace moe
