// Dense layers on the experts' kernels: y[T, rows] = x[T, K] W^T for one packed matrix (any weight
// format), every token against every row. The GPU service runs its projections, dense MLPs, shared
// experts and lm_head through this when its device is the CPU, so those layers stream packed bf16 /
// int8 / int4 weights at DRAM speed like the experts do.
#include "common.h"
#include "kernels.h"
#include "moe.h"

namespace moe {

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
  // about task_bytes of weights a task, but at least two tasks a thread where the rows allow (a k or v
  // projection of 512 rows is one task's worth: one thread would stream it alone)
  const int per = (m.rows + 2 * tp.size() - 1) / (2 * tp.size());
  const int b = std::min(task_rows(weight_row_bytes(fmt, m.Kp)), std::max(64, (per + 63) / 64 * 64));
  tp.parallel_for((m.rows + b - 1) / b, [&](int i) {
    gemm_rows(kn, m, 0, i * b, std::min(m.rows, (i + 1) * b), xs, T, y, size_t(m.rows));
  });
}

}  // namespace moe
