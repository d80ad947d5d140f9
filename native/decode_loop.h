// A decode step's layers in one native call (native/decode_loop.cpp): each layer's attention block
// (gqa_decode_block), its routed experts (through the shared-memory ring to the expert service, or on this
// process's own kernels) and the residual add, with no Python between the layers.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "moe.h"
#include "ring.h"

namespace moe {

// The GPU side's end of one ring session as the loop drives it. Requests go into the data block of their slot
// (the layout is the Python side's, moe_core/shm.py: x at the block's start, then ids, weights, the output);
// posted / consumed move as the loop posts requests and reads responses.
struct RingClient {
  uint8_t* base;
  size_t size;
  uint64_t step, posted, consumed;
  uint32_t dtype;                   // the wire code of the hidden rows' dtype
  uint64_t slot[ring::REQ_SLOTS];   // each request slot's data block
  uint64_t ids_at, w_at, out_at;    // offsets in a block
  int64_t wait_us, spin_us;         // one wait's slice (then back to the caller), and how long it spins first
};

// Per layer, what the loop measured (wall clock ns, the clock of time.time_ns()): the attention block's end,
// the request handed over (local experts: computed), the answer added; then the ring's own Timing of it.
enum LoopTime { ATTENTION_END, SUBMIT_END, WAIT_END, QUEUED_US, COMPUTE_US, EXPERT_START, EXPERT_END, LOOP_TIMES };

struct LoopEnd {
  int layer;        // where it stopped (the number of layers when done)
  int status;       // 0 done; -1 a wait's slice ended with no answer (call again with waiting); else a gRPC code
  std::string msg;  // status > 0: why
};

// B sequences' new tokens through layers first.. of `blocks` (each an MoE layer whose block routes): h [B, H]
// updated in place. local: per layer the experts to run here (then ring is unused); else the ring's client.
// waiting: layer `first`'s request is already posted, only its answer is awaited. times [layers][LOOP_TIMES].
LoopEnd decode_layers(const std::vector<GqaBlock>& blocks, const std::vector<const MoELayer*>* local, RingClient* ring,
                      int first, bool waiting, int B, void* h, const void* cos, const void* sin,
                      const DecodeSeq* seqs, int64_t* times);

}  // namespace moe
