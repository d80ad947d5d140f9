// An attention block's decode step in one call: input RMSNorm; GQA's fused q/k/v projection (+ biases), per-head
// QK-norm and rotary embedding, or MLA's q through its low-rank pair (or q_proj), its latent and rotary key, their
// norm and rotary embedding, and its absorbed query; the new K/V rows (MLA: latent and rotary key) into the paged
// pool; attention over each sequence's blocks (MLA: in the latent space, then W_uv); o_proj (+ bias), the residual
// add and the post-attention RMSNorm, and for an MoE layer its router's top-k choice, for B sequences of one new
// token each. It replaces ~30 torch ops and 7 native calls a layer and sequence (gpu_service/attention.py
// gqa_attention / mla_attention and layers.route stay the reference) whose dispatch cost several times the
// arithmetic at decode (docs/performance/decode_step.md), and runs the projections and the router once for all B rows.
//
// Rounding is torch's at every point the reference rounds (model dtype T: bf16 bits or fp32): the projections'
// fp32 outputs, the bias adds, the norms, rope, the attention output and the residual add, so one sequence's
// block is bit for bit the reference's; the routers' softmax and sigmoid are torch's kernels' arithmetic in
// their order (torch_rounding.h), their choice torch's topk algorithm (tests/model/test_decode_step.py).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/matvec_f32.h"
#include "kernels/torch_rounding.h"
#include "kernels/vec_builds.h"
#include "moe.h"
#include "runtime/common.h"

namespace moe {

namespace {

using namespace rounding;

struct Scratch {  // per calling thread, reused across calls (a decode step's few rows)
  std::vector<float> xf, y, att, of, qf, lat, lo;
  std::vector<int32_t> sel, sel_len;  // a window's positions
  std::vector<uint8_t> xn, qkv, rot, tmp, ckv;  // T elements
};

template <class T>
T* as(std::vector<uint8_t>& v, size_t n) {
  v.resize(n * sizeof(T));
  return reinterpret_cast<T*>(v.data());
}

#define MOE_BLOCK_INLINE __attribute__((always_inline, optimize("fp-contract=off"))) inline

// GQA: the fused q/k/v of the input norm (s.xf), biases, QK-norm, rope, the new K/V rows into the pool and the
// attention (a window's last keys, sinks) -> s.of [B, nh dv], the o_proj's fp32 input
template <class T>
MOE_BLOCK_INLINE void gqa_attend(const DecodeBlock& g, int B, Scratch& s, const T* cos, const T* sin,
                                 const DecodeSeq* seqs) {
  constexpr bool BF16 = std::is_same<T, uint16_t>::value;
  const int H = g.H, nh = g.nh, nkv = g.nkv, d = g.d, dv = g.dv, nq = nh * d, nk = nkv * d, rows = nq + nk + nkv * dv;
  // the pool's element size (--kv-cache-dtype) and a row's elements (an 8-bit row's scale byte included)
  const size_t kv_size = kv_elem_bytes(g.kv), kr = kv_row_bytes(g.kv, d) / kv_size, vr = kv_row_bytes(g.kv, dv) / kv_size;
  s.y.resize(size_t(B) * std::max(rows, H));
  linear_forward(*g.qkv_k, g.qkv, s.xf.data(), B, s.y.data());
  // q, k, v rounded to T, biases added in T
  T* qkv = as<T>(s.qkv, size_t(B) * rows);
  const void* bias[3] = {g.q_bias, g.k_bias, g.v_bias};
  const int off[3] = {0, nq, nq + nk}, len[3] = {nq, nk, nkv * dv};
  for (int t = 0; t < B; ++t)
    for (int p = 0; p < 3; ++p) {
      const float* y = s.y.data() + size_t(t) * rows + off[p];
      T* o = qkv + size_t(t) * rows + off[p];
      const T* b = static_cast<const T*>(bias[p]);
      for (int i = 0; i < len[p]; ++i) put(o, i, b ? held<T>(y[i]) + get(b, i) : y[i]);
      if (p == 2 && g.v_scale != 1.f)  // (torch: v * value_scale in T, the scale an fp32 operand)
        for (int i = 0; i < len[p]; ++i) put(o, i, get(o, i) * g.v_scale);
    }
  // per token: q [nh, d] and k [nkv, d] normed and rotated into rot (q then k), v as is
  T* rot = as<T>(s.rot, size_t(B) * (nq + nk));
  T* tmp = as<T>(s.tmp, size_t(nq + nk));  // one token's q and k, normed
  for (int t = 0; t < B; ++t) {
    T* src = qkv + size_t(t) * rows;
    T* dst = rot + size_t(t) * (nq + nk);
    const T* c = cos + size_t(t) * (g.rot / 2);
    const T* sn = sin + size_t(t) * (g.rot / 2);
    if (g.q_norm) {
      rms_norm_rows(src, BF16, g.q_norm, BF16, tmp, BF16, nh, d, g.eps);
      rms_norm_rows(src + nq, BF16, g.k_norm, BF16, tmp + nq, BF16, nkv, d, g.eps);
    } else {
      std::memcpy(tmp, src, sizeof(T) * (nq + nk));
    }
    if (g.rot == d) {
      rope_rows(tmp, dst, BF16, 1, nh, d, c, sn);
      rope_rows(tmp + nq, dst + nq, BF16, 1, nkv, d, c, sn);
    } else {  // partial rotary: each head's first rot dims turn, the rest pass through
      std::memcpy(dst, tmp, sizeof(T) * (nq + nk));
      for (int hd = 0; hd < nh + nkv; ++hd) rope_rows(tmp + size_t(hd) * d, dst + size_t(hd) * d, BF16, 1, 1,
                                                       g.rot, c, sn);
    }
    // the new position's K and V rows into the pool: block table[pos / block], row pos % block
    const DecodeSeq& q = seqs[t];
    const size_t blk = size_t(q.table[q.pos >> g.block_shift]), row = size_t(q.pos & ((1 << g.block_shift) - 1));
    for (int k = 0; k < nkv; ++k) {
      const size_t at = k * g.kv_head + blk * g.kv_block + row * kr, vat = k * g.v_head + blk * g.v_block + row * vr;
      store_kv(g.kv, dst + nq + size_t(k) * d, BF16, static_cast<char*>(g.K) + at * kv_size, d);
      store_kv(g.kv, src + nq + nk + size_t(k) * dv, BF16, static_cast<char*>(g.V) + vat * kv_size, dv);
    }
  }
  // attention, a sequence at a time (each over its kv heads on the pool); the query as fp32, the output
  // rounded to T, then the projection's fp32 input
  const int no = nh * dv;  // the heads' outputs
  s.att.resize(size_t(no));
  s.of.resize(size_t(B) * no);
  s.qf.resize(size_t(nq));
  float* qf = s.qf.data();
  for (int t = 0; t < B; ++t) {
    const T* qt = rot + size_t(t) * (nq + nk);
    for (int i = 0; i < nq; ++i) qf[i] = get(qt, i);
    const DecodeSeq& q = seqs[t];
    const int L = q.pos + 1, lo = g.window ? std::max(0, L - g.window) : 0;
    if (lo > 0) {  // a window's positions lo .. pos, the same for every kv head (as gqa_attend's selection)
      s.sel.resize(size_t(L - lo));
      for (int j = lo; j < L; ++j) s.sel[j - lo] = j;
      s.sel_len.assign(size_t(nkv), L - lo);
      decode_attention(g.isa, qf, nh, nkv, d, dv, g.K, g.kv, g.kv_head, kr, g.V, g.v_head, vr, L, g.scale,
                       s.att.data(), q.table, g.block_shift, g.kv_block, g.v_block, s.sel.data(), s.sel_len.data(), 0,
                       g.sinks);
    } else if (q.first >= 0) {  // consecutive blocks: each head's rows are one strided matrix
      decode_attention(g.isa, qf, nh, nkv, d, dv, static_cast<const char*>(g.K) + q.first * g.kv_block * kv_size,
                       g.kv, g.kv_head, kr, static_cast<const char*>(g.V) + q.first * g.v_block * kv_size, g.v_head,
                       vr, L, g.scale, s.att.data(), nullptr, 0, 0, 0, nullptr, nullptr, 0, g.sinks);
    } else {
      decode_attention(g.isa, qf, nh, nkv, d, dv, g.K, g.kv, g.kv_head, kr, g.V, g.v_head, vr, L, g.scale,
                       s.att.data(), q.table, g.block_shift, g.kv_block, g.v_block, nullptr, nullptr, 0, g.sinks);
    }
    for (int i = 0; i < no; ++i) s.of[size_t(t) * no + i] = held<T>(s.att[i]);
  }
}

// y [B, n] fp32 of a projection -> out [B, n] in T, the bias (optional) added in T: torch's linear(x, w) + b
template <class T>
MOE_BLOCK_INLINE void round_rows(const float* y, const void* bias, int B, int n, T* out) {
  const T* b = static_cast<const T*>(bias);
  for (int t = 0; t < B; ++t)
    for (int i = 0; i < n; ++i) {
      const size_t at = size_t(t) * n + i;
      put(out, at, b ? held<T>(y[at]) + get(b, i) : y[at]);
    }
}

// MLA, absorbed (gpu_service/attention.py mla_attention's decode branch, with its roundings): q through q_a, its
// norm and q_b; the latent and rotary key through kv_a; rope; both into the pool; the latent query (kv_b's W_uk),
// the latent attention, the heads' output (W_uv) -> s.of [B, nh dv], the o_proj's fp32 input
template <class T>
MOE_BLOCK_INLINE void mla_attend(const DecodeBlock& g, int B, Scratch& s, const T* cos, const T* sin,
                                 const DecodeSeq* seqs) {
  constexpr bool BF16 = std::is_same<T, uint16_t>::value;
  const MlaPart& m = g.m;
  const int H = g.H, nh = g.nh, r = m.r, dn = m.dn, dr = m.dr, dv = m.dv, dq = dn + dr, nq = nh * dq;
  const size_t kv_size = kv_elem_bytes(g.kv), cr = kv_row_bytes(g.kv, m.r) / kv_size,
               pr = kv_row_bytes(g.kv, m.dr) / kv_size;  // the latent's and the rotary key's rows
  const int ql = m.q_a_k ? m.q_a.rows : 0;
  s.y.resize(size_t(B) * std::max({nq, r + dr, ql, H}));
  T* q = as<T>(s.qkv, size_t(B) * nq);
  if (m.q_a_k) {  // q_a, rounded (+ bias), its norm, then q_b
    linear_forward(*m.q_a_k, m.q_a, s.xf.data(), B, s.y.data());
    T* qa = as<T>(s.tmp, size_t(B) * ql * 2);
    round_rows(s.y.data(), m.q_a_bias, B, ql, qa);
    rms_norm_rows(qa, BF16, m.q_a_norm, BF16, qa + size_t(B) * ql, BF16, B, ql, 1e-6f);
    s.qf.resize(size_t(B) * ql);
    for (size_t i = 0; i < size_t(B) * ql; ++i) s.qf[i] = get(qa + size_t(B) * ql, i);
    linear_forward(*m.q_b_k, m.q_b, s.qf.data(), B, s.y.data());
  } else {
    linear_forward(*m.q_b_k, m.q_b, s.xf.data(), B, s.y.data());
  }
  round_rows(s.y.data(), nullptr, B, nq, q);
  // the latent (normed) and the rotary key
  T* ckv = as<T>(s.ckv, size_t(B) * (r + dr) + size_t(B) * r);
  T* c = ckv + size_t(B) * (r + dr);
  linear_forward(*m.kv_a_k, m.kv_a, s.xf.data(), B, s.y.data());
  round_rows(s.y.data(), m.kv_a_bias, B, r + dr, ckv);
  for (int t = 0; t < B; ++t)
    rms_norm_rows(ckv + size_t(t) * (r + dr), BF16, m.kv_a_norm, BF16, c + size_t(t) * r, BF16, 1, r, 1e-6f);
  // per token: the rotary parts (q's nh heads, then k) rotated into rot; the new latent and key into the pool; q
  // as fp32: each head's latent query after its absorption, then its rotated part
  T* rot = as<T>(s.rot, size_t(B) * (nh + 1) * dr);
  T* pe = as<T>(s.tmp, size_t(nh + 1) * dr);  // one token's rotary parts, de-interleaved
  const int half = dr / 2;
  for (int t = 0; t < B; ++t) {
    const T* qt = q + size_t(t) * nq;
    for (int hd = 0; hd <= nh; ++hd) {
      const T* x = hd < nh ? qt + size_t(hd) * dq + dn : ckv + size_t(t) * (r + dr) + r;
      T* o = pe + size_t(hd) * dr;
      if (m.interleave)  // pairs (x0, x1), (x2, x3), ...: evens then odds, rotated as halves
        for (int i = 0; i < half; ++i) o[i] = x[2 * i], o[half + i] = x[2 * i + 1];
      else
        std::memcpy(o, x, sizeof(T) * dr);
    }
    T* rt = rot + size_t(t) * (nh + 1) * dr;
    rope_rows(pe, rt, BF16, 1, nh + 1, dr, cos + size_t(t) * half, sin + size_t(t) * half);
    const DecodeSeq& sq = seqs[t];
    const size_t blk = size_t(sq.table[sq.pos >> g.block_shift]), row = size_t(sq.pos & ((1 << g.block_shift) - 1));
    const size_t at = (blk << g.block_shift) + row;
    store_kv(g.kv, c + size_t(t) * r, BF16, static_cast<char*>(g.K) + at * cr * kv_size, r);
    store_kv(g.kv, rt + size_t(nh) * dr, BF16, static_cast<char*>(g.V) + at * pr * kv_size, dr);
  }
  // the latent queries of all B tokens: q_nope fp32 [B, nh, dn] -> [nh, B, r]
  s.qf.resize(size_t(B) * nh * dn);
  for (int t = 0; t < B; ++t)
    for (int hd = 0; hd < nh; ++hd)
      for (int i = 0; i < dn; ++i)
        s.qf[(size_t(t) * nh + hd) * dn + i] = get(q, size_t(t) * nq + size_t(hd) * dq + i);
  s.lat.resize(size_t(nh) * B * r);
  mla_absorb_q(g.isa, m.kv_b, m.kv_b_bf16, nh, dn, dv, r, s.qf.data(), size_t(nh) * dn, B, s.lat.data());
  // per token its attention over its blocks: the query [nh, r + dr] (the latent rounded to T), the heads' latent
  // outputs rounded to T into lo [nh, B, r]
  s.att.resize(size_t(nh) * (r + dr) + size_t(nh) * r);
  float* qc = s.att.data();
  float* ol = qc + size_t(nh) * (r + dr);
  s.lo.resize(size_t(nh) * B * r);
  for (int t = 0; t < B; ++t) {
    const T* rt = rot + size_t(t) * (nh + 1) * dr;
    for (int hd = 0; hd < nh; ++hd) {
      const float* l = s.lat.data() + (size_t(hd) * B + t) * r;
      float* o = qc + size_t(hd) * (r + dr);
      for (int i = 0; i < r; ++i) o[i] = held<T>(l[i]);
      for (int i = 0; i < dr; ++i) o[r + i] = get(rt, size_t(hd) * dr + i);
    }
    const DecodeSeq& sq = seqs[t];
    const int L = sq.pos + 1;
    if (sq.first >= 0) {  // consecutive blocks: the rows of one matrix each
      const size_t at = size_t(sq.first) << g.block_shift;
      mla_decode_attention(g.isa, qc, nh, r, dr, static_cast<const char*>(g.K) + at * cr * kv_size,
                           static_cast<const char*>(g.V) + at * pr * kv_size, g.kv, cr, pr, L, g.scale, ol);
    } else {
      mla_decode_attention(g.isa, qc, nh, r, dr, g.K, g.V, g.kv, cr, pr, L, g.scale, ol, sq.table, g.block_shift,
                           cr << g.block_shift, pr << g.block_shift);
    }
    for (int hd = 0; hd < nh; ++hd)
      for (int i = 0; i < r; ++i) s.lo[(size_t(hd) * B + t) * r + i] = held<T>(ol[size_t(hd) * r + i]);
  }
  // the heads' outputs [B, nh dv], rounded to T: the o_proj's input
  s.of.resize(size_t(B) * nh * dv);
  mla_absorb_o(g.isa, m.kv_b, m.kv_b_bf16, nh, dn, dv, r, s.lo.data(), B, s.of.data());
  for (float& v : s.of) v = held<T>(v);
}

template <class T>
MOE_BLOCK_INLINE void run(const DecodeBlock& g, int B, T* h, const T* cos, const T* sin, const DecodeSeq* seqs,
                          T* x_out, int32_t* ids, float* weights) {
  constexpr bool BF16 = std::is_same<T, uint16_t>::value;
  Scratch& s = thread_scratch<Scratch>();
  const int H = g.H;
  // input norm -> the projections' fp32 input (the reference's x.float() of the rounded norm)
  T* xn = as<T>(s.xn, size_t(B) * H);
  rms_norm_rows(h, BF16, g.in_norm, BF16, xn, BF16, B, H, g.eps);
  s.xf.resize(size_t(B) * H);
  for (size_t i = 0; i < size_t(B) * H; ++i) s.xf[i] = get(xn, i);
  if (g.mla)
    mla_attend(g, B, s, cos, sin, seqs);
  else
    gqa_attend(g, B, s, cos, sin, seqs);
  s.y.resize(std::max(s.y.size(), size_t(B) * H));
  linear_forward(*g.o_k, g.o, s.of.data(), B, s.y.data());
  // h += o (o rounded to T, its bias added in T), then the post-attention norm
  const T* ob = static_cast<const T*>(g.o_bias);
  for (int t = 0; t < B; ++t)
    for (int i = 0; i < H; ++i) {
      float o = held<T>(s.y[size_t(t) * H + i]);
      if (ob) o = held<T>(o + get(ob, i));
      const size_t at = size_t(t) * H + i;
      put(h, at, get(h, at) + o);
    }
  rms_norm_rows(h, BF16, g.post_norm, BF16, x_out, BF16, B, H, g.eps);
  if (!g.routes()) return;
  for (size_t i = 0; i < size_t(B) * H; ++i) s.xf[i] = get(x_out, i);
  if (g.w32) {  // fp32 logits (torch: F.linear(x.float(), the fp32 weight)), then the sigmoid's or softmax's choice
    s.y.resize(size_t(B) * std::max(H, g.E));
    matvec_f32(g.w32, s.xf.data(), B, g.E, H, s.y.data());
    if (g.softmax32) {
      softmax_topk(s.y.data(), B, g.E, g.top_k, g.norm_topk, false, ids, weights, g.n_group, g.topk_group, g.scaling);
      return;
    }
    sigmoid_topk(s.y.data(), g.bias32, B, g.E, g.top_k, g.n_group, g.topk_group, g.norm_topk, g.scaling, ids,
                 weights);
    return;
  }
  // the softmax router on the normed rows: logits rounded to T, then the softmax's choice
  const int E = g.gate.rows;
  s.y.resize(size_t(B) * std::max(H, E));
  linear_forward(*g.gate_k, g.gate, s.xf.data(), B, s.y.data());
  for (size_t i = 0; i < size_t(B) * E; ++i) s.y[i] = held<T>(s.y[i]);
  softmax_topk(s.y.data(), B, E, g.top_k, g.norm_topk, BF16 && g.round_w, ids, weights);
}

// the block's own loops (conversions, roundings, bias and residual adds, the fp32 router's mat-vec) built for the
// kernel path's vector width
MOE_VEC_BUILDS(run_any, run)

// out[e] = exp(l[e] - mx): torch's vector exp (Sleef's: torch_expf) or libm's
__attribute__((always_inline, optimize("fp-contract=off"))) inline void exp_shifted(const float* l, int E, float mx,
                                                                                    bool sleef, float* out) {
  if (sleef)
    for (int e = 0; e < E; ++e) out[e] = torch_expf(l[e] - mx);
  else
    for (int e = 0; e < E; ++e) out[e] = std::exp(l[e] - mx);
}
MOE_FMA_BUILDS(exp_shifted_any, exp_shifted)

}  // namespace

void softmax_topk(const float* logits, int B, int E, int k, bool norm_topk, bool round_bf16, int32_t* ids,
                  float* weights, int n_group, int topk_group, float scaling) {
  MOE_CHECK(k > 0 && k <= E && k <= MAX_K && n_group > 0 && E % n_group == 0 && topk_group > 0 &&
                topk_group <= n_group && k <= topk_group * (E / n_group), "router: bad top-k or groups");
  const int per = E / n_group;
  std::vector<std::pair<float, int>> best(n_group);
  std::vector<char> keep(n_group);
  using elem = std::pair<float, int64_t>;  // (probability, id), as torch's CPU topk queues them
  std::vector<elem> q(E);
  // torch's topk (largest, sorted): the same algorithms on the same queue, so that equal probabilities (logits
  // equal in bf16 are common) come out in the same order and the same one of them makes the cut
  const auto before = [](const elem& x, const elem& y) {
    return (std::isnan(x.first) && !std::isnan(y.first)) || x.first > y.first;
  };
  // torch's softmax over the last dim (SoftMaxKernel.cpp _vec_softmax_lastdim): the max, exp(x - max) with its
  // vector exp (libm's at DEFAULT), their sum in vec::reduce_all's order, each times 1 / sum: its bits
  const int vb = torch_vector_bytes(), V = (vb > 0 ? vb : 32) / 4;
  const bool fma = has_fma();
  std::vector<float> ex(E);
  for (int t = 0; t < B; ++t) {
    const float* l = logits + size_t(t) * E;
    const float mx = *std::max_element(l, l + E);
    exp_shifted_any(fma, l, E, mx, vb > 0, ex.data());
    const float inv = 1.f / torch_sum(ex.data(), size_t(E), V, vb > 0);
    for (int e = 0; e < E; ++e) q[e] = elem(ex[e] * inv, e);
    if (topk_group < n_group) {  // the groups of the topk_group highest maxima; the others' experts at 0
      for (int gi = 0; gi < n_group; ++gi) {
        float m = q[size_t(gi) * per].first;
        for (int e = 1; e < per; ++e) m = std::max(m, q[size_t(gi) * per + e].first);
        best[gi] = {m, gi};
      }
      std::partial_sort(best.begin(), best.begin() + topk_group, best.end(), [](const auto& x, const auto& y) {
        return x.first > y.first || (x.first == y.first && x.second < y.second);
      });
      std::fill(keep.begin(), keep.end(), 0);
      for (int j = 0; j < topk_group; ++j) keep[best[j].second] = 1;
      for (int e = 0; e < E; ++e)
        if (!keep[e / per]) q[e].first = 0.f;
    }
    if (int64_t(k) * 64 <= E) {
      std::partial_sort(q.begin(), q.begin() + k, q.end(), before);
    } else {
      std::nth_element(q.begin(), q.begin() + k - 1, q.end(), before);
      std::sort(q.begin(), q.begin() + k - 1, before);
    }
    float total = 0.f;
    for (int j = 0; j < k; ++j) total += q[j].first;
    for (int j = 0; j < k; ++j) {
      float w = q[j].first;
      if (norm_topk) w /= total;
      w *= scaling;  // (1 but for DeepSeek-V2: exact)
      ids[size_t(t) * k + j] = int32_t(q[j].second);
      weights[size_t(t) * k + j] = round_bf16 ? held<uint16_t>(w) : w;
    }
  }
}

void sigmoid_topk(const float* logits, const float* bias, int B, int E, int k, int n_group, int topk_group,
                  bool norm_topk, float scaling, int32_t* ids, float* weights) {
  MOE_CHECK(k > 0 && k <= E && k <= MAX_K && n_group > 0 && E % n_group == 0 && topk_group > 0 &&
                topk_group <= n_group && k <= topk_group * (E / n_group), "router: bad top-k or groups");
  const int per = E / n_group;
  std::vector<float> score(E), choice(E);
  std::vector<std::pair<float, int>> q(std::max(E, n_group));
  const auto before = [](const std::pair<float, int>& x, const std::pair<float, int>& y) {
    return x.first > y.first || (x.first == y.first && x.second < y.second);
  };
  const size_t from = torch_scalar_from<float>(size_t(B) * E, torch_vector_bytes());  // the logits: one run
  for (int t = 0; t < B; ++t) {
    const float* l = logits + size_t(t) * E;
    for (int e = 0; e < E; ++e) {
      score[e] = size_t(t) * E + e < from ? torch_sigmoid(l[e]) : libm_sigmoid(l[e]);
      choice[e] = bias ? score[e] + bias[e] : score[e];
    }
    if (topk_group < n_group) {  // each group scored by its two best choices; the other groups' experts out
      for (int gi = 0; gi < n_group; ++gi) {
        const float* c = choice.data() + size_t(gi) * per;
        float a = -INFINITY, b = -INFINITY;
        for (int e = 0; e < per; ++e) {
          if (c[e] > a) b = a, a = c[e];
          else if (c[e] > b) b = c[e];
        }
        q[gi] = {per > 1 ? a + b : a, gi};
      }
      std::partial_sort(q.begin(), q.begin() + topk_group, q.begin() + n_group, before);
      std::vector<char> keep(n_group, 0);
      for (int j = 0; j < topk_group; ++j) keep[q[j].second] = 1;
      for (int e = 0; e < E; ++e)
        if (!keep[e / per]) choice[e] = -INFINITY;
    }
    for (int e = 0; e < E; ++e) q[e] = {choice[e], e};
    std::partial_sort(q.begin(), q.begin() + k, q.begin() + E, before);
    float total = 0.f;
    for (int j = 0; j < k; ++j) total += score[q[j].second];
    for (int j = 0; j < k; ++j) {
      float w = score[q[j].second];
      if (norm_topk) w = w / (total + 1e-20f);
      ids[size_t(t) * k + j] = q[j].second;
      weights[size_t(t) * k + j] = w * scaling;
    }
  }
}

void decode_block(const DecodeBlock& g, int B, void* h, const void* cos, const void* sin, const DecodeSeq* seqs,
                  void* x_out, int32_t* ids, float* weights) {
  if (g.mla) {
    const MlaPart& m = g.m;
    MOE_CHECK(B > 0 && g.nh > 0 && m.r > 0 && m.dn > 0 && m.dv > 0 && m.dr > 0 && m.dr % 2 == 0 && m.kv_b &&
                  m.kv_a_norm && (!m.q_a_k || m.q_a_norm), "MLA decode block: bad shapes or a missing weight");
    MOE_CHECK(m.q_b.rows == g.nh * (m.dn + m.dr) && m.q_b.K == (m.q_a_k ? m.q_a.rows : g.H) &&
                  (!m.q_a_k || m.q_a.K == g.H) && m.kv_a.K == g.H && m.kv_a.rows == m.r + m.dr &&
                  g.o.K == g.nh * m.dv && g.o.rows == g.H, "MLA decode block: the projections do not fit the heads");
  } else {
    MOE_CHECK(B > 0 && g.nh > 0 && g.nkv > 0 && g.nh % g.nkv == 0 && g.d % 2 == 0 && g.dv > 0 && g.rot > 0 &&
                  g.rot % 2 == 0 && g.rot <= g.d && g.window >= 0, "decode block: bad shapes");
    MOE_CHECK(g.qkv.K == g.H && g.qkv.rows == (g.nh + g.nkv) * g.d + g.nkv * g.dv && g.o.K == g.nh * g.dv &&
                  g.o.rows == g.H, "decode block: the projections do not fit the heads");
    MOE_CHECK(!g.q_norm == !g.k_norm, "decode block: QK-norm needs both weights");
  }
  MOE_CHECK(!g.gate_k || (g.gate.K == g.H && ids && weights), "decode block: the router does not fit");
  MOE_CHECK(!g.w32 || (g.E > 0 && ids && weights), "decode block: the fp32 router does not fit");
  for (int t = 0; t < B; ++t)
    MOE_CHECK(seqs[t].pos >= 0 && seqs[t].table, "decode block: a sequence without a position or block table");
  const Vec v = vec_of(g.isa);
  if (g.bf16)
    run_any(v, g, B, static_cast<uint16_t*>(h), static_cast<const uint16_t*>(cos), static_cast<const uint16_t*>(sin),
            seqs, static_cast<uint16_t*>(x_out), ids, weights);
  else
    run_any(v, g, B, static_cast<float*>(h), static_cast<const float*>(cos), static_cast<const float*>(sin), seqs,
            static_cast<float*>(x_out), ids, weights);
}

}  // namespace moe
