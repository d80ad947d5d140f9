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

#include "common.h"
#include "moe.h"
#include "driver.h"
#include "numa.h"
#include "vmath.h"

namespace moe {

namespace {


// The int formats' activation quantizer, 8 lanes at a time where the CPU has AVX2 (every path but
// portable): the same bytes as the scalar loops (max is exact; x * inv rounds to nearest even in
// both, as nearbyint does in the default rounding mode).
__attribute__((target("avx2"))) float absmax_avx2(const float* x, int n) {
  const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 m = _mm256_setzero_ps();
  int i = 0;
  for (; i + 8 <= n; i += 8) m = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(x + i), abs), m);  // NaN: keeps m
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  float amax = 0.f;
  for (float v : lanes) amax = std::max(amax, v);
  for (; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  return amax;
}

// dst[i] = round(x[i] * inv) + 128 for whole 32-element blocks; returns the elements done
__attribute__((target("avx2"))) int quantize_u8_avx2(const float* x, int n, float inv, uint8_t* dst) {
  const __m256 s = _mm256_set1_ps(inv);
  const __m256i off = _mm256_set1_epi32(128), order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  int i = 0;
  for (; i + 32 <= n; i += 32) {
    __m256i q[4];
    for (int j = 0; j < 4; ++j)
      q[j] = _mm256_add_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8 * j), s)), off);
    // packs work within 128-bit halves: the bytes come out as 4-element runs, put back in order
    __m256i b = _mm256_packus_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), _mm256_permutevar8x32_epi32(b, order));
  }
  return i;
}

// SwiGLU activation of one slot: a = silu(gate) * up, each step rounded to bf16 as a bf16 model's
// would be.
void act_row(const float* gate, const float* up, float* a, int I) {
  for (int i = 0; i < I; ++i) {
    float gv = bf16_to_f32(f32_to_bf16(gate[i])), uv = bf16_to_f32(f32_to_bf16(up[i]));
    float sv = bf16_to_f32(f32_to_bf16(gv / (1.f + std::exp(-gv))));
    a[i] = bf16_to_f32(f32_to_bf16(sv * uv));
  }
}

// Round to bf16 (nearest even, like f32_to_bf16 for finite values) and back, 16 lanes.
__attribute__((target("avx512f,avx512bw"))) inline __m512 round_bf16(__m512 v) {
  __m512i u = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  u = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  return _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32(int(0xffff0000u))));
}

__attribute__((target("avx512f,avx512bw"))) void act_row_avx512(const float* gate, const float* up, float* a, int I) {
  const __m512 one = _mm512_set1_ps(1.f);
  for (int i = 0; i < I; i += 16) {
    const __mmask16 k = I - i >= 16 ? __mmask16(0xffff) : __mmask16((1u << (I - i)) - 1);
    __m512 gv = round_bf16(_mm512_maskz_loadu_ps(k, gate + i)), uv = round_bf16(_mm512_maskz_loadu_ps(k, up + i));
    __m512 sv = round_bf16(_mm512_div_ps(gv, _mm512_add_ps(one, exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), gv)))));
    _mm512_mask_storeu_ps(a + i, k, round_bf16(_mm512_mul_ps(sv, uv)));
  }
}

// The same on AVX2 (8 lanes; 2^n built in the exponent bits; a scalar tail).
__attribute__((target("avx2,fma"))) inline __m256 round_bf16(__m256 v) {
  __m256i u = _mm256_castps_si256(v);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  u = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  return _mm256_castsi256_ps(_mm256_and_si256(u, _mm256_set1_epi32(int(0xffff0000u))));
}

__attribute__((target("avx2,fma"))) void act_row_avx2(const float* gate, const float* up, float* a, int I) {
  const __m256 one = _mm256_set1_ps(1.f);
  int i = 0;
  for (; i + 8 <= I; i += 8) {
    __m256 gv = round_bf16(_mm256_loadu_ps(gate + i)), uv = round_bf16(_mm256_loadu_ps(up + i));
    __m256 sv = round_bf16(_mm256_div_ps(gv, _mm256_add_ps(one, exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), gv)))));
    _mm256_storeu_ps(a + i, round_bf16(_mm256_mul_ps(sv, uv)));
  }
  act_row(gate + i, up + i, a + i, I - i);
}

// gpt-oss's clamped SwiGLU of one slot, each step rounded to bf16 as transformers' bf16 model's is.
void act_row_clamped(const float* gate, const float* up, float* a, int I, float alpha, float limit) {
  auto r = [](float v) { return bf16_to_f32(f32_to_bf16(v)); };
  for (int i = 0; i < I; ++i) {
    const float g = std::min(r(gate[i]), limit), u = std::clamp(r(up[i]), -limit, limit);
    const float s = r(1.f / (1.f + std::exp(-r(g * alpha))));
    a[i] = r(r(u + 1.f) * r(g * s));
  }
}

// The same, 16 and 8 lanes (exp_ps within 2 ulp of std::exp before the bf16 rounding; scalar tail on AVX2)
__attribute__((target("avx512f,avx512bw"))) void act_row_clamped_avx512(const float* gate, const float* up, float* a,
                                                                        int I, float alpha, float limit) {
  const __m512 one = _mm512_set1_ps(1.f), lim = _mm512_set1_ps(limit), nlim = _mm512_set1_ps(-limit),
               al = _mm512_set1_ps(alpha);
  for (int i = 0; i < I; i += 16) {
    const __mmask16 k = I - i >= 16 ? __mmask16(0xffff) : __mmask16((1u << (I - i)) - 1);
    const __m512 g = _mm512_min_ps(round_bf16(_mm512_maskz_loadu_ps(k, gate + i)), lim);
    const __m512 u = _mm512_min_ps(_mm512_max_ps(round_bf16(_mm512_maskz_loadu_ps(k, up + i)), nlim), lim);
    const __m512 t = round_bf16(_mm512_mul_ps(g, al));
    const __m512 sg = round_bf16(_mm512_div_ps(one, _mm512_add_ps(one, exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), t)))));
    const __m512 glu = round_bf16(_mm512_mul_ps(g, sg));
    _mm512_mask_storeu_ps(a + i, k, round_bf16(_mm512_mul_ps(round_bf16(_mm512_add_ps(u, one)), glu)));
  }
}

__attribute__((target("avx2,fma"))) void act_row_clamped_avx2(const float* gate, const float* up, float* a, int I,
                                                              float alpha, float limit) {
  const __m256 one = _mm256_set1_ps(1.f), lim = _mm256_set1_ps(limit), nlim = _mm256_set1_ps(-limit),
               al = _mm256_set1_ps(alpha);
  int i = 0;
  for (; i + 8 <= I; i += 8) {
    const __m256 g = _mm256_min_ps(round_bf16(_mm256_loadu_ps(gate + i)), lim);
    const __m256 u = _mm256_min_ps(_mm256_max_ps(round_bf16(_mm256_loadu_ps(up + i)), nlim), lim);
    const __m256 t = round_bf16(_mm256_mul_ps(g, al));
    const __m256 sg = round_bf16(_mm256_div_ps(one, _mm256_add_ps(one, exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), t)))));
    const __m256 glu = round_bf16(_mm256_mul_ps(g, sg));
    _mm256_storeu_ps(a + i, round_bf16(_mm256_mul_ps(round_bf16(_mm256_add_ps(u, one)), glu)));
  }
  act_row_clamped(gate + i, up + i, a + i, I - i, alpha, limit);
}

}  // namespace

// Put one fp32 row (n values) into row `r` of `b` in the format's activation form.
void quantize_row(Isa isa, Fmt fmt, const float* x, int n, ActBuf& b, int r) {
  uint8_t* dst = b.data.data() + size_t(r) * b.row_bytes;
  if (fmt == Fmt::Bf16) {
    auto* d = reinterpret_cast<uint16_t*>(dst);
    for (int i = 0; i < n; ++i) d[i] = f32_to_bf16(x[i]);
    return;
  }
  const bool simd = isa != Isa::Portable;
  float amax = 0.f;
  if (simd) amax = absmax_avx2(x, n);
  else
    for (int i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float scale = amax > 0 ? amax / 127.f : 1.f, inv = 1.f / scale;
  b.scale[r] = scale;
  // u8 = q + 128: VNNI multiplies unsigned activations by signed weights
  for (int i = simd ? quantize_u8_avx2(x, n, inv, dst) : 0; i < n; ++i)
    dst[i] = uint8_t(int(std::nearbyint(x[i] * inv)) + 128);
  for (size_t i = n; i < b.row_bytes; ++i) dst[i] = 128;  // padding is q = 0
}

void gemm_rows(Isa isa, Fmt fmt, const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y,
               size_t ldy) {
  if (isa == Isa::Amx) {  // whole 16-row tiles on AMX where this expert's tokens were packed; the rest on AVX-512
    const int tiles = x.amx_b ? (r1 - r0) / 16 * 16 : 0;
    if (tiles) gemm_rows_amx(fmt, m, e, r0, r0 + tiles, x, ns, Y, ldy);
    r0 += tiles;
    isa = Isa::Avx512;
    if (r0 >= r1) return;
  }
  switch (fmt) {
    case Fmt::Bf16: return gemm_rows_bf16(isa, m, e, r0, r1, x, ns, Y, ldy);
    case Fmt::Int8: return gemm_rows_int8(isa, m, e, r0, r1, x, ns, Y, ldy);
    case Fmt::Int4: return gemm_rows_int4(isa, m, e, r0, r1, x, ns, Y, ldy);
    case Fmt::Mxfp4: return gemm_rows_mxfp4(isa, m, e, r0, r1, x, ns, Y, ldy);
  }
}


void moe_forward(Isa isa, const MoEWeights& m, const float* hidden, const int32_t* ids, const float* weights,
                 float* out, int T, int k) {
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
  xb.resize(m.fmt, T, m.gate_up.Kp);
  ab.resize(m.fmt, n_slots, m.down.Kp);
  if (gu.size() < size_t(n_slots) * 2 * I) gu.resize(size_t(n_slots) * 2 * I);
  if (y.size() < size_t(n_slots) * H) y.resize(size_t(n_slots) * H);

  tp.parallel_for(T, [&](int t) { quantize_row(isa, m.fmt, hidden + size_t(t) * H, H, xb, t); });
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
  // AMX: each expert's activations in tile layout, packed once per phase (not once per task)
  const bool amx = isa == Isa::Amx && (m.fmt == Fmt::Bf16 || m.fmt == Fmt::Int8);
  std::vector<size_t> amx_off(E + 1, 0);
  uint8_t* amx_base = nullptr;
  auto amx_ptr = [&](int e) { return amx_base + amx_off[e]; };
  auto pack_amx = [&](const Acts& a, int Kp) {
    if (!amx) return;
    for (int e = 0; e < E; ++e) {
      const int n = start[e + 1] - start[e];
      amx_off[e + 1] = amx_off[e] + (n >= AMX_MIN_SLOTS ? amx_b_bytes(m.fmt, n, Kp) : 0);
    }
    amx_base = sc.amx_space(amx_off[E]);
    tp.parallel_for(E, [&](int e) {
      if (amx_off[e + 1] > amx_off[e])
        pack_amx_b(m.fmt, Acts{a.rows + start[e], a.scale + start[e]}, start[e + 1] - start[e], Kp, amx_ptr(e));
    });
  };
  auto sub = [&](const Acts& a, int e) {
    const int s0 = start[e];
    return Acts{a.rows + s0, a.scale + s0, amx && amx_off[e + 1] > amx_off[e] ? amx_ptr(e) : nullptr};
  };
  // rows per task: about tuning().task_bytes of weights
  const int b1 = task_rows(weight_row_bytes(m.fmt, m.gate_up.Kp));
  const int b2 = task_rows(weight_row_bytes(m.fmt, m.down.Kp));
  auto t1 = make_tasks(2 * I, b1);
  pack_amx(xs, m.gate_up.Kp);
  tp.parallel_for_grouped(group_start.data(), nodes, [&](int i) {
    auto [e, r0] = t1[i];
    int s0 = start[e];
    gemm_rows(isa, m.fmt, m.gate_up, e, r0, std::min(2 * I, r0 + b1), sub(xs, e), start[e + 1] - s0,
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
    if (m.act == Act::ClampedSwiglu) {
      if (isa == Isa::Portable) act_row_clamped(g, g + I, a.data(), I, m.alpha, m.limit);
      else if (ymm_path(isa)) act_row_clamped_avx2(g, g + I, a.data(), I, m.alpha, m.limit);
      else act_row_clamped_avx512(g, g + I, a.data(), I, m.alpha, m.limit);
    } else if (isa == Isa::Portable) act_row(g, g + I, a.data(), I);
    else if (ymm_path(isa)) act_row_avx2(g, g + I, a.data(), I);
    else act_row_avx512(g, g + I, a.data(), I);
    quantize_row(isa, m.fmt, a.data(), I, ab, s);
  });
  const Acts as = ab.view(nullptr, n_slots);
  auto t2 = make_tasks(H, b2);
  pack_amx(as, m.down.Kp);
  tp.parallel_for_grouped(group_start.data(), nodes, [&](int i) {
    auto [e, r0] = t2[i];
    int s0 = start[e];
    gemm_rows(isa, m.fmt, m.down, e, r0, std::min(H, r0 + b2), sub(as, e), start[e + 1] - s0,
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
