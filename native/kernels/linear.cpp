// Dense layers on the experts' kernels: y[T, rows] = x[T, K] W^T for one packed matrix (any weight
// format), every token against every row. The GPU service runs its projections, dense MLPs, shared
// experts and lm_head through this when its device is the CPU, so those layers stream packed bf16 /
// int8 / int4 weights at DRAM speed like the experts do.
#include <algorithm>

#include "kernels/kernels.h"
#include "moe.h"
#include "runtime/common.h"

namespace moe {

constexpr int DECODE_ROWS = 8;  // tokens a call up to which it is a decode step's (a few sequences' rows)

void linear_forward(const Kernels& kn, const Matrix& m, const float* x, int T, float* y) {
  const Fmt fmt = kn.fmt;
  MOE_CHECK(T >= 0 && m.rows > 0 && m.K > 0 && m.Kp >= m.K && m.Kp % 64 == 0, "bad linear shapes");
  if (T == 0) return;
  ThreadPool& tp = pool();
  ActBuf& xb = tp.scratch.xb;  // ours alone: the caller holds compute_mutex()
  xb.resize(fmt, T, m.Kp);
  tp.parallel_for(T, [&](int t) { kn.quantize_row(fmt, x + size_t(t) * m.K, m.K, xb, t); });
  Acts xs = xb.view(nullptr, T);
  if (kn.amx_tiles && T >= AMX_MIN_SLOTS) {
    // every row multiplies every token: the tokens go into tile layout once, a group of 16 a task
    const size_t group = amx_b_bytes(fmt, 16, m.Kp);
    uint8_t* dst = tp.scratch.amx_space(amx_b_bytes(fmt, T, m.Kp));
    tp.parallel_for((T + 15) / 16, [&](int g) {
      pack_amx_b(fmt, Acts{xs.rows + g * 16, xs.scale + g * 16}, std::min(16, T - g * 16), m.Kp, dst + g * group);
    });
    xs.amx_b = dst;
  }
  // Decode (a few rows of tokens): equal tasks, a whole number a thread, each at most 2 task_bytes of weights (about
  // task_bytes a task left q/k/v's 5.9 MB of int4 as 5 tasks for 2 threads, the last streamed by one alone: int4 at
  // one token 5% faster this way, int8 2%, bf16 1%; docs/performance/kernels.md). Prefill: about task_bytes a task, but at
  // least two a thread where the rows allow (a k or v projection of 512 rows is one task's worth: one thread would
  // stream it alone), for the balance between threads that other work on the cores slows.
  const int n = int(tp.size());
  const size_t row_bytes = weight_row_bytes(fmt, m.Kp);
  int b;
  if (T <= DECODE_ROWS) {
    const size_t share = 2 * n * tuning().task_bytes;
    const int tasks = n * int(std::max<size_t>(1, (size_t(m.rows) * row_bytes + share - 1) / share));
    b = ((m.rows + tasks - 1) / tasks + 63) / 64 * 64;
  } else {
    const int per = (m.rows + 2 * n - 1) / (2 * n);
    b = std::min(task_rows(row_bytes), std::max(64, (per + 63) / 64 * 64));
  }
  tp.parallel_for((m.rows + b - 1) / b, [&](int i) {
    gemm_rows(kn, m, 0, i * b, std::min(m.rows, (i + 1) * b), xs, T, y, size_t(m.rows));
  });
}

void linear_groups(const Kernels& kn, const Matrix* ms, int G, const float* x, int T, float* y) {
  MOE_CHECK(G > 0 && T >= 0, "bad group count");
  const Matrix& m0 = ms[0];
  for (int g = 0; g < G; ++g)
    MOE_CHECK(ms[g].rows == m0.rows && ms[g].K == m0.K && ms[g].Kp == m0.Kp && m0.Kp % 64 == 0,
              "grouped linear: the groups' matrices differ in shape");
  if (T == 0) return;
  const Fmt fmt = kn.fmt;
  const int R = m0.rows, K = m0.K;
  ThreadPool& tp = pool();
  ActBuf& xb = tp.scratch.xb;  // ours alone: the caller holds compute_mutex(); row g T + t: token t's group g
  xb.resize(fmt, G * T, m0.Kp);
  tp.parallel_for(G * T, [&](int i) {
    const int g = i / T, t = i % T;
    kn.quantize_row(fmt, x + (size_t(t) * G + g) * K, K, xb, i);
  });
  const Acts xs = xb.view(nullptr, G * T);
  const uint8_t* amx = nullptr;  // AMX: each group's tokens in tile layout, 16 a chunk (as linear_forward packs them)
  const int chunks = (T + 15) / 16;
  const size_t chunk = kn.amx_tiles && T >= AMX_MIN_SLOTS ? amx_b_bytes(fmt, 16, m0.Kp) : 0;
  if (chunk) {
    uint8_t* dst = tp.scratch.amx_space(size_t(G) * chunks * chunk);
    tp.parallel_for(G * chunks, [&](int i) {
      const int g = i / chunks, c = i % chunks, at = g * T + c * 16;
      pack_amx_b(fmt, Acts{xs.rows + at, xs.scale + at}, std::min(16, T - c * 16), m0.Kp, dst + size_t(i) * chunk);
    });
    amx = dst;
  }
  // each group's rows in blocks as linear_forward's decode splits one matrix: about 2 task_bytes a task
  const size_t row_bytes = weight_row_bytes(fmt, m0.Kp);
  const int per = std::max<int>(1, int(std::min<size_t>(R, (2 * tuning().task_bytes + row_bytes - 1) / row_bytes)));
  const int b = (per + 63) / 64 * 64, nb = (R + b - 1) / b;
  tp.parallel_for(G * nb, [&](int i) {
    const int g = i / nb, j = i % nb;
    const Acts xg{xs.rows + size_t(g) * T, xs.scale + size_t(g) * T, amx ? amx + size_t(g) * chunks * chunk : nullptr};
    gemm_rows(kn, ms[g], 0, j * b, std::min(R, (j + 1) * b), xg, T, y + size_t(g) * R, size_t(G) * R);
  });
}

}  // namespace moe
