// See decode_loop.h. Per layer: the attention block (which also routes), the routed experts' request written
// straight into its ring slot and the doorbell rung (or the local kernels run), the wait for the answer with the
// ring's spin-then-sleep policy, and h += y rounded as torch's add in the model dtype. The same operations as the
// torch path's Model.forward in the same order, so its tokens are the torch path's bit for bit
// (tests/test_decode_loop.py). A wait that outlasts its slice returns to the caller, which checks the session's
// lifeline and deadline and calls again: nothing here blocks for longer than a slice without the GIL given back.
#include "decode_loop.h"

#include <chrono>
#include <mutex>
#include <stdexcept>

#include "common.h"
#include "torch_rounding.h"

namespace moe {

namespace {

using namespace rounding;

int64_t wall_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

struct LoopScratch {  // per calling thread: the local path's request, and the answer read back
  std::vector<uint8_t> x, y;
  std::vector<int32_t> ids;
  std::vector<float> w;
};

template <class T>
void add_rows(T* h, const T* y, size_t n) {
  for (size_t i = 0; i < n; ++i) put(h, i, get(h, i) + get(y, i));
}

}  // namespace

LoopEnd decode_layers(const std::vector<GqaBlock>& blocks, const std::vector<const MoELayer*>* local, RingClient* ring,
                      int first, bool waiting, int B, void* h, const void* cos, const void* sin,
                      const DecodeSeq* seqs, int64_t* times) {
  const int layers = int(blocks.size());
  MOE_CHECK(first >= 0 && first <= layers && B > 0, "decode loop: bad first layer or batch");
  MOE_CHECK(local ? local->size() == blocks.size() : ring != nullptr, "decode loop: no experts to run");
  static thread_local LoopScratch s;
  for (int L = first; L < layers; ++L) {
    const GqaBlock& g = blocks[L];
    MOE_CHECK(g.gate_k != nullptr && g.top_k > 0, "decode loop: a layer without its router");
    const int k = g.top_k;
    const size_t elem = g.bf16 ? 2 : 4, xn = size_t(B) * g.H * elem, kn = size_t(B) * k * 4;
    int64_t* tm = times + size_t(L) * LOOP_TIMES;
    void* y;
    if (local) {
      s.x.resize(xn), s.y.resize(xn), s.ids.resize(size_t(B) * k), s.w.resize(size_t(B) * k);
      std::lock_guard<std::mutex> lk(compute_mutex());
      gqa_decode_block(g, B, h, cos, sin, seqs, s.x.data(), s.ids.data(), s.w.data());
      tm[ATTENTION_END] = wall_ns();
      try {
        moe_forward_part(*(*local)[L], s.x.data(), g.bf16, s.ids.data(), s.w.data(), s.y.data(), g.bf16, B, k, 0, 0);
      } catch (const std::invalid_argument& e) {
        release_scratch();
        return {L, ring::INVALID_ARGUMENT, e.what()};
      }
      tm[SUBMIT_END] = tm[WAIT_END] = wall_ns();
      tm[QUEUED_US] = tm[COMPUTE_US] = tm[EXPERT_START] = tm[EXPERT_END] = 0;
      y = s.y.data();
    } else {
      RingClient& r = *ring;
      if (!(waiting && L == first)) {
        const uint64_t seq = r.posted, at = r.slot[seq % ring::REQ_SLOTS];
        MOE_CHECK(at + r.out_at + xn <= r.size && r.ids_at >= xn && r.w_at >= r.ids_at + kn && r.out_at >= r.w_at + kn,
                  "decode loop: the request does not fit its ring slot");
        {
          std::lock_guard<std::mutex> lk(compute_mutex());
          gqa_decode_block(g, B, h, cos, sin, seqs, r.base + at, reinterpret_cast<int32_t*>(r.base + at + r.ids_at),
                           reinterpret_cast<float*>(r.base + at + r.w_at));
        }
        tm[ATTENTION_END] = wall_ns();
        const ring::ReqDesc d{seq, r.step, uint32_t(L), uint32_t(B), uint32_t(k), 0, r.dtype, 0,
                              {{at, xn}, {at + r.ids_at, kn}, {at + r.w_at, kn}, {at + r.out_at, xn}, {0, 0}}};
        ring_submit(r.base, d, nullptr, nullptr, nullptr, uint32_t(seq + 1));  // already in place: the descriptor, ring
        r.posted = seq + 1;
        tm[SUBMIT_END] = wall_ns();
      }
      s.y.resize(xn);
      ring::RespDesc got;
      std::string msg;
      const int st = ring_result(r.base, r.size, r.consumed, r.posted - 1, 0, s.y.data(), xn, r.wait_us, r.spin_us,
                                 &got, &msg);
      if (st != 0) return {L, st, msg};
      r.consumed += 1;
      tm[WAIT_END] = wall_ns();
      tm[QUEUED_US] = int64_t(got.queued_us), tm[COMPUTE_US] = int64_t(got.compute_us);
      tm[EXPERT_START] = got.start_ns, tm[EXPERT_END] = got.end_ns;
      y = s.y.data();
    }
    // the torch path's h = h + y, in the model dtype
    if (g.bf16)
      add_rows(static_cast<uint16_t*>(h), static_cast<const uint16_t*>(y), size_t(B) * g.H);
    else
      add_rows(static_cast<float*>(h), static_cast<const float*>(y), size_t(B) * g.H);
  }
  {
    std::lock_guard<std::mutex> lk(compute_mutex());
    release_scratch();
  }
  return {layers, 0, ""};
}

}  // namespace moe
