// See ring.h. Every offset a descriptor carries is checked against the region before use; anything
// this loop does not handle goes back to Python, which answers it (errors included) the same way.
#include "exchange/ring.h"

#include <cstring>

#include "exchange/doorbell.h"
#include "runtime/common.h"

namespace moe {

using namespace ring;

static std::atomic<uint32_t>* word(uint8_t* base, size_t off) {
  return reinterpret_cast<std::atomic<uint32_t>*>(base + off);
}

// Inside the data area (overflow-safe: no off + n), of the size the shape needs, and aligned:
// the kernels read int32/fp32 (and vectors) straight from these spans.
static bool span_ok(const Span& s, uint64_t want, size_t size) {
  return s.off >= DATA_START && s.off % SPAN_ALIGN == 0 && s.off <= size && s.n <= size - s.off && s.n == want;
}

RingServer::RingServer(uint8_t* base, size_t size, int hidden, int max_tokens, int max_k, uint32_t code_f32,
                       uint32_t code_bf16)
    : base_(base), size_(size), hidden_(hidden), max_tokens_(max_tokens), max_k_(max_k), code_f32_(code_f32),
      code_bf16_(code_bf16) {
  MOE_CHECK(size > DATA_START, "region too small");
  MOE_CHECK(max_k >= 1 && max_k <= MAX_K, "max_k outside [1, " + std::to_string(MAX_K) + "]");
}

bool RingServer::closed() const { return stop_ || word(base_, CLOSED)->load(std::memory_order_acquire) != 0; }

void RingServer::stop() {
  stop_ = true;
  doorbell_wake(word(base_, REQ_SEQ));
  doorbell_wake(word(base_, RESP_READ));
}

bool RingServer::respond(uint64_t seq, uint32_t part, uint32_t status, Span out, uint64_t queued_us,
                         uint64_t compute_us, int64_t start_ns, int64_t end_ns, const std::string& msg) {
  const uint64_t j = responses_;
  // a correct peer never has more than RESP_SLOTS unread; a broken one stalls only its own session
  for (int waited = 0;; ++waited) {
    uint32_t read = word(base_, RESP_READ)->load(std::memory_order_acquire);
    if (uint32_t(j - read) < uint32_t(RESP_SLOTS)) break;
    if (closed() || waited > 3000) return false;
    doorbell_wait(word(base_, RESP_READ), read, 10000, 0);
  }
  RespDesc d{seq, part, status, out, queued_us, compute_us, start_ns, end_ns, uint32_t(std::min(msg.size(), MSG_MAX)), 0};
  uint8_t* p = base_ + resp_desc(j);
  std::memcpy(p, &d, sizeof d);
  std::memcpy(p + sizeof d, msg.data(), d.msg_len);
  responses_ = j + 1;
  doorbell_ring(word(base_, RESP_SEQ), uint32_t(responses_));
  return true;
}

bool RingServer::run_native(uint64_t seq, int64_t t_recv, std::vector<PartLog>* log) {
  ReqDesc d;
  std::memcpy(&d, base_ + req_desc(seq), sizeof d);  // one copy: the peer may scribble on it meanwhile
  auto it = layers_.find(int(d.layer));
  const bool bf16 = d.dtype == code_bf16_;
  if (d.seq != seq || it == layers_.end() || !(bf16 || d.dtype == code_f32_) || d.k < 1 || d.k > uint32_t(max_k_) ||
      d.defer >= d.k || d.T > uint32_t(max_tokens_))
    return false;
  const uint64_t xb = uint64_t(d.T) * hidden_ * (bf16 ? 2 : 4), ib = uint64_t(d.T) * d.k * 4;
  if (!span_ok(d.span[0], xb, size_) || !span_ok(d.span[1], ib, size_) || !span_ok(d.span[2], ib, size_) ||
      !span_ok(d.span[3], xb, size_) || (d.defer && !span_ok(d.span[4], xb, size_)))
    return false;
  const MoELayer& l = it->second;
  const MoEWeights& m = l.w;
  if (m.E <= 0 || m.H != hidden_) return false;
  int64_t queued = 0;
  for (uint32_t part = 0; part < (d.defer ? 2u : 1u); ++part) {
    int64_t t0, t1;
    uint32_t status = 0;
    std::string msg;
    {
      std::lock_guard<std::mutex> g(compute_mutex());
      t0 = wall_ns();
      try {
        moe_forward_part(l, base_ + d.span[0].off, bf16, reinterpret_cast<const int32_t*>(base_ + d.span[1].off),
                         reinterpret_cast<const float*>(base_ + d.span[2].off), base_ + d.span[3 + part].off, bf16,
                         int(d.T), int(d.k), int(d.defer), int(part));
      } catch (const std::invalid_argument& e) {
        if (part == 0) return false;  // bad values: Python answers with the message (nothing was posted)
        status = INVALID_ARGUMENT;    // the peer changed the inputs after part 0 took them
        msg = e.what();
      } catch (const std::exception& e) {
        status = INTERNAL;  // for this request alone: the ring goes on
        msg = std::string("expert kernels failed: ") + e.what();
      }
      release_scratch();
      t1 = wall_ns();
    }
    if (part == 0) queued = std::max<int64_t>(0, t0 - t_recv);
    const Span out = status ? Span{0, 0} : d.span[3 + part];
    if (!respond(seq, part, status, out, uint64_t(queued / 1000), uint64_t((t1 - t0) / 1000), t0, t1, msg))
      return true;  // closed: nothing more to do for it
    if (status) return true;
    log->push_back({d.layer, part, d.T, t0, t1, queued});
  }
  return true;
}

Served RingServer::serve(int64_t timeout_us, int64_t spin_us, uint64_t* seq, std::vector<PartLog>* log) {
  if (pending_python_) {  // the caller answered the request it was handed
    pending_python_ = false;
    ++served_;
  }
  const int64_t until = wall_ns() + timeout_us * 1000;
  while (!closed()) {
    const uint32_t posted = doorbell_wait(word(base_, REQ_SEQ), uint32_t(served_), timeout_us, spin_us);
    if (closed()) break;
    while (posted != uint32_t(served_)) {
      if (!run_native(served_, wall_ns(), log)) {
        *seq = served_;
        pending_python_ = true;
        return Served::ForPython;
      }
      ++served_;
      if (closed()) return Served::Closed;
    }
    if (wall_ns() > until) return Served::Idle;  // let the caller publish metrics now and then
  }
  return Served::Closed;
}

void ring_submit(uint8_t* base, const ReqDesc& d, const void* x, const void* ids, const void* w, uint32_t posted) {
  // a null source is already in place: the caller copied it from the GPU straight into the (pinned) region
  if (x) std::memcpy(base + d.span[0].off, x, d.span[0].n);
  if (ids) std::memcpy(base + d.span[1].off, ids, d.span[1].n);
  if (w) std::memcpy(base + d.span[2].off, w, d.span[2].n);
  std::memcpy(base + req_desc(d.seq), &d, sizeof d);
  doorbell_ring(word(base, REQ_SEQ), posted);
}

int ring_result(uint8_t* base, size_t size, uint64_t j, uint64_t seq, uint32_t part, void* out, uint64_t n,
                int64_t timeout_us, int64_t spin_us, RespDesc* got, std::string* msg) {
  if (doorbell_wait(word(base, RESP_SEQ), uint32_t(j), timeout_us, spin_us) == uint32_t(j)) return -1;
  std::memcpy(got, base + resp_desc(j), sizeof *got);
  if (got->status) {
    msg->assign(reinterpret_cast<const char*>(base + resp_desc(j) + sizeof *got), std::min<size_t>(got->msg_len, MSG_MAX));
    return int(got->status);
  }
  if (got->seq != seq || got->part != part) {
    *msg = "ring out of order: wanted part " + std::to_string(part) + " of request " + std::to_string(seq) +
           ", got part " + std::to_string(got->part) + " of request " + std::to_string(got->seq);
    return INTERNAL;
  }
  if (!span_ok(got->out, n, size)) {
    *msg = "response span outside the region or of the wrong size";
    return INTERNAL;
  }
  std::memcpy(out, base + got->out.off, n);
  word(base, RESP_READ)->store(uint32_t(j + 1), std::memory_order_release);
  return OK;
}

}  // namespace moe
