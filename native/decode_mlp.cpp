// A SwiGLU MLP's decode rows (moe.h Mlp): a dense layer's MLP, or an MoE layer's shared experts, which the decode
// loop runs between handing the routed experts over and waiting for them. The kernel calls and the elementwise
// work between them, rounded where the torch path rounds (Model._mlp / _shared on the same packed matrices:
// NativeLinear's outputs in T, F.silu in T, the product in T; Qwen2-MoE's sigmoid of its gate's logit in T times
// the MLP's output), silu and sigmoid with the exp of torch's vector kernels: the torch path's numbers bit for
// bit, but for a row's tail past torch's vector width, which torch computes with std::exp (the intermediate sizes
// published are multiples of 16). The layer loop and the decode loop both call this: they agree bit for bit.
#include <cmath>
#include <vector>

#include "common.h"
#include "moe.h"
#include "torch_rounding.h"

namespace moe {

namespace {

using namespace rounding;

struct MlpScratch {  // per calling thread
  std::vector<float> xf, gu, act, y, z;
};

// a row's silu(gate) * up as torch rounds it: gate, up, silu and the product each held in T
template <class T>
__attribute__((always_inline)) inline void swiglu_row(const float* gu, int I, float* a) {
  for (int i = 0; i < I; ++i) {
    const float g = held<T>(gu[i]), u = held<T>(gu[I + i]);
    a[i] = held<T>(held<T>(torch_silu(g)) * u);
  }
}
// compiled for FMA too: torch_expf's fmas one instruction each, not libm calls
template <class T>
__attribute__((target("avx2,fma"), optimize("fp-contract=off"))) void swiglu_row_fma(const float* gu, int I,
                                                                                        float* a) {
  swiglu_row<T>(gu, I, a);
}
template <class T>
__attribute__((optimize("fp-contract=off"))) void swiglu_row_plain(const float* gu, int I, float* a) {
  swiglu_row<T>(gu, I, a);
}

template <class T>
void run(const Mlp& m, int B, const T* x, T* out) {
  static thread_local MlpScratch s;
  const int H = m.gate_up.K, I = m.down.K;
  s.xf.resize(size_t(B) * H), s.gu.resize(size_t(B) * 2 * I), s.act.resize(size_t(B) * I), s.y.resize(size_t(B) * H);
  for (size_t i = 0; i < size_t(B) * H; ++i) s.xf[i] = get(x, i);
  linear_forward(*m.gate_up_k, m.gate_up, s.xf.data(), B, s.gu.data());
  const CpuFeatures& f = detect_cpu();
  const bool fma = f.fma && f.avx2 && f.os_avx;
  for (int t = 0; t < B; ++t)
    (fma ? swiglu_row_fma<T> : swiglu_row_plain<T>)(s.gu.data() + size_t(t) * 2 * I, I, s.act.data() + size_t(t) * I);
  linear_forward(*m.down_k, m.down, s.act.data(), B, s.y.data());
  const bool gated = m.gate_k != nullptr;
  s.z.resize(size_t(B));
  if (gated) linear_forward(*m.gate_k, m.gate, s.xf.data(), B, s.z.data());  // the gate's logit, a row
  for (int t = 0; t < B; ++t) {
    const float scale = gated ? held<T>(torch_sigmoid(held<T>(s.z[t]))) : 1.f;  // in T, its sigmoid in T
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
