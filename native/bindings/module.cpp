// pybind11 bindings: raw pointers + shapes in (the Python layer owns the tensors), GIL released.
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>
#include <ctime>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "common.h"
#include "contention.h"
#include "decode_loop.h"
#include "doorbell.h"
#include "huge_buffer.h"
#include "kernels.h"
#include "moe.h"
#include "numa.h"
#include "ring.h"
#include "probes.h"
#include "torch_rounding.h"
#include "wire.h"

namespace py = pybind11;
using namespace moe;

// A 32-bit doorbell word inside a writable buffer (an mmap of the shared region), bounds-checked.
static std::atomic<uint32_t>* doorbell_at(py::buffer& buf, size_t offset) {
  py::buffer_info info = buf.request(true);
  size_t n = size_t(info.size) * size_t(info.itemsize);
  MOE_CHECK(offset % 4 == 0 && offset <= n && n - offset >= 4, "doorbell offset outside the buffer or unaligned");
  auto addr = reinterpret_cast<uintptr_t>(info.ptr) + offset;
  MOE_CHECK(addr % 4 == 0, "doorbell address unaligned");
  return reinterpret_cast<std::atomic<uint32_t>*>(addr);
}

static Isa parse_isa(const std::string& name);

static py::bytes new_bytes(size_t n) {  // to be filled before anyone else sees it
  py::bytes b = py::reinterpret_steal<py::bytes>(PyBytes_FromStringAndSize(nullptr, py::ssize_t(n)));
  if (!b) throw py::error_already_set();
  return b;
}

static uint8_t* bytes_data(py::bytes& b) { return reinterpret_cast<uint8_t*>(PyBytes_AS_STRING(b.ptr())); }

// a serialized LayerRequest the native exchange takes (wire.h: fast_head), read from a bytes-like object
static bool read_request(py::buffer& buf, wire::LayerRequestView& q, wire::Head& h) {
  py::buffer_info b = buf.request();
  return wire::parse_layer_request(static_cast<const uint8_t*>(b.ptr), size_t(b.size * b.itemsize), q) &&
         wire::fast_head(q, h);
}

// a serialized LayerResult with a 2-D output, read from a bytes-like object
static bool read_result(py::buffer& buf, wire::LayerResultView& q) {
  py::buffer_info b = buf.request();
  return wire::parse_layer_result(static_cast<const uint8_t*>(b.ptr), size_t(b.size * b.itemsize), q) &&
         q.layer <= std::numeric_limits<uint32_t>::max() && q.output.shape.size() == 2;
}

static int64_t unix_ns() {  // Python's time.time_ns(): the clock ExpertTiming's stamps are read on
  timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return int64_t(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

static Isa kernel_isa(const std::string& name) { return usable_isa(parse_isa(name)); }

static Fmt parse_fmt(const std::string& fmt) {
  return fmt == "bf16" ? Fmt::Bf16 : fmt == "int8" ? Fmt::Int8 : fmt == "int4" ? Fmt::Int4
       : fmt == "mxfp4" ? Fmt::Mxfp4 : fmt == "fp8" ? Fmt::Fp8 : fmt == "int4g32" ? Fmt::Int4G32
       : fmt == "iq4nl" ? Fmt::Iq4Nl : fmt == "uint4g32" ? Fmt::UInt4G32 : fmt == "int8g32" ? Fmt::Int8G32
       : fmt == "q4k" ? Fmt::Q4K : fmt == "q6k" ? Fmt::Q6K : fmt == "iq4xs" ? Fmt::Iq4Xs : fmt == "q5k" ? Fmt::Q5K
       : fmt == "q3k" ? Fmt::Q3K : fmt == "q2k" ? Fmt::Q2K
       : throw std::invalid_argument("unknown weight format '" + fmt + "' (bf16, int8, int4, mxfp4, fp8, int4g32, "
                                     "iq4nl, uint4g32, int8g32, q4k, q5k, q6k, q3k, q2k, iq4xs)");
}

// A packed matrix as Python hands it over: the addresses of (data, scale, rowsum, rowcorr), 0 for a part
// the format has none of (moe_kernels/packing.py's layout()).
using MatrixParts = std::tuple<uintptr_t, uintptr_t, uintptr_t, uintptr_t>;

static Matrix matrix_of(const MatrixParts& a, int rows, int K, int Kp) {
  auto [w, scale, rowsum, rowcorr] = a;
  MOE_CHECK(w != 0 && rows >= 0 && K >= 0 && Kp >= K, "bad packed matrix");
  return Matrix{reinterpret_cast<const void*>(w), reinterpret_cast<const float*>(scale),
                reinterpret_cast<const int32_t*>(rowsum), reinterpret_cast<const float*>(rowcorr), rows, K, Kp};
}

static Act parse_act(const std::string& act) {
  return act == "silu" ? Act::Silu : act == "clamped_swiglu" ? Act::ClampedSwiglu
       : throw std::invalid_argument("unknown expert activation '" + act + "' (silu, clamped_swiglu)");
}

// The bound objects keep `owner` (the Python object holding their buffers) alive as long as they live.
struct BoundMoELayer {
  MoELayer layer;
  py::object owner;
};
struct BoundLinear {
  const Kernels* k;
  Matrix m;
  py::object owner;
};
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

// What the native readers of the exchange's bytes return (named fields, not positions).
struct ResultHead {
  uint64_t step, layer, part, dtype;
  int64_t rows, cols;
  size_t nbytes;
  wire::Timing timing;
};
struct ServeEvent {
  Served kind;
  uint64_t seq;
  std::vector<PartLog> parts;
};
struct Exchanged {  // one part of an exchange computed: its serialized LayerResult, and when the kernels ran
  py::bytes result;
  int64_t start_unix_ns, end_unix_ns;
};
struct RingAnswer {
  int status;  // Status, or -1: nothing yet (timed out, or the ring closed)
  py::bytes message;
  ring::RespDesc desc;
};

static std::pair<uint8_t*, size_t> writable(py::buffer& buf) {
  py::buffer_info info = buf.request(true);
  return {static_cast<uint8_t*>(info.ptr), size_t(info.size) * size_t(info.itemsize)};
}

static KvType kv_type(int code) {  // moe_kernels/attention.py KV_CODES
  if (code < 0 || code > 2) throw std::invalid_argument("unknown KV cache type code " + std::to_string(code));
  return KvType(code);
}

static Isa parse_isa(const std::string& name) {
  if (name == "portable") return Isa::Portable;
  if (name == "avx2") return Isa::Avx2;
  if (name == "avxvnni") return Isa::AvxVnni;
  if (name == "avx512") return Isa::Avx512;
  if (name == "amx") return Isa::Amx;
  throw std::invalid_argument("unknown kernel path '" + name + "' (portable, avx2, avxvnni, avx512, amx)");
}

PYBIND11_MODULE(_native, m) {
  m.doc() = "Native routed-expert kernels (see native/)";
  py::class_<HugeBuffer>(m, "HugeBuffer", py::buffer_protocol(),
                         "bytes on 2 MiB-aligned memory advised for transparent huge pages")
      .def(py::init<size_t>(), py::arg("nbytes"))
      .def_property_readonly("nbytes", &HugeBuffer::size)
      .def_buffer([](HugeBuffer& b) {
        return py::buffer_info(b.data(), 1, py::format_descriptor<uint8_t>::format(), 1, {b.size()}, {1});
      });
  m.def("cpu_features", [] {
    CpuFeatures f = detect_cpu();
    py::dict d;
    d["avx512f"] = f.avx512f; d["avx512bw"] = f.avx512bw; d["avx512bf16"] = f.avx512bf16;
    d["avx512vnni"] = f.avx512vnni; d["avx512vbmi"] = f.avx512vbmi; d["amx_tile"] = f.amx_tile; d["amx_bf16"] = f.amx_bf16; d["amx_int8"] = f.amx_int8;
    d["os_avx512"] = f.os_avx512; d["os_amx"] = f.os_amx;
    d["avx2"] = f.avx2; d["fma"] = f.fma; d["f16c"] = f.f16c; d["avxvnni"] = f.avxvnni; d["os_avx"] = f.os_avx;
    return d;
  });
  m.def("set_tuning", [](size_t pf_bytes, size_t task_kb, int64_t v_prefetch_kb) {  // between calls (benchmarks)
    MOE_CHECK(task_kb >= 1, "task_kb must be >= 1");
    Tuning& t = tuning();
    t.pf_bytes = pf_bytes;
    t.task_bytes = task_kb * 1024;
    if (v_prefetch_kb >= 0) t.v_prefetch_bytes = size_t(v_prefetch_kb) * 1024;
  }, py::arg("pf_bytes"), py::arg("task_kb"), py::arg("v_prefetch_kb") = -1,
     "the kernels' streaming knobs (common.h Tuning); v_prefetch_kb -1: unchanged");
  m.def("get_tuning", [] {
    return py::make_tuple(tuning().pf_bytes, tuning().task_bytes / 1024, tuning().v_prefetch_bytes / 1024);
  });
  m.def("best_isa", [] { return std::string(isa_name(best_isa(detect_cpu()))); });
  m.def("set_torch_vector_bytes", &rounding::set_torch_vector_bytes, py::arg("bytes"),
        "torch's CPU vector width (64 AVX512, 32 AVX2, 0 DEFAULT): where its silu and sigmoid switch from Sleef's "
        "exp to libm's (native/torch_rounding.h)");
  m.def("torch_vector_bytes", &rounding::torch_vector_bytes);
  m.def("isa_supported", [](const std::string& p) { return isa_supported(parse_isa(p), detect_cpu()); });
  m.def("read_bandwidth", [](uintptr_t buf, size_t n, const std::string& variant) {
    py::gil_scoped_release nogil;
    std::lock_guard<std::mutex> g(compute_mutex());
    return read_bandwidth(reinterpret_cast<const float*>(buf), n, variant);
  }, py::arg("buf"), py::arg("n"), py::arg("variant") = "auto",
  "bytes/s streaming n floats on all pool threads; variant auto | avx512 | avx2 | scalar (checked against the CPU)");
  // arithmetic peaks (probes.h), each refused on a CPU without its instructions
  auto peak = [&m](const char* name, Isa needs, const char* what, double (*probe)(long)) {
    m.def(name, [=](long iters) {
      MOE_CHECK(isa_supported(needs, detect_cpu()), std::string("no ") + what + " on this CPU");
      py::gil_scoped_release nogil;
      std::lock_guard<std::mutex> g(compute_mutex());
      return probe(iters);
    });
  };
  peak("bf16_peak_flops", Isa::Avx512, "AVX-512 BF16", bf16_peak_flops);
  peak("vnni_peak_ops", Isa::Avx512, "AVX-512 VNNI", vnni_peak_ops);
  peak("fma_peak_flops", Isa::Avx2, "AVX2 + FMA", fma_peak_flops);
  peak("avx2_int8_peak_ops", Isa::Avx2, "AVX2", avx2_int8_peak_ops);
  peak("avxvnni_peak_ops", Isa::AvxVnni, "AVX-VNNI", avxvnni_peak_ops);
  peak("amx_bf16_peak_flops", Isa::Amx, "AMX (or the OS refuses the tile state)", amx_bf16_peak_flops);
  peak("amx_int8_peak_ops", Isa::Amx, "AMX (or the OS refuses the tile state)", amx_int8_peak_ops);
  m.def(
      "doorbell_ring",
      [](py::buffer buf, size_t offset, uint32_t value) { doorbell_ring(doorbell_at(buf, offset), value); },
      py::arg("buf"), py::arg("offset"), py::arg("value"), "store value at buf[offset] (release) and wake waiters");
  m.def(
      "doorbell_wait",
      [](py::buffer buf, size_t offset, uint32_t seen, int64_t timeout_us, int64_t spin_us) {
        std::atomic<uint32_t>* word = doorbell_at(buf, offset);
        py::gil_scoped_release nogil;
        return doorbell_wait(word, seen, timeout_us, spin_us);
      },
      py::arg("buf"), py::arg("offset"), py::arg("seen"), py::arg("timeout_us"), py::arg("spin_us"),
      "wait until buf[offset] != seen, at most timeout_us (spinning spin_us first, as the ring does): -> the value");
  m.def(
      "doorbell_wake", [](py::buffer buf, size_t offset) { doorbell_wake(doorbell_at(buf, offset)); },
      py::arg("buf"), py::arg("offset"), "wake waiters on buf[offset] without changing it");
  m.def("ring_layout", [] {
    using namespace ring;
    py::dict d;
    d["REQ_SEQ"] = REQ_SEQ; d["RESP_SEQ"] = RESP_SEQ; d["RESP_READ"] = RESP_READ; d["CLOSED"] = CLOSED;
    d["DESC_START"] = DESC_START; d["REQ_SLOTS"] = REQ_SLOTS; d["RESP_SLOTS"] = RESP_SLOTS;
    d["REQ_DESC_SIZE"] = REQ_DESC_SIZE; d["RESP_DESC_SIZE"] = RESP_DESC_SIZE; d["MSG_MAX"] = MSG_MAX;
    d["OK"] = uint32_t(OK); d["INVALID_ARGUMENT"] = uint32_t(INVALID_ARGUMENT); d["INTERNAL"] = uint32_t(INTERNAL);
    d["DATA_START"] = DATA_START; d["SPAN_ALIGN"] = SPAN_ALIGN; d["REQ_DESC_BYTES"] = sizeof(ReqDesc); d["RESP_DESC_BYTES"] = sizeof(RespDesc);
    return d;
  }, "the ring layout the C++ side uses (tests check moe_core/shm.py against it)");
  py::enum_<Served>(m, "ServeKind", "what one RingServer.serve() call ended with")
      .value("IDLE", Served::Idle)
      .value("CLOSED", Served::Closed)
      .value("FOR_PYTHON", Served::ForPython);
  py::class_<PartLog>(m, "PartLog", "one part the C++ loop computed, for the metrics")
      .def_readonly("layer", &PartLog::layer)
      .def_readonly("part", &PartLog::part)
      .def_readonly("tokens", &PartLog::tokens)
      .def_readonly("start_ns", &PartLog::start_ns)
      .def_readonly("end_ns", &PartLog::end_ns)
      .def_readonly("queued_ns", &PartLog::queued_ns);
  py::class_<ServeEvent>(m, "ServeEvent")
      .def_readonly("kind", &ServeEvent::kind)
      .def_readonly("seq", &ServeEvent::seq, "the request handed to Python (kind FOR_PYTHON)")
      .def_readonly("parts", &ServeEvent::parts, "parts computed since the last call");
  py::class_<RingServer>(m, "RingServer", "the expert side's serving loop of one shared-memory session")
      .def(py::init([](py::buffer region, int hidden, int max_tokens, int max_k, uint32_t code_f32, uint32_t code_bf16) {
             auto [p, n] = writable(region);
             return new RingServer(p, n, hidden, max_tokens, max_k, code_f32, code_bf16);
           }),
           py::arg("region"), py::arg("hidden"), py::arg("max_tokens"), py::arg("max_k"), py::arg("code_f32"),
           py::arg("code_bf16"), py::keep_alive<1, 2>())
      .def("add_layer", [](RingServer& r, int layer, const BoundMoELayer& l) { r.add_layer(layer, l.layer); },
           py::arg("layer"), py::arg("experts"), py::keep_alive<1, 3>())
      .def("serve",
           [](RingServer& r, int64_t timeout_us, int64_t spin_us) {
             ServeEvent ev{Served::Idle, 0, {}};
             py::gil_scoped_release nogil;
             ev.kind = r.serve(timeout_us, spin_us, &ev.seq, &ev.parts);
             return ev;
           },
           py::arg("timeout_us"), py::arg("spin_us"))
      .def("respond",
           [](RingServer& r, uint64_t seq, uint32_t part, uint32_t status, uint64_t off, uint64_t n, uint64_t queued_us,
              uint64_t compute_us, int64_t start_ns, int64_t end_ns, const std::string& msg) {
             py::gil_scoped_release nogil;
             return r.respond(seq, part, status, ring::Span{off, n}, queued_us, compute_us, start_ns, end_ns, msg);
           })
      .def("stop", &RingServer::stop)
      .def_property_readonly("served", &RingServer::served);
  m.def(
      "ring_submit",
      [](py::buffer region, uint64_t seq, uint64_t step, uint32_t layer, uint32_t T, uint32_t k, uint32_t defer,
         uint32_t dtype, uint64_t x_off, uint64_t x_n, uint64_t i_off, uint64_t i_n, uint64_t w_off, uint64_t w_n,
         uint64_t o_off, uint64_t o_n, uint64_t d_off, uint64_t d_n, uintptr_t x, uintptr_t ids, uintptr_t w,
         uint32_t posted) {
        auto [p, n] = writable(region);
        ring::ReqDesc d{seq, step, layer, T, k, defer, dtype, 0,
                        {{x_off, x_n}, {i_off, i_n}, {w_off, w_n}, {o_off, o_n}, {d_off, d_n}}};
        for (int i = 0; i < 3; ++i)  // our own spans: a bug here would write outside the region
          MOE_CHECK(d.span[i].off >= ring::DATA_START && d.span[i].off <= n && d.span[i].n <= n - d.span[i].off,
                    "submit: span outside the region");
        ring_submit(p, d, reinterpret_cast<const void*>(x), reinterpret_cast<const void*>(ids),
                    reinterpret_cast<const void*>(w), posted);
      },
      "GPU side: copy hidden/ids/weights into their spans, write the request descriptor, ring");
  py::class_<RingAnswer>(m, "RingAnswer", "one response of the ring as ring_result() read it")
      .def_readonly("status", &RingAnswer::status, "a gRPC status code (0 ok), -1 when none came in time")
      .def_readonly("message", &RingAnswer::message)
      .def_property_readonly("queued_us", [](const RingAnswer& a) { return a.desc.queued_us; })
      .def_property_readonly("compute_us", [](const RingAnswer& a) { return a.desc.compute_us; })
      .def_property_readonly("start_unix_ns", [](const RingAnswer& a) { return a.desc.start_ns; })
      .def_property_readonly("end_unix_ns", [](const RingAnswer& a) { return a.desc.end_ns; });
  m.def(
      "ring_result",
      [](py::buffer region, uint64_t j, uint64_t seq, uint32_t part, uintptr_t out, uint64_t nbytes, int64_t timeout_us,
         int64_t spin_us) {
        auto [p, n] = writable(region);
        RingAnswer a{0, py::bytes(), {}};
        std::string msg;
        {
          py::gil_scoped_release nogil;
          a.status = ring_result(p, n, j, seq, part, reinterpret_cast<void*>(out), nbytes, timeout_us, spin_us, &a.desc,
                                 &msg);
        }
        a.message = py::bytes(msg);
        return a;
      },
      "GPU side: wait for response j, check it, copy its output -> RingAnswer");
  m.def("numa_topology", [] { return numa().describe(); }, "NUMA nodes the kernels place experts on");
  m.def(
      "numa_place", [](uintptr_t p, size_t bytes_per_expert, int E) {
        return numa_place(reinterpret_cast<void*>(p), bytes_per_expert, E);
      },
      py::arg("ptr"), py::arg("bytes_per_expert"), py::arg("E"),
      "bind expert e's slice to node e % nodes before first touch; returns slices bound (0 on one node)");
  m.def("numa_binds", &numa_binds, "whether numa_place binds memory here (several real NUMA nodes)");
  m.def("set_amx_emulation", &set_amx_emulation, py::arg("on"),
        "tests only: run the AMX path with its tile instructions emulated in C++ (needs AVX-512 for the rest)");
  m.def("init_pool", [](int threads) { return pool(threads).size(); }, py::arg("threads"),
        "create the shared pool on first use (later calls return its size)");
  m.def("set_threads", [](int threads) { py::gil_scoped_release nogil; return resize_pool(threads); },
        py::arg("threads"), "rebuild the shared pool with this many threads (no work may be in flight)");
  m.def(
      "pool_check",
      [](int n_tasks, int fail_from) {
        py::gil_scoped_release nogil;
        std::lock_guard<std::mutex> g(compute_mutex());
        std::vector<int> hit(std::max(n_tasks, 0), 0);
        pool().parallel_for(n_tasks, [&](int i) {
          if (fail_from >= 0 && i >= fail_from) throw std::runtime_error("task " + std::to_string(i) + " failed");
          hit[i] = 1;
        });
        long done = 0;
        for (int h : hit) done += h;
        return done;
      },
      py::arg("n_tasks"), py::arg("fail_from") = -1,
      "tests: run n_tasks pool tasks, those from index fail_from on throwing; -> tasks that ran (all of them "
      "when none throws)");
  m.def("scratch_bytes", [] {
    std::lock_guard<std::mutex> g(compute_mutex());
    return pool().scratch.bytes();
  }, "bytes the kernels' scratch arena holds between calls");
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
      "MLA's latent query: q_lat [nh, t, r] fp32 = q_nope (fp32, tokens q_tok apart) x kv_b_proj's W_uk (native/mla.cpp)");
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
      "MLA's heads' output: o [t, nh, dv] fp32 = o_lat [nh, t, r] fp32 x kv_b_proj's W_uv^T (native/mla.cpp)");
  m.def(
      "decode_attention",
      [](const std::string& isa_arg, uintptr_t q, int nh, int nkv, int d, uintptr_t K, int kv, size_t k_head,
         size_t k_row, uintptr_t V, size_t v_head, size_t v_row, int L, float scale, uintptr_t out, uintptr_t table,
         int block_shift, size_t k_block, size_t v_block) {
        Isa isa = kernel_isa(isa_arg);
        const KvType t = kv_type(kv);
        py::gil_scoped_release nogil;
        std::lock_guard<std::mutex> g(compute_mutex());
        decode_attention(isa, reinterpret_cast<const float*>(q), nh, nkv, d, reinterpret_cast<const void*>(K), t,
                         k_head, k_row, reinterpret_cast<const void*>(V), v_head, v_row, L, scale,
                         reinterpret_cast<float*>(out), reinterpret_cast<const int32_t*>(table), block_shift, k_block,
                         v_block);
      },
      py::arg("isa"), py::arg("q"), py::arg("nh"), py::arg("nkv"), py::arg("d"), py::arg("K"), py::arg("kv"),
      py::arg("k_head"), py::arg("k_row"), py::arg("V"), py::arg("v_head"), py::arg("v_row"), py::arg("L"),
      py::arg("scale"), py::arg("out"), py::arg("table") = 0, py::arg("block_shift") = 0, py::arg("k_block") = 0,
      py::arg("v_block") = 0,
      "one decode query per head against K/V of type kv (fp32, bf16 or fp16: KV_CODES), contiguous or paged through a block table "
      "(native/attention.cpp)");
  m.def(
      "mla_decode_attention",
      [](const std::string& isa_arg, uintptr_t q, int nh, int r, int dr, uintptr_t C, uintptr_t KPE, int kv,
         size_t c_row, size_t kpe_row, int L, float scale, uintptr_t out, uintptr_t table, int block_shift,
         size_t c_block, size_t kpe_block) {
        Isa isa = kernel_isa(isa_arg);
        const KvType t = kv_type(kv);
        py::gil_scoped_release nogil;
        std::lock_guard<std::mutex> g(compute_mutex());
        mla_decode_attention(isa, reinterpret_cast<const float*>(q), nh, r, dr, reinterpret_cast<const void*>(C),
                             reinterpret_cast<const void*>(KPE), t, c_row, kpe_row, L, scale,
                             reinterpret_cast<float*>(out), reinterpret_cast<const int32_t*>(table), block_shift,
                             c_block, kpe_block);
      },
      py::arg("isa"), py::arg("q"), py::arg("nh"), py::arg("r"), py::arg("dr"), py::arg("C"), py::arg("KPE"),
      py::arg("kv"), py::arg("c_row"), py::arg("kpe_row"), py::arg("L"), py::arg("scale"), py::arg("out"),
      py::arg("table") = 0, py::arg("block_shift") = 0, py::arg("c_block") = 0, py::arg("kpe_block") = 0,
      "MLA's decode attention in the latent space: one query per head (latent then rotary) against the cached latents "
      "and rotary keys, contiguous or paged (native/attention.cpp)");
  m.def(
      "store_kv",
      [](int kv, uintptr_t src, bool src_bf16, uintptr_t dst, int n) {
        store_kv(kv_type(kv), reinterpret_cast<const void*>(src), src_bf16, reinterpret_cast<void*>(dst), n);
      },
      py::arg("kv"), py::arg("src"), py::arg("src_bf16"), py::arg("dst"), py::arg("n"),
      "n values (bf16 or fp32) into the KV cache's type, rounded as torch's .to() (the decode step's KV store)");
  m.def("machine_shared", [] {
    py::gil_scoped_release nogil;
    return machine_shared();
  }, "whether waits now treat the machine as shared with other programs (native/contention.h)");
  m.def("contention_stats", [] {
    ContentionStats st;
    {
      py::gil_scoped_release nogil;
      st = contention_stats();
    }
    py::dict d;
    d["shared"] = st.shared, d["contended"] = st.contended, d["foreign_cpus"] = st.foreign_cpus;
    d["windows"] = st.windows, d["foreign_windows"] = st.foreign_windows, d["turned_shared"] = st.turned_shared;
    d["window_s"] = st.window_s, d["foreign_threshold"] = st.foreign_threshold;
    return d;
  }, "the waits' policy and the samples behind it, for the metrics (native/contention.h ContentionStats)");
  m.def(
      "softmax_topk",
      [](uintptr_t logits, int B, int E, int k, bool norm_topk, bool round_bf16, uintptr_t ids, uintptr_t weights,
         int n_group, int topk_group, float scaling) {
        softmax_topk(reinterpret_cast<const float*>(logits), B, E, k, norm_topk, round_bf16,
                     reinterpret_cast<int32_t*>(ids), reinterpret_cast<float*>(weights), n_group, topk_group, scaling);
      },
      py::arg("logits"), py::arg("B"), py::arg("E"), py::arg("k"), py::arg("norm_topk"), py::arg("round_bf16"),
      py::arg("ids"), py::arg("weights"), py::arg("n_group") = 1, py::arg("topk_group") = 1, py::arg("scaling") = 1.f,
      "the softmax router's top-k choice, optionally within the best groups (native/decode_step.cpp)");
  m.def(
      "sigmoid_topk",
      [](uintptr_t logits, uintptr_t bias, int B, int E, int k, int n_group, int topk_group, bool norm_topk,
         float scaling, uintptr_t ids, uintptr_t weights) {
        sigmoid_topk(reinterpret_cast<const float*>(logits), reinterpret_cast<const float*>(bias), B, E, k, n_group,
                     topk_group, norm_topk, scaling, reinterpret_cast<int32_t*>(ids), reinterpret_cast<float*>(weights));
      },
      py::arg("logits"), py::arg("bias"), py::arg("B"), py::arg("E"), py::arg("k"), py::arg("n_group"),
      py::arg("topk_group"), py::arg("norm_topk"), py::arg("scaling"), py::arg("ids"), py::arg("weights"),
      "the sigmoid router's top-k choice (bias 0: none; native/decode_step.cpp)");
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
                float eps) {
        const size_t xb = x_bf16 ? 2 : 4, ob = out_bf16 ? 2 : 4;
        by_rows(rows, n, [&](int r0, int r1) {
          rms_norm_rows(reinterpret_cast<const char*>(x) + size_t(r0) * n * xb, x_bf16, reinterpret_cast<const void*>(w),
                        w_bf16, reinterpret_cast<char*>(out) + size_t(r0) * n * ob, out_bf16, r1 - r0, n, eps);
        });
      },
      py::arg("x"), py::arg("x_bf16"), py::arg("w"), py::arg("w_bf16"), py::arg("out"), py::arg("out_bf16"),
      py::arg("rows"), py::arg("n"), py::arg("eps"), "RMSNorm with torch's rounding (native/norm_rope.cpp)");
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
      py::arg("sin"), "rotary embedding, halves rotated, with torch's rounding (native/norm_rope.cpp)");
  py::class_<wire::Head>(m, "WireHead", "what the native exchange needs of a LayerRequest")
      .def_readonly("step", &wire::Head::step)
      .def_readonly("layer", &wire::Head::layer)
      .def_readonly("defer", &wire::Head::defer)
      .def_readonly("T", &wire::Head::T)
      .def_readonly("H", &wire::Head::H)
      .def_readonly("k", &wire::Head::k)
      .def_readonly("bf16", &wire::Head::bf16);
  m.def(
      "wire_head",
      [](py::buffer request) -> std::optional<wire::Head> {
        wire::LayerRequestView q;
        wire::Head h;
        if (!read_request(request, q, h)) return std::nullopt;
        return h;
      },
      py::arg("request"),
      "a serialized LayerRequest -> its WireHead when the native exchange can take it (native/wire.h: fast_head), "
      "else None");
  m.def(
      "wire_request",
      [](uint64_t step, uint32_t layer, uint32_t defer, uintptr_t hidden, uint64_t hidden_dtype, int itemsize, int64_t T,
         int64_t H, uintptr_t ids, uintptr_t weights, int64_t k) {
        MOE_CHECK(T >= 0 && H >= 0 && k >= 0 && (itemsize == 2 || itemsize == 4), "bad shape or itemsize");
        auto at = [](uintptr_t a) { return reinterpret_cast<const uint8_t*>(a); };
        const size_t nk = size_t(T) * size_t(k) * 4;
        wire::Request r{step, layer, defer, {hidden_dtype, T, H, at(hidden), size_t(T) * size_t(H) * itemsize},
                        {wire::INT32, T, k, at(ids), nk}, {wire::FLOAT32, T, k, at(weights), nk}};
        py::bytes b = new_bytes(wire::layer_request_size(r));
        wire::write_layer_request(bytes_data(b), r);
        return b;
      },
      py::arg("step"), py::arg("layer"), py::arg("defer"), py::arg("hidden"), py::arg("hidden_dtype"),
      py::arg("itemsize"), py::arg("T"), py::arg("H"), py::arg("ids"), py::arg("weights"), py::arg("k"),
      "a serialized LayerRequest from contiguous hidden [T, H], int32 ids and fp32 weights [T, k] at these addresses");
  py::class_<ResultHead>(m, "ResultHead", "a serialized LayerResult's fields, its output left in place")
      .def_readonly("step", &ResultHead::step)
      .def_readonly("layer", &ResultHead::layer)
      .def_readonly("part", &ResultHead::part)
      .def_readonly("dtype", &ResultHead::dtype, "the output's wire dtype (tensor.proto)")
      .def_readonly("rows", &ResultHead::rows)
      .def_readonly("cols", &ResultHead::cols)
      .def_readonly("nbytes", &ResultHead::nbytes, "the output's bytes")
      .def_property_readonly("queued_us", [](const ResultHead& h) { return h.timing.queued_us; })
      .def_property_readonly("compute_us", [](const ResultHead& h) { return h.timing.compute_us; })
      .def_property_readonly("start_unix_ns", [](const ResultHead& h) { return h.timing.start_unix_ns; })
      .def_property_readonly("end_unix_ns", [](const ResultHead& h) { return h.timing.end_unix_ns; });
  m.def(
      "wire_result",
      [](py::buffer result) -> std::optional<ResultHead> {
        wire::LayerResultView q;
        if (!read_result(result, q)) return std::nullopt;
        return ResultHead{q.step, q.layer, q.part, q.output.dtype, q.output.shape[0], q.output.shape[1], q.output.len,
                          q.timing};
      },
      py::arg("result"), "a serialized LayerResult -> its ResultHead, None when it is not one with a 2-D output");
  m.def(
      "wire_result_output",
      [](py::buffer result, uintptr_t out, size_t nbytes) {
        wire::LayerResultView q;
        MOE_CHECK(read_result(result, q) && q.output.len == nbytes, "not a LayerResult with an output of that many bytes");
        if (nbytes) std::memcpy(reinterpret_cast<void*>(out), q.output.data, nbytes);
      },
      py::arg("result"), py::arg("out"), py::arg("nbytes"), "copy a serialized LayerResult's output to `out`");
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
          "one part of a deferral split, hidden/out bf16 or fp32 (see native/moe_part.cpp)")
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
  // a GQA block's decode step (native/decode_step.cpp): the weights bound once, the pool layer and sequences per call
  py::class_<BoundDecodeBlock>(m, "DecodeBlock", "one attention block's weights for its native decode step")
      .def(py::init([](const std::string& isa, bool bf16, const BoundLinear& qkv, const BoundLinear& o,
                       uintptr_t in_norm, uintptr_t post_norm, uintptr_t q_norm, uintptr_t k_norm, uintptr_t q_bias,
                       uintptr_t k_bias, uintptr_t v_bias, uintptr_t o_bias, int H, int nh, int nkv, int d, int rot,
                       float eps, float scale, py::object gate, int top_k, bool norm_topk, bool round_w,
                       uintptr_t w32, uintptr_t bias32, bool softmax32, int E, int n_group, int topk_group, float scaling,
                       py::object owner) {
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
             return BoundDecodeBlock{g, std::move(owner)};
           }),
           py::arg("isa"), py::arg("bf16"), py::arg("qkv"), py::arg("o"), py::arg("in_norm"), py::arg("post_norm"),
           py::arg("q_norm"), py::arg("k_norm"), py::arg("q_bias"), py::arg("k_bias"), py::arg("v_bias"),
           py::arg("o_bias"), py::arg("H"), py::arg("nh"), py::arg("nkv"), py::arg("d"), py::arg("rot"), py::arg("eps"),
           py::arg("scale"), py::arg("gate") = py::none(), py::arg("top_k") = 0, py::arg("norm_topk") = false,
           py::arg("round_w") = false, py::arg("w32") = 0, py::arg("bias32") = 0, py::arg("softmax32") = false, py::arg("E") = 0,
           py::arg("n_group") = 1, py::arg("topk_group") = 1, py::arg("scaling") = 1.f, py::arg("owner") = py::none())
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
            g.H = H, g.nh = nh, g.nkv = 1, g.d = dn + dr, g.rot = dr, g.eps = eps, g.scale = scale;
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
             uintptr_t weights) {
            DecodeBlock g = b.g;
            g.K = reinterpret_cast<void*>(K), g.V = reinterpret_cast<void*>(V), g.kv = kv_type(kv);
            g.kv_head = kv_head, g.kv_block = kv_block, g.block_shift = block_shift;
            const int64_t* rows = reinterpret_cast<const int64_t*>(seqs);  // [B, 3]: table, position, first
            std::vector<DecodeSeq> sq(B > 0 ? B : 0);
            for (int t = 0; t < B; ++t)
              sq[t] = DecodeSeq{reinterpret_cast<const int32_t*>(rows[3 * t]), int32_t(rows[3 * t + 1]),
                                int32_t(rows[3 * t + 2])};
            py::gil_scoped_release nogil;
            std::lock_guard<std::mutex> lk(compute_mutex());
            decode_block(g, B, reinterpret_cast<void*>(h), reinterpret_cast<const void*>(cos),
                             reinterpret_cast<const void*>(sin), sq.data(), reinterpret_cast<void*>(x_out),
                             reinterpret_cast<int32_t*>(ids), reinterpret_cast<float*>(weights));
            release_scratch();
          },
          py::arg("B"), py::arg("h"), py::arg("cos"), py::arg("sin"), py::arg("K"), py::arg("V"), py::arg("kv"),
          py::arg("kv_head"), py::arg("kv_block"), py::arg("block_shift"), py::arg("seqs"), py::arg("x_out"), py::arg("ids") = 0,
          py::arg("weights") = 0,
          "B sequences' decode step of the block: h [B, H] updated in place, x_out [B, H] its post-attention norm; "
          "kv: the pool's element type (moe_kernels.attention.KV_CODES); seqs int64 [B, 3] (block table address, position, first consecutive block or -1)");
  py::class_<BoundMlp>(m, "Mlp", "a SwiGLU MLP's decode rows (a dense layer, shared experts; native/decode_mlp.cpp)")
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
  py::class_<BoundDecodeLoop>(m, "DecodeLoop", "a decode step's layers in one call (native/decode_loop.h)")
      .def(py::init([](const std::vector<const BoundDecodeBlock*>& blocks, const std::vector<py::object>& mlps,
                       const std::vector<uintptr_t>& K, const std::vector<uintptr_t>& V, int kv, size_t kv_head,
                       size_t kv_block, int block_shift, py::object owner) {
             MOE_CHECK(K.size() == blocks.size() && V.size() == blocks.size() && mlps.size() == blocks.size(),
                       "decode loop: one K, V and MLP (or None) a layer");
             BoundDecodeLoop l{{}, std::move(owner)};
             for (size_t i = 0; i < blocks.size(); ++i) {
               DecodeBlock g = blocks[i]->g;
               g.K = reinterpret_cast<void*>(K[i]), g.V = reinterpret_cast<void*>(V[i]), g.kv = kv_type(kv);
               g.kv_head = kv_head, g.kv_block = kv_block, g.block_shift = block_shift;
               l.layers.push_back({g, mlps[i].is_none() ? nullptr : &mlps[i].cast<const BoundMlp&>().m});
             }
             return l;
           }),
           py::arg("blocks"), py::arg("mlps"), py::arg("K"), py::arg("V"), py::arg("kv"), py::arg("kv_head"), py::arg("kv_block"),
           py::arg("block_shift"), py::arg("owner"),
           "mlps: per layer a dense layer's MLP or the shared experts (Mlp), or None; owner: keeps the blocks, the "
           "MLPs and the pool alive")
      .def(
          "run",
          [](const BoundDecodeLoop& l, int B, uintptr_t h, uintptr_t cos, uintptr_t sin, uintptr_t seqs,
             uintptr_t times, int first, bool waiting, int defer, py::object experts, uintptr_t logits) {
            MOE_CHECK(!logits || l.has_head, "decode loop: logits asked for, but no head set");
            const std::vector<const MoELayer*>* local = nullptr;
            RingClient* ring = nullptr;
            if (py::isinstance<BoundLocalExperts>(experts))
              local = &experts.cast<const BoundLocalExperts&>().layers;
            else
              ring = &experts.cast<BoundRingClient&>().c;
            const int64_t* rows = reinterpret_cast<const int64_t*>(seqs);  // [B, 3]: table, position, first
            std::vector<DecodeSeq> sq(B > 0 ? B : 0);
            for (int t = 0; t < B; ++t)
              sq[t] = DecodeSeq{reinterpret_cast<const int32_t*>(rows[3 * t]), int32_t(rows[3 * t + 1]),
                                int32_t(rows[3 * t + 2])};
            LoopEnd end;
            {
              py::gil_scoped_release nogil;
              end = decode_layers(l.layers, local, ring, first, waiting, defer, B, reinterpret_cast<void*>(h),
                                  reinterpret_cast<const void*>(cos), reinterpret_cast<const void*>(sin), sq.data(),
                                  reinterpret_cast<int64_t*>(times), logits ? &l.head : nullptr,
                                  reinterpret_cast<float*>(logits));
            }
            return std::make_tuple(end.layer, end.status, py::bytes(end.msg));
          },
          py::arg("B"), py::arg("h"), py::arg("cos"), py::arg("sin"), py::arg("seqs"), py::arg("times"),
          py::arg("first"), py::arg("waiting"), py::arg("defer"), py::arg("experts"), py::arg("logits") = 0,
          "B sequences' new tokens through the layers from `first`, `defer` experts a token deferred one layer: h "
          "[B, H] updated in place; seqs int64 [B, 3] "
          "as DecodeBlock.run takes them; times int64 [layers, DecodeLoop.times] (decode_loop.h LoopTime); experts: LocalExperts or "
          "RingClient; logits: fp32 [B, vocab] the head writes once the last layer is done (set_head), or 0 "
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
          "y [T, rows] fp32 = x [T, K] fp32 times the matrix, transposed (native/linear.cpp); round_bf16: each "
          "output rounded to bf16 (kept as fp32)");
}
