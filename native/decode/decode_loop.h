// A decode step's layers in one native call (native/decode/decode_loop.cpp): each layer's attention block
// (decode_block), its routed experts (through the shared-memory ring to the expert service, or on this
// process's own kernels) and the residual add, with no Python between the layers.
#pragma once
#include <cstdint>
#include <deque>
#include <string>
#include <vector>

#include "exchange/ring.h"
#include "moe.h"

namespace moe {

// The GPU side's end of one ring session as the loop drives it, for one step. Requests go into the data block of
// their slot (the layout is the Python side's, moe_core/shm.py: x at the block's start, then ids, weights, the
// immediate output, the deferred output); posted / consumed move as the loop posts requests and reads responses,
// and `outstanding` lists the responses still to read, in order, which is also where a wait resumes.
struct Expected {
  uint64_t seq;
  int layer;
  uint32_t part;  // 0 immediate, 1 deferred
};
struct RingClient {
  uint8_t* base;
  size_t size;
  uint64_t step, posted, consumed;
  uint32_t dtype;                        // the wire code of the hidden rows' dtype
  uint64_t slot[ring::REQ_SLOTS];        // each request slot's data block
  uint64_t ids_at, w_at, out_at, def_at; // offsets in a block
  int64_t wait_us, spin_us;              // one wait's slice (then back to the caller), and how long it spins first
  std::deque<Expected> outstanding;
  std::vector<uint8_t> late;             // the previous layer's deferred answer, once read
};

// Per layer, what the loop measured (wall clock ns, the clock of time.time_ns()): the attention block's end,
// the request handed over (local experts: computed), the answer added; the ring's own Timing of the immediate part
// and the start and end of the previous layer's deferred part, read in this layer's wait (0: none, or local); the
// end of the layer's MLP (a dense layer's, SUBMIT_END and WAIT_END 0; or the shared experts', run between the
// submit and the wait; 0: none).
enum LoopTime {
  ATTENTION_END, SUBMIT_END, WAIT_END, QUEUED_US, COMPUTE_US, EXPERT_START, EXPERT_END, LATE_START, LATE_END, MLP_END,
  LOOP_TIMES
};

// One layer of the loop: its attention block, which routes on an MoE layer, and its MLP: a dense layer's (the
// block does not route), or the MoE layer's shared experts (null: none). The dense layers come first (DeepSeek's
// and GLM's first_k_dense_replace), the MoE layers after them, to the last.
struct LoopLayer {
  DecodeBlock block;
  const Mlp* mlp;
  bool second_rope;   // rotates with the step's second rope table (MiMo-V2-Flash's sliding layers' own base)
  bool second_table;  // reads the step's second block tables (a window layer's rows: the KV pool's window pool)
};

// The step's end after the last layer, where the model allows: the final RMSNorm of h (torch's rounding, in
// promote_types(h, norm) as the layer loop's native norm gives it), widened to fp32, times the packed lm_head:
// logits [B, vocab] fp32, rounded to bf16 where the norm's output is bf16 (NativeLinear's as_float). What
// Model.forward does after the layer loop, in the same calls.
struct LoopHead {
  const void* norm;  // [H]
  bool norm_bf16;
  float eps;
  const Kernels* k;  // the lm_head's kernels and matrix
  Matrix m;
};

struct LoopEnd {
  int layer;        // where it stopped (the number of layers when done)
  int status;       // 0 done; -1 a wait's slice ended with no answer (call again with waiting); else a gRPC code
  std::string msg;  // status > 0: why
};

// The step's start, where the caller hands it to the loop's call (each torch op before the call costs tens of
// microseconds a token once the experts' bytes have streamed through the caches). gather_rope_rows: each sequence's
// row of the rope tables (cos, sin, cos2, sin2: [positions, rows] in T) by its position into out [4][B][rows].
// embed_rows: h [B, H] the embedding table's rows of tokens (int64 [B]); throws for an id outside [0, vocab).
void gather_rope_rows(const void* const tables[4], int rows, bool bf16, int B, const DecodeSeq* seqs, uint8_t* out);
void embed_rows(const void* table, int64_t vocab, const int64_t* tokens, int B, int H, bool bf16, void* h);

// B sequences' new tokens through layers first.. of `layers`: h [B, H] updated in place. local: per layer the
// experts to run here (null for a dense layer; then ring is unused); else the ring's client. waiting: layer
// `first`'s request is already posted, only its answers are awaited. defer: per token, this many lowest-weighted
// experts of each MoE layer but the last come back apart and are added one layer later (the layer loop's rule).
// times [layers][LOOP_TIMES]. head and logits (both or neither): once the last layer is done, logits [B, vocab] of h
// (see LoopHead). cos2/sin2: the second rope table, for the layers marked second_rope (null: no layer is); seqs2:
// the sequences with their second block tables, for the layers marked second_table (null: no layer is).
LoopEnd decode_layers(const std::vector<LoopLayer>& layers, const std::vector<const MoELayer*>* local, RingClient* ring,
                      int first, bool waiting, int defer, int B, void* h, const void* cos, const void* sin,
                      const DecodeSeq* seqs, const DecodeSeq* seqs2, int64_t* times, const LoopHead* head = nullptr,
                      float* logits = nullptr, const void* cos2 = nullptr, const void* sin2 = nullptr);

}  // namespace moe
