// The shared-memory exchange ring's hot path in C++ (layout: moe_core/shm.py, checked against
// ring_layout() by the tests): the expert side's serving loop and the GPU side's submit / result.
#pragma once
#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "moe.h"
#include "runtime/common.h"

namespace moe {

namespace ring {
constexpr size_t REQ_SEQ = 64, RESP_SEQ = 128, RESP_READ = 192, CLOSED = 256, DESC_START = 4096;
constexpr int REQ_SLOTS = 4, RESP_SLOTS = 8;
constexpr size_t REQ_DESC_SIZE = 256, RESP_DESC_SIZE = 384, MSG_MAX = 256;
constexpr size_t DATA_START = 8192;  // DESC_START + descriptors, page-rounded
constexpr size_t SPAN_ALIGN = 64;    // every tensor span starts on a cache line

// A response's status: gRPC's status codes, so both ends and the gRPC path speak one encoding.
enum Status : uint32_t { OK = 0, INVALID_ARGUMENT = 3, INTERNAL = 13 };

struct Span {
  uint64_t off, n;
};
struct ReqDesc {  // hidden, ids, weights, immediate out, deferred out
  uint64_t seq, step;
  uint32_t layer, T, k, defer, dtype, pad;
  Span span[5];
};
struct RespDesc {
  uint64_t seq;
  uint32_t part, status;
  Span out;
  uint64_t queued_us, compute_us;
  int64_t start_ns, end_ns;
  uint32_t msg_len, pad;
};
static_assert(sizeof(ReqDesc) == 120 && sizeof(RespDesc) == 72, "descriptor layout");

inline size_t req_desc(uint64_t i) { return DESC_START + (i % REQ_SLOTS) * REQ_DESC_SIZE; }
inline size_t resp_desc(uint64_t j) {
  return DESC_START + REQ_SLOTS * REQ_DESC_SIZE + (j % RESP_SLOTS) * RESP_DESC_SIZE;
}
}  // namespace ring

// Wall-clock ns, the clock of Python's time.time_ns(): the timings both ends of the ring report.
inline int64_t wall_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// What one serve() call ends with (the Python side's ServeKind).
enum class Served { Idle = 0, Closed = 1, ForPython = 2 };

struct PartLog {  // one computed part, for the Python side's metrics
  uint32_t layer, part, tokens;
  int64_t start_ns, end_ns, queued_ns;
};

class RingServer {
 public:
  // max_k: the experts a token may name (the model's top-k); larger requests go to Python, which names the error.
  RingServer(uint8_t* base, size_t size, int hidden, int max_tokens, int max_k, uint32_t code_f32, uint32_t code_bf16);
  void add_layer(int layer, const MoELayer& m) { layers_[layer] = m; }
  // Serve requests until: the ring closes or stop() (Closed), nothing came for timeout_us or
  // timeout_us passed while busy (Idle), or a request this loop does not run (an invalid one,
  // an fp16 one, a layer without native weights: ForPython, its seq in *seq; the caller serves
  // it and answers through respond()).
  Served serve(int64_t timeout_us, int64_t spin_us, uint64_t* seq, std::vector<PartLog>* log);
  // Post one response (in order); blocks while the peer has RESP_SLOTS unread. False if the ring closed.
  bool respond(uint64_t seq, uint32_t part, uint32_t status, ring::Span out, uint64_t queued_us, uint64_t compute_us,
               int64_t start_ns, int64_t end_ns, const std::string& msg);
  void stop();
  uint64_t served() const { return served_; }

 private:
  bool closed() const;
  bool run_native(uint64_t seq, int64_t t_recv, std::vector<PartLog>* log);
  uint8_t* base_;
  size_t size_;
  int hidden_, max_tokens_, max_k_;
  uint32_t code_f32_, code_bf16_;
  std::map<int, MoELayer> layers_;
  uint64_t served_ = 0, responses_ = 0;
  bool pending_python_ = false;  // the request at served_ was handed to the caller
  std::atomic<bool> stop_{false};
};

// GPU side: copy the tensors into their spans, write the descriptor, ring (one call per layer).
void ring_submit(uint8_t* base, const ring::ReqDesc& d, const void* x, const void* ids, const void* w,
                 uint32_t posted);
// Wait for response j, check it is (seq, part) and well-formed, copy its output to `out` (n bytes).
// Returns the status (Status: 0 ok); on status != 0 fills *msg. -1: timed out / ring closed (caller
// checks its lifeline and calls again).
int ring_result(uint8_t* base, size_t size, uint64_t j, uint64_t seq, uint32_t part, void* out, uint64_t n,
                int64_t timeout_us, int64_t spin_us, ring::RespDesc* got, std::string* msg);

}  // namespace moe
