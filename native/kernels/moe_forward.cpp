// The routed-expert SwiGLU driver, the same for every weight format. The (token, expert) pairs are
// grouped by expert, then
//   phase 1: tasks over (expert, block of gate/up rows): GU[slot] = W_gate_up[e] x_slot
//   act:     act[slot] = silu(gate) * up, rounded to bf16 (as a bf16 model would), then put in the
//            format's activation form (bf16, or int8 with a per-slot scale)
//   phase 2: tasks over (expert, block of down rows):   Y[slot] = W_down[e] act[slot]
//   combine: out[t] = sum_j w[t,j] * Y[slot(t,j)]   (fixed order: the same answer for any thread count)
// Each task reads one contiguous range of one expert's weights: at decode every thread streams DRAM
// sequentially; at prefill a block of weight rows is reused across all of that expert's tokens.
#include <immintrin.h>

#include <algorithm>
#include <cmath>

#include "kernels/kernels.h"
#include "moe.h"
#include "runtime/common.h"
#include "runtime/numa.h"

namespace moe {

void moe_forward(const MoELayer& l, const float* hidden, const int32_t* ids, const float* weights, float* out, int T,
                 int k) {
  const MoEWeights& m = l.w;
  const Kernels &kg = *l.gate_up_k, &kd = *l.down_k;
  MOE_CHECK(T >= 0 && k >= 1, "bad token count or k");
  const int E = m.E, H = m.H, I = m.I, S = T * k;
  MOE_CHECK(m.gate_up.rows == 2 * I && m.gate_up.K == H && m.down.rows == H && m.down.K == I, "bad weight shapes");
  MOE_CHECK(m.gate_up.Kp % 64 == 0 && m.down.Kp % 64 == 0, "packed rows must be a multiple of 64 elements");
  // id -1: no expert (a sharded expert service is sent -1 for the pairs other shards hold)
  for (int i = 0; i < S; ++i) MOE_CHECK(ids[i] >= -1 && ids[i] < E, "expert id out of range");
  ThreadPool& tp = pool();

  // group slots by expert; the slots of one expert are in token order
  std::vector<int> start(E + 1, 0), slot_of(S, -1);
  for (int i = 0; i < S; ++i)
    if (ids[i] >= 0) ++start[ids[i] + 1];
  for (int e = 0; e < E; ++e) start[e + 1] += start[e];
  const int n_slots = start[E];
  std::vector<int> tok_of(n_slots);
  {
    std::vector<int> fill(start.begin(), start.end() - 1);
    for (int i = 0; i < S; ++i) {
      if (ids[i] < 0) continue;
      int s = fill[ids[i]]++;
      slot_of[i] = s;
      tok_of[s] = i / k;
    }
  }
  Scratch& sc = tp.scratch;  // ours alone: the caller holds compute_mutex()
  ActBuf& xb = sc.xb;
  ActBuf& ab = sc.act;
  std::vector<float>& gu = sc.gu;
  std::vector<float>& y = sc.y;
  xb.resize(kg.fmt, T, m.gate_up.Kp);
  ab.resize(kd.fmt, n_slots, m.down.Kp);
  if (gu.size() < size_t(n_slots) * 2 * I) gu.resize(size_t(n_slots) * 2 * I);
  if (y.size() < size_t(n_slots) * H) y.resize(size_t(n_slots) * H);

  tp.parallel_for(T, [&](int t) { kg.quantize_row(kg.fmt, hidden + size_t(t) * H, H, xb, t); });
  const Acts xs = xb.view(tok_of.data(), n_slots);

  // tasks grouped by the NUMA node holding their expert (numa.h), each node's threads start on theirs
  const int nodes = numa().nodes;
  std::vector<int> group_start(nodes + 1, 0);
  auto make_tasks = [&](int rows, int block) {
    std::vector<std::pair<int, int>> tasks;
    for (int n = 0; n < nodes; ++n) {
      for (int e = n; e < E; e += nodes)  // numa_node_of_expert(e) == n
        if (start[e + 1] > start[e])
          for (int r = 0; r < rows; r += block) tasks.emplace_back(e, r);
      group_start[n + 1] = int(tasks.size());
    }
    return tasks;
  };
  // AMX: each expert's activations in tile layout, packed once per phase (not once per task); none (amx_off all
  // 0) where the phase's kernels do not tile
  std::vector<size_t> amx_off(E + 1, 0);
  uint8_t* amx_base = nullptr;
  auto amx_ptr = [&](int e) { return amx_base + amx_off[e]; };
  auto pack_amx = [&](const Kernels& kn, const Acts& a, int Kp) {
    for (int e = 0; e < E; ++e) {
      const int n = start[e + 1] - start[e];
      amx_off[e + 1] = amx_off[e] + (kn.amx_tiles && n >= AMX_MIN_SLOTS ? amx_b_bytes(kn.fmt, n, Kp) : 0);
    }
    if (!amx_off[E]) return;
    amx_base = sc.amx_space(amx_off[E]);
    tp.parallel_for(E, [&](int e) {
      if (amx_off[e + 1] > amx_off[e])
        pack_amx_b(kn.fmt, Acts{a.rows + start[e], a.scale + start[e]}, start[e + 1] - start[e], Kp, amx_ptr(e));
    });
  };
  auto sub = [&](const Acts& a, int e) {
    const int s0 = start[e];
    return Acts{a.rows + s0, a.scale + s0, amx_off[e + 1] > amx_off[e] ? amx_ptr(e) : nullptr};
  };
  // rows per task: about tuning().task_bytes of weights
  const int b1 = task_rows(weight_row_bytes(kg.fmt, m.gate_up.Kp));
  const int b2 = task_rows(weight_row_bytes(kd.fmt, m.down.Kp));
  auto t1 = make_tasks(2 * I, b1);
  pack_amx(kg, xs, m.gate_up.Kp);
  tp.parallel_for_grouped(group_start.data(), nodes, [&](int i) {
    auto [e, r0] = t1[i];
    int s0 = start[e];
    gemm_rows(kg, m.gate_up, e, r0, std::min(2 * I, r0 + b1), sub(xs, e), start[e + 1] - s0,
              gu.data() + size_t(s0) * 2 * I, 2 * I);
  });
  // the expert of each slot (slots are grouped by expert): only biased experts (gpt-oss) need it
  std::vector<int> expert_of(m.gate_up_bias || m.down_bias ? n_slots : 0);
  if (!expert_of.empty())
    for (int e = 0; e < E; ++e) std::fill(expert_of.begin() + start[e], expert_of.begin() + start[e + 1], e);
  tp.parallel_for(n_slots, [&](int s) {
    float* g = gu.data() + size_t(s) * 2 * I;
    if (m.gate_up_bias) {
      const float* b = m.gate_up_bias + size_t(expert_of[s]) * 2 * I;
      for (int i = 0; i < 2 * I; ++i) g[i] += b[i];
    }
    thread_local std::vector<float> a;
    a.resize(I);
    if (m.act == Act::ClampedSilu)  // the clamps before SwiGLU's rounding: min(bf16(x), l) = bf16(min(x, l)) for a
      for (int i = 0; i < I; ++i) {  // limit bf16 holds (transformers clamps the bf16 values)
        g[i] = std::min(g[i], m.limit);
        g[I + i] = std::clamp(g[I + i], -m.limit, m.limit);
      }
    (m.act == Act::ClampedSwiglu ? kd.clamped_swiglu : kd.silu)(g, g + I, a.data(), I, m.alpha, m.limit);
    kd.quantize_row(kd.fmt, a.data(), I, ab, s);
  });
  const Acts as = ab.view(nullptr, n_slots);
  auto t2 = make_tasks(H, b2);
  pack_amx(kd, as, m.down.Kp);
  tp.parallel_for_grouped(group_start.data(), nodes, [&](int i) {
    auto [e, r0] = t2[i];
    int s0 = start[e];
    gemm_rows(kd, m.down, e, r0, std::min(H, r0 + b2), sub(as, e), start[e + 1] - s0,
              y.data() + size_t(s0) * H, H);
  });
  tp.parallel_for(T, [&](int t) {
    float* o = out + size_t(t) * H;
    for (int h = 0; h < H; ++h) o[h] = 0.f;
    for (int j = 0; j < k; ++j) {
      const float wj = weights[size_t(t) * k + j];
      const int s = slot_of[size_t(t) * k + j];
      if (s < 0) continue;  // no expert here
      const float* yj = y.data() + size_t(s) * H;
      if (m.down_bias) {
        const float* b = m.down_bias + size_t(expert_of[s]) * H;
        for (int h = 0; h < H; ++h) o[h] += wj * (yj[h] + b[h]);
      } else {
        for (int h = 0; h < H; ++h) o[h] += wj * yj[h];
      }
    }
  });
}

}  // namespace moe
