// The decode step's bindings: the routers, an attention block's weights (DecodeBlock), a SwiGLU MLP, and the
// decode loop with its experts (in this process, or through a ring client) (native/decode/).
#include <array>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bindings/bindings.h"
#include "decode/decode_loop.h"
#include "exchange/ring.h"
#include "kernels/kernels.h"
#include "moe.h"
#include "runtime/common.h"

namespace moe {

namespace {

struct BoundDecodeBlock {
  DecodeBlock g;
  py::object owner;
};
// A block's router (DecodeBlock's fields): softmax over a packed gate, sigmoid over an fp32 weight, or none
void bind_router(DecodeBlock& g, const py::object& gate, int top_k, bool norm_topk, bool round_w, uintptr_t w32,
                 uintptr_t bias32, bool softmax32, int E, int n_group, int topk_group, float scaling) {
  MOE_CHECK(gate.is_none() || !w32, "decode block: one router, softmax in T (gate) or on fp32 logits (w32)");
  MOE_CHECK(!softmax32 || !bias32, "decode block: the fp32 softmax router takes no correction bias");
  g.softmax32 = softmax32;
  if (!gate.is_none()) {
    const BoundLinear& r = gate.cast<const BoundLinear&>();
    g.gate_k = r.k, g.gate = r.m;
  }
  if (w32) {
    g.w32 = reinterpret_cast<const float*>(w32), g.bias32 = reinterpret_cast<const float*>(bias32);
    g.E = E, g.n_group = n_group, g.topk_group = topk_group, g.scaling = scaling;
  }
  g.top_k = top_k, g.norm_topk = norm_topk, g.round_w = round_w;
}
// The step's sequences as the Python side passes them: int64 [B, 3] (block table address, position, first
// consecutive block or -1)
std::vector<DecodeSeq> decode_seqs(uintptr_t seqs, int B) {
  const int64_t* rows = reinterpret_cast<const int64_t*>(seqs);
  std::vector<DecodeSeq> sq(B > 0 ? B : 0);
  for (int t = 0; t < B; ++t)
    sq[t] = DecodeSeq{reinterpret_cast<const int32_t*>(rows[3 * t]), int32_t(rows[3 * t + 1]),
                      int32_t(rows[3 * t + 2])};
  return sq;
}
struct BoundMlp {
  Mlp m;
  py::object owner;
};
struct BoundDecodeLoop {  // the blocks with their layers of the KV pool bound, and the MLPs; the head, once set
  std::vector<LoopLayer> layers;
  py::object owner;
  bool has_head = false;
  LoopHead head{};
  py::object head_owner;
};
struct BoundLocalExperts {  // per layer, the experts the decode loop runs in this process
  std::vector<const MoELayer*> layers;
  py::object owner;
};
struct BoundRingClient {
  RingClient c;
  py::object region;
};

}  // namespace

void bind_decode(py::module_& m) {
  m.def(
      "softmax_topk",
      [](uintptr_t logits, int B, int E, int k, bool norm_topk, bool round_bf16, uintptr_t ids, uintptr_t weights,
         int n_group, int topk_group, float scaling) {
        softmax_topk(reinterpret_cast<const float*>(logits), B, E, k, norm_topk, round_bf16,
                     reinterpret_cast<int32_t*>(ids), reinterpret_cast<float*>(weights), n_group, topk_group, scaling);
      },
      py::arg("logits"), py::arg("B"), py::arg("E"), py::arg("k"), py::arg("norm_topk"), py::arg("round_bf16"),
      py::arg("ids"), py::arg("weights"), py::arg("n_group") = 1, py::arg("topk_group") = 1, py::arg("scaling") = 1.f,
      "the softmax router's top-k choice, optionally within the best groups (native/decode/decode_step.cpp)");
  m.def(
      "sigmoid_topk",
      [](uintptr_t logits, uintptr_t bias, int B, int E, int k, int n_group, int topk_group, bool norm_topk,
         float scaling, uintptr_t ids, uintptr_t weights) {
        sigmoid_topk(reinterpret_cast<const float*>(logits), reinterpret_cast<const float*>(bias), B, E, k, n_group,
                     topk_group, norm_topk, scaling, reinterpret_cast<int32_t*>(ids), reinterpret_cast<float*>(weights));
      },
      py::arg("logits"), py::arg("bias"), py::arg("B"), py::arg("E"), py::arg("k"), py::arg("n_group"),
      py::arg("topk_group"), py::arg("norm_topk"), py::arg("scaling"), py::arg("ids"), py::arg("weights"),
      "the sigmoid router's top-k choice (bias 0: none; native/decode/decode_step.cpp)");
  // a GQA block's decode step (native/decode/decode_step.cpp): the weights bound once, the pool layer and sequences per call
  py::class_<BoundDecodeBlock>(m, "DecodeBlock", "one attention block's weights for its native decode step")
      .def(py::init([](const std::string& isa, bool bf16, const BoundLinear& qkv, const BoundLinear& o,
                       uintptr_t in_norm, uintptr_t post_norm, uintptr_t q_norm, uintptr_t k_norm, uintptr_t q_bias,
                       uintptr_t k_bias, uintptr_t v_bias, uintptr_t o_bias, int H, int nh, int nkv, int d, int rot,
                       float eps, float scale, py::object gate, int top_k, bool norm_topk, bool round_w,
                       uintptr_t w32, uintptr_t bias32, bool softmax32, int E, int n_group, int topk_group, float scaling,
                       int dv, float v_scale, int window, uintptr_t sinks, py::object owner) {
             DecodeBlock g{};
             bind_router(g, gate, top_k, norm_topk, round_w, w32, bias32, softmax32, E, n_group, topk_group, scaling);
             g.isa = kernel_isa(isa);
             g.bf16 = bf16;
             g.qkv_k = qkv.k;
             g.qkv = qkv.m;
             g.o_k = o.k;
             g.o = o.m;
             auto ptr = [](uintptr_t p) { return reinterpret_cast<const void*>(p); };
             g.in_norm = ptr(in_norm), g.post_norm = ptr(post_norm), g.q_norm = ptr(q_norm), g.k_norm = ptr(k_norm);
             g.q_bias = ptr(q_bias), g.k_bias = ptr(k_bias), g.v_bias = ptr(v_bias), g.o_bias = ptr(o_bias);
             g.H = H, g.nh = nh, g.nkv = nkv, g.d = d, g.rot = rot, g.eps = eps, g.scale = scale;
             g.dv = dv ? dv : d, g.v_scale = v_scale, g.window = window;
             g.sinks = reinterpret_cast<const float*>(sinks);
             return BoundDecodeBlock{g, std::move(owner)};
           }),
           py::arg("isa"), py::arg("bf16"), py::arg("qkv"), py::arg("o"), py::arg("in_norm"), py::arg("post_norm"),
           py::arg("q_norm"), py::arg("k_norm"), py::arg("q_bias"), py::arg("k_bias"), py::arg("v_bias"),
           py::arg("o_bias"), py::arg("H"), py::arg("nh"), py::arg("nkv"), py::arg("d"), py::arg("rot"), py::arg("eps"),
           py::arg("scale"), py::arg("gate") = py::none(), py::arg("top_k") = 0, py::arg("norm_topk") = false,
           py::arg("round_w") = false, py::arg("w32") = 0, py::arg("bias32") = 0, py::arg("softmax32") = false, py::arg("E") = 0,
           py::arg("n_group") = 1, py::arg("topk_group") = 1, py::arg("scaling") = 1.f, py::arg("dv") = 0,
           py::arg("v_scale") = 1.f, py::arg("window") = 0, py::arg("sinks") = 0, py::arg("owner") = py::none())
      .def_static(
          "mla",
          [](const std::string& isa, bool bf16, py::object q_a, const BoundLinear& q_b, const BoundLinear& kv_a,
             const BoundLinear& o, uintptr_t kv_b, bool kv_b_bf16, uintptr_t in_norm, uintptr_t post_norm,
             uintptr_t q_a_norm, uintptr_t kv_a_norm, uintptr_t q_a_bias, uintptr_t kv_a_bias, uintptr_t o_bias, int H,
             int nh, int r, int dn, int dr, int dv, bool interleave, float eps, float scale, py::object gate, int top_k,
             bool norm_topk, bool round_w, uintptr_t w32, uintptr_t bias32, bool softmax32, int E, int n_group, int topk_group,
             float scaling, py::object owner) {
            DecodeBlock g{};
            bind_router(g, gate, top_k, norm_topk, round_w, w32, bias32, softmax32, E, n_group, topk_group, scaling);
            g.isa = kernel_isa(isa);
            g.bf16 = bf16;
            g.mla = true;
            MlaPart& m = g.m;
            if (!q_a.is_none()) {
              const BoundLinear& a = q_a.cast<const BoundLinear&>();
              m.q_a_k = a.k, m.q_a = a.m;
            }
            m.q_b_k = q_b.k, m.q_b = q_b.m, m.kv_a_k = kv_a.k, m.kv_a = kv_a.m;
            g.o_k = o.k, g.o = o.m;
            auto ptr = [](uintptr_t p) { return reinterpret_cast<const void*>(p); };
            m.kv_b = ptr(kv_b), m.kv_b_bf16 = kv_b_bf16, m.interleave = interleave;
            m.q_a_norm = ptr(q_a_norm), m.kv_a_norm = ptr(kv_a_norm), m.q_a_bias = ptr(q_a_bias);
            m.kv_a_bias = ptr(kv_a_bias);
            m.r = r, m.dn = dn, m.dr = dr, m.dv = dv;
            g.in_norm = ptr(in_norm), g.post_norm = ptr(post_norm), g.o_bias = ptr(o_bias);
            g.H = H, g.nh = nh, g.nkv = 1, g.d = dn + dr, g.dv = g.d, g.rot = dr, g.eps = eps, g.scale = scale;
            g.v_scale = 1.f;
            return BoundDecodeBlock{g, std::move(owner)};
          },
          py::arg("isa"), py::arg("bf16"), py::arg("q_a"), py::arg("q_b"), py::arg("kv_a"), py::arg("o"),
          py::arg("kv_b"), py::arg("kv_b_bf16"), py::arg("in_norm"), py::arg("post_norm"), py::arg("q_a_norm"),
          py::arg("kv_a_norm"), py::arg("q_a_bias"), py::arg("kv_a_bias"), py::arg("o_bias"), py::arg("H"),
          py::arg("nh"), py::arg("r"), py::arg("dn"), py::arg("dr"), py::arg("dv"), py::arg("interleave"),
          py::arg("eps"), py::arg("scale"), py::arg("gate") = py::none(), py::arg("top_k") = 0,
          py::arg("norm_topk") = false, py::arg("round_w") = false, py::arg("w32") = 0, py::arg("bias32") = 0,
          py::arg("softmax32") = false, py::arg("E") = 0, py::arg("n_group") = 1, py::arg("topk_group") = 1,
          py::arg("scaling") = 1.f, py::arg("owner") = py::none(),
          "one MLA attention block's weights (DeepSeek V2/V3) for its native decode step: q_a None where the model "
          "has q_proj alone (q_b then); kv_b: kv_b_proj's plain weight; the pool's K and V its latents and rotary "
          "keys")
      .def_property_readonly("routes", [](const BoundDecodeBlock& b) { return b.g.routes(); })
      .def(
          "run",
          [](const BoundDecodeBlock& b, int B, uintptr_t h, uintptr_t cos, uintptr_t sin, uintptr_t K, uintptr_t V,
             int kv, size_t kv_head, size_t kv_block, int block_shift, uintptr_t seqs, uintptr_t x_out, uintptr_t ids,
             uintptr_t weights, size_t v_head, size_t v_block) {
            DecodeBlock g = b.g;
            g.K = reinterpret_cast<void*>(K), g.V = reinterpret_cast<void*>(V), g.kv = kv_type(kv);
            g.kv_head = kv_head, g.kv_block = kv_block, g.block_shift = block_shift;
            g.v_head = v_head ? v_head : kv_head, g.v_block = v_block ? v_block : kv_block;  // (0: K's)
            std::vector<DecodeSeq> sq = decode_seqs(seqs, B);
            py::gil_scoped_release nogil;
            std::lock_guard<std::mutex> lk(compute_mutex());
            decode_block(g, B, reinterpret_cast<void*>(h), reinterpret_cast<const void*>(cos),
                             reinterpret_cast<const void*>(sin), sq.data(), reinterpret_cast<void*>(x_out),
                             reinterpret_cast<int32_t*>(ids), reinterpret_cast<float*>(weights));
            release_scratch();
          },
          py::arg("B"), py::arg("h"), py::arg("cos"), py::arg("sin"), py::arg("K"), py::arg("V"), py::arg("kv"),
          py::arg("kv_head"), py::arg("kv_block"), py::arg("block_shift"), py::arg("seqs"), py::arg("x_out"), py::arg("ids") = 0,
          py::arg("weights") = 0, py::arg("v_head") = 0, py::arg("v_block") = 0,
          "B sequences' decode step of the block: h [B, H] updated in place, x_out [B, H] its post-attention norm; "
          "kv: the pool's element type (moe_kernels.attention.KV_CODES); seqs int64 [B, 3] (block table address, position, first consecutive block or -1)");
  py::class_<BoundMlp>(m, "Mlp", "a SwiGLU MLP's decode rows (a dense layer, shared experts; native/decode/decode_mlp.cpp)")
      .def(py::init([](bool bf16, const BoundLinear& gate_up, const BoundLinear& down, py::object gate,
                       py::object owner) {
             Mlp m{bf16, gate_up.k, gate_up.m, down.k, down.m, nullptr, {}};
             if (!gate.is_none()) {
               const BoundLinear& g = gate.cast<const BoundLinear&>();
               m.gate_k = g.k, m.gate = g.m;
             }
             check_mlp(m);
             return BoundMlp{m, std::move(owner)};
           }),
           py::arg("bf16"), py::arg("gate_up"), py::arg("down"), py::arg("gate") = py::none(),
           py::arg("owner") = py::none())
      .def(
          "forward",
          [](const BoundMlp& b, int B, uintptr_t x, uintptr_t y) {
            py::gil_scoped_release nogil;
            std::lock_guard<std::mutex> lk(compute_mutex());
            mlp_forward(b.m, B, reinterpret_cast<const void*>(x), reinterpret_cast<void*>(y));
            release_scratch();
          },
          py::arg("B"), py::arg("x"), py::arg("y"), "x [B, H] -> y [B, H], both in the model dtype");
  py::class_<BoundLocalExperts>(m, "LocalExperts", "the decode loop's experts run in this process, one MoELayer a layer")
      .def(py::init([](const std::vector<py::object>& layers, py::object owner) {
             BoundLocalExperts e{{}, std::move(owner)};
             for (const py::object& l : layers)
               e.layers.push_back(l.is_none() ? nullptr : &l.cast<const BoundMoELayer&>().layer);
             return e;
           }),
           py::arg("layers"), py::arg("owner"), "layers: a MoELayer a layer, None for a dense one; owner: keeps them "
           "alive");
  py::class_<BoundRingClient>(m, "RingClient", "the GPU side's end of a ring session as the decode loop drives it")
      .def(py::init([](py::buffer region, uint64_t step, uint64_t posted, uint64_t consumed, uint32_t dtype,
                       const std::vector<uint64_t>& slots, uint64_t ids_at, uint64_t w_at, uint64_t out_at,
                       uint64_t def_at, int64_t wait_us, int64_t spin_us) {
             auto [p, n] = writable(region);
             MOE_CHECK(slots.size() == size_t(ring::REQ_SLOTS), "ring client: one data block per request slot");
             RingClient c{p, n, step, posted, consumed, dtype, {}, ids_at, w_at, out_at, def_at, wait_us, spin_us, {}, {}};
             for (int i = 0; i < ring::REQ_SLOTS; ++i) {
               MOE_CHECK(slots[i] >= ring::DATA_START && slots[i] % ring::SPAN_ALIGN == 0 && slots[i] <= n,
                         "ring client: a data block outside the region");
               c.slot[i] = slots[i];
             }
             return BoundRingClient{c, region};
           }),
           py::arg("region"), py::arg("step"), py::arg("posted"), py::arg("consumed"), py::arg("dtype"),
           py::arg("slots"), py::arg("ids_at"), py::arg("w_at"), py::arg("out_at"), py::arg("def_at"),
           py::arg("wait_us"), py::arg("spin_us"))
      .def_property_readonly("outstanding",
                             [](const BoundRingClient& r) {
                               std::vector<std::tuple<uint64_t, int, bool>> out;
                               for (const Expected& e : r.c.outstanding) out.emplace_back(e.seq, e.layer, e.part != 0);
                               return out;
                             },
                             "the responses still to read, in order: (request seq, layer, deferred)")
      .def_property_readonly("posted", [](const BoundRingClient& r) { return r.c.posted; })
      .def_property_readonly("consumed", [](const BoundRingClient& r) { return r.c.consumed; });
  py::class_<BoundDecodeLoop>(m, "DecodeLoop", "a decode step's layers in one call (native/decode/decode_loop.h)")
      .def(py::init([](const std::vector<const BoundDecodeBlock*>& blocks, const std::vector<py::object>& mlps,
                       const std::vector<uintptr_t>& K, const std::vector<uintptr_t>& V, int kv,
                       const std::vector<std::array<size_t, 4>>& strides, int block_shift,
                       const std::vector<bool>& second_rope, py::object owner, const std::vector<bool>& second_table) {
             const size_t n = blocks.size();
             MOE_CHECK(K.size() == n && V.size() == n && mlps.size() == n && strides.size() == n &&
                           second_rope.size() == n && (second_table.empty() || second_table.size() == n),
                       "decode loop: one K, V, MLP (or None), strides, rope and table choice a layer");
             BoundDecodeLoop l{{}, std::move(owner)};
             for (size_t i = 0; i < n; ++i) {
               DecodeBlock g = blocks[i]->g;
               g.K = reinterpret_cast<void*>(K[i]), g.V = reinterpret_cast<void*>(V[i]), g.kv = kv_type(kv);
               g.kv_head = strides[i][0], g.kv_block = strides[i][1], g.block_shift = block_shift;
               g.v_head = strides[i][2], g.v_block = strides[i][3];
               l.layers.push_back({g, mlps[i].is_none() ? nullptr : &mlps[i].cast<const BoundMlp&>().m,
                                   bool(second_rope[i]), !second_table.empty() && bool(second_table[i])});
             }
             return l;
           }),
           py::arg("blocks"), py::arg("mlps"), py::arg("K"), py::arg("V"), py::arg("kv"), py::arg("strides"),
           py::arg("block_shift"), py::arg("second_rope"), py::arg("owner"),
           py::arg("second_table") = std::vector<bool>(),
           "mlps: per layer a dense layer's MLP or the shared experts (Mlp), or None; strides: per layer its K's "
           "elements between heads and between blocks, then its V's; second_rope: per layer whether it rotates with "
           "run's cos2/sin2; owner: keeps the blocks, the MLPs and the pool alive; second_table: per layer whether it "
           "reads run's seqs2 (a window layer's window pool; empty: none)")
      .def(
          "run",
          [](const BoundDecodeLoop& l, int B, uintptr_t h, uintptr_t cos, uintptr_t sin, uintptr_t seqs,
             uintptr_t times, int first, bool waiting, int defer, py::object experts, uintptr_t logits,
             uintptr_t cos2, uintptr_t sin2, int rope_rows, uintptr_t tokens, uintptr_t embed, int64_t vocab,
             uintptr_t seqs2) {
            MOE_CHECK(!logits || l.has_head, "decode loop: logits asked for, but no head set");
            MOE_CHECK(!l.layers.empty() && B > 0 && rope_rows >= 0, "decode loop: no layers, sequences or rope width");
            const std::vector<const MoELayer*>* local = nullptr;
            RingClient* ring = nullptr;
            if (py::isinstance<BoundLocalExperts>(experts))
              local = &experts.cast<const BoundLocalExperts&>().layers;
            else
              ring = &experts.cast<BoundRingClient&>().c;
            std::vector<DecodeSeq> sq = decode_seqs(seqs, B), sq2 = decode_seqs(seqs2, seqs2 ? B : 0);
            // the step's start here where the caller asks (decode_loop.h): rope_rows > 0: cos, sin, cos2, sin2 are
            // whole tables, each sequence's rows gathered by its position; embed: h's rows, on a step's first call only
            const DecodeBlock& g0 = l.layers[0].block;
            thread_local std::vector<uint8_t> rope;
            if (rope_rows) {
              const size_t part = size_t(B) * rope_rows * (g0.bf16 ? 2 : 4);
              const void* const tables[4] = {reinterpret_cast<const void*>(cos), reinterpret_cast<const void*>(sin),
                                             reinterpret_cast<const void*>(cos2 ? cos2 : cos),
                                             reinterpret_cast<const void*>(sin2 ? sin2 : sin)};
              rope.resize(4 * part);
              gather_rope_rows(tables, rope_rows, g0.bf16, B, sq.data(), rope.data());
              cos = reinterpret_cast<uintptr_t>(rope.data()), sin = cos + part;
              if (cos2) cos2 = sin + part, sin2 = cos2 + part;
            }
            if (embed && first == 0 && !waiting)
              embed_rows(reinterpret_cast<const void*>(embed), vocab, reinterpret_cast<const int64_t*>(tokens), B,
                         g0.H, g0.bf16, reinterpret_cast<void*>(h));
            LoopEnd end;
            {
              py::gil_scoped_release nogil;
              end = decode_layers(l.layers, local, ring, first, waiting, defer, B, reinterpret_cast<void*>(h),
                                  reinterpret_cast<const void*>(cos), reinterpret_cast<const void*>(sin), sq.data(),
                                  seqs2 ? sq2.data() : nullptr, reinterpret_cast<int64_t*>(times),
                                  logits ? &l.head : nullptr, reinterpret_cast<float*>(logits),
                                  reinterpret_cast<const void*>(cos2), reinterpret_cast<const void*>(sin2));
            }
            return std::make_tuple(end.layer, end.status, py::bytes(end.msg));
          },
          py::arg("B"), py::arg("h"), py::arg("cos"), py::arg("sin"), py::arg("seqs"), py::arg("times"),
          py::arg("first"), py::arg("waiting"), py::arg("defer"), py::arg("experts"), py::arg("logits") = 0,
          py::arg("cos2") = 0, py::arg("sin2") = 0, py::arg("rope_rows") = 0, py::arg("tokens") = 0,
          py::arg("embed") = 0, py::arg("vocab") = 0, py::arg("seqs2") = 0,
          "B sequences' new tokens through the layers from `first`, `defer` experts a token deferred one layer: h "
          "[B, H] updated in place; seqs int64 [B, 3] "
          "as DecodeBlock.run takes them; times int64 [layers, DecodeLoop.times] (decode_loop.h LoopTime); experts: LocalExperts or "
          "RingClient; logits: fp32 [B, vocab] the head writes once the last layer is done (set_head), or 0; "
          "cos2/sin2: the second rope table (the layers built with second_rope), or 0; rope_rows > 0: cos, sin, "
          "cos2, sin2 are whole tables of that many elements a position, each sequence's row taken by its position; "
          "embed: the embedding table of vocab rows, h's rows set to its rows of tokens (int64 [B]) on a step's first call "
          "seqs2: the sequences as seqs with their second block tables (the layers built with second_table), or 0 "
          "-> (layer reached, status: 0 done, -1 a wait's slice ended, else a gRPC code; message)")
      .def(
          "set_head",
          [](BoundDecodeLoop& l, uintptr_t norm, bool norm_bf16, float eps, const BoundLinear& lm_head,
             py::object owner) {
            MOE_CHECK(!l.layers.empty() && lm_head.m.K == l.layers.back().block.H,
                      "decode loop: the lm_head's inputs are not the hidden size");
            l.head = LoopHead{reinterpret_cast<const void*>(norm), norm_bf16, eps, lm_head.k, lm_head.m};
            l.head_owner = std::move(owner);
            l.has_head = true;
          },
          py::arg("norm"), py::arg("norm_bf16"), py::arg("eps"), py::arg("lm_head"), py::arg("owner"),
          "the step's end in the same call (decode_loop.h LoopHead): the final norm's weight [H], its eps, the packed "
          "lm_head (Linear); owner keeps them alive")
      .def_property_readonly("has_head", [](const BoundDecodeLoop& l) { return l.has_head; })
      .def_property_readonly("layers", [](const BoundDecodeLoop& l) { return l.layers.size(); })
      .def_property_readonly_static("times", [](py::object) { return int(LOOP_TIMES); }, "int64s a layer in times");
}

}  // namespace moe
