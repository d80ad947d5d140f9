// A SwiGLU MLP's decode rows (moe.h Mlp): a dense layer's MLP, or an MoE layer's shared experts, which the decode
// loop runs between handing the routed experts over and waiting for them. The kernel calls and the elementwise
// work between them, rounded where the torch path rounds (Model._mlp / _shared on the same packed matrices:
// NativeLinear's outputs in T, F.silu in T, the product in T; Qwen2-MoE's sigmoid of its gate's logit in T times
// the MLP's output), silu and sigmoid with the exp torch uses for each element (Sleef's in its vector loop, libm's
// in the loop's tail: torch_rounding.h): the torch path's numbers bit for bit. The layer loop and the decode loop
// both call this: they agree bit for bit.
#include <cmath>
#include <vector>

#include "kernels/torch_rounding.h"
#include "kernels/vec_builds.h"
#include "moe.h"
#include "runtime/common.h"

namespace moe {

namespace {

using namespace rounding;

struct MlpScratch {  // per calling thread
  std::vector<float> xf, gu, act, y, z;
};

// a row's silu(gate) * up as torch rounds it: gate, up, silu and the product each held in T; silu with Sleef's exp
// up to `from`, libm's after it (torch's vector loop and its scalar tail); the first argument only names T
template <class T>
__attribute__((always_inline, optimize("fp-contract=off"))) inline void swiglu_row(const T*, const float* gu, int I,
                                                                                   size_t from, float* a) {
  for (size_t i = 0; i < size_t(I); ++i) {
    const float g = held<T>(gu[i]), u = held<T>(gu[I + i]);
    a[i] = held<T>(held<T>(i < from ? torch_silu(g) : libm_silu(g)) * u);
  }
}
// compiled for FMA too: torch_expf's fmas one instruction each, not libm calls
MOE_FMA_BUILDS(swiglu_row_any, swiglu_row)

template <class T>
void run(const Mlp& m, int B, const T* x, T* out) {
  MlpScratch& s = thread_scratch<MlpScratch>();
  const int H = m.gate_up.K, I = m.down.K;
  s.xf.resize(size_t(B) * H), s.gu.resize(size_t(B) * 2 * I), s.act.resize(size_t(B) * I), s.y.resize(size_t(B) * H);
  for (size_t i = 0; i < size_t(B) * H; ++i) s.xf[i] = get(x, i);
  linear_forward(*m.gate_up_k, m.gate_up, s.xf.data(), B, s.gu.data());
  const bool fma = has_fma();
  const int vb = torch_vector_bytes();
  const size_t from = torch_scalar_from<T>(size_t(I), vb);  // the gate: a strided view, a run per row
  for (int t = 0; t < B; ++t)
    swiglu_row_any(fma, x, s.gu.data() + size_t(t) * 2 * I, I, from, s.act.data() + size_t(t) * I);
  linear_forward(*m.down_k, m.down, s.act.data(), B, s.y.data());
  const bool gated = m.gate_k != nullptr;
  s.z.resize(size_t(B));
  if (gated) linear_forward(*m.gate_k, m.gate, s.xf.data(), B, s.z.data());  // the gate's logit, a row
  const size_t z_from = torch_scalar_from<T>(size_t(B), vb);  // the logits: one run of B
  for (int t = 0; t < B; ++t) {
    const float z = held<T>(s.z[t]);  // in T, its sigmoid in T
    const float scale = gated ? held<T>(size_t(t) < z_from ? torch_sigmoid(z) : libm_sigmoid(z)) : 1.f;
    for (int i = 0; i < H; ++i) {
      const float y = held<T>(s.y[size_t(t) * H + i]);
      put(out, size_t(t) * H + i, gated ? scale * y : y);
    }
  }
}

}  // namespace

void check_mlp(const Mlp& m) {
  MOE_CHECK(m.gate_up.rows == 2 * m.down.K && m.down.rows == m.gate_up.K &&
                (!m.gate_k || (m.gate.rows == 1 && m.gate.K == m.gate_up.K)),
            "mlp: gate/up, down and the gate do not fit each other");
}

void mlp_forward(const Mlp& m, int B, const void* x, void* y) {
  MOE_CHECK(B > 0, "mlp: no rows");
  check_mlp(m);
  if (m.bf16)
    run(m, B, static_cast<const uint16_t*>(x), static_cast<uint16_t*>(y));
  else
    run(m, B, static_cast<const float*>(x), static_cast<float*>(y));
}

}  // namespace moe
