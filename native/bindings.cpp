// pybind11 bindings: raw pointers + shapes in (the Python layer owns the tensors), GIL released.
#include <cstring>
#include <limits>
#include <ctime>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "common.h"
#include "doorbell.h"
#include "huge_buffer.h"
#include "moe.h"
#include "numa.h"
#include "ring.h"
#include "probes.h"
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

static Isa kernel_isa(const std::string& path) {
  Isa isa = parse_isa(path);
  MOE_CHECK(isa_supported(isa, detect_cpu()) || (isa == Isa::Amx && amx_emulation() &&
                                                   isa_supported(Isa::Avx512, detect_cpu())),
            std::string("kernel path ") + path + " not supported here");
  return isa;
}

static Fmt parse_fmt(const std::string& fmt) {
  return fmt == "bf16" ? Fmt::Bf16 : fmt == "int8" ? Fmt::Int8 : fmt == "int4" ? Fmt::Int4
       : fmt == "mxfp4" ? Fmt::Mxfp4
       : throw std::invalid_argument("unknown weight format '" + fmt + "' (bf16, int8, int4, mxfp4)");
}

static Matrix matrix_of(uintptr_t w, uintptr_t scale, uintptr_t rowsum, uintptr_t rowcorr, int rows, int K, int Kp) {
  return Matrix{reinterpret_cast<const void*>(w), reinterpret_cast<const float*>(scale),
                reinterpret_cast<const int32_t*>(rowsum), reinterpret_cast<const float*>(rowcorr), rows, K, Kp};
}

static MoEWeights weights_of(const std::string& fmt, int E, int I, int H, int Kp_h, int Kp_i, uintptr_t gu_w,
                             uintptr_t gu_scale, uintptr_t gu_rowsum, uintptr_t gu_rowcorr, uintptr_t dn_w,
                             uintptr_t dn_scale, uintptr_t dn_rowsum, uintptr_t dn_rowcorr, uintptr_t gu_bias,
                             uintptr_t dn_bias, int act, float alpha, float limit) {
  MOE_CHECK(act == int(Act::Silu) || act == int(Act::ClampedSwiglu), "unknown activation " + std::to_string(act));
  return MoEWeights{parse_fmt(fmt), E, H, I, matrix_of(gu_w, gu_scale, gu_rowsum, gu_rowcorr, 2 * I, H, Kp_h),
                    matrix_of(dn_w, dn_scale, dn_rowsum, dn_rowcorr, H, I, Kp_i),
                    reinterpret_cast<const float*>(gu_bias), reinterpret_cast<const float*>(dn_bias), Act(act), alpha,
                    limit};
}

// one layer's weights as NativeMoELayer._weight_args passes them (biases: 0 = none)
#define WEIGHT_PARAMS                                                                                              \
  const std::string &path, const std::string &fmt, int E, int I, int H, int Kp_h, int Kp_i, uintptr_t gu_w,        \
      uintptr_t gu_scale, uintptr_t gu_rowsum, uintptr_t gu_rowcorr, uintptr_t dn_w, uintptr_t dn_scale,           \
      uintptr_t dn_rowsum, uintptr_t dn_rowcorr, uintptr_t gu_bias, uintptr_t dn_bias, int act, float alpha,       \
      float limit
#define WEIGHTS_OF                                                                                                 \
  weights_of(fmt, E, I, H, Kp_h, Kp_i, gu_w, gu_scale, gu_rowsum, gu_rowcorr, dn_w, dn_scale, dn_rowsum,          \
             dn_rowcorr, gu_bias, dn_bias, act, alpha, limit)
#define WEIGHT_ARGS                                                                                             \
  py::arg("path"), py::arg("fmt"), py::arg("E"), py::arg("I"), py::arg("H"), py::arg("Kp_h"), py::arg("Kp_i"), \
      py::arg("gu_w"), py::arg("gu_scale"), py::arg("gu_rowsum"), py::arg("gu_rowcorr"), py::arg("dn_w"),       \
      py::arg("dn_scale"), py::arg("dn_rowsum"), py::arg("dn_rowcorr"), py::arg("gu_bias"), py::arg("dn_bias"), \
      py::arg("act"), py::arg("alpha"), py::arg("limit")

static std::pair<uint8_t*, size_t> writable(py::buffer& buf) {
  py::buffer_info info = buf.request(true);
  return {static_cast<uint8_t*>(info.ptr), size_t(info.size) * size_t(info.itemsize)};
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
    d["avx512vnni"] = f.avx512vnni; d["amx_tile"] = f.amx_tile; d["amx_bf16"] = f.amx_bf16; d["amx_int8"] = f.amx_int8;
    d["os_avx512"] = f.os_avx512; d["os_amx"] = f.os_amx;
    d["avx2"] = f.avx2; d["fma"] = f.fma; d["f16c"] = f.f16c; d["avxvnni"] = f.avxvnni; d["os_avx"] = f.os_avx;
    return d;
  });
  m.def("set_tuning", [](size_t pf_bytes, size_t task_kb) {  // between calls only (benchmarks)
    MOE_CHECK(task_kb >= 1, "task_kb must be >= 1");
    tuning() = Tuning{pf_bytes, task_kb * 1024};
  }, py::arg("pf_bytes"), py::arg("task_kb"));
  m.def("get_tuning", [] { return py::make_tuple(tuning().pf_bytes, tuning().task_bytes / 1024); });
  m.def("best_path", [] { return std::string(isa_name(best_isa(detect_cpu()))); });
  m.def("path_supported", [](const std::string& p) { return isa_supported(parse_isa(p), detect_cpu()); });
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
      "doorbell_wake", [](py::buffer buf, size_t offset) { doorbell_wake(doorbell_at(buf, offset)); },
      py::arg("buf"), py::arg("offset"), "wake waiters on buf[offset] without changing it");
  m.def("ring_layout", [] {
    using namespace ring;
    py::dict d;
    d["REQ_SEQ"] = REQ_SEQ; d["RESP_SEQ"] = RESP_SEQ; d["RESP_READ"] = RESP_READ; d["CLOSED"] = CLOSED;
    d["DESC_START"] = DESC_START; d["REQ_SLOTS"] = REQ_SLOTS; d["RESP_SLOTS"] = RESP_SLOTS;
    d["REQ_DESC_SIZE"] = REQ_DESC_SIZE; d["RESP_DESC_SIZE"] = RESP_DESC_SIZE; d["MSG_MAX"] = MSG_MAX;
    d["DATA_START"] = DATA_START; d["SPAN_ALIGN"] = SPAN_ALIGN; d["REQ_DESC_BYTES"] = sizeof(ReqDesc); d["RESP_DESC_BYTES"] = sizeof(RespDesc);
    return d;
  }, "the ring layout the C++ side uses (tests check moe_core/shm.py against it)");
  py::class_<RingServer>(m, "RingServer", "the expert side's serving loop of one shared-memory session")
      .def(py::init([](py::buffer region, int hidden, int max_tokens, uint32_t code_f32, uint32_t code_bf16) {
             auto [p, n] = writable(region);
             return new RingServer(p, n, hidden, max_tokens, code_f32, code_bf16);
           }),
           py::arg("region"), py::arg("hidden"), py::arg("max_tokens"), py::arg("code_f32"), py::arg("code_bf16"),
           py::keep_alive<1, 2>())
      .def("add_layer",
           [](RingServer& r, int layer, WEIGHT_PARAMS) { r.add_layer(layer, kernel_isa(path), WEIGHTS_OF); })
      .def("serve",
           [](RingServer& r, int64_t timeout_us, int64_t spin_us) {
             uint64_t seq = 0;
             std::vector<PartLog> log;
             int kind;
             {
               py::gil_scoped_release nogil;
               kind = r.serve(timeout_us, spin_us, &seq, &log);
             }
             py::list parts;
             for (auto& p : log) parts.append(py::make_tuple(p.layer, p.part, p.tokens, p.start_ns, p.end_ns, p.queued_ns));
             return py::make_tuple(kind, seq, parts);
           },
           py::arg("timeout_us"), py::arg("spin_us"),
           "-> (0 idle | 1 closed | 2 request for Python, its seq, [(layer, part, tokens, start_ns, end_ns, queued_ns)])")
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
  m.def(
      "ring_result",
      [](py::buffer region, uint64_t j, uint64_t seq, uint32_t part, uintptr_t out, uint64_t nbytes, int64_t timeout_us,
         int64_t spin_us) {
        auto [p, n] = writable(region);
        ring::RespDesc got{};
        std::string msg;
        int status;
        {
          py::gil_scoped_release nogil;
          status = ring_result(p, n, j, seq, part, reinterpret_cast<void*>(out), nbytes, timeout_us, spin_us, &got, &msg);
        }
        return py::make_tuple(status, py::bytes(msg), got.queued_us, got.compute_us, got.start_ns, got.end_ns);
      },
      "GPU side: wait for response j, check it, copy its output -> (status | -1 timeout, message, timing...)");
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
      "forward",
      [](WEIGHT_PARAMS, uintptr_t hidden, uintptr_t ids, uintptr_t weights, uintptr_t out, int T, int k) {
        Isa isa = kernel_isa(path);
        MoEWeights m = WEIGHTS_OF;
        py::gil_scoped_release nogil;
        std::lock_guard<std::mutex> g(compute_mutex());
        moe_forward(isa, m, reinterpret_cast<const float*>(hidden), reinterpret_cast<const int32_t*>(ids),
                    reinterpret_cast<const float*>(weights), reinterpret_cast<float*>(out), T, k);
        release_scratch();
      },
      WEIGHT_ARGS, py::arg("hidden"), py::arg("ids"), py::arg("weights"), py::arg("out"), py::arg("T"), py::arg("k"));
  m.def(
      "linear",
      [](const std::string& path, const std::string& fmt, int rows, int K, int Kp, uintptr_t w, uintptr_t scale,
         uintptr_t rowsum, uintptr_t rowcorr, uintptr_t x, uintptr_t y, int T) {
        Isa isa = kernel_isa(path);
        Matrix m = matrix_of(w, scale, rowsum, rowcorr, rows, K, Kp);
        Fmt f = parse_fmt(fmt);
        py::gil_scoped_release nogil;
        std::lock_guard<std::mutex> g(compute_mutex());
        linear_forward(isa, f, m, reinterpret_cast<const float*>(x), T, reinterpret_cast<float*>(y));
        release_scratch();
      },
      py::arg("path"), py::arg("fmt"), py::arg("rows"), py::arg("K"), py::arg("Kp"), py::arg("w"), py::arg("scale"),
      py::arg("rowsum"), py::arg("rowcorr"), py::arg("x"), py::arg("y"), py::arg("T"),
      "y [T, rows] fp32 = x [T, K] fp32 times one packed [rows, Kp] matrix, transposed (native/linear.cpp)");
  m.def(
      "decode_attention",
      [](const std::string& path, uintptr_t q, int nh, int nkv, int d, uintptr_t K, bool bf16, size_t k_head,
         size_t k_row, uintptr_t V, size_t v_head, size_t v_row, int L, float scale, uintptr_t out) {
        Isa isa = kernel_isa(path);
        py::gil_scoped_release nogil;
        std::lock_guard<std::mutex> g(compute_mutex());
        decode_attention(isa, reinterpret_cast<const float*>(q), nh, nkv, d, reinterpret_cast<const void*>(K), bf16,
                         k_head, k_row, reinterpret_cast<const void*>(V), v_head, v_row, L, scale,
                         reinterpret_cast<float*>(out));
      },
      py::arg("path"), py::arg("q"), py::arg("nh"), py::arg("nkv"), py::arg("d"), py::arg("K"), py::arg("bf16"),
      py::arg("k_head"), py::arg("k_row"), py::arg("V"), py::arg("v_head"), py::arg("v_row"), py::arg("L"),
      py::arg("scale"), py::arg("out"), "one decode query per head against bf16 or fp32 K/V (native/attention.cpp)");
  // small enough to run with the GIL held: no pool, no lock
  m.def(
      "rms_norm",
      [](uintptr_t x, bool x_bf16, uintptr_t w, bool w_bf16, uintptr_t out, bool out_bf16, int rows, int n, float eps) {
        rms_norm_rows(reinterpret_cast<const void*>(x), x_bf16, reinterpret_cast<const void*>(w), w_bf16,
                      reinterpret_cast<void*>(out), out_bf16, rows, n, eps);
      },
      py::arg("x"), py::arg("x_bf16"), py::arg("w"), py::arg("w_bf16"), py::arg("out"), py::arg("out_bf16"),
      py::arg("rows"), py::arg("n"), py::arg("eps"), "RMSNorm with torch's rounding (native/norm_rope.cpp)");
  m.def(
      "rope",
      [](uintptr_t x, uintptr_t out, bool bf16, int T, int heads, int dim, uintptr_t cos, uintptr_t sin) {
        rope_rows(reinterpret_cast<const void*>(x), reinterpret_cast<void*>(out), bf16, T, heads, dim,
                  reinterpret_cast<const void*>(cos), reinterpret_cast<const void*>(sin));
      },
      py::arg("x"), py::arg("out"), py::arg("bf16"), py::arg("T"), py::arg("heads"), py::arg("dim"), py::arg("cos"),
      py::arg("sin"), "rotary embedding, halves rotated, with torch's rounding (native/norm_rope.cpp)");
  m.def(
      "forward_part",
      [](WEIGHT_PARAMS, uintptr_t hidden, bool hidden_bf16, uintptr_t ids, uintptr_t weights, uintptr_t out,
         bool out_bf16, int T, int k, int defer, int part) {
        Isa isa = kernel_isa(path);
        MoEWeights m = WEIGHTS_OF;
        py::gil_scoped_release nogil;
        std::lock_guard<std::mutex> g(compute_mutex());
        moe_forward_part(isa, m, reinterpret_cast<const void*>(hidden), hidden_bf16,
                         reinterpret_cast<const int32_t*>(ids), reinterpret_cast<const float*>(weights),
                         reinterpret_cast<void*>(out), out_bf16, T, k, defer, part);
        release_scratch();
      },
      WEIGHT_ARGS, py::arg("hidden"), py::arg("hidden_bf16"), py::arg("ids"), py::arg("weights"), py::arg("out"),
      py::arg("out_bf16"), py::arg("T"), py::arg("k"), py::arg("defer"), py::arg("part"),
      "one part of a deferral split, hidden/out bf16 or fp32 (see native/moe_part.cpp)");
  m.def(
      "wire_head",
      [](py::buffer request) -> py::object {
        wire::LayerRequestView q;
        wire::Head h;
        if (!read_request(request, q, h)) return py::none();
        return py::make_tuple(h.step, h.layer, h.defer, h.T, h.H, h.k, h.bf16);
      },
      py::arg("request"),
      "a serialized LayerRequest -> (step, layer, defer, T, H, k, bf16) when the native exchange can take it "
      "(native/wire.h: fast_head), else None");
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
  m.def(
      "wire_result",
      [](py::buffer result) -> py::object {
        wire::LayerResultView q;
        if (!read_result(result, q)) return py::none();
        const wire::Timing& t = q.timing;
        return py::make_tuple(q.step, q.layer, q.part, q.output.dtype, q.output.shape[0], q.output.shape[1],
                              q.output.len, t.queued_us, t.compute_us, t.start_unix_ns, t.end_unix_ns);
      },
      py::arg("result"),
      "a serialized LayerResult -> (step, layer, part, output dtype, rows, cols, output bytes, queued_us, "
      "compute_us, start_unix_ns, end_unix_ns), None when it is not one with a 2-D output");
  m.def(
      "wire_result_output",
      [](py::buffer result, uintptr_t out, size_t nbytes) {
        wire::LayerResultView q;
        MOE_CHECK(read_result(result, q) && q.output.len == nbytes, "not a LayerResult with an output of that many bytes");
        if (nbytes) std::memcpy(reinterpret_cast<void*>(out), q.output.data, nbytes);
      },
      py::arg("result"), py::arg("out"), py::arg("nbytes"), "copy a serialized LayerResult's output to `out`");
  m.def(
      "exchange_part",
      [](WEIGHT_PARAMS, py::buffer request, int part, int64_t received_unix_ns) {
        Isa isa = kernel_isa(path);
        MoEWeights m = WEIGHTS_OF;
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
          moe_forward_part(isa, m, x, h.bf16, ids, w, out.data(), h.bf16, int(h.T), int(h.k), int(h.defer), part);
          t1 = unix_ns();
          release_scratch();
        }
        wire::Result r{h.step, h.layer, uint32_t(part), {h.bf16 ? wire::BFLOAT16 : wire::FLOAT32, h.T, h.H, out.data(), n},
                       {uint64_t(std::max<int64_t>(0, t0 - received_unix_ns) / 1000), uint64_t((t1 - t0) / 1000), t0,
                        t1}};
        py::bytes res = new_bytes(wire::layer_result_size(r));
        wire::write_layer_result(bytes_data(res), r);
        if (out.capacity() > SCRATCH_KEEP) {  // a long prefill's buffers are not kept for good
          std::vector<uint8_t>().swap(out);
          std::vector<uint32_t>().swap(x_al);
        }
        return py::make_tuple(res, t0, t1);
      },
      WEIGHT_ARGS, py::arg("request"), py::arg("part"), py::arg("received_unix_ns"),
      "one part of a serialized LayerRequest computed -> (the serialized LayerResult, compute start and end, "
      "unix ns)");
}
