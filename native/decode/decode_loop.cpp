// See decode_loop.h. Per layer: the attention block (which also routes), the routed experts' request written
// straight into its ring slot and the doorbell rung (or the local kernels run), the wait for the answers with the
// ring's spin-then-sleep policy (the previous layer's deferred part first, as they arrive), and h += y (+ the
// deferred part, + the shared experts, run while the expert service computes) rounded as torch's adds in the model
// dtype; a dense layer adds its MLP. The same operations as the layer loop's
// (Model.forward) in the same order, so its tokens are that loop's bit for bit (tests/model/test_decode_loop.py). A wait
// that outlasts its slice returns to the caller, which checks the session's lifeline and deadline and calls again
// (the ring client's `outstanding` says where to resume): nothing here blocks longer than a slice.
#include "decode/decode_loop.h"

#include <cstring>
#include <mutex>
#include <stdexcept>
#include <utility>

#include "kernels/torch_rounding.h"
#include "kernels/vec_builds.h"
#include "runtime/common.h"

namespace moe {

namespace {

using namespace rounding;

struct LoopScratch {  // per calling thread: the local path's request, its answers, the answer read back
  std::vector<uint8_t> x, y, late, late_next, sh;
  std::vector<int32_t> ids;
  std::vector<float> w, wide;
};

template <class T>
__attribute__((always_inline, optimize("fp-contract=off"))) inline void add_rows(T* h, const T* y, size_t n) {
  for (size_t i = 0; i < n; ++i) put(h, i, get(h, i) + get(y, i));
}

template <class T>
__attribute__((always_inline, optimize("fp-contract=off"))) inline void add_answer_t(T* h, T* y, const T* late,
                                                                                     const T* shared, size_t n) {
  if (late) add_rows(y, late, n);
  if (shared) add_rows(y, shared, n);
  add_rows(h, y, n);
}
MOE_VEC_BUILDS(add_answer_any, add_answer_t)

// the layer loop's y = y + late (if any), then h = h + (y + shared) (if any), each rounded to the model dtype
void add_answer(const DecodeBlock& g, void* h, void* y, const void* late, const void* shared, size_t n) {
  if (g.bf16)
    add_answer_any(vec_of(g.isa), static_cast<uint16_t*>(h), static_cast<uint16_t*>(y),
                   static_cast<const uint16_t*>(late), static_cast<const uint16_t*>(shared), n);
  else
    add_answer_any(vec_of(g.isa), static_cast<float*>(h), static_cast<float*>(y), static_cast<const float*>(late),
                   static_cast<const float*>(shared), n);
}

// Model.forward's end: h's final norm (its dtype promote_types(h, norm)), as fp32, times the lm_head
void run_head(const LoopHead& hd, bool bf16, int B, int H, const void* h, float* logits, LoopScratch& s) {
  const bool out_bf16 = bf16 && hd.norm_bf16;
  const size_t n = size_t(B) * H;
  s.x.resize(n * (out_bf16 ? 2 : 4));
  rms_norm_rows(h, bf16, hd.norm, hd.norm_bf16, s.x.data(), out_bf16, B, H, hd.eps);
  const float* xf = reinterpret_cast<const float*>(s.x.data());
  if (out_bf16) {  // x.float(): exact
    s.wide.resize(n);
    const uint16_t* x = reinterpret_cast<const uint16_t*>(s.x.data());
    for (size_t i = 0; i < n; ++i) s.wide[i] = get(x, i);
    xf = s.wide.data();
  }
  linear_forward(*hd.k, hd.m, xf, B, logits);
  if (out_bf16)  // torch's y.to(bfloat16).float()
    for (size_t i = 0, m = size_t(B) * hd.m.rows; i < m; ++i) logits[i] = held<uint16_t>(logits[i]);
}

}  // namespace

void gather_rope_rows(const void* const tables[4], int rows, bool bf16, int B, const DecodeSeq* seqs, uint8_t* out) {
  const size_t row = size_t(rows) * (bf16 ? 2 : 4);
  for (int i = 0; i < 4; ++i)
    for (int t = 0; t < B; ++t)
      std::memcpy(out + (size_t(i) * B + t) * row, static_cast<const uint8_t*>(tables[i]) + size_t(seqs[t].pos) * row,
                  row);
}

void embed_rows(const void* table, int64_t vocab, const int64_t* tokens, int B, int H, bool bf16, void* h) {
  for (int t = 0; t < B; ++t)
    MOE_CHECK(tokens[t] >= 0 && tokens[t] < vocab, "decode loop: a token id outside the embedding");
  const size_t width = size_t(H) * (bf16 ? 2 : 4);
  for (int t = 0; t < B; ++t)
    std::memcpy(static_cast<uint8_t*>(h) + t * width, static_cast<const uint8_t*>(table) + size_t(tokens[t]) * width,
                width);
}

LoopEnd decode_layers(const std::vector<LoopLayer>& layers, const std::vector<const MoELayer*>* local, RingClient* ring,
                      int first, bool waiting, int defer, int B, void* h, const void* cos, const void* sin,
                      const DecodeSeq* seqs, const DecodeSeq* seqs2, int64_t* times, const LoopHead* head,
                      float* logits, const void* cos2, const void* sin2) {
  const int n_layers = int(layers.size());
  MOE_CHECK(first >= 0 && first <= n_layers && B > 0 && defer >= 0, "decode loop: bad first layer, batch or defer");
  MOE_CHECK(!head == !logits && n_layers > 0, "decode loop: a head needs its logits and the logits a head");
  MOE_CHECK(local ? local->size() == layers.size() : ring != nullptr, "decode loop: no experts to run");
  for (const LoopLayer& l : layers) {
    MOE_CHECK(!l.second_rope || (cos2 && sin2), "decode loop: a layer's second rope table not given");
    MOE_CHECK(!l.second_table || seqs2, "decode loop: a layer's second block tables not given");
  }
  LoopScratch& s = thread_scratch<LoopScratch>();
  const void* const rope[2][2] = {{cos, sin}, {cos2, sin2}};
  for (int L = first; L < n_layers; ++L) {
    const DecodeBlock& g = layers[L].block;
    const Mlp* mlp = layers[L].mlp;
    const void* const* cs = rope[layers[L].second_rope];  // this layer's cos, sin
    const DecodeSeq* sq = layers[L].second_table ? seqs2 : seqs;  // and its block tables
    const size_t elem = g.bf16 ? 2 : 4, n = size_t(B) * g.H, xn = n * elem;
    int64_t* tm = times + size_t(L) * LOOP_TIMES;
    if (!g.routes()) {  // a dense layer: h += its MLP of the block's output
      MOE_CHECK(mlp && (L == 0 || !layers[L - 1].block.routes()), "decode loop: a dense layer without its MLP, or "
                "after an MoE layer");
      s.x.resize(xn), s.sh.resize(xn);
      std::lock_guard<std::mutex> lk(compute_mutex());
      decode_block(g, B, h, cs[0], cs[1], sq, s.x.data());
      tm[ATTENTION_END] = wall_ns();
      mlp_forward(*mlp, B, s.x.data(), s.sh.data());
      tm[MLP_END] = wall_ns();
      for (int c = SUBMIT_END; c < MLP_END; ++c) tm[c] = 0;
      add_answer(g, h, s.sh.data(), nullptr, nullptr, n);
      continue;
    }
    MOE_CHECK(g.top_k > 0 && defer < g.top_k, "decode loop: defer not below a layer's top-k");
    const int k = g.top_k, d = L + 1 < n_layers ? defer : 0;
    const size_t kn = size_t(B) * k * 4;
    // the previous layer's deferred answer: every MoE layer but the last defers
    const bool late_due = defer && L > 0 && layers[L - 1].block.routes();
    const void* late = nullptr;
    if (local) {
      s.x.resize(xn), s.y.resize(xn), s.late_next.resize(xn), s.ids.resize(size_t(B) * k), s.w.resize(size_t(B) * k);
      std::lock_guard<std::mutex> lk(compute_mutex());
      decode_block(g, B, h, cs[0], cs[1], sq, s.x.data(), s.ids.data(), s.w.data());
      tm[ATTENTION_END] = wall_ns();
      MOE_CHECK((*local)[L] != nullptr, "decode loop: an MoE layer without its local experts");
      try {
        const MoELayer& m = *(*local)[L];
        moe_forward_part(m, s.x.data(), g.bf16, s.ids.data(), s.w.data(), s.y.data(), g.bf16, B, k, d, 0);
        if (d) moe_forward_part(m, s.x.data(), g.bf16, s.ids.data(), s.w.data(), s.late_next.data(), g.bf16, B, k, d, 1);
      } catch (const std::invalid_argument& e) {
        release_scratch();
        return {L, ring::INVALID_ARGUMENT, e.what()};
      }
      tm[SUBMIT_END] = wall_ns();
      tm[MLP_END] = 0;
      if (mlp) {
        s.sh.resize(xn);
        mlp_forward(*mlp, B, s.x.data(), s.sh.data());
        tm[MLP_END] = wall_ns();
      }
      tm[WAIT_END] = wall_ns();
      for (int c = QUEUED_US; c < MLP_END; ++c) tm[c] = 0;
      if (late_due) late = s.late.data();
      add_answer(g, h, s.y.data(), late, mlp ? s.sh.data() : nullptr, n);
      std::swap(s.late, s.late_next);
      continue;
    }
    RingClient& r = *ring;
    if (!(waiting && L == first)) {
      const uint64_t seq = r.posted, at = r.slot[seq % ring::REQ_SLOTS];
      MOE_CHECK(at + r.def_at + xn <= r.size && r.ids_at >= xn && r.w_at >= r.ids_at + kn &&
                    r.out_at >= r.w_at + kn && r.def_at >= r.out_at + xn,
                "decode loop: the request does not fit its ring slot");
      {
        std::lock_guard<std::mutex> lk(compute_mutex());
        decode_block(g, B, h, cs[0], cs[1], sq, r.base + at, reinterpret_cast<int32_t*>(r.base + at + r.ids_at),
                     reinterpret_cast<float*>(r.base + at + r.w_at));
      }
      tm[ATTENTION_END] = wall_ns();
      const ring::ReqDesc q{seq, r.step, uint32_t(L), uint32_t(B), uint32_t(k), uint32_t(d), r.dtype, 0,
                            {{at, xn}, {at + r.ids_at, kn}, {at + r.w_at, kn}, {at + r.out_at, xn},
                             {d ? at + r.def_at : 0, d ? xn : 0}}};
      ring_submit(r.base, q, nullptr, nullptr, nullptr, uint32_t(seq + 1));  // all in place: the descriptor, ring
      r.posted = seq + 1;
      r.outstanding.push_back({seq, L, 0});
      if (d) r.outstanding.push_back({seq, L, 1});
      tm[SUBMIT_END] = wall_ns();
      tm[LATE_START] = tm[LATE_END] = tm[MLP_END] = 0;
      if (mlp) {  // the shared experts, while the expert service computes (the request's x is read, not written)
        s.sh.resize(xn);
        std::lock_guard<std::mutex> lk(compute_mutex());
        mlp_forward(*mlp, B, r.base + at, s.sh.data());
        tm[MLP_END] = wall_ns();
      }
    }
    // the answers this layer adds, in the order they come: the previous layer's deferred part, then its own
    s.y.resize(xn);
    while (true) {
      MOE_CHECK(!r.outstanding.empty(), "decode loop: no answer outstanding for the layer");
      const Expected e = r.outstanding.front();
      MOE_CHECK(e.layer == L - 1 ? e.part == 1 : e.layer == L && e.part == 0, "decode loop: answers out of order");
      void* into = e.part ? (r.late.resize(xn), r.late.data()) : s.y.data();
      ring::RespDesc got;
      std::string msg;
      const int st = ring_result(r.base, r.size, r.consumed, e.seq, e.part, into, xn, r.wait_us, r.spin_us, &got, &msg);
      if (st != 0) return {L, st, msg};
      r.consumed += 1;
      r.outstanding.pop_front();
      if (e.part) {
        tm[LATE_START] = got.start_ns, tm[LATE_END] = got.end_ns;
        continue;
      }
      tm[QUEUED_US] = int64_t(got.queued_us), tm[COMPUTE_US] = int64_t(got.compute_us);
      tm[EXPERT_START] = got.start_ns, tm[EXPERT_END] = got.end_ns;
      break;
    }
    tm[WAIT_END] = wall_ns();
    if (late_due) late = r.late.data();
    add_answer(g, h, s.y.data(), late, mlp ? s.sh.data() : nullptr, n);
  }
  {
    std::lock_guard<std::mutex> lk(compute_mutex());
    if (head) run_head(*head, layers.back().block.bf16, B, layers.back().block.H, h, logits, s);
    release_scratch();
  }
  return {n_layers, 0, ""};
}

}  // namespace moe
