// The kernels' bindings: decode attention, MLA's absorbed products, the KV store, the norms and rope, and the
// packed matrices bound to a kernel path: a layer's routed experts (MoELayer) and a dense matrix (Linear)
// (native/kernels/).
#include <algorithm>
#include <cstring>
#include <ctime>
#include <functional>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bindings/bindings.h"
#include "exchange/wire.h"
#include "kernels/kernels.h"
#include "kernels/torch_rounding.h"
#include "moe.h"
#include "runtime/common.h"

namespace moe {

namespace {

int64_t unix_ns() {  // Python's time.time_ns(): the clock ExpertTiming's stamps are read on
  timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return int64_t(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

Fmt parse_fmt(const std::string& fmt) {
  return fmt == "bf16" ? Fmt::Bf16 : fmt == "int8" ? Fmt::Int8 : fmt == "int4" ? Fmt::Int4
       : fmt == "mxfp4" ? Fmt::Mxfp4 : fmt == "fp8" ? Fmt::Fp8 : fmt == "int4g32" ? Fmt::Int4G32
       : fmt == "iq4nl" ? Fmt::Iq4Nl : fmt == "uint4g32" ? Fmt::UInt4G32 : fmt == "int8g32" ? Fmt::Int8G32
       : fmt == "q4k" ? Fmt::Q4K : fmt == "q6k" ? Fmt::Q6K : fmt == "iq4xs" ? Fmt::Iq4Xs : fmt == "q5k" ? Fmt::Q5K
       : fmt == "q3k" ? Fmt::Q3K : fmt == "q2k" ? Fmt::Q2K : fmt == "iq2xxs" ? Fmt::Iq2Xxs : fmt == "iq2xs" ? Fmt::Iq2Xs
       : fmt == "iq2s" ? Fmt::Iq2S : fmt == "iq3xxs" ? Fmt::Iq3Xxs : fmt == "iq3s" ? Fmt::Iq3S : fmt == "iq1s" ? Fmt::Iq1S
       : fmt == "iq1m" ? Fmt::Iq1M
       : throw std::invalid_argument("unknown weight format '" + fmt + "' (bf16, int8, int4, mxfp4, fp8, int4g32, "
                                     "iq4nl, uint4g32, int8g32, q4k, q5k, q6k, q3k, q2k, iq4xs, iq2xxs, iq2xs, iq2s, iq3xxs, "
                                     "iq3s, iq1s, iq1m)");
}

// A packed matrix as Python hands it over: the addresses of (data, scale, rowsum, rowcorr), 0 for a part
// the format has none of (moe_kernels/packing.py's layout()).
using MatrixParts = std::tuple<uintptr_t, uintptr_t, uintptr_t, uintptr_t>;

Matrix matrix_of(const MatrixParts& a, int rows, int K, int Kp) {
  auto [w, scale, rowsum, rowcorr] = a;
  MOE_CHECK(w != 0 && rows >= 0 && K >= 0 && Kp >= K, "bad packed matrix");
  return Matrix{reinterpret_cast<const void*>(w), reinterpret_cast<const float*>(scale),
                reinterpret_cast<const int32_t*>(rowsum), reinterpret_cast<const float*>(rowcorr), rows, K, Kp};
}

Act parse_act(const std::string& act) {
  return act == "silu" ? Act::Silu : act == "clamped_swiglu" ? Act::ClampedSwiglu
       : act == "clamped_silu" ? Act::ClampedSilu
       : throw std::invalid_argument("unknown expert activation '" + act + "' (silu, clamped_swiglu, clamped_silu)");
}

struct Exchanged {  // one part of an exchange computed: its serialized LayerResult, and when the kernels ran
  py::bytes result;
  int64_t start_unix_ns, end_unix_ns;
};

}  // namespace

void bind_kernels(py::module_& m) {
  m.def("set_amx_emulation", &set_amx_emulation, py::arg("on"),
        "tests only: run the AMX path with its tile instructions emulated in C++ (needs AVX-512 for the rest)");
  m.def(
      "mla_absorb_q",
      [](const std::string& isa, uintptr_t w, bool w_bf16, int nh, int dn, int dv, int r, uintptr_t q_nope,
         size_t q_tok, int t, uintptr_t q_lat) {
        const Isa k = kernel_isa(isa);
        py::gil_scoped_release nogil;
        std::lock_guard<std::mutex> g(compute_mutex());
        mla_absorb_q(k, reinterpret_cast<const void*>(w), w_bf16, nh, dn, dv, r,
                     reinterpret_cast<const float*>(q_nope), q_tok, t, reinterpret_cast<float*>(q_lat));
      },
      py::arg("isa"), py::arg("w"), py::arg("w_bf16"), py::arg("nh"), py::arg("dn"), py::arg("dv"), py::arg("r"),
      py::arg("q_nope"), py::arg("q_tok"), py::arg("t"), py::arg("q_lat"),
      "MLA's latent query: q_lat [nh, t, r] fp32 = q_nope (fp32, tokens q_tok apart) x kv_b_proj's W_uk (native/kernels/mla.cpp)");
  m.def(
      "mla_absorb_o",
      [](const std::string& isa, uintptr_t w, bool w_bf16, int nh, int dn, int dv, int r, uintptr_t o_lat, int t,
         uintptr_t o) {
        const Isa k = kernel_isa(isa);
        py::gil_scoped_release nogil;
        std::lock_guard<std::mutex> g(compute_mutex());
        mla_absorb_o(k, reinterpret_cast<const void*>(w), w_bf16, nh, dn, dv, r, reinterpret_cast<const float*>(o_lat),
                     t, reinterpret_cast<float*>(o));
      },
      py::arg("isa"), py::arg("w"), py::arg("w_bf16"), py::arg("nh"), py::arg("dn"), py::arg("dv"), py::arg("r"),
      py::arg("o_lat"), py::arg("t"), py::arg("o"),
      "MLA's heads' output: o [t, nh, dv] fp32 = o_lat [nh, t, r] fp32 x kv_b_proj's W_uv^T (native/kernels/mla.cpp)");
  m.def(
      "prefill_attention",
      [](const std::string& isa_arg, uintptr_t q, bool bf16, int t, int nh, int nkv, int d, int dv, size_t q_tok,
         size_t q_head, uintptr_t K, size_t k_head, size_t k_row, uintptr_t V, size_t v_head, size_t v_row, int start,
         float scale, uintptr_t out, int lo, int window, uintptr_t sinks) {
        const Isa isa = kernel_isa(isa_arg);
        py::gil_scoped_release nogil;
        std::lock_guard<std::mutex> g(compute_mutex());
        prefill_attention(isa, reinterpret_cast<const void*>(q), bf16, t, nh, nkv, d, dv, q_tok, q_head,
                          reinterpret_cast<const void*>(K), k_head, k_row, reinterpret_cast<const void*>(V), v_head,
                          v_row, start, scale, reinterpret_cast<float*>(out), lo, window,
                          reinterpret_cast<const float*>(sinks));
      },
      py::arg("isa"), py::arg("q"), py::arg("bf16"), py::arg("t"), py::arg("nh"), py::arg("nkv"), py::arg("d"),
      py::arg("dv"), py::arg("q_tok"), py::arg("q_head"), py::arg("K"), py::arg("k_head"), py::arg("k_row"),
      py::arg("V"), py::arg("v_head"), py::arg("v_row"), py::arg("start"), py::arg("scale"), py::arg("out"),
      py::arg("lo") = 0, py::arg("window") = 0, py::arg("sinks") = 0,
      "a chunk's t queries, causal (a window's last keys; sinks), against K/V of positions lo .. start + t - 1 "
      "(bf16 or fp32; "
      "native/kernels/prefill_attention.cpp)");
  m.def(
      "hyper_mix",
      [](const std::string& isa_arg, int n, int hc, int H, uintptr_t h, bool bf16, uintptr_t fn, uintptr_t base,
         uintptr_t scale, float eps, float norm_eps, int iters, uintptr_t post, uintptr_t comb, uintptr_t x) {
        const Isa isa = kernel_isa(isa_arg);
        auto f = [](uintptr_t p) { return reinterpret_cast<const float*>(p); };
        py::gil_scoped_release nogil;
        std::lock_guard<std::mutex> g(compute_mutex());
        hyper_mix(isa, n, hc, H, reinterpret_cast<const void*>(h), bf16, f(fn), f(base), f(scale), eps, norm_eps,
                  iters, reinterpret_cast<float*>(post), reinterpret_cast<float*>(comb), reinterpret_cast<void*>(x));
      },
      py::arg("isa"), py::arg("n"), py::arg("hc"), py::arg("H"), py::arg("h"), py::arg("bf16"), py::arg("fn"),
      py::arg("base"), py::arg("scale"), py::arg("eps"), py::arg("norm_eps"), py::arg("iters"), py::arg("post"),
      py::arg("comb"), py::arg("x"), "a hyper-connection's mix of n rows' streams (native/kernels/hyper_mix.cpp)");
  m.def(
      "hyper_expand",
      [](const std::string& isa_arg, int n, int hc, int H, uintptr_t h, bool bf16, uintptr_t y, uintptr_t post,
         uintptr_t comb, uintptr_t out) {
        const Isa isa = kernel_isa(isa_arg);
        py::gil_scoped_release nogil;
        std::lock_guard<std::mutex> g(compute_mutex());
        hyper_expand(isa, n, hc, H, reinterpret_cast<const void*>(h), bf16, reinterpret_cast<const void*>(y),
                     reinterpret_cast<const float*>(post), reinterpret_cast<const float*>(comb),
                     reinterpret_cast<void*>(out));
      },
      py::arg("isa"), py::arg("n"), py::arg("hc"), py::arg("H"), py::arg("h"), py::arg("bf16"), py::arg("y"),
      py::arg("post"), py::arg("comb"), py::arg("out"),
      "a hyper-connection's expand after its block (native/kernels/hyper_mix.cpp)");
  m.def(
      "delta_rule_step",
      [](const std::string& isa_arg, int H, int t, int dk, int dv, uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t e,
         uintptr_t beta, uintptr_t S, uintptr_t S_new, uintptr_t o, bool per_head) {
        const Isa isa = kernel_isa(isa_arg);
        auto f = [](uintptr_t p) { return reinterpret_cast<const float*>(p); };
        py::gil_scoped_release nogil;
        std::lock_guard<std::mutex> g(compute_mutex());
        delta_rule_step(isa, H, t, dk, dv, f(q), f(k), f(v), f(e), f(beta), f(S), reinterpret_cast<float*>(S_new),
                        reinterpret_cast<float*>(o), per_head);
      },
      py::arg("isa"), py::arg("H"), py::arg("t"), py::arg("dk"), py::arg("dv"), py::arg("q"), py::arg("k"),
      py::arg("v"), py::arg("e"), py::arg("beta"), py::arg("S"), py::arg("S_new"), py::arg("o"), py::arg("per_head") = false,
      "the delta rule's recurrence over t tokens, fp32 (native/kernels/delta_rule.cpp)");
  m.def(
      "decode_attention",
      [](const std::string& isa_arg, uintptr_t q, int nh, int nkv, int d, int dv, uintptr_t K, int kv, size_t k_head,
         size_t k_row, uintptr_t V, size_t v_head, size_t v_row, int L, float scale, uintptr_t out, uintptr_t table,
         int block_shift, size_t k_block, size_t v_block, uintptr_t sel, uintptr_t sel_len, size_t sel_stride,
         uintptr_t sinks) {
        Isa isa = kernel_isa(isa_arg);
        const KvType t = kv_type(kv);
        py::gil_scoped_release nogil;
        std::lock_guard<std::mutex> g(compute_mutex());
        decode_attention(isa, reinterpret_cast<const float*>(q), nh, nkv, d, dv, reinterpret_cast<const void*>(K), t,
                         k_head, k_row, reinterpret_cast<const void*>(V), v_head, v_row, L, scale,
                         reinterpret_cast<float*>(out), reinterpret_cast<const int32_t*>(table), block_shift, k_block,
                         v_block, reinterpret_cast<const int32_t*>(sel), reinterpret_cast<const int32_t*>(sel_len),
                         sel_stride, reinterpret_cast<const float*>(sinks));
      },
      py::arg("isa"), py::arg("q"), py::arg("nh"), py::arg("nkv"), py::arg("d"), py::arg("dv"), py::arg("K"),
      py::arg("kv"), py::arg("k_head"), py::arg("k_row"), py::arg("V"), py::arg("v_head"), py::arg("v_row"), py::arg("L"),
      py::arg("scale"), py::arg("out"), py::arg("table") = 0, py::arg("block_shift") = 0, py::arg("k_block") = 0,
      py::arg("v_block") = 0, py::arg("sel") = 0, py::arg("sel_len") = 0, py::arg("sel_stride") = 0,
      py::arg("sinks") = 0,
      "one decode query per head against K/V of type kv (KV_CODES), contiguous or paged through a block table, every "
      "position or each kv head's selection, each head's attention sink or none (native/kernels/attention.cpp)");
  m.def(
      "mla_decode_attention",
      [](const std::string& isa_arg, uintptr_t q, int nh, int r, int dr, uintptr_t C, uintptr_t KPE, int kv,
         size_t c_row, size_t kpe_row, int L, float scale, uintptr_t out, uintptr_t table, int block_shift,
         size_t c_block, size_t kpe_block, uintptr_t sel) {
        Isa isa = kernel_isa(isa_arg);
        const KvType t = kv_type(kv);
        py::gil_scoped_release nogil;
        std::lock_guard<std::mutex> g(compute_mutex());
        mla_decode_attention(isa, reinterpret_cast<const float*>(q), nh, r, dr, reinterpret_cast<const void*>(C),
                             reinterpret_cast<const void*>(KPE), t, c_row, kpe_row, L, scale,
                             reinterpret_cast<float*>(out), reinterpret_cast<const int32_t*>(table), block_shift,
                             c_block, kpe_block, reinterpret_cast<const int32_t*>(sel));
      },
      py::arg("isa"), py::arg("q"), py::arg("nh"), py::arg("r"), py::arg("dr"), py::arg("C"), py::arg("KPE"),
      py::arg("kv"), py::arg("c_row"), py::arg("kpe_row"), py::arg("L"), py::arg("scale"), py::arg("out"),
      py::arg("table") = 0, py::arg("block_shift") = 0, py::arg("c_block") = 0, py::arg("kpe_block") = 0,
      py::arg("sel") = 0,
      "MLA's decode attention in the latent space: one query per head (latent then rotary) against the cached latents "
      "and rotary keys, contiguous or paged, every position or a selection (native/kernels/attention.cpp)");
  m.def(
      "dsa_index_scores",
      [](const std::string& isa_arg, uintptr_t q, uintptr_t w, int H, int D, float scale, uintptr_t K, int kv,
         size_t k_row, int L, uintptr_t out, uintptr_t table, int block_shift, size_t k_block) {
        Isa isa = kernel_isa(isa_arg);
        const KvType t = kv_type(kv);
        py::gil_scoped_release nogil;
        std::lock_guard<std::mutex> g(compute_mutex());
        dsa_index_scores(isa, reinterpret_cast<const float*>(q), reinterpret_cast<const float*>(w), H, D, scale,
                         reinterpret_cast<const void*>(K), t, k_row, L, reinterpret_cast<float*>(out),
                         reinterpret_cast<const int32_t*>(table), block_shift, k_block);
      },
      py::arg("isa"), py::arg("q"), py::arg("w"), py::arg("H"), py::arg("D"), py::arg("scale"), py::arg("K"),
      py::arg("kv"), py::arg("k_row"), py::arg("L"), py::arg("out"), py::arg("table") = 0, py::arg("block_shift") = 0,
      py::arg("k_block") = 0,
      "DeepSeek Sparse Attention's indexer scores of every cached position: sum over heads of w * relu(scale * q . k); "
      "w 0: each head's scale * q . k, [H, L] (MiniMax-M3's block indexer; native/kernels/dsa.cpp)");
  m.def(
      "dsa_top_k",
      [](uintptr_t scores, int L, int k, uintptr_t out) {
        py::gil_scoped_release nogil;
        return dsa_top_k(reinterpret_cast<const float*>(scores), L, k, reinterpret_cast<int32_t*>(out));
      },
      py::arg("scores"), py::arg("L"), py::arg("k"), py::arg("out"),
      "the min(k, L) best positions (ties to the earlier), ascending, into out; returns how many "
      "(native/kernels/dsa.cpp)");
  m.def(
      "store_kv",
      [](int kv, uintptr_t src, bool src_bf16, uintptr_t dst, int n) {
        store_kv(kv_type(kv), reinterpret_cast<const void*>(src), src_bf16, reinterpret_cast<void*>(dst), n);
      },
      py::arg("kv"), py::arg("src"), py::arg("src_bf16"), py::arg("dst"), py::arg("n"),
      "n values (bf16 or fp32) into the KV cache's type, rounded as torch's .to() (the decode step's KV store)");
  // a decode step's few rows run with the GIL held (no pool, no lock); a prefill's rows go to the pool in
  // slices (each row stands alone: the same bits either way)
  auto by_rows = [](int rows, int work_per_row, const std::function<void(int, int)>& fn) {
    constexpr int POOL_WORK = 1 << 16;  // elements below which a handoff to the pool costs more than it saves
    if (int64_t(rows) * work_per_row < POOL_WORK) return fn(0, rows);
    py::gil_scoped_release nogil;
    std::lock_guard<std::mutex> g(compute_mutex());
    ThreadPool& tp = pool();
    const int tasks = std::min(rows, 4 * tp.size()), per = (rows + tasks - 1) / tasks;
    tp.parallel_for((rows + per - 1) / per, [&](int i) { fn(i * per, std::min(rows, (i + 1) * per)); });
  };
  m.def(
      "rms_norm",
      [by_rows](uintptr_t x, bool x_bf16, uintptr_t w, bool w_bf16, uintptr_t out, bool out_bf16, int rows, int n,
                float eps, bool wide) {
        const size_t xb = x_bf16 ? 2 : 4, ob = out_bf16 ? 2 : 4;
        by_rows(rows, n, [&](int r0, int r1) {
          rms_norm_rows(reinterpret_cast<const char*>(x) + size_t(r0) * n * xb, x_bf16, reinterpret_cast<const void*>(w),
                        w_bf16, reinterpret_cast<char*>(out) + size_t(r0) * n * ob, out_bf16, r1 - r0, n, eps, wide);
        });
      },
      py::arg("x"), py::arg("x_bf16"), py::arg("w"), py::arg("w_bf16"), py::arg("out"), py::arg("out_bf16"),
      py::arg("rows"), py::arg("n"), py::arg("eps"), py::arg("wide") = false,
      "RMSNorm with torch's rounding; wide: times the weight in fp32, rounded once (native/kernels/norm_rope.cpp)");
  m.def(
      "rope",
      [by_rows](uintptr_t x, uintptr_t out, bool bf16, int T, int heads, int dim, uintptr_t cos, uintptr_t sin) {
        const size_t b = bf16 ? 2 : 4, row = size_t(heads) * dim * b, angles = size_t(dim / 2) * b;
        by_rows(T, heads * dim, [&](int t0, int t1) {
          rope_rows(reinterpret_cast<const char*>(x) + t0 * row, reinterpret_cast<char*>(out) + t0 * row, bf16,
                    t1 - t0, heads, dim, reinterpret_cast<const char*>(cos) + t0 * angles,
                    reinterpret_cast<const char*>(sin) + t0 * angles);
        });
      },
      py::arg("x"), py::arg("out"), py::arg("bf16"), py::arg("T"), py::arg("heads"), py::arg("dim"), py::arg("cos"),
      py::arg("sin"), "rotary embedding, halves rotated, with torch's rounding (native/kernels/norm_rope.cpp)");
  m.def(
      "head_rope",
      [by_rows](uintptr_t x, uintptr_t out, bool bf16, int T, int heads, int D, int pairs, uintptr_t cos, uintptr_t sin,
                float eps, bool norm) {
        const size_t row = size_t(heads) * D * (bf16 ? 2 : 4);
        by_rows(T, heads * D, [&](int t0, int t1) {
          head_rope_rows(reinterpret_cast<const char*>(x) + t0 * row, reinterpret_cast<char*>(out) + t0 * row, bf16,
                         t1 - t0, heads, D, pairs, reinterpret_cast<const float*>(cos) + size_t(t0) * pairs,
                         reinterpret_cast<const float*>(sin) + size_t(t0) * pairs, eps, norm);
        });
      },
      py::arg("x"), py::arg("out"), py::arg("bf16"), py::arg("T"), py::arg("heads"), py::arg("D"), py::arg("pairs"),
      py::arg("cos"), py::arg("sin"), py::arg("eps"), py::arg("norm"),
      "DeepSeek-V4's heads: an unweighted RMSNorm (norm) then the trailing dims turned in interleaved pairs, with "
      "torch's rounding (native/kernels/norm_rope.cpp)");
  m.attr("MAX_K") = MAX_K;
  py::class_<Exchanged>(m, "Exchanged", "one part of a LayerRequest computed by MoELayer.exchange_part")
      .def_readonly("result", &Exchanged::result, "the serialized LayerResult")
      .def_readonly("start_unix_ns", &Exchanged::start_unix_ns)
      .def_readonly("end_unix_ns", &Exchanged::end_unix_ns);
  py::class_<BoundMoELayer>(m, "MoELayer",
                            "one layer's packed routed experts bound to the kernel path that runs them (native/moe.h)")
      .def(py::init([](const std::string& isa, const std::string& fmt, const std::string& down_fmt, int E, int I,
                       int H, int Kp_h, int Kp_i, const MatrixParts& gate_up, const MatrixParts& down,
                       uintptr_t gate_up_bias, uintptr_t down_bias, const std::string& act, float alpha, float limit,
                       py::object owner) {
             MOE_CHECK(E > 0 && I > 0 && H > 0, "bad expert shape");
             MoEWeights w{E, H, I, matrix_of(gate_up, 2 * I, H, Kp_h), matrix_of(down, H, I, Kp_i),
                          reinterpret_cast<const float*>(gate_up_bias), reinterpret_cast<const float*>(down_bias),
                          parse_act(act), alpha, limit};
             const Isa k = kernel_isa(isa);
             return BoundMoELayer{MoELayer{&kernels_for(k, parse_fmt(fmt)), &kernels_for(k, parse_fmt(down_fmt)), w},
                                  std::move(owner)};
           }),
           py::arg("isa"), py::arg("fmt"), py::arg("down_fmt"), py::arg("E"), py::arg("I"), py::arg("H"),
           py::arg("Kp_h"), py::arg("Kp_i"), py::arg("gate_up"), py::arg("down"), py::arg("gate_up_bias") = 0,
           py::arg("down_bias") = 0, py::arg("act") = "silu", py::arg("alpha") = 0.f, py::arg("limit") = 0.f,
           py::arg("owner") = py::none(),
           "gate_up / down: (data, scale, rowsum, rowcorr) addresses of [E, 2I, Kp_h] / [E, H, Kp_i] packed "
           "matrices, in formats fmt / down_fmt; biases fp32 [E, 2I] / [E, H] or 0; owner: kept alive with the layer")
      .def_property_readonly("isa", [](const BoundMoELayer& l) { return std::string(isa_name(l.layer.gate_up_k->isa)); })
      .def(
          "forward",
          [](const BoundMoELayer& l, uintptr_t hidden, uintptr_t ids, uintptr_t weights, uintptr_t out, int T, int k) {
            py::gil_scoped_release nogil;
            std::lock_guard<std::mutex> g(compute_mutex());
            moe_forward(l.layer, reinterpret_cast<const float*>(hidden),
                        reinterpret_cast<const int32_t*>(ids), reinterpret_cast<const float*>(weights),
                        reinterpret_cast<float*>(out), T, k);
            release_scratch();
          },
          py::arg("hidden"), py::arg("ids"), py::arg("weights"), py::arg("out"), py::arg("T"), py::arg("k"),
          "hidden [T, H] fp32, ids [T, k] int32, weights [T, k] fp32 -> out [T, H] fp32 (addresses)")
      .def(
          "forward_part",
          [](const BoundMoELayer& l, uintptr_t hidden, bool hidden_bf16, uintptr_t ids, uintptr_t weights,
             uintptr_t out, bool out_bf16, int T, int k, int defer, int part) {
            py::gil_scoped_release nogil;
            std::lock_guard<std::mutex> g(compute_mutex());
            moe_forward_part(l.layer, reinterpret_cast<const void*>(hidden), hidden_bf16,
                             reinterpret_cast<const int32_t*>(ids), reinterpret_cast<const float*>(weights),
                             reinterpret_cast<void*>(out), out_bf16, T, k, defer, part);
            release_scratch();
          },
          py::arg("hidden"), py::arg("hidden_bf16"), py::arg("ids"), py::arg("weights"), py::arg("out"),
          py::arg("out_bf16"), py::arg("T"), py::arg("k"), py::arg("defer"), py::arg("part"),
          "one part of a deferral split, hidden/out bf16 or fp32 (see native/kernels/moe_part.cpp)")
      .def(
          "exchange_part",
          [](const BoundMoELayer& l, py::buffer request, int part, int64_t received_unix_ns) {
            const MoEWeights& m = l.layer.w;
            wire::LayerRequestView q;
            wire::Head h;
            MOE_CHECK(read_request(request, q, h), "not a layer request the native exchange takes (wire_head says None)");
            MOE_CHECK(h.H == m.H, "hidden size " + std::to_string(h.H) + " != " + std::to_string(m.H));
            const size_t n = size_t(h.T) * size_t(h.H) * (h.bf16 ? 2 : 4), nk = size_t(h.T) * size_t(h.k) * 4;
            // the tensors sit in the message at whatever offsets its headers leave: the kernel reads them as
            // 2- and 4-byte values, so misaligned ones are copied first (small next to the kernel's work)
            thread_local std::vector<uint32_t> x_al, ids_al, w_al;
            thread_local std::vector<uint8_t> out;
            auto aligned = [](const uint8_t* p, size_t len, std::vector<uint32_t>& keep) -> const void* {
              if (reinterpret_cast<uintptr_t>(p) % 4 == 0) return p;
              keep.resize((len + 3) / 4);
              std::memcpy(keep.data(), p, len);
              return keep.data();
            };
            const void* x = aligned(q.hidden.data, n, x_al);
            auto* ids = static_cast<const int32_t*>(aligned(q.ids.data, nk, ids_al));
            auto* w = static_cast<const float*>(aligned(q.weights.data, nk, w_al));
            out.resize(n);
            int64_t t0, t1;
            {
              py::gil_scoped_release nogil;
              std::lock_guard<std::mutex> g(compute_mutex());
              t0 = unix_ns();
              moe_forward_part(l.layer, x, h.bf16, ids, w, out.data(), h.bf16, int(h.T), int(h.k),
                               int(h.defer), part);
              t1 = unix_ns();
              release_scratch();
            }
            wire::Result r{h.step, h.layer, uint32_t(part),
                           {h.bf16 ? wire::BFLOAT16 : wire::FLOAT32, h.T, h.H, out.data(), n},
                           {uint64_t(std::max<int64_t>(0, t0 - received_unix_ns) / 1000), uint64_t((t1 - t0) / 1000),
                            t0, t1}};
            py::bytes res = new_bytes(wire::layer_result_size(r));
            wire::write_layer_result(bytes_data(res), r);
            if (out.capacity() > SCRATCH_KEEP) {  // a long prefill's buffers are not kept for good
              std::vector<uint8_t>().swap(out);
              std::vector<uint32_t>().swap(x_al);
            }
            return Exchanged{res, t0, t1};
          },
          py::arg("request"), py::arg("part"), py::arg("received_unix_ns"),
          "one part of a serialized LayerRequest computed -> Exchanged");
  py::class_<BoundLinear>(m, "Linear", "one packed dense [rows, Kp] matrix bound to the kernel path that runs it")
      .def(py::init([](const std::string& isa, const std::string& fmt, int rows, int K, int Kp, const MatrixParts& parts,
                       py::object owner) {
             return BoundLinear{&kernels_for(kernel_isa(isa), parse_fmt(fmt)), matrix_of(parts, rows, K, Kp),
                                std::move(owner)};
           }),
           py::arg("isa"), py::arg("fmt"), py::arg("rows"), py::arg("K"), py::arg("Kp"), py::arg("parts"),
           py::arg("owner") = py::none())
      .def(
          "forward",
          [](const BoundLinear& l, uintptr_t x, uintptr_t y, int T, bool round_bf16) {
            py::gil_scoped_release nogil;
            std::lock_guard<std::mutex> g(compute_mutex());
            float* out = reinterpret_cast<float*>(y);
            linear_forward(*l.k, l.m, reinterpret_cast<const float*>(x), T, out);
            release_scratch();
            if (round_bf16)  // torch's y.to(bfloat16).float() in place: a bf16 model's logits, one pass
              for (size_t i = 0, n = size_t(T) * l.m.rows; i < n; ++i) out[i] = rounding::held<uint16_t>(out[i]);
          },
          py::arg("x"), py::arg("y"), py::arg("T"), py::arg("round_bf16") = false,
          "y [T, rows] fp32 = x [T, K] fp32 times the matrix, transposed (native/kernels/linear.cpp); round_bf16: each "
          "output rounded to bf16 (kept as fp32)");
  m.def(
      "linear_groups",
      [](const std::vector<const BoundLinear*>& parts, uintptr_t x, uintptr_t y, int T) {
        MOE_CHECK(!parts.empty(), "grouped linear: no groups");
        std::vector<Matrix> ms;
        for (const BoundLinear* p : parts) {
          MOE_CHECK(p->k == parts[0]->k, "grouped linear: the groups' formats or kernel paths differ");
          ms.push_back(p->m);
        }
        py::gil_scoped_release nogil;
        std::lock_guard<std::mutex> g(compute_mutex());
        linear_groups(*parts[0]->k, ms.data(), int(ms.size()), reinterpret_cast<const float*>(x), T,
                      reinterpret_cast<float*>(y));
        release_scratch();
      },
      py::arg("parts"), py::arg("x"), py::arg("y"), py::arg("T"),
      "y [T, G, rows] fp32 = each group g of x [T, G, K] fp32 through parts[g] (one shape and format), in one call");
}

}  // namespace moe
