// Routed-expert SwiGLU, bf16 weights, fp32 accumulation. One algorithm for decode and prefill:
// the (token, expert) pairs are grouped by expert, then
//   phase 1: tasks over (expert, block of gate/up rows): GU[slot] = W_gate_up[e] x_slot
//   act:     act[slot] = bf16(silu(gate) * up)                (rounded as a bf16 model would)
//   phase 2: tasks over (expert, block of down rows):   Y[slot] = W_down[e] act[slot]
//   combine: out[t] = sum_j w[t,j] * Y[slot(t,j)]           (fixed order: same answer for any thread count)
// Each task reads one contiguous range of one expert's weights, so at decode every thread streams
// DRAM sequentially, and at prefill a block of weight rows is reused across all of that expert's
// tokens from L1/L2. Layouts (packed once at load, K padded with zeros to a multiple of 32):
//   gate_up [E, 2I, Hp]   down [E, H, Ip]
#include <immintrin.h>

#include <cmath>

#include "common.h"
#include "moe.h"

namespace moe {

constexpr int RB = 4;  // weight rows per micro-kernel call
constexpr int PREFETCH = 2048;  // elements ahead
constexpr int KC = 1024;        // K chunk (elements): RB rows x 1 KiB of weights stay in L1
constexpr int TB = 6;  // tokens per micro-kernel call (RB*TB accumulators + RB + 1 of 32 zmm)

// C[t * ldc + r] = dot(W row r, X[t]) for r < nr, t < nt; K a multiple of 32.
static void mk_portable(const uint16_t* W, size_t ldw, int nr, const uint16_t* const* X, int nt, int K, float* C,
                        size_t ldc) {
  for (int t = 0; t < nt; ++t)
    for (int r = 0; r < nr; ++r) {
      float acc = 0.f;
      const uint16_t* w = W + r * ldw;
      for (int i = 0; i < K; ++i) acc += bf16_to_f32(w[i]) * bf16_to_f32(X[t][i]);
      C[t * ldc + r] = acc;
    }
}

// AVX-512 BF16 micro-kernel: a block of RB weight rows x NT tokens over one K chunk, accumulating
// into 16-lane partial sums kept in `acc` ([NT][RB] zmm), so a K-chunked loop keeps the weight
// rows in L1 while it sweeps the tokens. Reduced to scalars once, after the last chunk.
template <int NT>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) static inline void mk_avx512_t(
    const uint16_t* W, size_t ldw, int nr, const uint16_t* const* X, int k0, int k1, float* acc_mem, bool first) {
  __m512 acc[RB][NT];
  for (int r = 0; r < RB; ++r)
    for (int t = 0; t < NT; ++t)
      acc[r][t] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(acc_mem + (t * RB + r) * 16);
  const uint16_t* w[RB];
  for (int r = 0; r < RB; ++r) w[r] = W + (r < nr ? r : 0) * ldw;  // missing rows recompute row 0
  for (int i = k0; i < k1; i += 32) {
    __m512bh a[RB];
    for (int r = 0; r < RB; ++r) {
      // the weights stream from DRAM on first touch: ask for them ahead
      _mm_prefetch(reinterpret_cast<const char*>(w[r] + i + PREFETCH), _MM_HINT_T0);
      a[r] = (__m512bh)_mm512_loadu_si512(w[r] + i);
    }
    for (int t = 0; t < NT; ++t) {
      __m512bh x = (__m512bh)_mm512_loadu_si512(X[t] + i);
      for (int r = 0; r < RB; ++r) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], a[r], x);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int t = 0; t < NT; ++t) _mm512_storeu_ps(acc_mem + (t * RB + r) * 16, acc[r][t]);
}

__attribute__((target("avx512f"))) static void reduce_acc(const float* acc_mem, int nt, int nr, float* C,
                                                           size_t ldc) {
  for (int t = 0; t < nt; ++t)
    for (int r = 0; r < nr; ++r) C[t * ldc + r] = _mm512_reduce_add_ps(_mm512_loadu_ps(acc_mem + (t * RB + r) * 16));
}

static void mk_avx512(const uint16_t* W, size_t ldw, int nr, const uint16_t* const* X, int nt, int k0, int k1,
                      float* acc, bool first) {
  switch (nt) {
    case 6: return mk_avx512_t<6>(W, ldw, nr, X, k0, k1, acc, first);
    case 5: return mk_avx512_t<5>(W, ldw, nr, X, k0, k1, acc, first);
    case 4: return mk_avx512_t<4>(W, ldw, nr, X, k0, k1, acc, first);
    case 3: return mk_avx512_t<3>(W, ldw, nr, X, k0, k1, acc, first);
    case 2: return mk_avx512_t<2>(W, ldw, nr, X, k0, k1, acc, first);
    default: return mk_avx512_t<1>(W, ldw, nr, X, k0, k1, acc, first);
  }
}

// Y[s * ldy + r] = W[e] row r . X[s] for every slot s of expert e, rows [r0, r1).
static void gemm_rows(Isa isa, const uint16_t* We, size_t ldw, int r0, int r1, const uint16_t* const* Xs, int ns,
                      int K, float* Y, size_t ldy) {
  if (isa != Isa::Avx512Bf16) {
    for (int r = r0; r < r1; r += RB)
      for (int s = 0; s < ns; s += TB)
        mk_portable(We + r * ldw, ldw, std::min(RB, r1 - r), Xs + s, std::min(TB, ns - s), K, Y + s * ldy + r, ldy);
    return;
  }
  thread_local std::vector<float> acc;
  acc.resize(size_t(ns) * RB * 16);
  for (int r = r0; r < r1; r += RB) {
    const int nr = std::min(RB, r1 - r);
    for (int k0 = 0; k0 < K; k0 += KC)  // K chunks: the RB rows' chunk stays in L1 across all tokens
      for (int s = 0; s < ns; s += TB)
        mk_avx512(We + r * ldw, ldw, nr, Xs + s, std::min(TB, ns - s), k0, std::min(K, k0 + KC),
                  acc.data() + size_t(s) * RB * 16, k0 == 0);
    for (int s = 0; s < ns; s += TB) reduce_acc(acc.data() + size_t(s) * RB * 16, std::min(TB, ns - s), nr,
                                                Y + s * ldy + r, ldy);
  }
}

void moe_forward_bf16(Isa isa, const MoEShape& sh, const uint16_t* gate_up, const uint16_t* down, const float* hidden,
                      const int32_t* ids, const float* weights, float* out, int T, int k) {
  MOE_CHECK(T >= 0 && k >= 1, "bad token count or k");
  MOE_CHECK(sh.Hp % 32 == 0 && sh.Ip % 32 == 0 && sh.Hp >= sh.H && sh.Ip >= sh.I, "bad padded sizes");
  const int E = sh.E, H = sh.H, I = sh.I, Hp = sh.Hp, Ip = sh.Ip, S = T * k;
  for (int i = 0; i < S; ++i) MOE_CHECK(ids[i] >= 0 && ids[i] < E, "expert id out of range");
  ThreadPool& tp = pool();

  // group (token, slot) pairs by expert; slots of one expert are in token order
  std::vector<int> start(E + 1, 0), slot_of(S), tok_of(S);
  for (int i = 0; i < S; ++i) ++start[ids[i] + 1];
  for (int e = 0; e < E; ++e) start[e + 1] += start[e];
  {
    std::vector<int> fill(start.begin(), start.end() - 1);
    for (int i = 0; i < S; ++i) {
      int s = fill[ids[i]]++;
      slot_of[i] = s;
      tok_of[s] = i / k;
    }
  }
  // scratch reused across calls (fresh multi-MB buffers would page-fault on every call)
  // (thread_local names inside the lambdas below would resolve to each worker's own copy: the
  // lambdas use these references to the calling thread's buffers instead)
  thread_local std::vector<uint16_t> xb_tl, act_tl;
  thread_local std::vector<float> gu_tl, y_tl;
  auto& xb = xb_tl;
  auto& act = act_tl;
  auto& gu = gu_tl;
  auto& y = y_tl;
  xb.assign(size_t(T) * Hp, 0);  // zero padding: the kernels read whole rows
  act.assign(size_t(S) * Ip, 0);
  if (gu.size() < size_t(S) * 2 * I) gu.resize(size_t(S) * 2 * I);
  if (y.size() < size_t(S) * H) y.resize(size_t(S) * H);
  tp.parallel_for(T, [&](int t) {
    for (int h = 0; h < H; ++h) xb[size_t(t) * Hp + h] = f32_to_bf16(hidden[size_t(t) * H + h]);
  });
  std::vector<const uint16_t*> xs(S), as(S);
  for (int s = 0; s < S; ++s) {
    xs[s] = xb.data() + size_t(tok_of[s]) * Hp;
    as[s] = act.data() + size_t(s) * Ip;
  }

  // tasks: (expert, row block); blocks sized so decode gets >= ~8 tasks per thread
  auto make_tasks = [&](int rows, int block) {
    std::vector<std::pair<int, int>> tasks;
    for (int e = 0; e < E; ++e)
      if (start[e + 1] > start[e])
        for (int r = 0; r < rows; r += block) tasks.emplace_back(e, r);
    return tasks;
  };
  const int blk1 = 64, blk2 = 64;
  auto t1 = make_tasks(2 * I, blk1);
  tp.parallel_for(int(t1.size()), [&](int i) {
    auto [e, r0] = t1[i];
    int s0 = start[e], ns = start[e + 1] - s0;
    gemm_rows(isa, gate_up + size_t(e) * 2 * I * Hp, Hp, r0, std::min(2 * I, r0 + blk1), xs.data() + s0, ns, Hp,
              gu.data() + size_t(s0) * 2 * I, 2 * I);
  });
  tp.parallel_for(S, [&](int s) {
    const float* g = gu.data() + size_t(s) * 2 * I;
    uint16_t* a = act.data() + size_t(s) * Ip;
    for (int i = 0; i < I; ++i) {
      float gv = bf16_to_f32(f32_to_bf16(g[i])), uv = bf16_to_f32(f32_to_bf16(g[I + i]));
      float sv = bf16_to_f32(f32_to_bf16(gv / (1.f + std::exp(-gv))));
      a[i] = f32_to_bf16(sv * uv);
    }
  });
  auto t2 = make_tasks(H, blk2);
  tp.parallel_for(int(t2.size()), [&](int i) {
    auto [e, r0] = t2[i];
    int s0 = start[e], ns = start[e + 1] - s0;
    gemm_rows(isa, down + size_t(e) * H * Ip, Ip, r0, std::min(H, r0 + blk2), as.data() + s0, ns, Ip,
              y.data() + size_t(s0) * H, H);
  });
  tp.parallel_for(T, [&](int t) {
    float* o = out + size_t(t) * H;
    for (int h = 0; h < H; ++h) o[h] = 0.f;
    for (int j = 0; j < k; ++j) {
      const float wj = weights[size_t(t) * k + j];
      const float* yj = y.data() + size_t(slot_of[size_t(t) * k + j]) * H;
      for (int h = 0; h < H; ++h) o[h] += wj * yj[h];
    }
  });
}

}  // namespace moe
