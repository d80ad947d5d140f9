// DeepSeek Sparse Attention's lightning indexer at decode (DeepSeek-V3.2, GLM-5): each cached position's score
// sum over heads of w[h] * relu(scale * q[h] . k), then the top k positions, which MLA's latent attention reads
// (mla_decode_attention with a selection). At 32k positions the scores are 64 heads x 128 dims a position, 0.27 GMAC
// against 8 MB of bf16 keys: compute decides, so keys go four at a time past every head's query (each q row load
// feeds four FMAs; the query, 32 KB at fp32, stays in L1), a key converted to fp32 once. Plain lane-wise loops built
// per width (vec_builds.h); threads over chunks of positions.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernels/torch_rounding.h"
#include "kernels/vec_builds.h"
#include "moe.h"
#include "runtime/common.h"

namespace moe {

namespace {

using namespace rounding;

constexpr int LANES = 16;       // partial sums of a dot product
constexpr int KEYS = 4;         // keys a pass over the heads
constexpr int MAX_DIM = 512;    // the indexer's head dim (128 as published)
constexpr int CHUNK = 256;      // positions a task
constexpr size_t SERIAL_MACS = size_t(1) << 18;

// positions [j0, j1): out[j] = sum_h w[h] * max(0, scale * q[h] . k[at(j)]); at(j) where position j's key is in k
template <class T, class At>
__attribute__((always_inline, optimize("fp-contract=off"))) inline void scores_t(const float* q, const float* w, int H,
                                                                                int D, float scale, const T* k, At at,
                                                                                int j0, int j1, float* out) {
  alignas(64) float kf[KEYS][MAX_DIM];
  const int body = D - D % LANES;
  for (int j = j0; j < j1; j += KEYS) {
    const int n = std::min(KEYS, j1 - j);
    for (int i = 0; i < KEYS; ++i) {
      const T* key = k + at(j + std::min(i, n - 1));  // a short tail repeats its last key (its sums are not stored)
      for (int d = 0; d < D; ++d) kf[i][d] = get(key, d);
    }
    float tot[KEYS] = {};
    for (int h = 0; h < H; ++h) {
      const float* qh = q + size_t(h) * D;
      float acc[KEYS][LANES] = {};
      for (int d = 0; d < body; d += LANES)
        for (int i = 0; i < KEYS; ++i)
          for (int l = 0; l < LANES; ++l) acc[i][l] += qh[d + l] * kf[i][d + l];
      for (int d = body; d < D; ++d)
        for (int i = 0; i < KEYS; ++i) acc[i][d - body] += qh[d] * kf[i][d];
      for (int i = 0; i < KEYS; ++i) {
        for (int m = LANES / 2; m > 0; m /= 2)
          for (int l = 0; l < m; ++l) acc[i][l] += acc[i][l + m];
        const float s = acc[i][0] * scale;
        tot[i] += s > 0.f ? w[h] * s : 0.f;
      }
    }
    for (int i = 0; i < n; ++i) out[j + i] = tot[i];
  }
}

MOE_VEC_BUILDS(scores_any, scores_t)

}  // namespace

void dsa_index_scores(Isa isa, const float* q, const float* w, int H, int D, float scale, const void* K, KvType kv,
                      size_t k_row, int L, float* out, const int32_t* table, int block_shift, size_t k_block) {
  MOE_CHECK(H > 0 && D > 0 && D <= MAX_DIM && L >= 0, "dsa_index_scores: bad shapes");
  MOE_CHECK(kv == KvType::F32 || kv == KvType::BF16, "dsa_index_scores: keys must be fp32 or bf16");
  MOE_CHECK(!table || (block_shift >= 0 && block_shift < 16), "dsa_index_scores: bad block size");
  const Vec v = vec_of(isa);
  auto run = [&](auto* k, int j0, int j1) {
    const int mask = (1 << block_shift) - 1;
    if (table)
      scores_any(v, q, w, H, D, scale, k, [&](int j) {
        return size_t(table[j >> block_shift]) * k_block + size_t(j & mask) * k_row; }, j0, j1, out);
    else
      scores_any(v, q, w, H, D, scale, k, [&](int j) { return size_t(j) * k_row; }, j0, j1, out);
  };
  auto chunk = [&](int c) {
    const int j0 = c * CHUNK, j1 = std::min(L, j0 + CHUNK);
    if (kv == KvType::BF16)
      run(static_cast<const uint16_t*>(K), j0, j1);
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
